"""Drives a live artweb with openpipe-art 0.5.23's ``PipelineTrainer`` over its ``ServerlessBackend``
(unchanged; run with ``.venv-art23``'s python): rollout workers keep sampling the latest served step
while training jobs queue and train behind each other.

    art23_pipeline_script.py --base-url http://127.0.0.1:PORT/v1 --key aw_... \\
        --project games --run-name pipe-r1 --base-model gateway-tiny --steps 3

The last line of stdout is ``RESULT <json>``: the steps the backend reports, which steps each
rollout sampled from, and what answers for every step afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
from typing import Any

import art
from art.pipeline_trainer.trainer import PipelineTrainer
from art.serverless.backend import ServerlessBackend

PROMPTS = ["Say yes.", "Say no.", "Say maybe.", "Count to three."]


async def main(args: argparse.Namespace) -> dict[str, Any]:
    backend = ServerlessBackend(api_key=args.key, base_url=args.base_url)
    model = art.TrainableModel(
        name="pipe", project=args.project, base_model=args.base_model, run_name=args.run_name
    )
    await model.register(backend)
    sampled_from: list[str] = []

    async def rollout(model: art.TrainableModel, prompt: str, _config: None) -> art.TrajectoryGroup:
        trajectories = []
        for _ in range(4):
            messages: art.Messages = [{"role": "user", "content": prompt}]
            reply = await model.openai_client().chat.completions.create(
                model=model.get_inference_name(), messages=messages, max_tokens=6, logprobs=True
            )
            sampled_from.append(reply.model)
            text = reply.choices[0].message.content or ""
            trajectories.append(
                art.Trajectory(
                    messages_and_choices=[*messages, reply.choices[0]], reward=float(len(text) % 3) / 2
                )
            )
        return art.TrajectoryGroup(trajectories)

    trainer = PipelineTrainer(
        model=model, backend=backend, rollout_fn=rollout, scenarios=itertools.cycle(PROMPTS), config=None,
        learning_rate=1e-3, loss_fn="cispo", max_steps=args.steps, eval_fn=None, eval_at_start=False,
        num_rollout_workers=2, min_batch_size=2, max_batch_size=2, max_steps_off_policy=2,
    )  # fmt: skip
    await asyncio.wait_for(trainer.train(handle_signals=False), timeout=400)
    step = await model.get_step()
    answers = {}
    for older in range(step + 1):
        reply = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(older), messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        answers[older] = reply.model
    await backend.close()
    return {"step": step, "sampled_from": sorted(set(sampled_from)), "answers": answers}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for flag in ("--base-url", "--key", "--project", "--run-name", "--base-model", "--steps"):
        parser.add_argument(flag, required=True)
    parsed = parser.parse_args()
    parsed.steps = int(parsed.steps)
    print("RESULT " + json.dumps(asyncio.run(main(parsed))), flush=True)
