"""Checkpoints in an S3-compatible bucket shared by hosts that share nothing else on disk.

A real S3 HTTP server (moto's standalone ``moto_server``, started here as a subprocess), real
Celery workers and a real inference server, each with its own CHECKPOINT_DIR (its local cache):
worker A trains and is killed, worker B resumes from what A uploaded, and an inference server on a
third cache fetches the newest checkpoint by key and digest and serves it.
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


def chat(server: Process, checkpoint: Checkpoint, public_id: str) -> dict:
    """A request as the gateway sends it (projects.gateway.upstream.InferenceServerUpstream): the
    writer's path (which does not exist on this host), the storage key and the digest."""
    from training.serving.protocol import (
        ADAPTER_HEADER,
        ADAPTER_KEY_HEADER,
        ADAPTER_SHA256_HEADER,
        MODEL_HEADER,
    )

    request = urllib.request.Request(
        f"{server.url}/v1/chat/completions",
        data=json.dumps(
            {"model": public_id, "messages": [{"role": "user", "content": "Say a"}], "max_tokens": 4}
        ).encode(),
        headers={
            "Authorization": f"Bearer {SERVER_TOKEN}",
            "Content-Type": "application/json",
            MODEL_HEADER: public_id,
            ADAPTER_HEADER: checkpoint.path,
            ADAPTER_KEY_HEADER: checkpoint.storage_key,
            ADAPTER_SHA256_HEADER: checkpoint.sha256,
        },
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return dict(json.loads(response.read()))


def test_second_worker_resumes_from_s3_and_a_third_host_serves_the_new_checkpoint(
    start_worker,
    api,
    inputs,
    s3_server,
    s3_settings,
    tmp_path,
):
    cache_a, cache_b, cache_c = (tmp_path / name for name in ("cache-a", "cache-b", "cache-c"))
    first = start_worker(ARTWEB_CHECKPOINT_DIR=str(cache_a), **s3_server.env())
    run_id = create_run(api, inputs, "s3m", steps=3, max_new_tokens=8)
    wait_for(
        lambda: Run.objects.get(pk=run_id).current_step >= 1, timeout=240, what="a first step", worker=first
    )
    first.kill()
    killed_at = Run.objects.get(pk=run_id).current_step
    assert status_of(run_id) == RunStatus.RUNNING, "worker A finished before it was killed"

    second = start_worker(ARTWEB_CHECKPOINT_DIR=str(cache_b), **s3_server.env())
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
        for name in ("adapter_model.safetensors", "adapter_config.json", "state.json"):
            assert (fetched / name).read_bytes() == (
                writer_cache / checkpoint.storage_key / name
            ).read_bytes()
    # B never saw A's disk: the checkpoint it resumed from came from the bucket into its cache.
    resumed_from = checkpoints[killed_at]
    assert folder_digest(cache_b / resumed_from.storage_key).sha256 == resumed_from.sha256
    assert not (cache_a / checkpoints[3].storage_key).exists()

    fetched_c = tmp_path / "inference-data" / "fetched"  # the server's own cache: never a trainer's folder
    env = {
        **os.environ,
        "DATABASE_URL": test_database_url(),
        "ARTWEB_DATA_DIR": str(tmp_path / "inference-data"),
        "ARTWEB_CHECKPOINT_DIR": str(cache_c),
        "INFERENCE_ADAPTER_ROOT": str(cache_c),
        "INFERENCE_CACHE_DIR": str(fetched_c),
        "INFERENCE_SERVER_TOKEN": SERVER_TOKEN,
        "DEBUG": "1",
        "TORCH_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        **s3_server.env(),
    }
    server = start_inference_server(tmp_path, env)
    try:
        newest = checkpoints[3]
        reply = chat(server, newest, f"it/s3m:{newest.step}")
        assert reply["model"] == "it/s3m:3" and reply["choices"][0]["message"]["role"] == "assistant"
        assert folder_digest(fetched_c / newest.storage_key).sha256 == newest.sha256
        with urllib.request.urlopen(
            urllib.request.Request(f"{server.url}/stats", headers={"Authorization": f"Bearer {SERVER_TOKEN}"})
        ) as response:
            loaded = json.loads(response.read())["adapters"]["loaded"]
        assert loaded == [str((fetched_c / newest.storage_key).resolve())]
    finally:
        server.stop()
