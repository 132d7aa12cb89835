"""Checkpoints in an S3-compatible bucket shared by hosts that share nothing else on disk.

A real S3 HTTP server (moto's standalone ``moto_server``, started here as a subprocess), real
Celery workers, a real inference server and the gateway, on two simulated hosts (a data folder
each): worker A trains and is killed, and A's folder is moved away; worker B resumes from what A
uploaded, B's inference server serves the newest checkpoint through the gateway, fetched by key
and digest; a fork is trained by a new worker on host A.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from projects.models import Checkpoint, Run, RunEvent, RunStatus, StepMetrics
from projects.storage import StoredObject, checkpoint_local_dir, checkpoint_store, folder_digest
from tests.integration import test_training_runs
from tests.integration.conftest import wait_for
from tests.integration.test_training_runs import TERMINAL, create_run, status_of
from tests.processes import Process, test_database_url

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

api = test_training_runs.api  # the same fixtures: an API client and the run's inputs, through the API
inputs = test_training_runs.inputs

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "artweb-it"
PREFIX = "install-1"
SERVER_TOKEN = "storage-test-token"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class S3Server:
    endpoint: str
    process: subprocess.Popen

    def env(self) -> dict[str, str]:
        """The settings every host of the installation gets (the compose file's names)."""
        return {
            "STORAGE_BACKEND": "s3",
            "STORAGE_S3_BUCKET": BUCKET,
            "STORAGE_S3_PREFIX": PREFIX,
            "STORAGE_S3_ENDPOINT_URL": self.endpoint,
            "STORAGE_S3_REGION": "us-east-1",
            "STORAGE_S3_ACCESS_KEY_ID": "test",
            "STORAGE_S3_SECRET_ACCESS_KEY": "test",
        }

    def client(self):
        import boto3

        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            aws_access_key_id="test", aws_secret_access_key="test",
        )  # fmt: skip


def start_moto_server(log: Path) -> S3Server:
    """``moto_server`` on a free loopback port, waited for until it answers."""
    executable = Path(sys.executable).with_name("moto_server")
    if not executable.exists():
        pytest.fail("moto_server is missing: pip install -e .[dev] (moto[server] is in the dev extra)")
    port = free_port()
    with open(log, "wb") as handle:
        process = subprocess.Popen(
            [str(executable), "-H", "127.0.0.1", "-p", str(port)],
            stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2):
                break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"moto_server did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.2)
    return S3Server(endpoint, process)


@pytest.fixture
def s3_server(tmp_path) -> Iterator[S3Server]:
    server = start_moto_server(tmp_path / "moto.log")
    server.client().create_bucket(Bucket=BUCKET)
    yield server
    server.process.terminate()
    try:
        server.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.process.kill()


@pytest.fixture
def s3_settings(settings, s3_server, tmp_path):
    """This (web) process uses the same bucket, with a cache of its own."""
    for name, value in s3_server.env().items():
        setattr(settings, name, value)
    settings.CHECKPOINT_DIR = tmp_path / "web-cache"
    return settings


def start_inference_server(tmp_path: Path, env: dict[str, str]) -> Process:
    log = tmp_path / "inference.log"
    command = [sys.executable, "manage.py", "serve_inference", "--base-model", "tiny", "--port", "0"]
    with open(log, "wb") as handle:
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )
    server = Process("inference", process, log)
    deadline = time.monotonic() + 180
    while not server.url:
        for line in server.output().splitlines():
            if line.startswith("inference server for ") and " on " in line:
                server.url = line.rsplit(" on ", 1)[1].strip()
        if process.poll() is not None or time.monotonic() > deadline:
            server.kill()
            pytest.fail(f"the inference server did not start:\n{server.output()[-3000:]}")
        time.sleep(0.2)
    return server


def host_env(root: Path, s3_server: S3Server) -> dict[str, str]:
    """One simulated host: a data folder of its own (its checkpoint folder and its inference
    server's cache inside), and the installation's bucket."""
    return {
        "ARTWEB_DATA_DIR": str(root),
        "ARTWEB_CHECKPOINT_DIR": str(root / "checkpoints"),
        "INFERENCE_ADAPTER_ROOT": str(root / "checkpoints"),
        "INFERENCE_CACHE_DIR": str(root / "inference-cache"),
        **s3_server.env(),
    }


def start_gateway(tmp_path: Path, s3_server: S3Server) -> Process:
    port = free_port()
    env = {
        **os.environ, "DATABASE_URL": test_database_url(), "ARTWEB_DATA_DIR": str(tmp_path / "web-data"),
        "INFERENCE_SERVER_TOKEN": SERVER_TOKEN, "DEBUG": "1", "HF_HUB_OFFLINE": "1",
        "GATEWAY_RATE_LIMIT_PER_MINUTE": "0", **s3_server.env(),
    }  # fmt: skip
    log = tmp_path / "gateway.log"
    with open(log, "wb") as handle:
        process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "artweb.asgi:application", "--port", str(port), "--log-level", "warning"],
            cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    gateway = Process("gateway", process, log)
    gateway.url = f"http://127.0.0.1:{port}"
    wait_for(lambda: _answers(f"{gateway.url}/healthz"), timeout=120, what="the gateway")
    return gateway


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


def test_two_hosts_share_only_the_bucket_the_database_and_the_broker(
    start_worker,
    api,
    inputs,
    s3_server,
    s3_settings,
    tmp_path,
):
    """Host A trains a run and is killed mid-run; its data folder is then moved away, so nothing
    can read it by any path a row names. Host B's worker resumes the run from the bucket to the
    end, B's inference server serves the newest checkpoint through the gateway, and a fork of the
    run (its step 0 put in the bucket by the web host) is trained by a new worker on host A."""
    from openai import OpenAI

    from projects import services

    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"
    cache_a, cache_b = host_a / "checkpoints", host_b / "checkpoints"
    first = start_worker(**host_env(host_a, s3_server))
    run_id = create_run(api, inputs, "s3m", steps=3, max_new_tokens=8)
    wait_for(
        lambda: Run.objects.get(pk=run_id).current_step >= 1, timeout=240, what="a first step", worker=first
    )
    first.kill()
    killed_at = Run.objects.get(pk=run_id).current_step
    assert status_of(run_id) == RunStatus.RUNNING, "worker A finished before it was killed"
    gone_a = host_a.rename(tmp_path / "host-a-gone")  # A's disk: unreachable from now on
    cache_gone = gone_a / "checkpoints"

    second = start_worker(**host_env(host_b, s3_server))
    wait_for(lambda: status_of(run_id) in TERMINAL, timeout=300, what="the resumed run", worker=second)
    run = Run.objects.get(pk=run_id)
    assert run.status == RunStatus.SUCCEEDED, (run.error, second.output()[-3000:])
    steps = list(StepMetrics.objects.filter(run=run).order_by("step").values_list("step", flat=True))
    assert steps == [1, 2, 3], "every step recorded exactly once"
    assert RunEvent.objects.filter(run=run, message=f"Resumed from checkpoint step {killed_at}").exists()

    checkpoints = {c.step: c for c in Checkpoint.objects.filter(model=run.model)}
    assert sorted(checkpoints) == [0, 1, 2, 3]
    keys = {c.storage_key for c in checkpoints.values()}
    # Every row names a complete object in the bucket, with the digest of what the trainer wrote.
    assert checkpoint_store().list_keys(f"model-{run.model_id}/") == sorted(keys)
    for step, checkpoint in checkpoints.items():
        writer_cache = cache_a if step <= killed_at else cache_b
        assert Path(checkpoint.path).is_relative_to(writer_cache), (step, checkpoint.path)
        assert checkpoint_store().stat(checkpoint.storage_key) == StoredObject(
            checkpoint.storage_key, checkpoint.sha256, checkpoint.size_bytes
        )
        # What this (web) host fetches is what the trainer wrote (older steps have since lost
        # their optimizer state in the bucket: retention, services.checkpoints).
        fetched = checkpoint_local_dir(checkpoint)
        assert fetched is not None and fetched.is_relative_to(tmp_path / "web-cache")
        written = (cache_gone if step <= killed_at else cache_b) / checkpoint.storage_key
        for name in ("adapter_model.safetensors", "adapter_config.json", "state.json"):
            assert (fetched / name).read_bytes() == (written / name).read_bytes()
    # B never saw A's disk: the checkpoint it resumed from came from the bucket into its cache.
    resumed_from = checkpoints[killed_at]
    assert folder_digest(cache_b / resumed_from.storage_key).sha256 == resumed_from.sha256
    assert not (cache_gone / checkpoints[3].storage_key).exists()

    # Host B's inference server, through the gateway: the newest checkpoint, fetched by its key.
    env = {
        **os.environ, "DATABASE_URL": test_database_url(), "INFERENCE_SERVER_TOKEN": SERVER_TOKEN,
        "DEBUG": "1", "TORCH_THREADS": "1", "HF_HUB_OFFLINE": "1", **host_env(host_b, s3_server),
    }  # fmt: skip
    server = start_inference_server(tmp_path, env)
    gateway = start_gateway(tmp_path, s3_server)
    try:
        newest = checkpoints[3]
        key = services.api_key_create(team=run.project.team, name="two-hosts").plaintext
        client = OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=120)
        public = f"{run.project.name}/s3m"
        reply = wait_for(
            lambda: _completion(client, f"{public}:latest"), timeout=60, what="a completion", worker=server
        )
        assert reply.model == f"{public}:3" and reply.choices[0].message.role == "assistant"
        fetched_b = host_b / "inference-cache" / newest.storage_key
        assert folder_digest(fetched_b).sha256 == newest.sha256
        with urllib.request.urlopen(
            urllib.request.Request(f"{server.url}/stats", headers={"Authorization": f"Bearer {SERVER_TOKEN}"})
        ) as response:
            stats = json.loads(response.read())
        assert stats["adapters"]["loaded"] == [str(fetched_b.resolve())]
        assert stats["checkpoint_cache"]["misses"] == 1 and stats["checkpoint_cache"]["used_bytes"] > 0
    finally:
        gateway.stop()
        server.stop()

    # A fork of step 3 (host B wrote it): its step 0 is the web host's copy, in the bucket; B
    # stops, and a new worker on host A (an empty data folder) trains the fork from there.
    second.kill()
    response = api.post(f"/api/v1/runs/{run_id}/fork/", {"from_step": 3, "name": "s3fork",
                                                         "config": {"steps": 1}}, format="json")  # fmt: skip
    assert response.status_code == 201, response.json()
    fork_id = response.json()["id"]
    third = start_worker(**host_env(host_a, s3_server))
    wait_for(lambda: status_of(fork_id) in TERMINAL, timeout=300, what="the fork's run", worker=third)
    fork = Run.objects.get(pk=fork_id)
    assert fork.status == RunStatus.SUCCEEDED, (fork.error, third.output()[-3000:])
    start = Checkpoint.objects.get(model=fork.model, step=0)
    assert start.storage_key and checkpoint_store().stat(start.storage_key) is not None
    assert folder_digest(cache_a / start.storage_key).sha256 == start.sha256  # fetched into A's cache
    assert Path(Checkpoint.objects.get(model=fork.model, step=1).path).is_relative_to(cache_a)


def _completion(client, model: str):
    import openai

    try:
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say a"}], max_tokens=4
        )
    except openai.APIStatusError as exc:
        if exc.status_code == 503:  # the server's registration is not seen yet
            return None
        raise


def test_a_tinker_training_client_continues_on_another_host_from_the_bucket(
    start_worker,
    cast,
    alpha_key,
    tiny_model_dir,
    s3_server,
    s3_settings,
    tmp_path,
):
    """A Tinker training client trains on host A (its session in A's worker), saves its state,
    takes one more step; A is killed and its data folder moved away. The SDK's next request runs
    on host B, which rebuilds the session from the state in the bucket and the request log in the
    database: the client's losses equal, number for number, an uninterrupted client's on B."""
    import random

    import tinker
    from tinker import types
    from transformers import AutoTokenizer

    from projects import services
    from projects.models import TinkerModel
    from tests.integration.test_tinker_sdk import _mean_loss, _prompts, _sft_datum

    services.base_model_register(name="tiny", source=str(tiny_model_dir))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    data = [_sft_datum(types, tokenizer, p) for p in _prompts(random.Random(3), 4)]
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"

    def steps(trainer, count: int, losses: list[float]) -> None:
        for _ in range(count):
            losses.append(_mean_loss(trainer.forward_backward(data, "cross_entropy").result(), data))
            trainer.optim_step(types.AdamParams(learning_rate=2e-2)).result()

    gateway = start_gateway(tmp_path, s3_server)
    try:
        first = start_worker(**host_env(host_a, s3_server), TINKER_POLL_S="5")
        client = tinker.ServiceClient(base_url=f"{gateway.url}/tinker", api_key=f"tml-{alpha_key}")
        ours = client.create_lora_training_client(base_model="tiny", rank=8, seed=4).result()
        moved: list[float] = []
        steps(ours, 2, moved)
        ours.save_state(name="early").result()
        steps(ours, 1, moved)
        # A finished its queue (and let go of the client) before it dies: B need not wait out a lease.
        wait_for(lambda: TinkerModel.objects.get(pk=ours.model_id).drainer == "", timeout=30,
                 what="host A to let go of the client", worker=first)  # fmt: skip
        first.kill()
        host_a.rename(tmp_path / "host-a-gone")  # A's disk: unreachable from now on

        second = start_worker(**host_env(host_b, s3_server), TINKER_POLL_S="5")
        steps(ours, 2, moved)
        whole: list[float] = []
        reference = client.create_lora_training_client(base_model="tiny", rank=8, seed=4).result()
        steps(reference, 5, whole)
    finally:
        gateway.stop()
    print(f"losses, moved {[round(v, 4) for v in moved]} vs whole {[round(v, 4) for v in whole]}")
    assert moved == whole and whole[-1] < whole[0], (moved, whole)
    model = TinkerModel.objects.get(pk=ours.model_id)
    assert not model.lost
    [event] = RunEvent.objects.filter(run=model.run, message__contains="session was rebuilt")
    assert "from its checkpoint of step 2 by running 2 requests again (1 optimizer step)" in event.message
    # B read the saved state from the bucket into its own cache, never from A's folder.
    saved = Checkpoint.objects.get(model=model.model, step=2)
    assert "weights/early" in saved.metrics["tinker_names"]
    assert folder_digest(host_b / "checkpoints" / saved.storage_key).sha256 == saved.sha256
    assert "Traceback" not in second.output()
