"""GRPO math as pure torch functions: group advantages, the clipped policy losses, entropy.

Shapes: per-token tensors are [B, T] (B completions, T completion positions, padded; `mask` is 1
on real completion tokens), advantages are [B]. Nothing here knows about models or tokenizers.
"""

from __future__ import annotations

import torch

from training.recipes.signal import is_zero_variance


def group_advantages(rewards: torch.Tensor, scale: bool, eps: float = 1e-6) -> torch.Tensor:
    """Advantages of the completions of one group (along the last dim): reward minus group mean,
    divided by the group's std (+ eps) when `scale`.

    The std is the population std (divide by G, not G - 1), as in ART and the DeepSeekMath paper's
    normalisation: a group [0, 1] gets advantages [-1, +1]. `scale=False` is Dr.GRPO's choice
    (the std scaling over-weights nearly-solved and nearly-failed groups).
    """
    rewards = rewards.float()
    centred = rewards - rewards.mean(dim=-1, keepdim=True)
    if not scale:
        return centred
    std = rewards.std(dim=-1, keepdim=True, unbiased=False)
    return centred / (std + eps)


def compute_advantages(groups: list[list[float]], scale: bool) -> tuple[list[list[float]], int]:
    """Advantages for each group of rewards, and how many groups had zero variance.

    A zero-variance group (all rewards equal) gets exact zeros; the trainer skips it.
    """
    advantages: list[list[float]] = []
    zero_variance = 0
    for rewards in groups:
        if is_zero_variance(rewards):
            zero_variance += 1
            advantages.append([0.0] * len(rewards))
        else:
            advantages.append(group_advantages(torch.tensor(rewards, dtype=torch.float64), scale).tolist())
    return advantages, zero_variance


def update_advantages(rewards: list[float], trainable: list[bool], *, scale: bool) -> list[float | None]:
    """Each sample's advantage in a GRPO update of its group, None for a sample the update leaves
    out (every sample of a zero-variance group; one with ``trainable`` False, e.g. cut off under
    overlong_filter, which still counts in the group's mean and std). ``rewards`` are the ones the
    trainer compares: the grader's plus any length penalty (training.rollouts.trajectory.to_train_group).
    The trainer (training.recipes.grpo_update.grpo_step), the step's stored trajectories and the viewer
    all take their advantages from here."""
    if is_zero_variance(rewards):
        return [None] * len(rewards)
    (advantages,), _ = compute_advantages([rewards], scale=scale)
    return [advantage if keep else None for advantage, keep in zip(advantages, trainable, strict=True)]


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str,
    epsilon: float,
    epsilon_high: float | None,
    normalization: str,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    max_tokens_constant: int | None = None,
    importance_level: str = "token",
) -> tuple[torch.Tensor, dict[str, float]]:
    """The GRPO loss to minimise, and metrics.

    logprobs: current policy, with grad, [B, T]. old_logprobs: the sampler's, [B, T].
    ratio r = exp(logprobs - old_logprobs), clipped to [1 - epsilon, 1 + epsilon_high].
    importance_level "sequence" (GSPO) replaces each token's ratio by its sequence's geometric mean
      s = exp(mean over the sequence's tokens of (logprobs - old_logprobs)); its value is the same
      for every token of a sequence, its gradient reaches each token as in GSPO-token:
      r_t = sg(s) * exp(logprobs_t - sg(logprobs_t)).
      ppo:   per-token loss -min(r * A, clip(r) * A)  (PPO's pessimistic clipped surrogate)
      cispo: per-token loss -sg(clip(r)) * A * logprobs  (CISPO, MiniMax-M1: the IS weight is
             clipped and detached, so every token keeps a gradient, unlike PPO's clipped ones)
    normalization:
      sequence: mean over each sequence's tokens, then mean over sequences (GRPO)
      token:    sum over all tokens / number of tokens (DAPO)
      constant: sum over all tokens / (B * max_tokens_constant) (Dr.GRPO, no length bias)
    KL: when ref_logprobs is given, kl_coef * k3 is added per token, k3 = exp(d) - d - 1 with
    d = ref - logprobs (Schulman's unbiased, always positive estimator of KL(policy || ref)).
    Metrics: clip_fraction (share of tokens whose ratio lies outside the clip range), kl (mean k3,
    0 without ref), ratio_mean; token means over the mask.
    """
    per_token, kl, ratio = token_objective(
        logprobs, old_logprobs, advantages, mask, loss_type=loss_type, epsilon=epsilon,
        epsilon_high=epsilon_high, ref_logprobs=ref_logprobs, kl_coef=kl_coef, importance_level=importance_level,
    )  # fmt: skip
    mask = mask.to(logprobs.dtype)
    loss = normalize(per_token, mask, normalization, max_tokens_constant)
    return loss, objective_metrics(ratio, kl, mask, epsilon=epsilon, epsilon_high=epsilon_high)


def token_objective(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str,
    epsilon: float,
    epsilon_high: float | None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    importance_level: str = "token",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-token loss of ``policy_loss`` before normalisation, the per-token KL (k3; zeros
    without ``ref_logprobs``) and the ratios; ``advantages`` per sequence [B] or per token [B, T]."""
    if epsilon_high is None:
        epsilon_high = epsilon
    mask = mask.to(logprobs.dtype)
    advantages = advantages.to(logprobs.dtype)
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    if importance_level == "token":
        ratio = torch.exp(logprobs - old_logprobs)
    elif importance_level == "sequence":
        log_ratio = (logprobs - old_logprobs) * mask
        sequence_log_ratio = log_ratio.sum(dim=-1, keepdim=True) / mask.sum(dim=-1, keepdim=True).clamp(
            min=1.0
        )
        ratio = torch.exp(sequence_log_ratio.detach() + logprobs - logprobs.detach())
    else:
        raise ValueError(f"unknown importance_level {importance_level!r}")
    clipped_ratio = torch.clamp(ratio, 1.0 - epsilon, 1.0 + epsilon_high)
    if loss_type == "ppo":
        per_token = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
    elif loss_type == "cispo":
        per_token = -clipped_ratio.detach() * advantages * logprobs
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")

    kl = torch.zeros_like(per_token)
    if ref_logprobs is not None:
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + kl_coef * kl
    return per_token, kl, ratio


def objective_metrics(
    ratio: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, *, epsilon: float, epsilon_high: float | None
) -> dict[str, float]:
    """clip_fraction, kl, ratio_mean and ratio_sq_mean: token means over ``mask``."""
    high = epsilon if epsilon_high is None else epsilon_high
    with torch.no_grad():
        tokens = mask.sum().clamp(min=1.0)
        outside = ((ratio < 1.0 - epsilon) | (ratio > 1.0 + high)).to(mask.dtype)
        return {
            "clip_fraction": float((outside * mask).sum() / tokens),
            "kl": float((kl * mask).sum() / tokens),
            "ratio_mean": float((ratio * mask).sum() / tokens),
            # E[r²]: with ratio_mean, the ratio's spread over several batches (training.recipes.grpo_update)
            "ratio_sq_mean": float((ratio * ratio * mask).sum() / tokens),
        }


def normalize(
    per_token: torch.Tensor, mask: torch.Tensor, normalization: str, max_tokens_constant: int | None = None
) -> torch.Tensor:
    """Reduce a masked [B, T] per-token loss to a scalar (see `policy_loss` for the three modes)."""
    masked = per_token * mask
    if normalization == "token":
        return masked.sum() / mask.sum().clamp(min=1.0)
    if normalization == "sequence":
        return (masked.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)).mean()
    if normalization == "constant":
        if not max_tokens_constant:
            raise ValueError("normalization 'constant' needs max_tokens_constant")
        return masked.sum() / (per_token.shape[0] * max_tokens_constant)
    raise ValueError(f"unknown normalization {normalization!r}")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) along the last dim, in nats: logsumexp(z) - sum(p * z)."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
