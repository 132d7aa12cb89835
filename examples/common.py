"""What every example shares: its flags, the backend and model, sampling, held-out evaluation and
the training loop that prints one reward per step. Plain ART: nothing here imports artweb."""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

# Before ART is imported: no W&B account, and litellm (RULER's judge client) must not fetch its price list.
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import art  # noqa: E402

Rollout = Callable[[art.TrainableModel, Any, float], Awaitable[art.Trajectory]]


def parser(description: str, *, model: str) -> argparse.ArgumentParser:
    """The flags every example takes; an example adds its own before ``parse_args``."""
    flags = argparse.ArgumentParser(description=description)
    flags.add_argument("--steps", type=int, default=10, help="training steps (backend.train calls)")
    flags.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="artweb's gateway, /v1")
    flags.add_argument("--api-key", default=os.environ.get("ARTWEB_API_KEY"), help="a team API key (aw_...)")
    flags.add_argument("--base-model", default="smollm2-135m-instruct", help="a registered base model")
    flags.add_argument("--project", default="examples")
    flags.add_argument("--model", default=model, help="trainable model name (an existing one resumes)")
    flags.add_argument("--groups", type=int, default=2, help="trajectory groups (scenarios) per step")
    flags.add_argument("--group-size", type=int, default=4, help="rollouts per scenario")
    flags.add_argument("--eval-rows", type=int, default=8, help="held-out scenarios scored before and after")
    flags.add_argument("--learning-rate", type=float, default=1e-4)
    flags.add_argument("--max-tokens", type=int, default=16, help="new tokens per model turn")
    flags.add_argument("--seed", type=int, default=0)
    return flags


async def setup(args: argparse.Namespace) -> tuple[art.ServerlessBackend, art.TrainableModel]:
    if not args.api_key:
        raise SystemExit("--api-key (or ARTWEB_API_KEY) is required")
    backend = art.ServerlessBackend(api_key=args.api_key, base_url=args.base_url)
    # openpipe-art 0.5.20+ names a model's checkpoints by its run_name (required there); 0.5.18 has none.
    extra = {"run_name": args.model} if "run_name" in art.TrainableModel.model_fields else {}
    model = art.TrainableModel(name=args.model, project=args.project, base_model=args.base_model, **extra)
    await model.register(backend)
    return backend, model


async def sample(model: art.TrainableModel, messages: list, *, max_tokens: int, temperature: float = 1.0,
                 **extra: Any) -> Any:  # fmt: skip
    """One choice from the model's latest checkpoint, with the logprobs (and, from artweb, the token
    ids) that training needs. Temperature 1 for training rollouts: the trainer scores at 1."""
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, logprobs=True, max_tokens=max_tokens,
        temperature=temperature, **extra,
    )  # fmt: skip
    return completion.choices[0]


async def evaluate(model: art.TrainableModel, rollout: Rollout, scenarios: Sequence[Any]) -> float:
    """Mean reward over held-out scenarios, sampled greedily so before and after compare."""
    trajectories = await asyncio.gather(*(rollout(model, scenario, 0.0) for scenario in scenarios))
    return sum(t.reward for t in trajectories) / max(len(trajectories), 1)


async def train(
    args: argparse.Namespace,
    *,
    rollout: Rollout,
    train_scenarios: Callable[[int], Sequence[Any]],
    held_out: Sequence[Any],
    score_group: Callable[[art.TrajectoryGroup], Awaitable[art.TrajectoryGroup | None]] | None = None,
) -> dict[str, Any]:
    """ART's loop: gather groups, ``backend.train`` one step, repeat; held-out reward before and after.
    Prints one ``step N reward R`` line per step and returns the figures."""
    backend, model = await setup(args)
    print(f"model {model.project}/{model.name} (entity {model.entity}) at step {await model.get_step()}")
    figures: dict[str, Any] = {"steps": []}
    figures["eval_before"] = await evaluate(model, rollout, held_out)
    print(f"held-out reward before: {figures['eval_before']:.3f} ({len(held_out)} rows)", flush=True)
    for index in range(args.steps):
        started = time.monotonic()
        groups = await art.gather_trajectory_groups(
            (
                art.TrajectoryGroup(rollout(model, scenario, 1.0) for _ in range(args.group_size))
                for scenario in train_scenarios(index)
            ),
            after_each=score_group,
            pbar_desc=None,
        )
        rollout_seconds = time.monotonic() - started
        rewards = [t.reward for group in groups for t in group.trajectories]
        started = time.monotonic()
        result = await backend.train(model, groups, learning_rate=args.learning_rate)
        train_seconds = time.monotonic() - started
        reward = sum(rewards) / max(len(rewards), 1)
        split = {
            k.removeprefix("time/step_"): round(v, 2)
            for k, v in result.metrics.items()
            if k.startswith("time/")
        }
        # Optimizer steps in this train() call: one per packed sequence (ART's semantics).
        gradient_steps = result.metrics.get("data/step_num_gradient_steps")
        figures["steps"].append({"step": result.step, "reward": reward, "rollout_s": rollout_seconds,
                                 "train_s": train_seconds, "server": split,
                                 "gradient_steps": gradient_steps})  # fmt: skip
        print(f"step {result.step} reward {reward:.3f} (rollouts {rollout_seconds:.1f} s, "
              f"backend.train {train_seconds:.1f} s {split}, {gradient_steps} optimizer steps)", flush=True)  # fmt: skip
    figures["eval_after"] = await evaluate(model, rollout, held_out)
    print(
        f"held-out reward after: {figures['eval_after']:.3f} (before {figures['eval_before']:.3f})",
        flush=True,
    )
    await backend.close()
    return figures
