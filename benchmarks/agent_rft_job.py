"""Does an Agent RFT job learn on the bundled model? (issue 56, must-have 6's figure)

``manage.py up`` on a scratch SQLite data folder (``fine_tuning_job.live_stack``), with
``OUTBOUND_ALLOW`` naming this script's loopback server, which plays the team's two services:

- ``/lookup``, the tool (``method.reinforcement.tools``): the secret number of a word, a 3-digit
  number drawn at random per word, so only the tool knows it (``{"output": "The secret number of
  kiwi is 417."}``; an unknown word is a tool error);
- ``/grade``, the ``endpoint`` grader: 1.0 when the final answer holds the row's number; else 0.5
  for a well-formed ``lookup`` call with the row's word; 0.25 for a well-formed call with another
  word (``--other-call-credit``); 0.1 for a ``<tool_call>`` tag that did not parse (an attempt); 0
  otherwise. The partial credit is there because the base model almost never calls the tool
  (below): without it every group of the first steps scores 0 and GRPO has nothing to learn from.
  Both designs measured (README) taught the policy to copy a call out of its prompt: with 0.25 the
  example call, ``"apple"`` and all (well-formed, 14 of 16 held-out answers at the end); with
  ``--other-call-credit 0.1`` (no more than an attempt) the environment's template line
  ``<tool_call>{"name": "<tool name>", ...}`` (malformed, 16 of 16). Neither reached a right answer
  in 8 steps.

Rows: "What is the secret number of the word "kiwi"?" (32 training words, 16 held out as the job's
``validation_file``), ``max_episode_steps`` 2 (call, then answer). The job is
``fine_tuning.jobs.create(method="reinforcement")`` with the job recipe, ``n_epochs`` 1, ``batch_size`` 4:
8 steps of 4 prompts x 8 rollouts (dynamic sampling may draw up to twice that), 32 new tokens a turn.

The prompt, chosen by a probe before this script (the environment's own tool prompt appended to the
system message, 4 words x 8 samples at temperature 1, 32 new tokens, 1 thread): with a system
message "Answer with the number only." the model wrote a parsable ``lookup`` call 0/32 times, and
0/32 with a one-line example call added to it; with "Only the lookup tool knows secret numbers.
First call it, for example: <example>. Then answer with the number only." as the system message,
0/32 and not one ``<tool_call>`` tag; with the instruction and the example at the end of the user
message ("... Call the lookup tool first, like <tool_call>{"name": "lookup", "arguments": {"word":
"apple"}}</tool_call>, then answer with the number only.") a tag 4/32 times, still no parsable
call. The rows use the last: the only one with anything for partial credit to reward.

``--warm-start-sft``: the route OpenAI's users take when a model does not yet call a tool. A
supervised job first (``method.supervised``, ``n_epochs`` 2, ``batch_size`` 4; ``--sft-rows``,
``--sft-epochs``): 32 lines about 32 other words (in neither file above), each the same question, an
assistant message whose ``tool_calls`` holds the ``lookup`` call, the ``tool`` message with that
word's number, and the number as the final reply, with the row's ``tools``; artweb renders them as a
rollout renders a conversation, so the calls it teaches are the ones the rollouts parse. Then the
RFT job above with ``model`` = the supervised job's ``fine_tuned_model``: its step-0 evaluation is
the supervised model's held-out reward, and the base model's is measured after it by ``POST
/api/v1/evaluations/`` on the RFT job (its held-out rows, environment and grader, greedy, the run's
``max_new_tokens``). Measured (README, held-out reward and right answers of 16): base 0.094, 0;
after 16 supervised steps 1.0, 16, and the RFT job kept it (nothing left to gain); after 4
supervised steps (``--sft-rows 16 --sft-epochs 1``) 0.0, 0 (not one call), and after the RFT job's 8
steps 1.0, 16: there the right answers came from the reinforcement stage.

Reported: held-out reward (the run's greedy evaluations of all 16 held-out rows at step 0 and at
the end, graded by the same endpoint) and how the held-out answers split over the grader's tiers,
with the words the calls asked for; per step the mean reward, the calls the tool endpoint received
per kept rollout and their mean latency (step metrics ``tool_endpoint_calls``,
``tool_latency_mean_s``, ``tool_wait_s``), and the share of graded rollouts (all draws) with a
well-formed call and with the right answer (from the grader's log); seconds from ``create`` to
success, and the load average before and after.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.agent_rft_job [--other-call-credit 0.25]
[--warm-start-sft [--sft-rows 32 --sft-epochs 2]] [--compute-multiplier 0.5] [--json out.json]``
(``--tiny``: the wiring in a minute on a tiny model, which never calls the tool).
Nothing else may train on this machine meanwhile (2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections import Counter, defaultdict
from typing import Any

from benchmarks._loopback import json_endpoint
from benchmarks._model import add_model_arguments, prepared_model
from benchmarks.fine_tuning_job import api, held_out, live_stack, stack_client, upload

WORDS = ("kiwi", "tiger", "piano", "river", "candle", "forest", "rocket", "mirror", "garden", "pepper",
    "violin", "island", "lemon", "castle", "thunder", "marble", "pencil", "dragon", "window", "saddle",
    "harbor", "rabbit", "meadow", "copper", "ladder", "falcon", "button", "glacier", "orchard", "lantern",
    "walnut", "canyon", "parrot", "velvet", "compass", "barrel", "tunnel", "anchor", "cactus", "feather",
    "helmet", "jigsaw", "kettle", "magnet", "needle", "oyster", "puzzle", "quartz")  # fmt: skip
EXAMPLE_CALL = '<tool_call>{"name": "lookup", "arguments": {"word": "apple"}}</tool_call>'
TOOL = {
    "type": "function",
    "function": {"name": "lookup", "description": "The secret number of a word.",
                 "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}},
}  # fmt: skip
MALFORMED = 0.1  # a <tool_call> tag that did not parse
# --warm-start-sft's supervised rows: words in neither the training nor the held-out rows.
SFT_WORDS = ("acorn", "badger", "bucket", "cherry", "cobalt", "daisy", "engine", "fossil", "goblet",
    "hammock", "iceberg", "jacket", "koala", "lobster", "mango", "nutmeg", "otter", "pebble", "quilt",
    "raven", "salmon", "teapot", "umbrella", "vessel", "wombat", "yarrow", "zipper", "bamboo", "crayon",
    "dolphin", "ember", "fiddle")  # fmt: skip


def question(word: str) -> dict[str, str]:
    return {"role": "user", "content": f'What is the secret number of the word "{word}"? '
            f"Call the lookup tool first, like {EXAMPLE_CALL}, then answer with the number only."}  # fmt: skip


def rows(seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, str]]:
    """(training rows, validation rows, the secret number of each word)."""
    rng = random.Random(seed)
    secrets = {word: str(rng.randrange(100, 1000)) for word in WORDS}
    lines = [{"messages": [question(word)], "word": word, "answer": secrets[word]} for word in WORDS]
    return lines[:32], lines[32:48], secrets


def sft_rows(seed: int) -> list[dict[str, Any]]:
    """--warm-start-sft's supervised lines (OpenAI's chat format with tools): the same question about
    another word, the assistant's ``lookup`` call, the tool's answer, the number as the final reply
    (the words' numbers are their own draw, so ``rows``' numbers stay as they were)."""
    rng = random.Random(f"sft-{seed}")
    secrets = {word: str(rng.randrange(100, 1000)) for word in SFT_WORDS}
    lines = [
        {"messages": [
            question(word),
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0", "type": "function",
             "function": {"name": "lookup", "arguments": json.dumps({"word": word})}}]},
            {"role": "tool", "tool_call_id": "call_0", "content": f"The secret number of {word} is {number}."},
            {"role": "assistant", "content": number}],
         "tools": [TOOL], "parallel_tool_calls": False}
        for word, number in secrets.items()
    ]  # fmt: skip
    return lines


def _arguments(call: dict[str, Any]) -> Any:
    arguments = call.get("arguments")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return None
    return arguments


def lookup_calls(sample: dict[str, Any]) -> list[dict[str, Any]]:
    """The well-formed calls to the tool in a trace (the environment parsed them)."""
    return [c for c in sample.get("output_tools") or [] if c.get("name") == "lookup"]


def grade(sample: dict[str, Any], item: dict[str, Any], other_call_credit: float = 0.25) -> float:
    """The grader's reward (the module docstring's tiers)."""
    if item["answer"] in (sample.get("output_text") or ""):
        return 1.0
    calls = lookup_calls(sample)
    if any(
        isinstance(a := _arguments(c), dict) and str(a.get("word", "")).strip().lower() == item["word"]
        for c in calls
    ):
        return 0.5
    if calls:
        return other_call_credit
    said = " ".join(
        str(m.get("content") or "") for m in sample.get("messages") or [] if m.get("role") == "assistant"
    )
    return MALFORMED if "<tool_call>" in said else 0.0


def finished(client: Any, job_id: str) -> Any:
    """The job once it succeeded (SystemExit if it failed or was cancelled)."""
    while (job := client.fine_tuning.jobs.retrieve(job_id)).status not in (
        "succeeded",
        "failed",
        "cancelled",
    ):
        time.sleep(0.5)
    if job.status != "succeeded":
        raise SystemExit(f"the job {job.status}: {job.error}")
    return job


class TeamServices:
    """The tool and the grader on 127.0.0.1, with a log of what each received."""

    def __init__(self, secrets: dict[str, str], other_call_credit: float) -> None:
        self.tool_calls: list[dict[str, Any]] = []
        self.gradings: list[dict[str, Any]] = []
        services = self

        def answer(path: str, body: Any) -> dict[str, Any]:
            if path == "/lookup":
                word = str((body.get("arguments") or {}).get("word", "")).strip().lower()
                services.tool_calls.append({"word": word, "item": body["item"].get("word")})
                return (
                    {"output": f"The secret number of {word} is {secrets[word]}."}
                    if word in secrets else {"error": f"no secret number for {word!r}"}
                )  # fmt: skip
            reward = grade(body["sample"], body["item"], other_call_credit)
            services.gradings.append({"ids": body.get("ids") or {}, "word": body["item"]["word"],
                                      "reward": reward, "called": bool(lookup_calls(body["sample"])),
                                      "words": [str((_arguments(c) or {}).get("word")) for c in lookup_calls(body["sample"])
                                                if isinstance(_arguments(c), dict)]})  # fmt: skip
            return {"reward": reward}

        self.httpd = json_endpoint(answer)
        self.host = self.httpd.host


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(parser)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--episode-steps", type=int, default=2)
    parser.add_argument("--other-call-credit", type=float, default=0.25,
                        help="reward for a well-formed lookup call with another word (the second design: 0.1)")  # fmt: skip
    parser.add_argument("--compute-multiplier", type=float,
                        help="the job's compute_multiplier (rollouts per prompt: 8 times it); default: left out")  # fmt: skip
    parser.add_argument("--warm-start-sft", action="store_true",
                        help="a supervised job on 32 other words' lookup conversations first; the RFT job "
                        "starts from its fine_tuned_model, and the base model is evaluated on the held-out rows")  # fmt: skip
    parser.add_argument("--sft-rows", type=int, default=32, help="the first N of the 32 supervised lines")
    parser.add_argument("--sft-epochs", type=int, default=2)
    parser.add_argument("--sft-batch", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--broker", default="", help="a Celery broker URL; default: the embedded one")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args(argv)
    cache, source = prepared_model(args)

    train, validation, secrets = rows(args.seed)
    supervised = sft_rows(args.seed)[: args.sft_rows]
    held_out_words = {row["word"] for row in validation}
    team = TeamServices(secrets, args.other_call_credit)
    # The stack's web process checks the tool's and the grader's URLs, its worker calls them.
    os.environ["OUTBOUND_ALLOW"] = ",".join(filter(None, [os.environ.get("OUTBOUND_ALLOW", ""), team.host]))
    load_before = os.getloadavg()
    sft: dict[str, Any] = {}
    with live_stack(cache, source, args.broker) as (url, env):
        base_name, key, client = stack_client(url, env)
        start_model = base_name
        if args.warm_start_sft:
            # The route OpenAI's users take: teach the call format by example, then reinforce.
            (sft_file,) = upload(client, supervised)
            sft_hyper = {"n_epochs": args.sft_epochs, "batch_size": args.sft_batch}
            started = time.monotonic()
            sft_job = client.fine_tuning.jobs.create(
                model=base_name, training_file=sft_file, seed=args.seed, suffix="lookup-sft",
                method={"type": "supervised", "supervised": {"hyperparameters": sft_hyper}},
            )  # fmt: skip
            sft_job = finished(client, sft_job.id)
            start_model = sft_job.fine_tuned_model
            sft = {"hyperparameters": sft_hyper, "rows": len(supervised), "fine_tuned_model": start_model,
                   "seconds_to_success": time.monotonic() - started, "trained_tokens": sft_job.trained_tokens,
                   "load_average_after": os.getloadavg()}  # fmt: skip
        files = upload(client, train, validation)
        hyper: dict[str, Any] = {"n_epochs": args.epochs, "batch_size": args.batch}
        if args.compute_multiplier is not None:
            hyper["compute_multiplier"] = args.compute_multiplier
        started = time.monotonic()
        # artweb's Agent RFT fields and grader type are not in the openai package's types.
        method: Any = {"type": "reinforcement", "reinforcement": {
            "hyperparameters": hyper, "max_episode_steps": args.episode_steps,
            "tools": [{**TOOL, "server_url": f"http://{team.host}/lookup"}],
            "grader": {"type": "endpoint", "name": "secret", "url": f"http://{team.host}/grade"}}}  # fmt: skip
        job = client.fine_tuning.jobs.create(
            model=start_model,
            training_file=files[0],
            validation_file=files[1],
            seed=args.seed,
            suffix="lookup",
            method=method,
        )
        job = finished(client, job.id)
        seconds = time.monotonic() - started
        run = api(url, key, "GET", f"/api/v1/runs/{job.run_id}/")  # type: ignore[attr-defined]  # artweb's field
        job_held_out = held_out(url, key, run["id"])
        steps = api(url, key, "GET", f"/api/v1/runs/{run['id']}/metrics/?limit=1000")["data"]
        job_gradings = len(team.gradings)
        base: dict[str, Any] = {}
        if args.warm_start_sft:
            # The RFT job's step 0 is the supervised model: the base model is evaluated on the job's
            # held-out rows, environment and grader, as the run evaluates (greedy, its max_new_tokens).
            evaluation = api(url, key, "POST", "/api/v1/evaluations/", {
                "fine_tuning_job": job.id, "model": base_name,
                "max_new_tokens": run["config"].get("max_new_tokens")})  # fmt: skip
            while evaluation["status"] not in ("succeeded", "failed", "cancelled"):
                time.sleep(0.5)
                evaluation = api(url, key, "GET", f"/api/v1/evaluations/{evaluation['id']}/")
            if evaluation["status"] != "succeeded":
                raise SystemExit(f"the base model's evaluation {evaluation['status']}: {evaluation['error']}")
            base = {"reward_mean": evaluation["results"]["reward_mean"], "split": evaluation["split"],
                    "rows": evaluation["results"].get("rows", evaluation["max_rows"])}  # fmt: skip
    load_after = os.getloadavg()

    config = run["config"]
    rollouts = config["groups_per_step"] * config["group_size"]
    graded: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for grading in team.gradings:
        if grading["word"] not in held_out_words:
            graded[int(grading["ids"].get("step", 0))].append(grading)
    per_step = []
    for entry in sorted(steps, key=lambda e: e["step"]):
        metrics, mine = entry["metrics"], graded.get(entry["step"], [])
        per_step.append({
            "step": entry["step"], "reward_mean": entry["reward_mean"],
            "tool_calls_per_rollout": metrics.get("tool_endpoint_calls", 0.0) / rollouts,
            "tool_latency_mean_ms": 1000 * metrics.get("tool_latency_mean_s", 0.0),
            "tool_wait_ms": 1000 * metrics.get("tool_wait_s", 0.0),
            "graded_rollouts": len(mine),
            "called_share": sum(g["called"] for g in mine) / max(len(mine), 1),
            "right_answer_share": sum(g["reward"] == 1.0 for g in mine) / max(len(mine), 1),
        })  # fmt: skip
    evaluations = [g for g in team.gradings[:job_gradings] if g["word"] in held_out_words]
    base_evaluation = [g for g in team.gradings[job_gradings:] if g["word"] in held_out_words]
    size = len(validation)

    def tiers(gradings: list[dict[str, Any]]) -> dict[str, Any]:
        rewards = [g["reward"] for g in gradings]
        counted = {
            "right answer": rewards.count(1.0), "call, right word": rewards.count(0.5),
            "call, other word": sum(g["called"] and g["reward"] not in (1.0, 0.5) for g in gradings),
            "malformed call": sum(not g["called"] and g["reward"] == MALFORMED for g in gradings),
            "no call": sum(not g["called"] and g["reward"] == 0.0 for g in gradings),
        }  # fmt: skip
        return counted | {"call words": dict(Counter(w for g in gradings for w in g["words"]).most_common(4))}

    last = run["current_step"]
    report = {
        "model": source, "steps": last, "hyperparameters": hyper, "rollouts_per_step": rollouts,
        "max_new_tokens": config.get("max_new_tokens"), "max_episode_steps": args.episode_steps,
        "other_call_credit": args.other_call_credit,
        "held_out_before": job_held_out.get(0), "held_out_after": job_held_out.get(last),
        "held_out_tiers_before": tiers(evaluations[:size]), "held_out_tiers_after": tiers(evaluations[-size:]),
        **({"start_model": start_model, "sft_job": sft, "held_out_base": base,
            "held_out_tiers_base": tiers(base_evaluation)} if args.warm_start_sft else {}),
        "per_step": per_step, "tool_calls_received": len(team.tool_calls),
        "seconds_to_success": seconds, "trained_tokens": job.trained_tokens,
        "load_average_before": load_before, "load_average_after": load_after,
    }  # fmt: skip
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)
    return report


if __name__ == "__main__":
    main()
