"""The gateway under ``manage.py runserver`` (Django's WSGI server, what a Django developer types
first): a streamed completion arrives whole and usage is recorded, as under uvicorn
(projects.gateway.sync_servers)."""

from __future__ import annotations

import sys
import urllib.request

import pytest
from openai import OpenAI

from projects.models import InferenceServer, UsageRecord
from tests.projects.gateway.conftest import BASE_MODEL, Process, free_port, register_base_model, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

HELLO = [{"role": "user", "content": "Hello! How are you today?"}]


@pytest.fixture(scope="module")
def runserver(serving, inference_server) -> Process:
    port = free_port()

    def ready(process: Process) -> bool:
        process.url = f"http://127.0.0.1:{port}"
        try:
            with urllib.request.urlopen(f"{process.url}/healthz", timeout=2):
                return True
        except OSError:
            return False

    command = [sys.executable, "manage.py", "runserver", f"127.0.0.1:{port}", "--noreload"]
    return serving.start("runserver", command, ready)


def test_a_streamed_completion_works_under_runserver(tiny_model_dir, inference_server, runserver, alpha_key):
    register_base_model(tiny_model_dir)
    wait_for(lambda: InferenceServer.objects.filter(url=inference_server.url).exists(), timeout=10,
             what="the inference server's heartbeat")  # fmt: skip
    api = OpenAI(base_url=f"{runserver.url}/v1", api_key=alpha_key, max_retries=0, timeout=120)
    whole = api.chat.completions.create(model=BASE_MODEL, messages=HELLO, max_tokens=8, seed=7)
    for _ in range(2):  # the second stream reuses the pooled connection of the first
        chunks = list(api.chat.completions.create(
            model=BASE_MODEL, messages=HELLO, max_tokens=8, seed=7, stream=True,
            stream_options={"include_usage": True},
        ))  # fmt: skip
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content
        assert (
            chunks[-1].usage is not None
            and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        )
    # Recorded after each response, on the gateway's loop (the per-request loop is gone by then).
    wait_for(lambda: UsageRecord.objects.filter(requests=3).exists(), timeout=10, what="usage of all three")
    assert "Event loop is closed" not in runserver.output()
