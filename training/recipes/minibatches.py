"""A GRPO step's samples as the session's datums: the ``grpo`` loss's inputs and weights, and the
split into minibatches (one optimizer step each; training.recipes.grpo_update)."""

from __future__ import annotations

from typing import Any

from training.config import TrainConfig
from training.rollouts.trajectory import TrainSample
from training.session.contract import Datum, datum_of


def grpo_data(samples: list[tuple[TrainSample, float]], config: TrainConfig) -> list[Datum]:
    """The samples as session datums for the ``grpo`` loss: the sampler's logprobs and each
    sample's advantage on its completion tokens, and weights that make the summed loss the
    normalised one (``normalization``: sequence 1 / (tokens of the sequence · sequences), token
    1 / all tokens, constant 1 / (sequences · max_new_tokens)), 0 on tokens not trained."""
    sequences = len(samples)
    total_tokens = sum(sample.trainable_tokens() for sample, _ in samples)
    data = []
    for sample, advantage in samples:
        mask = sample.completion_mask or [1] * len(sample.completion_token_ids)
        if config.normalization == "sequence":
            scale = 1.0 / (max(sum(mask), 1) * sequences)
        elif config.normalization == "token":
            scale = 1.0 / max(total_tokens, 1)
        elif config.normalization == "constant":
            scale = 1.0 / (sequences * config.max_new_tokens)
        else:
            raise ValueError(f"unknown normalization {config.normalization!r}")
        data.append(
            datum_of(
                sample,
                weights=[bit * scale for bit in mask],
                advantages=[advantage] * len(mask),
                logprobs=list(sample.completion_logprobs),
            )
        )
    return data


def split_evenly(items: list[Any], parts: int) -> list[list[Any]]:
    """``items`` in order as ``min(parts, len(items))`` contiguous chunks whose sizes differ by at
    most one (the first ones the larger): a group's samples stay together where they can."""
    parts = max(1, min(parts, len(items)))
    size, extra = divmod(len(items), parts)
    chunks, at = [], 0
    for index in range(parts):
        width = size + (1 if index < extra else 0)
        chunks.append(items[at : at + width])
        at += width
    return chunks
