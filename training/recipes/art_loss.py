"""OpenPipe ART's training objective for client training jobs, as pure torch functions.

ART's backends train a job's trajectories in *packed sequences* and take one optimizer step per
sequence. Per token, before the loss (ART's packing step, over the whole job):
- weight w = 1 / (the trajectory's trained tokens), then divided by the mean w over all trained
  tokens of the job: every trajectory counts the same, however long;
- advantage A = the trajectory's group advantage, scaled by ``advantage_balance`` (b > 0 shrinks
  negative advantages by 1 - b, b < 0 positive ones by 1 + b), then divided by the job's mean |A|·w
  over trained tokens: the step size no longer depends on the rewards' scale.

Then per packed sequence (ART's ``loss_fn``): the importance ratio r = exp(new - old) (old = the
sampler's logprobs; a missing one, NaN, counts as sampled by the current policy: r = 1), at token,
sequence (geometric mean over a trajectory's tokens), average or geometric-average level;
optionally capped (``max_negative_advantage_importance_sampling_weight``), masked outside the clip
range (``mask_prob_ratio``); Kimi K2's ``tau`` shifts A by -tau·(new - old); the KL penalty shifts A
by coef·(mean kl - kl_t) with kl_t = source_t - ref_t (source: the sampler's or the learner's
logprobs); then
    ppo:   -min(r·A, clip(r, 1 - eps, 1 + eps_high)·A)
    cispo: -sg(clip(r, 1 - eps, 1 + eps_high))·A·new
times the truncated importance weight min(exp(old - original), C) when the trainer's own logprobs
(``old``) and the sampler's (``original``) are both known, times w, summed over trained tokens and
divided by their count in the sequence.
"""

from __future__ import annotations

import torch

from training.recipes.art_config import ArtLoss

# exp() of a larger log ratio overflows float16 at 10; ART bounds fp32 log ratios at 20.
LOG_RATIO_BOUND = 20.0


def art_token_weights(lengths: list[int]) -> list[float]:
    """Each trajectory's per-token weight (``lengths``: trained tokens per trajectory), normalised
    so the mean over all trained tokens is 1: trajectory i's tokens weigh total / (n · lengths[i])."""
    raw = [1.0 / (length + 1e-6) for length in lengths]
    total = sum(lengths)
    mean = sum(w * n for w, n in zip(raw, lengths, strict=True)) / total if total else 0.0
    return [w / mean if mean > 0 else w for w in raw]


def art_shaped_advantages(
    advantages: list[float], lengths: list[int], weights: list[float], *, balance: float = 0.0
) -> list[float]:
    """The trajectories' advantages after ``advantage_balance`` and the division by the mean
    |A|·w over all trained tokens (see the module doc)."""
    if balance > 0:
        advantages = [a if a > 0 else a * (1 - balance) for a in advantages]
    elif balance < 0:
        advantages = [a if a < 0 else a * (1 + balance) for a in advantages]
    total = sum(lengths)
    if not total:
        return list(advantages)
    mean = sum(abs(a) * w * n for a, w, n in zip(advantages, weights, lengths, strict=True)) / total
    return [a / mean for a in advantages] if mean > 0 else list(advantages)


def art_policy_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    config: ArtLoss,
    *,
    ref_logprobs: torch.Tensor | None = None,
    original_logprobs: torch.Tensor | None = None,
    kl_average: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one packed sequence and its metrics.

    Per-token tensors are [N, T] (N trajectories of the sequence, T positions, ``mask`` 1 on
    trained tokens); ``advantages`` and ``weights`` are [N] (one per trajectory) or [N, T]. ``old_logprobs``
    may hold NaN (no logprob: r = 1). ``ref_logprobs``: the KL reference's, needed when
    ``kl_penalty_coef`` > 0. ``original_logprobs``: the sampler's, when ``old_logprobs`` are the
    trainer's own (precalculated); the truncated IS weight needs both. ``kl_average``: the KL
    penalty's mean over a whole call of which these tokens are a share (a data-parallel rank's,
    training.hosting.ranks); None: the mean over these tokens.
    """
    trained = mask > 0
    maskf = trained.to(new_logprobs.dtype)
    tokens = maskf.sum()
    new = torch.where(trained, new_logprobs, torch.zeros_like(new_logprobs))
    old = torch.where(trained, old_logprobs.to(new.dtype), torch.zeros_like(new))
    old = torch.where(torch.isfinite(old), old, new.detach())
    # Per trajectory ([N]) or already per token ([N, T]).
    advantage = (advantages[:, None] if advantages.dim() == 1 else advantages).to(new.dtype).expand_as(
        new
    ) * maskf
    weight = (weights[:, None] if weights.dim() == 1 else weights).to(new.dtype).expand_as(new)

    log_ratio = new - old
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    level = config.importance_sampling_level
    if level != "token":
        per_sequence = (log_ratio * maskf).sum(-1, keepdim=True) / maskf.sum(-1, keepdim=True).clamp(min=1)
        sequence_ratio = torch.exp(per_sequence.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)).expand_as(new)
        if level == "sequence":
            ratio = sequence_ratio
        elif level == "average":
            ratio = (ratio + sequence_ratio) / 2
        elif level == "geometric_average":
            ratio = ratio.sqrt() * sequence_ratio.sqrt()
        else:
            raise ValueError(f"unknown importance_sampling_level {level!r}")
    raw_ratio = ratio
    low, high = 1 - config.epsilon, 1 + config.epsilon_high
    if config.max_negative_advantage_importance_sampling_weight:
        ratio = ratio.clamp(max=config.max_negative_advantage_importance_sampling_weight)
    if config.mask_prob_ratio:
        ratio = torch.where((ratio > low) & (ratio < high), ratio, torch.zeros_like(ratio))
    if config.kimi_k2_tau:
        advantage = advantage - config.kimi_k2_tau * log_ratio.detach()
    kl_mean = 0.0
    if config.kl_penalty_coef > 0:
        if ref_logprobs is None:
            raise ValueError("a KL penalty needs the reference's logprobs")
        source = old.detach() if config.kl_penalty_source == "sample" else new.detach()
        ref = torch.where(trained, ref_logprobs.to(new.dtype), torch.zeros_like(new))
        kl = (source - ref) * maskf
        average = (
            kl.sum() / (tokens + 1e-18) if kl_average is None else torch.tensor(kl_average, dtype=new.dtype)
        )
        advantage = advantage + config.kl_penalty_coef * (average - kl) * maskf
        kl_mean = float(average)

    if config.ppo:
        per_token = -torch.minimum(ratio * advantage, ratio.clamp(low, high) * advantage)
    else:
        per_token = -(ratio.detach().clamp(low, high) * advantage * new)
    if config.truncated_importance_sampling and original_logprobs is not None:
        original = torch.where(trained, original_logprobs.to(new.dtype), torch.zeros_like(new))
        original = torch.where(torch.isfinite(original), original, new.detach())
        per_token = per_token * torch.exp(old - original).clamp(max=config.truncated_importance_sampling)
    loss = (per_token * weight * maskf).sum() / (tokens + 1e-18)

    with torch.no_grad():
        ratios = raw_ratio[trained]
        if config.ppo:
            signs = advantage[trained]
            clipped = ((signs > 0) & (ratios > high)) | ((signs < 0) & (ratios < low))
        else:
            clipped = (ratios < low) | (ratios > high)
        count = max(int(ratios.numel()), 1)
        metrics = {
            "clip_fraction": float(clipped.sum()) / count,
            "ratio_mean": float(ratios.sum()) / count if ratios.numel() else 1.0,
            "kl_policy_ref": kl_mean,
        }
    return loss, metrics
