"""Learning-rate schedules: the rate of each step of a run, a pure function of the config.

``index`` counts the run's steps from 1 to ``total`` (a run started from a checkpoint counts its own
steps, not the model's), so a resumed run finds the rate its dead worker would have used.

- warm-up: steps 1..W (``warmup_steps``) rise linearly, ``lr · i / (W + 1)``;
- then ``constant`` stays at ``lr``; ``cosine`` and ``linear`` fall from ``lr`` at step W + 1 to the
  floor ``lr · min_lr_ratio`` at the last step (cosine: half a cosine period; linear: a straight line).
"""

from __future__ import annotations

import math
from typing import Any


def learning_rate_at(config: Any, index: int, total: int) -> float:
    """The learning rate of step ``index`` (1-based) of a run of ``total`` steps. ``config`` has
    ``learning_rate``, ``lr_schedule``, ``warmup_steps`` and ``min_lr_ratio`` (a TrainConfig)."""
    if not 1 <= index <= max(total, 1):
        raise ValueError(f"step {index} is outside the run's steps 1..{total}")
    peak = float(config.learning_rate)
    warmup = int(config.warmup_steps)
    if index <= warmup:
        return peak * index / (warmup + 1)
    if config.lr_schedule == "constant":
        return peak
    floor = peak * float(config.min_lr_ratio)
    progress = (index - warmup - 1) / max(total - warmup - 1, 1)
    if config.lr_schedule == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if config.lr_schedule == "linear":
        return floor + (peak - floor) * (1.0 - progress)
    raise ValueError(f"unknown lr_schedule {config.lr_schedule!r}")
