"""A client training job's update with ART's semantics: one optimizer step per packed sequence.

The job's samples (with their shaped advantages and weights, training.art_loss) are packed by ART's
rule (training.packing.plan_sequences); each sequence is a forward and backward pass of ART's loss
and an optimizer step at its own learning rate. Logprobs the loss compares with and that must not
move while the job trains — the trainer's own before its first step (``precalculate_logprobs``,
truncated IS) and the KL reference's — are computed for every sequence before the first step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file

from training.art_config import ArtOptions
from training.art_loss import art_policy_loss
from training.packing import build_sequence
from training.trajectory import TrainSample

BASE_MODEL = "base"  # the KL reference when it is step 0: the adapter switched off


@dataclass
class Sequenced:
    """The job's trainable samples: each with its advantage (shaped), weight and trajectory."""

    samples: list[TrainSample]
    advantages: list[float]
    weights: list[float]
    trajectory: list[int]  # index of the sample's trajectory (counts trajectories per sequence)
    group: list[int]  # index of its trajectory group (ART packs a group's samples together)


def learning_rate_of(base: float, options: ArtOptions, *, trajectories: int, reward_std: float) -> float:
    """A sequence's learning rate: ART's ``trajectories ** power`` multiplier, and the mean
    within-group reward std when ``scale_learning_rate_by_reward_std_dev`` (no ART trainer of
    0.5.23 reads that key; this is its documented meaning)."""
    rate = base * float(trajectories) ** options.num_trajectories_learning_rate_multiplier_power
    if options.scale_learning_rate_by_reward_std_dev:
        rate *= reward_std
    return rate


def _batch(trainer: Any, members: list[int], job: Sequenced) -> tuple[dict[str, torch.Tensor], list[int]]:
    """One sequence's tensors, and the order of its members in them."""
    if trainer.packed:
        dtype = trainer.model.get_input_embeddings().weight.dtype
        row = build_sequence(
            members,
            job.samples,
            job.advantages,
            mask_dtype=dtype if dtype.is_floating_point else torch.float32,
        )
        batch = {
            "input_ids": row.input_ids, "position_ids": row.position_ids,
            "attention_mask": row.attention_mask, "keep": row.keep, "logit_index": row.logit_index,
            "targets": row.targets, "mask": row.mask, "old_logprobs": row.old_logprobs,
            "advantages": row.advantages, "positions": torch.tensor(row.width),
        }  # fmt: skip
        order = row.members
    else:
        batch = trainer._collate([(job.samples[i], job.advantages[i]) for i in members])
        order = list(members)
    return {name: tensor.to(trainer.device) for name, tensor in batch.items()}, order


@contextlib.contextmanager
def _reference_policy(trainer: Any, reference: Path | str) -> Iterator[None]:
    """The policy as it was at the reference: the base model (adapter off) or a checkpoint's
    adapter weights swapped in, then the live ones put back."""
    if reference == BASE_MODEL:
        with trainer.model.disable_adapter():
            yield
        return
    live = {
        name: tensor.detach().clone() for name, tensor in get_peft_model_state_dict(trainer.model).items()
    }
    set_peft_model_state_dict(trainer.model, load_file(Path(reference) / "adapter_model.safetensors",
                                                       device=str(trainer.device)))  # fmt: skip
    try:
        yield
    finally:
        set_peft_model_state_dict(trainer.model, live)


def _fixed_logprobs(trainer: Any, batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [trainer._completion_logprobs(batch)[0].detach() for batch in batches]


def art_update(
    trainer: Any,
    job: Sequenced,
    rows: list[list[int]],
    options: ArtOptions,
    *,
    learning_rate: float,
    reward_std: float,
    reference: Path | str | None,
) -> tuple[dict[str, float], list[dict[str, float]]]:
    """Train ``rows`` (lists of indices into ``job``), one optimizer step each; the job's metrics
    and each step's (ART's gradient_step events)."""
    trainer.step += 1
    batches = [_batch(trainer, members, job) for members in rows]
    trainer_logprobs = (
        _fixed_logprobs(trainer, [b for b, _ in batches]) if options.needs_trainer_logprobs else None
    )
    reference_logprobs = None
    if reference is not None:
        with _reference_policy(trainer, reference):
            reference_logprobs = _fixed_logprobs(trainer, [b for b, _ in batches])

    steps: list[dict[str, float]] = []
    for index, (batch, order) in enumerate(batches):
        logprobs, entropy = trainer._completion_logprobs(batch)
        sampler = batch["old_logprobs"]
        old = trainer_logprobs[index] if trainer_logprobs is not None else sampler
        weights = torch.tensor([job.weights[i] for i in order], device=trainer.device)
        advantages = torch.tensor([job.advantages[i] for i in order], device=trainer.device)
        loss, metrics = art_policy_loss(
            logprobs, old, advantages, weights, batch["mask"], options.loss,
            ref_logprobs=reference_logprobs[index] if reference_logprobs is not None else None,
            original_logprobs=sampler if trainer_logprobs is not None else None,
        )  # fmt: skip
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(trainer.trainable_parameters, trainer.config.max_grad_norm)
        rate = learning_rate_of(
            learning_rate,
            options,
            trajectories=len({job.trajectory[i] for i in order}),
            reward_std=reward_std,
        )
        for group in trainer.optimizer.param_groups:
            group["lr"] = rate
        if math.isfinite(float(grad_norm)):
            trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        tokens = float(batch["mask"].sum())
        steps.append({
            "loss": float(loss.detach()),
            "grad_norm": float(grad_norm),
            "learning_rate": rate,
            "entropy": float((entropy * batch["mask"]).sum()) / max(tokens, 1.0),
            "trainable_tokens": tokens,
            "num_trajectories": float(len({job.trajectory[i] for i in order})),
            "positions": float(batch["positions"]) if "positions" in batch else float(batch["input_ids"].numel()),
            **metrics,
        })  # fmt: skip
    for group in trainer.optimizer.param_groups:  # a checkpoint keeps the job's own rate
        group["lr"] = learning_rate
    return _job_metrics(steps), steps


def _job_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    """The job's metrics: means over its steps, token-weighted where a step's value is a token mean."""
    if not steps:
        return {"loss": 0.0, "grad_norm": 0.0, "entropy": 0.0, "clip_fraction": 0.0, "kl": 0.0,
                "ratio_mean": 1.0, "trainable_tokens": 0.0, "gradient_steps": 0.0, "update_positions": 0.0,
                "padding_fraction": 0.0}  # fmt: skip
    tokens = sum(step["trainable_tokens"] for step in steps) or 1.0

    def by_tokens(name: str) -> float:
        return sum(step[name] * step["trainable_tokens"] for step in steps) / tokens

    return {
        "loss": sum(step["loss"] for step in steps) / len(steps),
        "grad_norm": sum(step["grad_norm"] for step in steps) / len(steps),
        "entropy": by_tokens("entropy"),
        "clip_fraction": by_tokens("clip_fraction"),
        "ratio_mean": by_tokens("ratio_mean"),
        "kl": by_tokens("kl_policy_ref"),
        "trainable_tokens": sum(step["trainable_tokens"] for step in steps),
        "gradient_steps": float(len(steps)),
        "update_positions": sum(step["positions"] for step in steps),
        "padding_fraction": 0.0,
    }
