"""The real `openai` client fine-tunes on a live artweb (uvicorn, a Celery worker, an inference
server, PostgreSQL, Redis, the tiny model) through OpenAI's fine-tuning API, unchanged: upload
files, create a reinforcement job (a `multi` grader over a `string_check`), a supervised job and a
DPO job, follow each job's events to success, list its checkpoints and call the fine-tuned model
through `chat.completions` at once. Each job is a run, the same object in `/api/v1/runs/`."""

from __future__ import annotations

import io
import json
import time

import pytest
from openai import OpenAI

from projects import services
from projects.models import Run
from tests.projects.gateway.conftest import (  # noqa: F401  (fixtures)
    BASE_MODEL,
    gateway,
    http,
    inference_server,
    register_base_model,
    serving,
)

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

WORDS = "abcdef"
RL = [{"messages": [{"role": "user", "content": f"Say {w}"}], "answer": w} for w in WORDS]
SFT = [
    {"messages": [{"role": "user", "content": f"Say {w}"}, {"role": "assistant", "content": w}]}
    for w in WORDS
]
DPO = [
    {"input": {"messages": [{"role": "user", "content": f"Say {w}"}]},
     "preferred_output": [{"role": "assistant", "content": w}],
     "non_preferred_output": [{"role": "assistant", "content": "no"}]}
    for w in WORDS
]  # fmt: skip
GRADER = {
    "type": "multi",
    "graders": {
        "exact": {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
                  "reference": "{{item.answer}}", "operation": "like"},
        "short": {"type": "string_check", "name": "short", "input": "{{sample.output_text}}",
                  "reference": "", "operation": "ne"},
    },
    "calculate_output": "0.8 * exact + 0.2 * short",
}  # fmt: skip
SMALL = {"n_epochs": 1, "batch_size": 2}  # 4 training rows: 2 steps


def upload(client: OpenAI, rows) -> str:
    body = "\n".join(json.dumps(row) for row in rows).encode()
    return client.files.create(file=("rows.jsonl", io.BytesIO(body)), purpose="fine-tune").id


def follow(client: OpenAI, job_id: str, worker) -> tuple[object, list]:
    """Poll the job's events as a CI script does (newest first, ``after`` the last seen) until
    the job is terminal; the job and every event seen, oldest first."""
    seen: dict[str, object] = {}
    deadline = time.monotonic() + 300
    while True:
        for event in client.fine_tuning.jobs.list_events(job_id, limit=100).data:
            seen.setdefault(event.id, event)
        job = client.fine_tuning.jobs.retrieve(job_id)
        if job.status in ("succeeded", "failed", "cancelled"):
            for event in client.fine_tuning.jobs.list_events(job_id, limit=100).data:
                seen.setdefault(event.id, event)
            return job, sorted(seen.values(), key=lambda e: int(e.id.removeprefix("ftevent-")))
        if time.monotonic() > deadline:
            pytest.fail(f"job {job_id} still {job.status}:\n{worker.output()[-4000:]}")
        time.sleep(0.5)


def test_openai_client_fine_tunes_with_every_method_and_serves_the_result(
    gateway,  # noqa: F811  (the fixtures imported above)
    serving,  # noqa: F811
    start_worker,
    tiny_model_dir,
    cast,
):
    register_base_model(tiny_model_dir)
    worker = start_worker(ARTWEB_DATA_DIR=str(serving.data_dir))  # the inference server's checkpoints
    key = services.api_key_create(team=cast.alpha, name="ci").plaintext
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=120)
    train, valid = upload(client, RL[:4]), upload(client, RL[4:])
    jobs = {
        "reinforcement": client.fine_tuning.jobs.create(
            model=BASE_MODEL, training_file=train, validation_file=valid, suffix="words", seed=3,
            method={"type": "reinforcement", "reinforcement": {"grader": GRADER, "hyperparameters": SMALL}},
        ),
        "supervised": client.fine_tuning.jobs.create(
            model=BASE_MODEL, training_file=upload(client, SFT[:4]), validation_file=upload(client, SFT[4:]),
            method={"type": "supervised", "supervised": {"hyperparameters": {**SMALL, "learning_rate_multiplier": 2}}},
        ),
        "dpo": client.fine_tuning.jobs.create(
            model=BASE_MODEL, training_file=upload(client, DPO[:4]),
            method={"type": "dpo", "dpo": {"hyperparameters": {**SMALL, "beta": 0.2}}},
        ),
    }  # fmt: skip
    for method, created in jobs.items():
        job, events = follow(client, created.id, worker)
        assert job.status == "succeeded", (method, job.error, [e.message for e in events][-5:])
        metrics = [e for e in events if e.type == "metrics"]
        assert [e.data["step"] for e in metrics] == [1, 2], (method, [e.message for e in events])
        assert all(e.data["total_steps"] == 2 and "train_loss" in e.data for e in metrics)
        assert job.trained_tokens and job.trained_tokens > 0 and job.finished_at >= job.created_at
        checkpoints = client.fine_tuning.jobs.checkpoints.list(job.id).data
        assert [c.step_number for c in checkpoints] == [2, 1]  # newest first; not the untrained step 0
        assert job.fine_tuned_model == checkpoints[0].fine_tuned_model_checkpoint
        # Served at once, under the name the job gave, with the same team key.
        reply = client.chat.completions.create(
            model=job.fine_tuned_model, messages=[{"role": "user", "content": "Say a"}], max_tokens=4
        )
        assert reply.model == job.fine_tuned_model and reply.choices[0].message.content is not None
        # The same object everywhere: the job is a run of the team's, in the REST API.
        run = Run.objects.get(pk=job.run_id)
        assert run.kind == {"reinforcement": "platform", "supervised": "sft", "dpo": "dpo"}[method]
        status, _, body = http("GET", f"{gateway.url}/api/v1/runs/{run.pk}/", key=key)
        assert status == 200 and body["status"] == "succeeded", body
    # A job may continue a fine-tuned checkpoint: its model's step 0 is a copy of that checkpoint.
    tuned = client.fine_tuning.jobs.retrieve(jobs["reinforcement"].id).fine_tuned_model
    more = client.fine_tuning.jobs.create(
        model=tuned, training_file=upload(client, SFT[:2]),
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1, "batch_size": 2}}},
    )  # fmt: skip
    job, events = follow(client, more.id, worker)
    assert job.status == "succeeded" and job.model == tuned, (job.error, [e.message for e in events][-5:])
    continued = Run.objects.get(pk=job.run_id)
    assert continued.forked_from is not None and continued.forked_from.model.name in tuned
    assert continued.model.checkpoints.filter(step=0).exists()
    assert [c.step_number for c in client.fine_tuning.jobs.checkpoints.list(job.id).data] == [1]
    rl_run = Run.objects.get(pk=jobs["reinforcement"].run_id)
    assert rl_run.reward.spec["type"] == "multi" and rl_run.task_set.validation_count == 2
    # The reinforcement recipe (fine_tuning.RECIPES): 6 completions per prompt, dynamic sampling
    # drawing up to 2× the rows when groups score alike; every trajectory drawn is stored.
    drawn = rl_run.trajectories.count()
    assert 2 * 2 * 6 <= drawn <= 2 * 2 * 2 * 6 and drawn % 6 == 0, drawn
