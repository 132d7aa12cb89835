"""docker-compose.yml and the Dockerfile must describe things that exist (no Docker engine runs here)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[3]


def settings_env_names() -> set[str]:
    source = (ROOT / "artweb" / "settings.py").read_text()
    names = set(re.findall(r'env_(?:str|bool|int|float|list)\(\s*"([A-Z0-9_]+)"', source))
    return names | {f"{name}_FILE" for name in names}


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_has_the_production_services():
    services = compose()["services"]
    assert {"web", "worker", "beat", "postgres", "redis"} <= set(services)


def test_every_build_context_and_dockerfile_exists():
    for name, service in compose()["services"].items():
        build = service.get("build")
        if build is None:
            assert "image" in service, f"{name} has neither build nor image"
            continue
        context = ROOT / build["context"]
        assert context.is_dir(), name
        assert (context / build.get("dockerfile", "Dockerfile")).is_file(), name


def test_dockerfile_copies_only_existing_paths():
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            sources = line.split()[1:-1]
            for source in sources:
                assert (ROOT / source).exists(), f"Dockerfile copies missing {source}"


def test_every_environment_variable_is_a_setting():
    known = settings_env_names()
    for name, service in compose()["services"].items():
        if "build" not in service:
            continue
        env = service.get("environment", {})
        assert env, f"{name} has no environment"
        unknown = set(env) - known
        assert not unknown, f"{name} sets variables that artweb/settings.py never reads: {unknown}"
        assert {"DATABASE_URL", "CELERY_BROKER_URL", "SECRET_KEY"} <= set(env), name
        assert env["DATABASE_URL"].startswith("postgres://") and env["CELERY_BROKER_URL"].startswith(
            "redis://"
        )


def _command(service: dict) -> list[str]:
    command = service["command"]
    if isinstance(command, str):
        command = shlex.split(command)
    if command[:2] == ["sh", "-c"]:
        return shlex.split(command[2])
    return command


def test_commands_refer_to_real_entry_points():
    import importlib

    for _name, service in compose()["services"].items():
        if "build" not in service:
            continue
        words = _command(service)
        for i, word in enumerate(words):
            if word == "-A":
                assert importlib.import_module(words[i + 1]).celery_app is not None
            if ":application" in word:
                module, attribute = word.split(":")
                assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), word
                assert f"{attribute} =" in (ROOT / (module.replace(".", "/") + ".py")).read_text()
            if word == "manage.py":
                assert (ROOT / "manage.py").is_file()


def test_worker_runs_one_task_at_a_time():
    words = _command(compose()["services"]["worker"])
    assert words[words.index("-c") + 1] == "1"
    assert words[words.index("--prefetch-multiplier") + 1] == "1"
    queues = words[words.index("-Q") + 1].split(",")
    from projects.queues import Queue

    assert set(queues) == {q.value for q in Queue}
