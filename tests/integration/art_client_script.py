"""Drives a live artweb with OpenPipe ART's own client, unchanged (openpipe-art 0.5.18,
``ServerlessBackend``), the way an ART program does. Run by tests/integration/test_art_client.py
with the ART virtualenv's python (``.venv-art``: ART's pins are not the project's); it imports
nothing of artweb.

    art_client_script.py --base-url http://127.0.0.1:PORT/v1 --key aw_... --other-key aw_... \\
        --project games --model agent --base-model gateway-tiny

Each check raises on failure; the last line of stdout is ``RESULT <json>`` with what it saw.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import art
import openai
from art.serverless.backend import ServerlessBackend

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
PROMPT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Say something."}]


def reward_of(text: str) -> float:
    """Anything with variance will do: the tiny model is random."""
    return float(len(text) % 3) / 2


async def sample(client: Any, name: str, messages: list, **extra: Any) -> Any:
    return await client.chat.completions.create(
        model=name, messages=messages, logprobs=True, max_tokens=6, temperature=1.0, **extra
    )


async def rollout(model: art.TrainableModel, step: int | None = None) -> art.Trajectory:
    completion = await sample(model.openai_client(), model.get_inference_name(step), PROMPT)
    choice = completion.choices[0]
    return art.Trajectory(
        messages_and_choices=[*PROMPT, choice], reward=reward_of(choice.message.content or "")
    )


async def tool_rollout(model: art.TrainableModel) -> art.Trajectory:
    """Two model turns with a tool result between them (the tool is run here, by the client)."""
    client = model.openai_client()
    messages: list = [
        {"role": "system", "content": "Use the add tool."},
        {"role": "user", "content": "What is 2 + 3?"},
    ]
    first = (await sample(client, model.get_inference_name(), messages, tools=TOOLS,
                          tool_choice={"type": "function", "function": {"name": "add"}})).choices[0]  # fmt: skip
    calls = first.message.tool_calls or []
    call_id = calls[0].id if calls else "call_0"
    tool_result = {"role": "tool", "tool_call_id": call_id, "content": "5"}
    messages_so_far = [*messages, first.message.model_dump(exclude_none=True), tool_result]
    second = (await sample(client, model.get_inference_name(), messages_so_far, tools=TOOLS)).choices[0]
    return art.Trajectory(
        messages_and_choices=[*messages, first, tool_result, second],
        tools=TOOLS,
        reward=reward_of(second.message.content or ""),
        metadata={"parsed_tool_call": bool(calls)},
    )


async def refused(what: str, call: Any) -> str:
    """Another team's key: the model reads as missing (404), whatever the path."""
    try:
        await call
    except openai.NotFoundError as exc:
        return f"{what}: {type(exc).__name__}"
    raise AssertionError(f"{what}: another team's key was not refused")


async def main(args: argparse.Namespace) -> dict[str, Any]:
    seen: dict[str, Any] = {"train": []}
    backend = ServerlessBackend(api_key=args.key, base_url=args.base_url)
    model = art.TrainableModel(name=args.model, project=args.project, base_model=args.base_model)
    await model.register(backend)
    seen["entity"], seen["model_id"] = model.entity, model.id
    assert await model.get_step() == 0, "a registered model is at step 0"
    # Step 0 answers at once, under the latest name and under :step0.
    latest = await sample(model.openai_client(), model.get_inference_name(), PROMPT)
    assert latest.model.endswith(":0"), latest.model
    choice = latest.choices[0]
    extra = choice.model_dump(mode="json")
    assert extra.get("token_ids") and extra.get("prompt_token_ids"), "the gateway's ids survive model_dump"
    seen["choice_fields"] = sorted(
        key for key in extra if key not in ("index", "message", "finish_reason", "logprobs")
    )

    for step in (1, 2, 3):
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(model) for _ in range(4)) for _ in range(2)), pbar_desc=None
        )
        if step == 2:  # a multi-turn tool-call trajectory group
            groups.append(await art.TrajectoryGroup(tool_rollout(model) for _ in range(2)))
        started = time.monotonic()
        result = await backend.train(model, groups, learning_rate=1e-3)
        seconds = time.monotonic() - started
        assert result.step == step, (result.step, step)
        assert await model.get_step() == step
        # The new checkpoint is served at once, under both names.
        latest = await sample(model.openai_client(), model.get_inference_name(), PROMPT)
        pinned = await sample(model.openai_client(), model.get_inference_name(step), PROMPT)
        assert latest.model == pinned.model == f"{args.project}/{args.model}:{step}", (
            latest.model,
            pinned.model,
        )
        metrics = result.metrics
        seen["train"].append({
            "step": result.step, "seconds": round(seconds, 3),
            **{k: round(v, 4) for k, v in metrics.items() if k.startswith("time/step_") or k in (
                "loss/train", "data/step_num_groups_trainable", "data/step_trainer_tokens", "reward")},
        })  # fmt: skip
    # :step0 stays callable after later steps.
    assert (await sample(model.openai_client(), model.get_inference_name(0), PROMPT)).model.endswith(":0")

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
        await sample(model.openai_client(), model.get_inference_name(1), PROMPT)
        raise AssertionError("a deleted checkpoint answered")
    except openai.NotFoundError:
        pass
    seen["steps_after_delete"] = steps

    other = ServerlessBackend(api_key=args.other_key, base_url=args.base_url)
    oc = other._client
    seen["refused"] = [
        await refused(
            "register into the team",
            oc.models.create(
                entity=model.entity,
                project=args.project,
                name=args.model,
                base_model=args.base_model,
                return_existing=True,
            ),
        ),  # fmt: skip
        await refused("list checkpoints", oc.models.checkpoints.list(model_id=model.id)),
        await refused("delete checkpoints", oc.models.checkpoints.delete(model_id=model.id, steps=[3])),
        await refused("train", oc.training_jobs.create(model_id=model.id, trajectory_groups=groups)),
        await refused("log", oc.models.log(model_id=model.id, trajectory_groups=groups, split="val")),
        await refused("delete the model", oc.models.delete(model_id=model.id)),
        await refused(
            "sample",
            sample(
                openai.AsyncOpenAI(base_url=args.base_url, api_key=args.other_key),
                model.get_inference_name(),
                PROMPT,
            ),
        ),  # fmt: skip
    ]
    await other.close()
    await backend.close()
    return seen


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for flag in ("--base-url", "--key", "--other-key", "--project", "--model", "--base-model"):
        parser.add_argument(flag, required=True)
    print("RESULT " + json.dumps(asyncio.run(main(parser.parse_args()))), flush=True)
