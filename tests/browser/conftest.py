"""The dashboard in real Chromium against the real stack: the web app under uvicorn (ASGI, so the
playground streams), a `celery worker` and an inference server, all on the tiny model and the
pytest-django test database (transactional tests, so rows are visible across processes).

Debian's chromium is driven through Playwright (never a downloaded browser). Screenshots of each
page go to tests/artifacts/ (git-ignored) for a person to look at.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings

from tests.openai_stub import LOOPBACK_ALLOWED
from tests.processes import Process, test_database_url
from tests.projects.gateway.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "tests" / "artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@dataclass
class Stack:
    web: Process
    worker: Process
    inference: Process
    processes: list[Process] = field(default_factory=list)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.output()[-3000:]}" for p in self.processes)


def _start(name: str, command: list[str], env: dict[str, str], log: Path) -> Process:
    with open(log, "wb") as handle:
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Process(name, process, log)


def _wait(process: Process, ready: Callable[[Process], bool], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not ready(process):
        if process.process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{process.name} did not start:\n{process.output()[-3000:]}")
        time.sleep(0.2)


@pytest.fixture
def stack(transactional_db, tiny_model_dir, tmp_path) -> Iterator[Stack]:
    """Web, worker and inference server, started together (each imports torch: tens of seconds)."""
    broker = settings.CELERY_BROKER_URL
    if not broker.startswith("redis://"):
        pytest.fail("browser tests need CELERY_BROKER_URL pointing at Redis (make test sets it)")
    import redis

    redis.Redis.from_url(broker).flushdb()
    from projects import services

    services.base_model_register(name="tiny", source=str(tiny_model_dir))
    env = {
        **os.environ,
        "DATABASE_URL": test_database_url(),
        "CELERY_BROKER_URL": broker,
        "ARTWEB_DATA_DIR": str(tmp_path / "data"),  # shared: the server loads the worker's checkpoints
        "DEBUG": "1",
        "TORCH_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "OUTBOUND_ALLOW": ",".join(LOOPBACK_ALLOWED),  # the test's judge/OpenAI/MCP servers
        "INFERENCE_SERVER_TOKEN": "browser-test-token",
        "INFERENCE_HEARTBEAT_INTERVAL_S": "0.5",
        "INFERENCE_HEARTBEAT_TIMEOUT_S": "5",
        "RUN_HEARTBEAT_TIMEOUT_S": "30",
    }
    port = free_port()
    python = sys.executable
    web = _start(
        "web",
        [python, "-m", "uvicorn", "artweb.asgi:application", "--port", str(port), "--log-level", "warning"],
        env,
        tmp_path / "web.log",
    )
    worker = _start(
        "worker",
        [python, "-m", "celery", "-A", "artweb", "worker", "-Q", "train,default", "-c", "1",
         "--prefetch-multiplier", "1", "--loglevel", "INFO", "-n", "browser@%h"],
        env,
        tmp_path / "worker.log",
    )  # fmt: skip
    inference = _start(
        "inference",
        [python, "manage.py", "serve_inference", "--base-model", "tiny", "--port", "0"],
        env,
        tmp_path / "inference.log",
    )
    started = Stack(web, worker, inference, [web, worker, inference])
    try:
        web.url = f"http://127.0.0.1:{port}"

        def web_ready(process: Process) -> bool:
            try:
                with urllib.request.urlopen(f"{process.url}/healthz", timeout=2):
                    return True
            except OSError:
                return False

        _wait(web, web_ready)
        _wait(worker, lambda p: "ready." in p.output())
        _wait(inference, lambda p: "inference server for " in p.output())
        yield started
    finally:
        for process in started.processes:
            process.stop()
        _wait_for_other_connections_to_close()


def _wait_for_other_connections_to_close(timeout: float = 15) -> None:
    """Children's pool processes may hold a connection a moment after their parent exits; the test
    database can be dropped only when they are gone."""
    from django.db import connection

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            if cursor.fetchone()[0] == 0:
                return
        time.sleep(0.2)


@dataclass
class Browser:
    page: object
    console_errors: list[str]

    def screenshot(self, name: str) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)  # type: ignore[attr-defined]
        return path


@pytest.fixture
def browser(monkeypatch) -> Iterator[Browser]:
    # Playwright's sync API runs an event loop in this thread; the test's own ORM reads are plain
    # blocking calls, which Django would otherwise refuse "from an async context".
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (.ci/run does)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        context = chromium.new_context(viewport={"width": 1280, "height": 900})
        page = context.new_page()
        errors: list[str] = []
        page.on(
            "console",
            lambda message: message.type == "error" and errors.append(f"{page.url}: {message.text}"),
        )
        page.on("pageerror", lambda error: errors.append(f"{page.url}: {error}"))
        page.on("dialog", lambda dialog: dialog.accept())  # the cancel / revoke confirmations
        page.set_default_timeout(20_000)
        opened = Browser(page, errors)
        yield opened
        opened.screenshot("last-page")  # where the test ended, passed or failed
        # The test's ORM reads inside Playwright's context got a connection of their own (Django
        # keeps connections per context); close it, or the test database cannot be dropped.
        from django.db import connections

        connections.close_all()
        context.close()
        chromium.close()


def chat_in_playground(page: Any, prompt: str, max_tokens: int) -> dict[str, str]:
    """Send ``prompt`` from a checkpoint page's playground and wait for both answers (the
    checkpoint's and its base model's); fail on an answer shown as an error. The answers' texts."""
    page.fill("#pg-prompt", prompt)
    page.fill("#pg-max-tokens", str(max_tokens))
    page.click("#playground-form button[type=submit]")
    answers = {}
    for side in ("checkpoint", "base"):
        page.wait_for_selector(f"#pg-answer-{side}[data-done]", timeout=60_000)
        answer = page.locator(f"#pg-answer-{side}")
        assert "error" not in (answer.get_attribute("class") or ""), answer.inner_text()
        answers[side] = answer.inner_text()
    return answers
