"""From production back to training, on a live stack (issue 55's proof): the real ``openai`` client
stores completions through the gateway, a program attaches rewards over REST, a training step runs on
the captured traffic on a real Celery worker, and the gateway serves the new checkpoint through the
model's alias at a canary share, sticky per conversation, and a schedule of two more steps trains in
order at its rates. Web and gateway under uvicorn, an inference server, a worker, the tiny model,
PostgreSQL and Redis."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from openai import OpenAI

from projects import services
from projects.models import InferenceServer, RunEvent
from tests.projects.gateway.conftest import (  # noqa: F401  (fixtures)
    BASE_MODEL,
    gateway,
    inference_server,
    register_base_model,
    serving,
)

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

PROMPTS = ["Say yes.", "Say no."]


def rest(url: str, key: str, method: str, path: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(f"{url}{path}", method=method,
                                     data=json.dumps(body).encode() if body is not None else None)  # fmt: skip
    request.add_header("Authorization", f"Bearer {key}")
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_captured_traffic_trains_a_checkpoint_served_at_a_canary_share(
    gateway,  # noqa: F811  (the fixtures imported above)
    serving,  # noqa: F811
    inference_server,  # noqa: F811
    start_worker,
    tiny_model_dir,
    cast,
):
    register_base_model(tiny_model_dir)
    deadline = time.monotonic() + 30
    while not InferenceServer.objects.filter(url=inference_server.url).exists():
        assert time.monotonic() < deadline, "the inference server never registered"
        time.sleep(0.2)
    services.completion_storage_set(team=cast.alpha, storage="requested")
    model, _ = services.client_model_register(team=cast.alpha, entity=None, project="support", name="agent",
                                              base_model=BASE_MODEL)  # fmt: skip
    key = services.api_key_create(team=cast.alpha, name="prod").plaintext
    alias = rest(
        gateway.url, key, "POST", "/api/v1/aliases", {"model": model.pk, "name": "prod", "checkpoint": 0}
    )
    worker = start_worker(ARTWEB_DATA_DIR=str(serving.data_dir))
    api = OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=120)

    # Production traffic through the alias, stored; a program rates it (alternately 1 and 0).
    ids = []
    for index, prompt in enumerate(PROMPTS):
        for sample in range(3):
            reply = api.chat.completions.create(
                model="support/agent:prod", messages=[{"role": "user", "content": prompt}], max_tokens=4,
                temperature=1.0, seed=10 * index + sample, store=True, metadata={"conversation_id": f"u{index}{sample}"},
            )  # fmt: skip
            assert reply.model == "support/agent:0"
            ids.append(reply.id)
    deadline = time.monotonic() + 30
    while len(list(api.chat.completions.list(model="support/agent:prod"))) < len(ids):
        assert time.monotonic() < deadline, "the completions were not stored"
        time.sleep(0.2)
    for number, completion_id in enumerate(ids):
        rest(
            gateway.url,
            key,
            "POST",
            "/api/v1/feedback",
            {"completion_id": completion_id, "value": number % 2},
        )

    # One training step on the captured traffic, on the worker.
    job = rest(gateway.url, key, "POST", "/api/v1/stored-completions/train",
               {"model": model.pk, "filters": {"model": "support/agent:prod"}})  # fmt: skip
    assert job["counts"]["used"] == len(ids) and job["counts"]["groups"] == len(PROMPTS)
    deadline = time.monotonic() + 240
    while (status := rest(gateway.url, key, "GET", f"/v1/preview/training-jobs/{job['id']}")["status"]) not in (
        "succeeded", "failed",
    ):  # fmt: skip
        assert time.monotonic() < deadline, f"the training job is still {status}:\n{worker.output()[-3000:]}"
        time.sleep(0.5)
    assert status == "succeeded", worker.output()[-3000:]
    lineage = RunEvent.objects.filter(run__model=model, data__has_key="stored_completions").get()
    assert sorted(lineage.data["stored_completions"]) == sorted(ids)

    # The new checkpoint at a canary share of the alias: conversations split, each stays put.
    rest(gateway.url, key, "POST", f"/api/v1/aliases/{alias['id']}/canary", {"checkpoint": 1, "share": 0.5})

    def served(conversation: str) -> str:
        return api.chat.completions.create(
            model="support/agent:prod", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=2,
            temperature=0, metadata={"conversation_id": conversation},
        ).model  # fmt: skip

    split = {f"c{i}": served(f"c{i}") for i in range(16)}
    assert set(split.values()) == {"support/agent:0", "support/agent:1"}, split
    assert {served("c0") for _ in range(3)} == {split["c0"]}
    arms = rest(gateway.url, key, "GET", f"/api/v1/aliases/{alias['id']}")["arms"]
    assert [(arm["role"], arm["step"]) for arm in arms] == [("checkpoint", 0), ("candidate", 1)]

    # A schedule on the same traffic: two more steps, one job each, trained in order at the
    # schedule's rates, each step's event naming the completions it used.
    plan = rest(gateway.url, key, "POST", "/api/v1/stored-completions/train", {
        "model": model.pk, "filters": {"model": "support/agent:prod"},
        "schedule": {"steps": 2, "learning_rate": 1e-4, "lr_schedule": "linear", "seed": 1},
    })  # fmt: skip
    assert plan["object"] == "training_schedule" and plan["learning_rates"] == pytest.approx([1e-4, 1e-5])
    deadline = time.monotonic() + 120
    for job_id in plan["jobs"]:
        while (status := rest(gateway.url, key, "GET", f"/v1/preview/training-jobs/{job_id}")["status"]) not in (
            "succeeded", "failed",
        ):  # fmt: skip
            assert time.monotonic() < deadline, f"job {job_id} is still {status}:\n{worker.output()[-3000:]}"
            time.sleep(0.5)
        assert status == "succeeded", worker.output()[-3000:]
    steps = RunEvent.objects.filter(run__model=model, data__has_key="schedule").order_by("id")
    assert [event.data["schedule"]["step"] for event in steps] == [1, 2]
    assert sorted(name for event in steps for name in event.data["stored_completions"]) == sorted(ids)
    assert set(model.checkpoints.values_list("step", flat=True)) >= {2, 3}
    assert "Traceback" not in worker.output()
