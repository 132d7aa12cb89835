"""A reinforcement fine-tuning job through the real `openai` client on the bundled model, against the
same task trained as a platform run through the REST API (issue 29's figures).

``manage.py up`` on a scratch SQLite data folder (as ``tinker_overhead.py``), then:
1. upload the README's example files, ``examples/fine_tuning/{train,valid}.jsonl``: the arithmetic
   task of ``sample_efficiency.py`` (48 training rows, 16 held out; each row's system message says
   "Answer with the number only.") in OpenAI's reinforcement format;
2. ``client.fine_tuning.jobs.create(method="reinforcement", grader=<its multi grader>)`` with
   ``n_epochs``/``batch_size``; follow ``list_events`` to success. Reported: held-out reward before
   and after (the run's greedy evaluation of all 16 rows at step 0 and at the end), seconds from
   ``create`` to the first checkpoint listed by ``checkpoints.list``, seconds to success, steps;
3. ``POST /api/v1/runs/`` on a new model with the job's task set, environment, reward and config:
   the same task as a platform run. Same seed, same config: the held-out figures must match the
   job's (they train the same way: a job *is* a run); the report says whether they do.

``--method supervised`` / ``--method dpo``: the same rows as a supervised file (the bare answer as the
assistant's target) or a preference file (the bare answer preferred to "The answer is N."), the job
graded as OpenAI's supervised and DPO jobs are here (text similarity of the held-out reply to the
target, ``fine_tuning.REFERENCE_GRADER``); no platform run beside it (step 3 is the reinforcement
job's check).

Run: ``.venv/bin/python -m benchmarks.fine_tuning_job [--method reinforcement] [--epochs 1 --batch 4] [--broker redis://…]``.
Nothing else may train on this machine meanwhile (2 cores).
"""

from __future__ import annotations

import argparse
import io
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks._model import add_model_arguments, prepared_model
from benchmarks.sample_efficiency import ARITHMETIC_REWARD
from benchmarks.tinker_overhead import _manage, live_stack

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fine_tuning"


def openai_rows() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training, validation) lines: the README's example files, the arithmetic task's rows in
    OpenAI's reinforcement format (tests/platform/test_fine_tuning_example.py keeps them so)."""
    return tuple(  # type: ignore[return-value]
        [json.loads(line) for line in (EXAMPLE / name).read_text().splitlines() if line.strip()]
        for name in ("train.jsonl", "valid.jsonl")
    )


def method_rows(rows: list[dict[str, Any]], method: str) -> list[dict[str, Any]]:
    """The reinforcement rows as ``method``'s lines: the bare answer is the target (supervised), or is
    preferred to the answer in a sentence (dpo)."""
    if method == "supervised":
        return [
            {"messages": [*row["messages"], {"role": "assistant", "content": row["answer"]}]} for row in rows
        ]
    if method == "dpo":
        return [
            {"input": {"messages": row["messages"]},
             "preferred_output": [{"role": "assistant", "content": row["answer"]}],
             "non_preferred_output": [{"role": "assistant", "content": f"The answer is {row['answer']}."}]}
            for row in rows
        ]  # fmt: skip
    return rows


def stack_client(url: str, env: dict[str, str]) -> tuple[str, str, Any]:
    """On a ``live_stack``: its base model's name, a new team key and an ``openai`` client with it."""
    from openai import OpenAI

    base_name = _manage(env, "from projects.models import BaseModel; print(BaseModel.objects.get().name)")
    key = _manage(env, "from projects import services; from projects.models import Team; "
                  "team, _ = Team.objects.get_or_create(name='bench'); "
                  "print(services.api_key_create(team=team, name='bench').plaintext)")  # fmt: skip
    return base_name, key, OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=300)


def upload(
    client: Any, train: list[dict[str, Any]], validation: list[dict[str, Any]] | None = None
) -> list[str]:
    """The ids of ``train`` and ``validation`` (when given) uploaded as fine-tuning files."""
    return [
        client.files.create(file=(name, io.BytesIO("\n".join(map(json.dumps, rows)).encode())),
                            purpose="fine-tune").id
        for name, rows in (("train.jsonl", train), ("valid.jsonl", validation)) if rows is not None
    ]  # fmt: skip


def api(url: str, key: str, method: str, path: str, body: Any = None) -> Any:
    request = urllib.request.Request(f"{url}{path}", method=method,
                                     data=json.dumps(body).encode() if body is not None else None)  # fmt: skip
    request.add_header("Authorization", f"Bearer {key}")
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def held_out(url: str, key: str, run_id: int) -> dict[int, float]:
    listed = api(url, key, "GET", f"/api/v1/runs/{run_id}/evaluations/?limit=100")["data"]
    return {e["step"]: e["results"]["reward_mean"] for e in listed if e["status"] == "succeeded"}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(parser)
    parser.add_argument("--method", choices=("reinforcement", "supervised", "dpo"), default="reinforcement")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--broker", default="", help="a Celery broker URL; default: the embedded one")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args(argv)
    cache, source = prepared_model(args)

    train, validation = (method_rows(rows, args.method) for rows in openai_rows())
    with live_stack(cache, source, args.broker) as (url, env):
        base_name, key, client = stack_client(url, env)
        files = upload(client, train, validation)
        hyper = {"n_epochs": args.epochs, "batch_size": args.batch}
        started = time.monotonic()
        job = client.fine_tuning.jobs.create(
            model=base_name, training_file=files[0], validation_file=files[1], seed=args.seed, suffix="arith",
            method={"type": args.method, args.method: {
                "hyperparameters": hyper,
                **({"grader": ARITHMETIC_REWARD} if args.method == "reinforcement" else {})}},
        )  # fmt: skip
        first_checkpoint = None
        while True:
            if first_checkpoint is None and client.fine_tuning.jobs.checkpoints.list(job.id, limit=1).data:
                first_checkpoint = time.monotonic() - started
            job = client.fine_tuning.jobs.retrieve(job.id)
            if job.status in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(0.5)
        job_seconds = time.monotonic() - started
        if job.status != "succeeded":
            raise SystemExit(f"the job {job.status}: {job.error}")
        run = api(url, key, "GET", f"/api/v1/runs/{job.run_id}/")
        job_held_out = held_out(url, key, run["id"])
        if args.method != "reinforcement":
            report = {"model": source, "method": args.method, "steps": run["current_step"], "hyperparameters": hyper,
                      "held_out_before": job_held_out.get(0), "held_out_after": job_held_out.get(run["current_step"]),
                      "seconds_to_success": job_seconds, "trained_tokens": job.trained_tokens}  # fmt: skip
            print(json.dumps(report, indent=1))
            return report

        # The same task as a platform run: the job's inputs and config, a model of its own.
        model = api(url, key, "POST", "/api/v1/models/",
                    {"project": run["project"], "name": "platform-arith", "base_model": base_name})  # fmt: skip
        started = time.monotonic()
        platform = api(url, key, "POST", "/api/v1/runs/", {
            "model": model["id"], "task_set": run["task_set"], "environment": run["environment"],
            "reward": run["reward"], "config": run["config"]})  # fmt: skip
        while platform["status"] not in ("succeeded", "failed", "cancelled"):
            time.sleep(0.5)
            platform = api(url, key, "GET", f"/api/v1/runs/{platform['id']}/")
        platform_seconds = time.monotonic() - started
        platform_held_out = held_out(url, key, platform["id"])

    last = run["current_step"]
    report = {
        "model": source, "steps": last, "hyperparameters": hyper, "config": run["config"],
        "job": {"held_out_before": job_held_out.get(0), "held_out_after": job_held_out.get(last),
                "seconds_to_first_checkpoint": first_checkpoint, "seconds_to_success": job_seconds,
                "trained_tokens": job.trained_tokens, "fine_tuned_model": job.fine_tuned_model},
        "platform_run": {"status": platform["status"], "held_out_before": platform_held_out.get(0),
                         "held_out_after": platform_held_out.get(last), "seconds_to_success": platform_seconds},
    }  # fmt: skip
    report["same_training"] = (
        report["job"]["held_out_before"] == report["platform_run"]["held_out_before"]
        and report["job"]["held_out_after"] == report["platform_run"]["held_out_after"]
    )
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)
    return report


if __name__ == "__main__":
    main()
