"""Drives a live artweb with OpenPipe ART's newest client, unchanged but for its PEP 695 syntax
(openpipe-art 0.5.23 in ``.venv-art23``, converted for Python 3.11 by art_wheel_py311.py), the way
an ART program does. Run with that virtualenv's python; it imports nothing of artweb.

    art23_client_script.py --base-url http://127.0.0.1:PORT/v1 --key aw_... --other-key aw_... \\
        --project games --model agent --run-name agent-r1 --base-model gateway-tiny

What 0.5.23 adds over 0.5.18 (art_client_script.py) and this checks: ``TrainableModel`` needs a
``run_name`` (registered and served under it); ``openai_client()`` and
``litellm_completion_params()`` send ``return_token_ids``, ``return_tokens_as_token_ids``,
``nvext`` and ``chat_template_kwargs`` on every completion and check each reply (token ids against
``usage.completion_tokens``, then ``art_completion_tokens`` on the choice); ``with
art.Trajectory():`` captures the HTTP exchanges instead of ``messages_and_choices``; ``train()``
sends a 25-key ``experimental_config`` and takes ``loss_fn`` and the KL-penalty family.

Each check raises on failure; the last line of stdout is ``RESULT <json>`` with what it saw.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from typing import Any

import art
import litellm
import openai
from art._backend_training import build_rl_train_configs
from art.serverless.backend import ServerlessBackend
from art.serverless.client import ExperimentalTrainingConfig

PROMPT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Say something."}]
DEFAULT_EXTRAS = {"return_token_ids", "return_tokens_as_token_ids", "nvext", "chat_template_kwargs"}


_rewarded = itertools.count()


def reward_of(text: str) -> float:
    """Every other rollout scores 1: any 4 rollouts of a group (gathered together) hold both, so
    every group has variance and every step trains (a reward of the random tiny model's text once
    gave a step whose groups all scored alike, and no KL to check). The text does not matter."""
    return float(next(_rewarded) % 2)


async def sample(client: Any, name: str, messages: list = PROMPT, **extra: Any) -> Any:
    return await client.chat.completions.create(
        model=name, messages=messages, logprobs=True, max_tokens=6, temperature=1.0, **extra
    )


async def choices_rollout(model: art.TrainableModel) -> art.Trajectory:
    completion = await sample(model.openai_client(), model.get_inference_name())
    choice = completion.choices[0]
    return art.Trajectory(
        messages_and_choices=[*PROMPT, choice], reward=reward_of(choice.message.content or "")
    )


async def captured_rollout(model: art.TrainableModel) -> art.Trajectory:
    """0.5.23's way: the exchanges made inside the block are the trajectory (no messages_and_choices)."""
    with art.Trajectory() as trajectory:
        completion = await sample(model.openai_client(), model.get_inference_name())
    trajectory.reward = reward_of(completion.choices[0].message.content or "")
    return trajectory


async def refused(what: str, call: Any) -> str:
    """Another team's key: the model reads as missing (404), whatever the path."""
    try:
        await call
    except openai.NotFoundError as exc:
        return f"{what}: {type(exc).__name__}"
    raise AssertionError(f"{what}: another team's key was not refused")


async def job_events(backend: ServerlessBackend, job_id: str, timeout: float = 300) -> list[Any]:
    """The job's events until it ends, as ServerlessBackend polls them (``after`` the last id)."""
    events: list[Any] = []
    after: str | None = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await asyncio.sleep(1)
        async for event in backend._client.training_jobs.events.list(
            training_job_id=job_id, **({"after": after} if after else {})
        ):
            events.append(event)
            after = event.id
            if event.type in ("training_ended", "training_failed"):
                return events
    raise AssertionError(f"training job {job_id} did not end in {timeout} s: {[e.type for e in events]}")


async def main(args: argparse.Namespace) -> dict[str, Any]:
    seen: dict[str, Any] = {"train": []}
    backend = ServerlessBackend(api_key=args.key, base_url=args.base_url)
    model = art.TrainableModel(
        name=args.model, project=args.project, base_model=args.base_model, run_name=args.run_name
    )
    await model.register(backend)
    seen["entity"], seen["model_id"] = model.entity, model.id
    assert model.get_inference_name() == f"wandb-artifact:///{model.entity}/{args.project}/{args.run_name}"
    assert await model.get_step() == 0, "a registered model is at step 0"

    # Sampling with the default extras: the client adds them and checks the reply.
    extras = model._default_chat_completion_extra_body() or {}
    assert set(extras) >= DEFAULT_EXTRAS, extras
    latest = await sample(model.openai_client(), model.get_inference_name())
    assert latest.model.endswith(":0"), latest.model
    dumped = latest.choices[0].model_dump(mode="json")
    assert dumped.get("token_ids") and dumped.get("prompt_token_ids"), "the gateway's ids survive model_dump"
    assert dumped.get("art_completion_tokens") == len(dumped["token_ids"]) == latest.usage.completion_tokens
    assert all(entry["token"].startswith("token_id:") for entry in dumped["logprobs"]["content"]), (
        "return_tokens_as_token_ids: logprob tokens read token_id:N"
    )
    seen["choice_fields"] = sorted(
        k for k in dumped if k not in ("index", "message", "finish_reason", "logprobs")
    )
    streamed = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=PROMPT, max_tokens=6, stream=True
    )
    stream_ids = [i for chunk in [c async for c in streamed] for ch in chunk.choices for i in (ch.model_extra or {}).get("token_ids") or []]  # fmt: skip
    seen["stream_token_ids"] = len(stream_ids)
    assert stream_ids, "return_token_ids on a streamed reply: each delta carries its ids"
    litellm_reply = await litellm.acompletion(
        messages=PROMPT, max_tokens=6, **model.litellm_completion_params()
    )
    assert litellm_reply.choices[0].message.content is not None
    seen["litellm_model"] = litellm_reply.model

    # Step 1: a messages_and_choices group and a captured-exchange group, 0.5.23's defaults.
    groups = [
        await art.TrajectoryGroup(choices_rollout(model) for _ in range(4)),
        await art.TrajectoryGroup(captured_rollout(model) for _ in range(4)),
    ]
    captured = groups[1].model_dump(mode="json")["trajectories"][0]
    assert "messages_and_choices" not in captured and captured["exchanges"]["chat_completions"], captured
    started = time.monotonic()
    result = await backend.train(model, groups, learning_rate=1e-3)
    assert result.step == 1, result.step
    seen["train"].append({"step": result.step, "seconds": round(time.monotonic() - started, 3),
                          "gradient_steps": result.metrics.get("data/step_num_gradient_steps")})  # fmt: skip

    # Step 2: a non-default loss and a KL penalty against step 0, through train().
    groups = [await art.TrajectoryGroup(captured_rollout(model) for _ in range(4)) for _ in range(2)]
    started = time.monotonic()
    result = await backend.train(
        model, groups, learning_rate=1e-3, loss_fn="ppo", kl_penalty_coef=0.1, kl_penalty_reference_step=0
    )
    assert result.step == 2, result.step
    seen["train"].append({"step": result.step, "seconds": round(time.monotonic() - started, 3),
                          "gradient_steps": result.metrics.get("data/step_num_gradient_steps"),
                          "kl": result.metrics.get("loss/kl_policy_ref")})  # fmt: skip

    # Step 3: the same request ServerlessBackend sends, made here to read its events.
    groups = [await art.TrajectoryGroup(choices_rollout(model) for _ in range(4)) for _ in range(2)]
    _, dev_config = build_rl_train_configs(
        learning_rate=1e-3, ppo=False, kl_penalty_coef=0.05, kl_penalty_source="sample"
    )
    job = await backend._client.training_jobs.create(
        model_id=model.id, trajectory_groups=groups,
        experimental_config={**{k: dev_config.get(k) for k in ExperimentalTrainingConfig.__annotations__},
                             "learning_rate": 1e-3, "loss_fn": "cispo", "normalize_advantages": True,
                             "kl_penalty_step_lag": 1},
    )  # fmt: skip
    events = await job_events(backend, job.id)
    kinds = [event.type for event in events]
    assert kinds[0] == "training_started" and kinds[-1] == "training_ended", kinds
    num_sequences = events[0].data["num_sequences"]
    gradient_steps = [event.data for event in events if event.type == "gradient_step"]
    assert len(gradient_steps) == num_sequences >= 1, (num_sequences, kinds)
    assert all(isinstance(v, (int, float)) for step in gradient_steps for v in step.values()), gradient_steps
    seen["events"] = {"num_sequences": num_sequences, "gradient_step_keys": sorted(gradient_steps[0])}
    assert await model.get_step() == 3

    # Each new checkpoint is served at once, under both names; :step0 stays callable.
    latest = await sample(model.openai_client(), model.get_inference_name())
    pinned = await sample(model.openai_client(), model.get_inference_name(3))
    assert latest.model == pinned.model == f"{args.project}/{args.run_name}:3", (latest.model, pinned.model)
    assert (await sample(model.openai_client(), model.get_inference_name(0))).model.endswith(":0")

    # Any name ART accepts registers and samples, and the reply names it as ART sent it.
    odd = art.TrainableModel(name="Odd one", project=args.project, base_model=args.base_model,
                             run_name="Run #2 (α)")  # fmt: skip
    await odd.register(backend)
    assert await odd.get_step() == 0
    reply = await sample(odd.openai_client(), odd.get_inference_name())
    seen["odd_name_reply_model"] = reply.model
    assert "Run #2 (α)" in reply.model, reply.model

    client = backend._client
    steps = [c.step async for c in client.models.checkpoints.list(model_id=model.id)]
    assert steps == [0, 1, 2, 3], steps
    try:
        await client.models.checkpoints.delete(model_id=model.id, steps=[3])
        raise AssertionError("the latest checkpoint was deleted")
    except openai.ConflictError:
        pass
    await backend._delete_checkpoint_files(model, steps_to_keep=[3])
    steps = [c.step async for c in client.models.checkpoints.list(model_id=model.id)]
    assert steps == [3], steps
    try:
        await sample(model.openai_client(), model.get_inference_name(1))
        raise AssertionError("a deleted checkpoint answered")
    except openai.NotFoundError:
        pass
    seen["steps_after_delete"] = steps

    other = ServerlessBackend(api_key=args.other_key, base_url=args.base_url)
    oc = other._client
    seen["refused"] = [
        await refused("register into the team", oc.models.create(
            entity=model.entity, project=args.project, name=args.run_name, base_model=args.base_model,
            return_existing=True)),
        await refused("list checkpoints", oc.models.checkpoints.list(model_id=model.id)),
        await refused("delete checkpoints", oc.models.checkpoints.delete(model_id=model.id, steps=[3])),
        await refused("train", oc.training_jobs.create(model_id=model.id, trajectory_groups=groups)),
        await refused("events", oc.training_jobs.events.list(training_job_id=job.id)),
        await refused("delete the model", oc.models.delete(model_id=model.id)),
        await refused("sample", sample(openai.AsyncOpenAI(base_url=args.base_url, api_key=args.other_key),
                                       model.get_inference_name())),
    ]  # fmt: skip
    await other.close()
    await backend.close()
    return seen


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for flag in ("--base-url", "--key", "--other-key", "--project", "--model", "--run-name", "--base-model"):
        parser.add_argument(flag, required=True)
    print("RESULT " + json.dumps(asyncio.run(main(parser.parse_args()))), flush=True)
