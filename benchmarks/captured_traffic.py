"""Training only on captured traffic (issue 55): the held-out reward of a model trained on nothing but
the completions its deployed checkpoint served, against that checkpoint.

``manage.py up`` on a scratch SQLite data folder (as ``fine_tuning_job.py``), the team storing every
completion, then, all through the platform's own APIs:
1. traffic: the 48 training prompts of ``examples/fine_tuning/train.jsonl`` (the arithmetic task,
   "Answer with the number only."), ``--samples`` times each at temperature 1 with the real
   ``openai`` client against ``traffic/agent:0`` (a model whose step 0 is the bundled base), each
   with ``metadata={"answer": …}``: what users of the deployed checkpoint asked and got;
2. feedback: ``POST /api/v1/completion-gradings`` runs the README's partial-credit grader
   (``benchmarks.sample_efficiency.ARITHMETIC_REWARD``) over the stored completions on the worker;
3. training: ``--steps`` times ``POST /api/v1/stored-completions/train`` on those same stored
   completions: off-policy steps on the sampler's exact ids and logprobs (the later steps further
   from the policy that sampled them), each followed to its end;
4. held out: the 16 rows of ``valid.jsonl``, greedy, through the gateway, from step 0 (the checkpoint
   that served the traffic) and from the last step, graded by the same grader here;
5. canary: ``traffic/agent:prod`` names step 0 with the last step as a ``--canary-share`` canary,
   and ``--canary-requests`` HTTP requests through the gateway (one token each, each its own
   conversation id) are counted by the checkpoint that answered (the reply's ``model``), then the
   first 50 conversations are asked again to check each stays on its checkpoint.

Run: ``.venv/bin/python -m benchmarks.captured_traffic [--samples 4 --steps 6]``. Nothing else may
train on this machine meanwhile (2 cores).
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks._model import add_model_arguments, prepared_model
from benchmarks.fine_tuning_job import api, openai_rows
from benchmarks.sample_efficiency import ARITHMETIC_REWARD
from benchmarks.tinker_overhead import _manage, live_stack

SETUP = """
import json
from projects import services
from projects.models import BaseModel, Team
team, _ = Team.objects.get_or_create(name='bench')
services.completion_storage_set(team=team, storage='all')
model, run = services.client_model_register(team=team, entity=None, project='traffic', name='agent',
                                            base_model=BaseModel.objects.get().name)
print(json.dumps({'key': services.api_key_create(team=team, name='bench').plaintext, 'model': model.pk,
                  'project': model.project_id}))
"""


def held_out(client: Any, model: str, rows: list[dict[str, Any]]) -> float:
    from training.rewards import Sample, build_grader, grade_group

    grader = build_grader(ARITHMETIC_REWARD)
    rewards = []
    for row in rows:
        reply = client.chat.completions.create(
            model=model, messages=row["messages"], max_tokens=16, temperature=0
        )
        text = reply.choices[0].message.content or ""
        rewards.append(grade_group(grader, [Sample(output_text=text)], {"answer": row["answer"]})[0].reward)
    return sum(rewards) / len(rewards)


def wait(url: str, key: str, path: str, done: tuple[str, ...], timeout: float = 1800) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = api(url, key, "GET", path)
        if body["status"] in done:
            return body
        time.sleep(1)
    raise SystemExit(f"{path} did not finish in {timeout:.0f} s")


def canary(client: Any, url: str, key: str, model: int, args: argparse.Namespace) -> dict[str, Any]:
    alias = api(url, key, "POST", "/api/v1/aliases", {"model": model, "name": "prod", "checkpoint": 0})
    api(url, key, "POST", f"/api/v1/aliases/{alias['id']}/canary",
        {"checkpoint": args.steps, "share": args.canary_share})  # fmt: skip

    def ask(conversation: str) -> str:
        reply = client.chat.completions.create(
            model="traffic/agent:prod", messages=[{"role": "user", "content": "2+2?"}], max_tokens=1,
            temperature=0, store=False, metadata={"conversation_id": conversation},
        )  # fmt: skip
        return reply.model

    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        served = list(pool.map(ask, [f"canary-{i}" for i in range(args.canary_requests)]))
    seconds = time.monotonic() - started
    candidate = f"traffic/agent:{args.steps}"
    with ThreadPoolExecutor(8) as pool:
        again = list(pool.map(ask, [f"canary-{i}" for i in range(50)]))
    return {
        "share": args.canary_share,
        "requests": len(served),
        "to_candidate": served.count(candidate),
        "measured_share": round(served.count(candidate) / max(len(served), 1), 4),
        "answered_by": sorted(set(served)),
        "sticky": again == served[:50],
        "seconds": round(seconds, 1),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(parser)
    parser.add_argument("--samples", type=int, default=4, help="completions per training prompt")
    parser.add_argument("--steps", type=int, default=6, help="training steps on the captured completions")
    parser.add_argument("--canary-requests", type=int, default=1000, help="requests through the alias")
    parser.add_argument("--canary-share", type=float, default=0.25, help="the candidate's share")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args(argv)
    cache, source = prepared_model(args)

    from openai import OpenAI

    train, validation = openai_rows()
    report: dict[str, Any] = {"model": source, "samples_per_prompt": args.samples, "steps": args.steps}
    with live_stack(cache, source) as (url, env):
        setup = json.loads(_manage(env, SETUP))
        key = setup["key"]
        client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=2, timeout=300)

        started = time.monotonic()

        def ask(job: tuple[int, int]) -> str:
            index, sample = job
            row = train[index]
            reply = client.chat.completions.create(
                model="traffic/agent:0", messages=row["messages"], max_tokens=16, temperature=1.0,
                seed=1000 * index + sample, metadata={"answer": row["answer"], "conversation_id": f"r{index}s{sample}"},
            )  # fmt: skip
            return reply.id

        with ThreadPoolExecutor(8) as pool:
            ids = list(pool.map(ask, [(i, k) for i in range(len(train)) for k in range(args.samples)]))
        report["traffic"] = {"completions": len(ids), "seconds": round(time.monotonic() - started, 1)}
        for _ in range(60):  # stored after each reply has gone
            if len(list(client.chat.completions.list(model="traffic/agent:0", limit=100))) >= len(ids):
                break
            time.sleep(1)

        reward = api(url, key, "POST", "/api/v1/reward-definitions/",
                     {"project": setup["project"], "name": "arith", "spec": ARITHMETIC_REWARD})  # fmt: skip
        started = time.monotonic()
        grading = api(url, key, "POST", "/api/v1/completion-gradings", {"reward": reward["id"]})
        grading = wait(url, key, f"/api/v1/completion-gradings/{grading['id']}", ("succeeded", "failed"))
        report["grading"] = {key_: grading[key_] for key_ in ("status", "graded", "errors", "mean_reward")}
        report["grading"]["seconds"] = round(time.monotonic() - started, 1)

        steps = []
        for _ in range(args.steps):
            started = time.monotonic()
            job = api(url, key, "POST", "/api/v1/stored-completions/train",
                      {"model": setup["model"], "filters": {"model": "traffic/agent:0"}})  # fmt: skip
            finished = wait(
                url, key, f"/v1/preview/training-jobs/{job['id']}", ("succeeded", "failed", "cancelled")
            )
            if finished["status"] != "succeeded":
                raise SystemExit(f"training job {job['id']} {finished['status']}: {finished}")
            steps.append(
                {"job": job["id"], "counts": job["counts"], "seconds": round(time.monotonic() - started, 1)}
            )
        report["training"] = steps

        last = f"traffic/agent:{args.steps}"
        report["held_out_before"] = held_out(client, "traffic/agent:0", validation)
        report["held_out_after"] = held_out(client, last, validation)
        report["held_out_rows"] = len(validation)
        report["canary"] = canary(client, url, key, setup["model"], args)
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)
    return report


if __name__ == "__main__":
    main()
