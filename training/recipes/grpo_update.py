"""The GRPO update, written over the session primitives (training.session): whoever holds the
session — a policy in this process (``grpo_train_step``), or the host's trainer service
(training.hosting.service_run) — runs exactly these calls, so a run trains the same wherever its
session lives.

A step's groups become (sample, advantage) pairs, those become the ``grpo`` loss's datums split into
``num_minibatches`` minibatches, and each of ``ppo_epochs`` passes (``early_ppo_epochs`` on the
first steps) runs one ``forward_backward`` and one ``optim_step`` per minibatch (passes after the
first in an order seeded by the step)."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable

import torch

from training.config import TrainConfig
from training.hosting.ranks import DataParallelSession, is_data_parallel
from training.recipes.grpo import is_zero_variance, update_advantages
from training.recipes.minibatches import grpo_data, split_evenly
from training.rollouts.trajectory import TrainGroup, TrainSample
from training.session.contract import BASE_MODEL, Session
from training.session.local import TrainingSession
from training.session.policy import Policy

# The session an update runs over, made when there is something to update (it may add metrics,
# e.g. the data-parallel world size).
SessionFor = Callable[[dict[str, float]], Session]


def update_metrics() -> dict[str, float]:
    """An update's metrics before it runs (what a step with nothing to train reports)."""
    return {"loss": 0.0, "grad_norm": 0.0, "entropy": 0.0, "clip_fraction": 0.0, "kl": 0.0, "ratio_mean": 1.0,
            "trainable_tokens": 0.0}  # fmt: skip


def grpo_step(
    session_for: SessionFor, groups: list[TrainGroup], config: TrainConfig, *, step: int,
    learning_rate: float | None = None,
) -> dict[str, float]:  # fmt: skip
    """One GRPO step from sampled groups at ``learning_rate`` (the config's when None); ``step``
    is the policy's count of updates including this one. When every group has zero variance
    there is no update: loss, grad_norm, entropy, kl and trainable_tokens are 0."""
    start = time.perf_counter()
    rewards = [[sample.reward for sample in group.samples] for group in groups]
    zero_variance_groups = sum(1 for group_rewards in rewards if is_zero_variance(group_rewards))
    all_rewards = torch.tensor([r for group in rewards for r in group], dtype=torch.float64)
    metrics = update_metrics()
    metrics["zero_variance_fraction"] = zero_variance_groups / max(len(groups), 1)
    metrics["reward_mean"] = float(all_rewards.mean()) if len(all_rewards) else 0.0
    metrics["reward_std"] = float(all_rewards.std(unbiased=False)) if len(all_rewards) else 0.0
    # Groups whose rewards are all equal have zero advantage everywhere: nothing to learn. With
    # overlong_filter, a completion cut off at max_new_tokens (its mask all 0) is not trained on
    # either; it still counted in its group's advantages.
    samples = [
        (sample, advantage)
        for group in groups
        for sample, advantage in zip(group.samples, group_update_advantages(group, config), strict=True)
        if advantage is not None
    ]
    return update_samples(
        session_for, samples, metrics, config, step=step, start=start, learning_rate=learning_rate
    )


def grpo_train_step(
    policy: Policy,
    groups: list[TrainGroup],
    *,
    learning_rate: float | None = None,
    session: Session | None = None,
) -> dict[str, float]:
    """One GRPO step of ``policy`` from sampled groups (``num_minibatches`` × ``ppo_epochs``
    optimizer steps at ``learning_rate``, the config's when None), counted in ``policy.step``;
    returns the step's metrics (``grpo_step``). ``session``: the session the update's primitives
    go through, e.g. a run's mirrored to its data-parallel followers
    (training.hosting.in_process.InProcessRun.run_session), whose ranks then take every primitive
    with this one, as SFT's and DPO's do; the policy's own (``TrainingSession``) when None."""
    session_for = _policy_session(policy) if session is None else _devices_of(session)
    metrics = grpo_step(session_for, groups, policy.config, step=policy.step + 1, learning_rate=learning_rate)
    policy.step += 1
    return metrics


def _policy_session(policy: Policy) -> SessionFor:
    """The update runs over the policy's session, over every rank when the update is data-parallel
    (training.hosting.ranks)."""

    def session_for(metrics: dict[str, float]) -> Session:
        local = TrainingSession(policy)
        if not is_data_parallel():
            return local
        ranks = DataParallelSession(local)  # every rank runs this update on the same samples
        metrics["update_devices"] = float(ranks.world_size)
        return ranks

    return session_for


def _devices_of(session: Session) -> SessionFor:
    """The update's session is ``session``; its metrics say over how many devices it ran."""

    def session_for(metrics: dict[str, float]) -> Session:
        metrics["update_devices"] = float(getattr(session, "world_size", 1))
        return session

    return session_for


def group_update_advantages(group: TrainGroup, config: TrainConfig) -> list[float | None]:
    """Each sample's advantage in the update, None for one it leaves out (training.recipes.grpo
    .update_advantages): what grpo_step trains on and what the step records with each trajectory."""
    trainable = [not (config.overlong_filter and sample.trainable_tokens() == 0) for sample in group.samples]
    rewards = [sample.reward for sample in group.samples]
    return update_advantages(rewards, trainable, scale=config.scale_rewards)


def update_samples(
    session_for: SessionFor, samples: list[tuple[TrainSample, float]], metrics: dict[str, float],
    config: TrainConfig, *, step: int, start: float, learning_rate: float | None = None,
) -> dict[str, float]:  # fmt: skip
    """The update over ``samples``: minibatches of datums whose weights carry the loss's
    normalisation (within the minibatch), the base model's logprobs when there is a KL term, then
    for each pass (``passes``) one ``forward_backward`` with the ``grpo`` loss and one
    ``optim_step`` per minibatch. Metrics are token-weighted means over the updates (loss and
    grad_norm: plain means); ``first_update_ratio_mean`` is the first update's, where the learner
    is still the sampler."""
    rate = config.peak_learning_rate if learning_rate is None else learning_rate
    for sample, _ in samples:
        check_sample(sample)
    metrics["learning_rate"] = rate
    if not samples:
        metrics["train_seconds"] = time.perf_counter() - start
        return metrics
    session = session_for(metrics)
    minibatches = [grpo_data(chunk, config) for chunk in split_evenly(samples, config.num_minibatches)]
    if config.kl_coef > 0:
        for data in minibatches:
            for datum, values in zip(data, session.forward(data, reference=BASE_MODEL), strict=True):
                datum.loss_fn_inputs["ref_logprobs"] = values
    trained = [
        float(sum(1 for d in data for w in d.loss_fn_inputs["weights"] if w != 0)) for data in minibatches
    ]
    loss_config = {"loss_type": config.loss_type, "epsilon": config.epsilon, "epsilon_high": config.epsilon_high,
                   "importance_level": config.importance_level, "kl_coef": config.kl_coef}  # fmt: skip
    order = random.Random(config.seed * 1_000_003 + step)
    losses: list[float] = []
    norms: list[float] = []
    tokens, positions, padding = 0.0, 0.0, 0.0
    sums = {name: 0.0 for name in ("entropy", "clip_fraction", "kl", "ratio_mean", "ratio_sq_mean")}
    for epoch in range(passes(config, step)):
        indices = list(range(len(minibatches)))
        if epoch:
            order.shuffle(indices)
        for index in indices:
            result = session.forward_backward(minibatches[index], "grpo", loss_config)
            stepped = session.optim_step(learning_rate=rate, weight_decay=config.weight_decay)
            if not losses:
                metrics["first_update_ratio_mean"] = result.metrics["ratio_mean"]
            losses.append(result.loss)
            norms.append(stepped["grad_norm"])
            count = trained[index]
            tokens += count
            for name in sums:
                sums[name] += result.metrics[name] * count
            positions += result.metrics["positions"]
            padding += result.metrics["padding"]
    means = {name: value / max(tokens, 1.0) for name, value in sums.items()}
    metrics.update({name: means[name] for name in ("entropy", "clip_fraction", "kl", "ratio_mean")})
    metrics["ratio_std"] = math.sqrt(max(means["ratio_sq_mean"] - means["ratio_mean"] ** 2, 0.0))
    metrics["loss"] = sum(losses) / len(losses)
    metrics["grad_norm"] = sum(norms) / len(norms)
    metrics["optimizer_steps"] = float(len(losses))
    metrics["trainable_tokens"] = float(sum(sample.trainable_tokens() for sample, _ in samples))
    # What the forward passes computed: positions (each packed prompt once) and the share of them
    # that was padding.
    metrics["update_positions"] = positions
    metrics["padding_fraction"] = padding / max(positions, 1.0)
    metrics["train_seconds"] = time.perf_counter() - start
    return metrics


def passes(config: TrainConfig, step: int) -> int:
    """How many passes step ``step`` (counted from 1) makes over its batch."""
    if step <= config.early_ppo_epochs_steps:
        return max(config.ppo_epochs, config.early_ppo_epochs)
    return config.ppo_epochs


def check_sample(sample: TrainSample) -> None:
    if len(sample.completion_logprobs) != len(sample.completion_token_ids):
        raise ValueError("a sample needs one logprob per completion token")
    if not sample.prompt_token_ids:
        raise ValueError("a sample needs a non-empty prompt")
    if sample.completion_mask is not None:
        if len(sample.completion_mask) != len(sample.completion_token_ids):
            raise ValueError("a sample's completion_mask needs one entry per completion token")
        if any(value not in (0, 1) for value in sample.completion_mask):
            raise ValueError("a sample's completion_mask holds only 0 and 1")
