"""A client training job's update with ART's semantics: one optimizer step per packed sequence.

The job's samples (with their shaped advantages and weights, training.recipes.art_loss) are packed by ART's
rule (training.session.packing.plan_sequences); each sequence is one ``forward_backward`` of the session
with ART's loss (``art``, training.session.losses) and one ``optim_step`` at its own learning rate
(training.session). Logprobs the loss compares with and that must not
move while the job trains — the trainer's own before its first step (``precalculate_logprobs``,
truncated IS) and the KL reference's — are computed for every sequence before the first step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from training.recipes.art_config import ArtOptions
from training.rollouts.trajectory import TrainSample
from training.session.contract import BASE_MODEL, Session, datum_of

__all__ = ["BASE_MODEL", "Sequenced", "art_update", "learning_rate_of"]


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


def _completion(values: list[float], sample: TrainSample) -> list[float]:
    """A datum's output values at the sample's completion positions."""
    return values[len(sample.prompt_token_ids) - 1 :]


def art_update(
    session: Session,
    job: Sequenced,
    rows: list[list[int]],
    options: ArtOptions,
    *,
    learning_rate: float,
    reward_std: float,
    reference: Path | str | None,
) -> tuple[dict[str, float], list[dict[str, float]]]:
    """Train ``rows`` (lists of indices into ``job``), one ``forward_backward`` with ART's loss and
    one ``optim_step`` each; the job's metrics and each step's (ART's gradient_step events).
    ``session``: a training.session.local.TrainingSession or a trainer service's RemoteSession: only
    their primitives are used."""
    masks = [sample.completion_mask or [1] * len(sample.completion_token_ids) for sample in job.samples]
    # Weighted from the completion on: forward computes only the positions the loss reads.
    plain = [datum_of(sample, weights=[1.0] * len(sample.completion_token_ids)) for sample in job.samples]
    trainer_logprobs = session.forward(plain) if options.needs_trainer_logprobs else None
    reference_logprobs = None
    if reference is not None:
        reference_logprobs = session.forward(plain, reference=reference)

    steps: list[dict[str, float]] = []
    config = dataclasses.asdict(options.loss)
    for members in rows:
        tokens = sum(sum(masks[i]) for i in members)  # ART divides a sequence's loss by its trained tokens
        data = []
        for i in members:
            sample, mask = job.samples[i], masks[i]
            per_token: dict[str, list[float]] = {
                "weights": [m * job.weights[i] / max(tokens, 1) for m in mask],
                "advantages": [job.advantages[i]] * len(mask),
                "logprobs": list(sample.completion_logprobs),
            }
            if trainer_logprobs is not None:
                per_token["original_logprobs"] = per_token["logprobs"]
                per_token["logprobs"] = _completion(trainer_logprobs[i], sample)
            if reference_logprobs is not None:
                per_token["ref_logprobs"] = _completion(reference_logprobs[i], sample)
            data.append(datum_of(sample, **per_token))
        result = session.forward_backward(data, "art", config)
        rate = learning_rate_of(
            learning_rate,
            options,
            trajectories=len({job.trajectory[i] for i in members}),
            reward_std=reward_std,
        )
        stepped = session.optim_step(learning_rate=rate)
        metrics = {k: v for k, v in result.metrics.items() if k != "loss:sum"}
        steps.append({
            "loss": result.loss,
            "grad_norm": stepped["grad_norm"],
            "learning_rate": rate,
            "trainable_tokens": float(tokens),
            "num_trajectories": float(len({job.trajectory[i] for i in members})),
            "update_devices": float(stepped.get("update_devices", 1.0)),
            "positions": float(sum(len(job.samples[i].prompt_token_ids) + len(job.samples[i].completion_token_ids)
                                   for i in members)),
            **metrics,
        })  # fmt: skip
    return _job_metrics(steps), steps


def _job_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    """The job's metrics: means over its steps, token-weighted where a step's value is a token mean."""
    if not steps:
        return {"loss": 0.0, "grad_norm": 0.0, "entropy": 0.0, "clip_fraction": 0.0, "kl": 0.0,
                "ratio_mean": 1.0, "trainable_tokens": 0.0, "gradient_steps": 0.0, "update_positions": 0.0,
                "padding_fraction": 0.0, "update_devices": 1.0}  # fmt: skip
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
        "update_devices": max(step["update_devices"] for step in steps),
        "update_positions": sum(step["positions"] for step in steps),
        "padding_fraction": 0.0,
    }
