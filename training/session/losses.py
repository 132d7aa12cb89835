"""Named losses over per-token inputs: what ``TrainingSession.forward_backward`` computes.

A loss is a pure function ``(inputs, config) -> (loss, metrics)`` over a batch of datums laid out
[B, T] (``LossInputs``: the learner's logprobs with grad, and the datums' per-token inputs, 0 beyond
a datum's end). Like Tinker's built-in losses they are *sums* over tokens (a weight of 0 leaves a
token out; normalising is the caller's, through the weights), so a batch split into several
``forward_backward`` calls accumulates exactly the gradient of the whole. ``q`` below is the
sampler's logprob, ``p`` the learner's, ``A`` the advantage, ``w`` the weight (1 when absent):

- ``cross_entropy``: -sum w·p                                  (SFT; inputs: weights)
- ``importance_sampling``: -sum w·exp(p - q)·A                 (REINFORCE, off-policy corrected)
- ``ppo``: -sum w·min(r·A, clip(r, low, high)·A), r = exp(p - q); ``clip_low_threshold`` 0.8,
  ``clip_high_threshold`` 1.2 (absolute ratios, as Tinker takes them)
- ``cispo``: -sum w·sg(clip(r, low, high))·A·p; thresholds as ppo's
- ``dro``: -sum w·(p·A - beta/2·(p - q)²); ``beta`` 0.05
- ``gspo``: ppo with each datum's ratio the geometric mean over its weighted tokens (GSPO-token:
  r_t = sg(s)·exp(p_t - sg(p_t)), so each token keeps its own gradient)
- ``grpo``: the platform's GRPO objective (training.recipes.grpo.token_objective: ``loss_type`` ppo|cispo,
  ``epsilon``, ``epsilon_high``, ``importance_level`` token|sequence, ``kl_coef`` with
  ``ref_logprobs``); the weights carry its normalisation (sequence, token or constant)
- ``art``: OpenPipe ART's objective for one packed sequence (training.recipes.art_loss); ``loss_fn_config``
  is an ``ArtLoss`` as a dict; inputs: weights, advantages, logprobs (NaN: the learner's own),
  optional ``ref_logprobs`` and ``original_logprobs``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from training.recipes.art_loss import ArtLoss, art_policy_loss
from training.recipes.grpo import objective_metrics, token_objective
from training.session.contract import LossInputError


@dataclass
class LossInputs:
    """A batch of datums for a loss: [B, T] tensors, ``mask`` 1 on each datum's real positions."""

    logprobs: torch.Tensor  # the learner's logprobs of the target tokens, with grad
    mask: torch.Tensor
    weights: torch.Tensor
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # logprobs, advantages, ...

    def need(self, name: str, loss: str) -> torch.Tensor:
        if name not in self.inputs:
            raise LossInputError(f"loss {loss!r} needs loss_fn_inputs[{name!r}] on every datum")
        return self.inputs[name]


LossFn = Callable[[LossInputs, dict[str, Any]], tuple[torch.Tensor, dict[str, float]]]


def _config(config: dict[str, Any], loss: str, defaults: dict[str, float]) -> dict[str, float]:
    unknown = sorted(set(config) - set(defaults))
    if unknown:
        raise LossInputError(
            f"loss {loss!r} takes no {', '.join(unknown)} (it takes {', '.join(defaults) or 'nothing'})"
        )
    return {**defaults, **{k: float(v) for k, v in config.items()}}


def _ratio_metrics(ratio: torch.Tensor, weighted: torch.Tensor, low: float, high: float) -> dict[str, float]:
    with torch.no_grad():
        count = weighted.sum().clamp(min=1.0)
        outside = ((ratio < low) | (ratio > high)).to(weighted.dtype)
        return {
            "clip_fraction": float((outside * weighted).sum() / count),
            "ratio_mean": float((ratio * weighted).sum() / count),
        }


def cross_entropy(batch: LossInputs, config: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    _config(config, "cross_entropy", {})
    loss = -(batch.weights * batch.logprobs).sum()
    tokens = float((batch.weights != 0).sum())
    return loss, {"tokens": tokens}


def importance_sampling(batch: LossInputs, config: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    _config(config, "importance_sampling", {})
    ratio = torch.exp(batch.logprobs - batch.need("logprobs", "importance_sampling"))
    loss = -(batch.weights * ratio * batch.need("advantages", "importance_sampling")).sum()
    return loss, _ratio_metrics(ratio.detach(), (batch.weights != 0).to(ratio.dtype), 0.0, float("inf"))


def _clipped(batch: LossInputs, config: dict[str, Any], loss: str) -> tuple[torch.Tensor, float, float]:
    settings = _config(config, loss, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    low, high = settings["clip_low_threshold"], settings["clip_high_threshold"]
    if not 0 <= low <= 1 <= high:
        raise LossInputError(f"loss {loss!r} needs clip_low_threshold <= 1 <= clip_high_threshold")
    return torch.exp(batch.logprobs - batch.need("logprobs", loss)), low, high


def ppo(batch: LossInputs, config: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    ratio, low, high = _clipped(batch, config, "ppo")
    advantages = batch.need("advantages", "ppo")
    objective = torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
    return -(batch.weights * objective).sum(), _ratio_metrics(
        ratio.detach(), (batch.weights != 0).to(ratio.dtype), low, high
    )


def cispo(batch: LossInputs, config: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    ratio, low, high = _clipped(batch, config, "cispo")
    objective = ratio.detach().clamp(low, high) * batch.need("advantages", "cispo") * batch.logprobs
    return -(batch.weights * objective).sum(), _ratio_metrics(
        ratio.detach(), (batch.weights != 0).to(ratio.dtype), low, high
    )


def dro(batch: LossInputs, config: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    beta = _config(config, "dro", {"beta": 0.05})["beta"]
    sampled = batch.need("logprobs", "dro")
    objective = (
        batch.logprobs * batch.need("advantages", "dro") - 0.5 * beta * (batch.logprobs - sampled) ** 2
    )
    return -(batch.weights * objective).sum(), {}


def gspo(batch: LossInputs, config: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    settings = _config(config, "gspo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    low, high = settings["clip_low_threshold"], settings["clip_high_threshold"]
    weighted = (batch.weights != 0).to(batch.logprobs.dtype)
    log_ratio = (batch.logprobs - batch.need("logprobs", "gspo")) * weighted
    sequence = log_ratio.sum(-1, keepdim=True) / weighted.sum(-1, keepdim=True).clamp(min=1.0)
    ratio = torch.exp(sequence.detach() + batch.logprobs - batch.logprobs.detach())
    advantages = batch.need("advantages", "gspo")
    objective = torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
    return -(batch.weights * objective).sum(), _ratio_metrics(ratio.detach(), weighted, low, high)


def grpo(batch: LossInputs, config: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    defaults: dict[str, Any] = {"loss_type": "ppo", "epsilon": 0.2, "epsilon_high": None,
                                "importance_level": "token", "kl_coef": 0.0}  # fmt: skip
    unknown = sorted(set(config) - set(defaults))
    if unknown:
        raise LossInputError(f"loss 'grpo' takes no {', '.join(unknown)} (it takes {', '.join(defaults)})")
    settings = {**defaults, **config}
    trained = (batch.weights != 0).to(batch.logprobs.dtype)
    reference = batch.inputs.get("ref_logprobs")
    if settings["kl_coef"] > 0 and reference is None:
        raise LossInputError("loss 'grpo' with kl_coef > 0 needs loss_fn_inputs['ref_logprobs']")
    try:
        per_token, kl, ratio = token_objective(
            batch.logprobs, batch.need("logprobs", "grpo"), batch.need("advantages", "grpo"), trained,
            loss_type=settings["loss_type"], epsilon=float(settings["epsilon"]),
            epsilon_high=settings["epsilon_high"], ref_logprobs=reference if settings["kl_coef"] > 0 else None,
            kl_coef=float(settings["kl_coef"]), importance_level=settings["importance_level"],
        )  # fmt: skip
    except ValueError as exc:
        raise LossInputError(f"loss 'grpo': {exc}") from None
    metrics = objective_metrics(
        ratio, kl, trained, epsilon=float(settings["epsilon"]), epsilon_high=settings["epsilon_high"]
    )
    return (per_token * batch.weights).sum(), metrics


# The ``art`` loss's whole-call mean KL, computed over every rank (training.hosting.ranks).
KL_AVERAGE = "__kl_average__"


def art(batch: LossInputs, config: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    """ART's per-sequence objective: training.recipes.art_loss.art_policy_loss with per-token advantages and
    weights. art_policy_loss divides by the trained tokens, so this multiplies back: a sum, like the
    others (the caller's weights hold ART's 1 / tokens-of-the-sequence). ``config[KL_AVERAGE]``,
    set by a data-parallel session only: the whole call's mean KL (see art_policy_loss)."""
    config = dict(config)
    kl_average = config.pop(KL_AVERAGE, None)
    if kl_average is not None and not isinstance(kl_average, (int, float)):
        raise LossInputError(f"loss 'art': {KL_AVERAGE} must be a number")
    try:
        settings = ArtLoss(**config)
    except TypeError as exc:
        raise LossInputError(f"loss 'art': {exc}") from None
    trained = (batch.weights != 0).to(batch.logprobs.dtype)
    loss, metrics = art_policy_loss(
        batch.logprobs,
        batch.need("logprobs", "art"),
        batch.need("advantages", "art"),
        batch.weights,
        trained,
        settings,
        ref_logprobs=batch.inputs.get("ref_logprobs"),
        original_logprobs=batch.inputs.get("original_logprobs"),
        kl_average=kl_average,
    )
    return loss * trained.sum(), metrics


LOSSES: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
    "grpo": grpo,
    "art": art,
}


def loss_named(name: str) -> LossFn:
    if name not in LOSSES:
        raise LossInputError(f"unknown loss_fn {name!r} (one of {', '.join(LOSSES)})")
    return LOSSES[name]
