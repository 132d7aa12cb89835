"""`serve_inference --engine vllm` and the gateway's vLLM path, as real processes: the command
launches the server, waits for its health check, registers it and heartbeats; the gateway loads
each checkpoint's adapter through vLLM's runtime LoRA API, least recently used out, and speaks
vLLM's dialect.

The server launched here is a PROTOCOL DOUBLE (tests/projects/gateway/fake_vllm.py, through
--vllm-command): it can die, fail at start, refuse requests and count calls on demand, which these
wiring tests need (command line, health wait, registration, signals, the adapter calls and their
bookkeeping, error and stream rewriting). The same path against the real vLLM (its CPU build) is
tests/vllm/test_vllm_gateway.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from projects import services
from projects.models import BaseModel, InferenceServer, UsageRecord
from tests.projects.gateway.conftest import (
    ROOT,
    SERVER_TOKEN,
    Process,
    Serving,
    http,
    register_base_model,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

VLLM_MODEL = "gateway-tiny-vllm"  # served only by the vLLM servers of this module
FAKE_VLLM = f"{sys.executable} {ROOT / 'tests' / 'projects' / 'gateway' / 'fake_vllm.py'}"
HELLO = [{"role": "user", "content": "Hello there"}]


def start_vllm_server(serving: Serving, base_model: str = VLLM_MODEL, *, capacity: int = 2,
                      command: str | None = FAKE_VLLM, **extra_env: str) -> Process:  # fmt: skip
    def ready(process: Process) -> bool:
        for line in process.output().splitlines():
            if line.startswith("inference server for ") and " on " in line:
                process.url = line.rsplit(" on ", 1)[1].strip()
                return True
        return False

    argv = [sys.executable, "manage.py", "serve_inference", "--base-model", base_model, "--port", "0",
            "--engine", "vllm", "--capacity", str(capacity)]  # fmt: skip
    if command:
        argv += ["--vllm-command", command]
    return serving.start(f"vllm-{base_model}", argv, ready, **extra_env)


def fake(server: Process, what: str) -> list | dict:
    return http("GET", f"{server.url}/fake/{what}")[2]


def vllm_calls(server: Process, since: int = 0) -> list[tuple[str, str]]:
    """(path, model or adapter name) of each /v1 call the double received after the first `since`."""
    calls = fake(server, "calls")[since:]
    return [(c["path"], (c["body"] or {}).get("lora_name") or (c["body"] or {}).get("model")) for c in calls]


@pytest.fixture(scope="module")
def vllm_server(serving, tiny_model_dir, django_db_blocker) -> Process:
    with django_db_blocker.unblock():
        register_base_model(tiny_model_dir, name=VLLM_MODEL)  # the command checks it exists
    return start_vllm_server(serving)


@pytest.fixture(scope="module")
def vllm_gateway(serving, vllm_server) -> Process:
    return serving.start_gateway()


@pytest.fixture
def live(tiny_model_dir, vllm_server, vllm_gateway) -> Process:
    register_base_model(tiny_model_dir, name=VLLM_MODEL)  # this test's (flushed) database
    wait_for(lambda: InferenceServer.objects.filter(url=vllm_server.url).exists(), timeout=10,
             what="the vLLM server's heartbeat")  # fmt: skip
    return vllm_gateway


def client(gateway: Process, key: str) -> OpenAI:
    return OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=120)


def checkpoints(serving: Serving, tiny_model_dir: Path, team, steps: list[int], project: str = "vl"):
    """A trainable model on the vLLM base model with real LoRA checkpoints at `steps`."""
    from training.base_models import load_base_model
    from training.config import LoraSpec, TrainConfig
    from training.session.policy import Policy

    base_model = BaseModel.objects.get(name=VLLM_MODEL)
    model = services.trainable_model_create(
        project=services.project_create(team=team, name=project), name="agent", base_model=base_model
    )
    base, tokenizer = load_base_model(str(tiny_model_dir), tiny_model_dir.parent)
    trainer = Policy(base, tokenizer, TrainConfig(), LoraSpec())
    rows = []
    for step in steps:
        path = serving.checkpoint_dir / f"vllm-model-{model.pk}" / f"step-{step}"
        trainer.save_checkpoint(path, step=step, metrics={})
        rows.append(services.checkpoint_record(model=model, run=None, step=step, path=str(path)))
    return model, rows


def post_status(url: str, body: dict) -> int:
    """The status of a POST with the server token (vLLM answers adapter calls in plain text)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {SERVER_TOKEN}",
                                              "Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def adapter(model, step: int) -> str:
    """The name the gateway gives a checkpoint's adapter on vLLM: not guessable without SECRET_KEY."""
    from projects.serving_names import secret_suffix

    identity = f"model-{model.pk}-step-{step}"
    return f"{identity}-{secret_suffix(identity)}"


def loaded(server_url: str) -> list[str]:
    return InferenceServer.objects.get(url=server_url).loaded_adapters


def test_serve_inference_launches_vllm_with_lora_and_registers_it(live, vllm_server):
    row = InferenceServer.objects.get(url=vllm_server.url)
    assert (row.engine, row.capacity, row.base_model.name) == ("vllm", 2, VLLM_MODEL)
    info = fake(vllm_server, "info")
    argv = " ".join(info["argv"])
    assert info["runtime_lora"] is True  # VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
    for flag in ("--model ", "--enable-lora", "--max-loras 2", f"--served-model-name {VLLM_MODEL}",
                 "--tool-call-parser hermes"):  # fmt: skip
        assert flag in argv
    assert SERVER_TOKEN not in argv  # it travels in VLLM_API_KEY: a command line is readable by all
    assert info["pid"] != vllm_server.process.pid  # a child, not this process
    # The server token guards vLLM's /v1 routes, and through the guard middleware every other route.
    assert http("GET", f"{vllm_server.url}/v1/models")[0] == 401
    assert "--middleware training.serving.vllm_guard.BearerTokenGuard" in argv
    for path in ("/metrics", "/tokenize", "/invocations", "/v1/models"):
        assert http("GET", f"{vllm_server.url}{path}")[0] == 401, path
    assert http("GET", f"{vllm_server.url}/v1/models", key=SERVER_TOKEN)[0] == 200


def test_checkpoints_are_loaded_on_first_use_and_the_least_recently_used_is_unloaded(
    live, serving, vllm_server, tiny_model_dir, cast, alpha_key
):
    api = client(live, alpha_key)
    reply = api.chat.completions.create(model=VLLM_MODEL, messages=HELLO, max_tokens=5)
    assert (reply.model, reply.choices[0].message.content) == (VLLM_MODEL, f"canned reply from {VLLM_MODEL}")

    model, (one, two, three) = checkpoints(serving, tiny_model_dir, cast.alpha, [1, 2, 3])
    names = {step: adapter(model, step) for step in (1, 2, 3)}
    before = len(fake(vllm_server, "calls"))
    for step in (1, 2, 1, 3):  # 3 pushes out 2, the least recently used (capacity 2)
        reply = api.chat.completions.create(model=f"vl/agent:{step}", messages=HELLO, max_tokens=5)
        assert reply.model == f"vl/agent:{step}"  # the public id, not the adapter name
        assert reply.choices[0].message.content == f"canned reply from {names[step]}"
    chat = "/v1/chat/completions"
    assert vllm_calls(vllm_server, before) == [
        ("/v1/load_lora_adapter", names[1]), (chat, names[1]),
        ("/v1/load_lora_adapter", names[2]), (chat, names[2]),
        (chat, names[1]),
        ("/v1/unload_lora_adapter", names[2]), ("/v1/load_lora_adapter", names[3]), (chat, names[3]),
    ]  # fmt: skip
    load = next(c for c in fake(vllm_server, "calls") if c["body"] and c["body"].get("lora_name") == names[3])
    assert load["body"]["lora_path"] == three.path
    assert loaded(vllm_server.url) == [names[1], names[3]]
    served = {m["id"] for m in http("GET", f"{vllm_server.url}/v1/models", key=SERVER_TOKEN)[2]["data"]}
    assert served == {VLLM_MODEL, names[1], names[3]}  # what vLLM holds agrees with the record

    # :latest resolves to step 3, already loaded: no load call.
    before = len(fake(vllm_server, "calls"))
    assert api.chat.completions.create(model="vl/agent:latest", messages=HELLO).model == "vl/agent:3"
    assert vllm_calls(vllm_server, before) == [(chat, names[3])]

    def metered():
        rows = {r.model: r.requests for r in UsageRecord.objects.filter(team=cast.alpha)}
        return rows if rows.get("vl/agent:3") == 2 else None

    rows = wait_for(metered, timeout=10, what="usage from vLLM's bodies")
    assert rows[VLLM_MODEL] == 1 and rows["vl/agent:1"] == 2


def test_a_checkpoint_written_elsewhere_is_fetched_by_key_on_the_vllm_host(
    live, serving, vllm_server, tiny_model_dir, cast, alpha_key
):
    """The row names the writer's folder on another host (absent here) and a store key: the
    gateway asks the server's fetcher for the checkpoint, and vLLM loads the folder it answers."""
    from projects.storage import checkpoint_key, folder_digest

    row = InferenceServer.objects.get(url=vllm_server.url)
    assert row.fetch_url and row.fetch_url != row.url
    model, (first,) = checkpoints(serving, tiny_model_dir, cast.alpha, [1], project="fx")
    key = checkpoint_key(model_id=model.pk, step=1)
    stored = serving.checkpoint_dir / key  # the local store of the server's host (ARTWEB_DATA_DIR)
    stored.parent.mkdir(parents=True, exist_ok=True)
    Path(first.path).rename(stored)
    digest = folder_digest(stored)
    first.path = "/another-host/checkpoints/" + key  # where the writer had it: not on this host
    first.storage_key, first.sha256, first.size_bytes = key, digest.sha256, digest.size_bytes
    first.save(update_fields=["path", "storage_key", "sha256", "size_bytes"])

    reply = client(live, alpha_key).chat.completions.create(model="fx/agent:1", messages=HELLO, max_tokens=5)
    assert reply.choices[0].message.content == f"canned reply from {adapter(model, 1)}"
    name = adapter(model, 1)
    load = next(c for c in fake(vllm_server, "calls") if c["body"] and c["body"].get("lora_name") == name)
    assert Path(load["body"]["lora_path"]).resolve() == stored.resolve()

    first.sha256 = "0" * 64  # a row whose digest the stored folder does not have: refused, not loaded
    first.save(update_fields=["sha256"])
    InferenceServer.objects.filter(url=vllm_server.url).update(loaded_adapters=[])
    time.sleep(1.5)  # the gateway remembers a route for GATEWAY_LOOKUP_CACHE_S
    with pytest.raises(openai.APIStatusError) as refused:
        client(live, alpha_key).chat.completions.create(model="fx/agent:1", messages=HELLO, max_tokens=5)
    assert refused.value.status_code == 502 and refused.value.body["code"] == "adapter_fetch_failed"


def test_streams_are_relayed_with_the_public_model_id_and_metered(live, serving, vllm_server, tiny_model_dir,
                                                                  cast, alpha_key):  # fmt: skip
    model, _ = checkpoints(serving, tiny_model_dir, cast.alpha, [1], project="st")
    api = client(live, alpha_key)
    chunks = list(api.chat.completions.create(model="st/agent:1", messages=HELLO, stream=True))
    assert {c.model for c in chunks} == {"st/agent:1"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        f"canned reply from {adapter(model, 1)}"
    )
    assert all(c.usage is None for c in chunks)  # the usage chunk the gateway asked for is hidden
    asked = list(api.chat.completions.create(model="st/agent:1", messages=HELLO, stream=True,
                                             stream_options={"include_usage": True}))  # fmt: skip
    assert asked[-1].usage.completion_tokens == 4 and asked[-1].choices == []
    wait_for(
        lambda: UsageRecord.objects.filter(model="st/agent:1", requests=2, completion_tokens=8).exists(),
        timeout=10, what="usage from the streams",
    )  # fmt: skip


def test_already_loaded_lost_and_unloadable_adapters_are_handled(live, serving, vllm_server, tiny_model_dir, cast,
                                                                  alpha_key):  # fmt: skip
    model, (one, two) = checkpoints(serving, tiny_model_dir, cast.alpha, [1, 2], project="err")
    api = client(live, alpha_key)
    name_one, name_two = adapter(model, 1), adapter(model, 2)
    load = f"{vllm_server.url}/v1/load_lora_adapter"
    unload = f"{vllm_server.url}/v1/unload_lora_adapter"

    # Loaded behind the gateway's back (another gateway process): "already loaded" counts as loaded.
    assert post_status(load, {"lora_name": name_one, "lora_path": one.path}) == 200
    assert api.chat.completions.create(model="err/agent:1", messages=HELLO).model == "err/agent:1"
    assert name_one in loaded(vllm_server.url)

    # Unloaded behind its back (a restarted vLLM): the completion's 404 leads to a reload and a retry.
    assert post_status(unload, {"lora_name": name_one}) == 200
    before = len(fake(vllm_server, "calls"))
    assert api.chat.completions.create(model="err/agent:1", messages=HELLO).model == "err/agent:1"
    chat = "/v1/chat/completions"
    assert vllm_calls(vllm_server, before) == [
        (chat, name_one),
        ("/v1/load_lora_adapter", name_one),
        (chat, name_one),
    ]

    # A checkpoint vLLM cannot load: a 500 with OpenAI's error object, and nothing recorded as loaded.
    for path in Path(two.path).iterdir():
        path.unlink()
    status, _, error = http("POST", f"{live.url}/v1/chat/completions", key=alpha_key,
                            body={"model": "err/agent:2", "messages": HELLO})  # fmt: skip
    assert status == 500 and set(error["error"]) == {"message", "type", "param", "code", "request_id"}
    assert error["error"]["code"] == "adapter_load_failed" and "No adapter found" in error["error"]["message"]
    assert name_two not in loaded(vllm_server.url)
    with pytest.raises(openai.InternalServerError):
        api.chat.completions.create(model="err/agent:2", messages=HELLO)

    # vLLM's own error bodies become OpenAI error objects.
    status, _, error = http("POST", f"{live.url}/v1/chat/completions", key=alpha_key,
                            body={"model": VLLM_MODEL, "messages": [{"role": "user", "content": "FAKE_ERROR"}]})  # fmt: skip
    assert status == 400 and error["error"]["message"] == "this double refuses FAKE_ERROR"
    assert error["error"]["type"] == "invalid_request_error"


def test_sigterm_stops_vllm_and_deregisters(live, serving, tiny_model_dir):
    register_base_model(tiny_model_dir, name="gateway-tiny-vllm-b")
    server = start_vllm_server(serving, "gateway-tiny-vllm-b")
    wait_for(lambda: InferenceServer.objects.filter(url=server.url).exists(), timeout=10, what="registration")
    child_pid = fake(server, "info")["pid"]
    os.kill(server.process.pid, signal.SIGTERM)  # the command only, not its process group
    assert server.process.wait(timeout=30) == 0
    assert not InferenceServer.objects.filter(url=server.url).exists()
    wait_for(lambda: not _alive(child_pid), timeout=10, what="vLLM to be stopped")


def test_a_vllm_that_dies_ends_serve_inference_with_an_error(live, serving, tiny_model_dir):
    register_base_model(tiny_model_dir, name="gateway-tiny-vllm-c")
    server = start_vllm_server(serving, "gateway-tiny-vllm-c")
    wait_for(lambda: InferenceServer.objects.filter(url=server.url).exists(), timeout=10, what="registration")
    http("POST", f"{server.url}/fake/die")
    assert server.process.wait(timeout=30) != 0
    assert "vLLM exited with status 3" in server.output()
    assert not InferenceServer.objects.filter(url=server.url).exists()


def test_vllm_missing_or_failing_at_start_is_a_readable_error(live, serving):
    base = [sys.executable, "manage.py", "serve_inference", "--base-model", VLLM_MODEL, "--port", "0",
            "--engine", "vllm"]  # fmt: skip
    env = {key: value for key, value in serving.env.items() if key != "INFERENCE_VLLM_COMMAND"}
    nowhere = {**env, "VLLM_PYTHON": str(serving.data_dir / "no-venv" / "bin" / "python")}
    missing = subprocess.run(base, cwd=ROOT, env=nowhere, capture_output=True, text=True, timeout=120)
    assert (
        missing.returncode != 0
        and "needs vLLM, which is neither importable here nor at VLLM_PYTHON" in missing.stderr
    )
    assert "make install-vllm" in missing.stderr

    failing = subprocess.run(base + ["--vllm-command", FAKE_VLLM], cwd=ROOT, capture_output=True, text=True,
                             env={**env, "FAKE_VLLM_EXIT_AT_START": "7"}, timeout=120)  # fmt: skip
    assert failing.returncode != 0
    assert "vLLM exited with status 7 before it was ready" in failing.stderr
    assert "failing at start as asked" in failing.stderr  # vLLM's own output is passed through


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as stopped.
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "\nState:\tZ" not in status.read_text()
