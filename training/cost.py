"""What a step or an evaluation used, in the units an operator prices: device-seconds and tokens.

Device-seconds are the worker's own wall clock for the work times the devices it held: every
visible CUDA device for ``device="cuda"`` (a worker owns the GPUs it sees), one for ``"cuda:N"``,
and one CPU "device" otherwise (a CPU worker is priced per worker-hour, not per core). Judge
tokens are the ``usage`` the judge endpoint reported for each reply (``GradeResult.token_usage``).
The prices and totals live in ``projects.selectors.costs``; this module only measures.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from training.rollouts.trajectory import Trajectory

GPU = "gpu"
CPU = "cpu"


def device_kind(device: str) -> str:
    return GPU if device.startswith("cuda") else CPU


def device_count(device: str) -> int:
    """Devices a worker on ``device`` holds (see the module doc)."""
    if device_kind(device) == CPU or ":" in device:
        return 1
    import torch

    return max(1, torch.cuda.device_count())


def device_usage(device: str, seconds: float, *, count: int | None = None) -> dict[str, Any]:
    """Step-metrics fields for ``seconds`` of wall clock on ``device``: device_kind, device_count,
    device_seconds (= seconds × count)."""
    count = device_count(device) if count is None else count
    return {
        "device_kind": device_kind(device),
        "device_count": float(count),
        "device_seconds": float(seconds) * count,
    }


def sampled_tokens(trajectory: Trajectory) -> int:
    """Tokens the model generated (tool results and chat headers between turns are not counted)."""
    if trajectory.completion_mask is None:
        return len(trajectory.completion_token_ids)
    return sum(trajectory.completion_mask)


def judge_token_usage(usages: Iterable[dict[str, dict[str, int]]]) -> dict[str, float]:
    """judge_prompt_tokens and judge_completion_tokens summed over graders' ``token_usage`` maps
    ({judge model: {prompt_tokens, completion_tokens, total_tokens}}), every model together."""
    prompt = completion = 0
    for usage in usages:
        for counts in usage.values():
            prompt += int(counts.get("prompt_tokens", 0))
            completion += int(counts.get("completion_tokens", 0))
    return {"judge_prompt_tokens": float(prompt), "judge_completion_tokens": float(completion)}
