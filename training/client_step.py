"""One training step on a client's scored trajectory groups (OpenPipe ART's protocol), top to bottom:
load the policy at the model's latest checkpoint, tokenize the groups on the exact ids that were
sampled (training.client_groups), compute ART's group advantages, one update, save checkpoint N+1.

No Django: the caller (projects.jobs.training_jobs) records the checkpoint, the step's metrics and
trajectories, and only then tells the client the step is over. The checkpoint files are complete
(atomic rename, training.trainer) before this function returns.

Advantages as ART computes them: reward minus the group's mean, divided by the group's population
std (+1e-6) unless ``scale_rewards`` is off; a trajectory whose advantage is zero (a zero-variance
group, or one exactly at its group's mean) is dropped. The step advances even when nothing is
left to train on (``num_groups_trainable`` 0): the checkpoint is saved unchanged, as ART does.
"""

from __future__ import annotations

import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from training.client_groups import ClientGroup, ClientTrajectory, TokenizedTrajectory, TrajectoryTokenizer
from training.config import LoraSpec, TrainConfig
from training.cost import device_usage
from training.grpo import compute_advantages
from training.loop import checkpoint_path, load_policy_model
from training.trajectory import TrainSample

# An advantage this close to zero is zero: the trajectory carries no signal (ART drops it).
ZERO_ADVANTAGE = 1e-9


@dataclass
class ClientStepSpec:
    base_model_source: str
    model_cache_dir: Path
    checkpoint_root: Path  # one folder per step: <root>/step-000003
    config: TrainConfig
    lora: LoraSpec
    groups: list[ClientGroup]
    from_step: int  # the model's latest checkpoint; this step saves from_step + 1
    resume_from: Path | None  # its directory; None: the untrained adapter (step 0 has no files)
    accepts_model: Callable[[str], bool] | None = None  # see TrajectoryTokenizer
    device: str = "cpu"
    unsloth: str = "auto"


@dataclass
class ScoredTrajectory:
    group_index: int
    trajectory: ClientTrajectory
    tokenized: TokenizedTrajectory
    advantage: float


@dataclass
class ClientStepResult:
    step: int
    path: Path
    metrics: dict[str, float]  # artweb's names (StepMetrics: the dashboard's charts)
    art_metrics: dict[str, float]  # ART's canonical names (the client's gradient_step event)
    trajectories: list[ScoredTrajectory]


class ClientStepHooks(Protocol):
    def started(self, *, num_sequences: int) -> None:
        """The groups tokenized: the update begins (the client's ``training_started``)."""


# ART's experimental_config keys (art/serverless/client.py ExperimentalTrainingConfig). Each is
# mapped onto TrainConfig or refused: a value artweb cannot honour is never silently ignored.
EXPERIMENTAL_KEYS = (
    "advantage_balance", "epsilon", "epsilon_high", "importance_sampling_level", "kimi_k2_tau",
    "learning_rate", "mask_prob_ratio", "max_negative_advantage_importance_sampling_weight", "ppo",
    "precalculate_logprobs", "scale_rewards",
)  # fmt: skip
# Off in ART by default; artweb's objective has no such term, so only the "off" value is accepted.
_ONLY_OFF: dict[str, tuple[Any, str]] = {
    "advantage_balance": (0.0, "0.0 (balanced)"),
    "kimi_k2_tau": (None, "null"),
    "mask_prob_ratio": (False, "false"),
    "max_negative_advantage_importance_sampling_weight": (None, "null"),
    "precalculate_logprobs": (False, "false (the sampler's logprobs are used)"),
}


def art_train_config(experimental: dict[str, Any] | None) -> TrainConfig:
    """The TrainConfig of one client step for ART's ``experimental_config``.

    None means "ART's default". ``ppo`` picks the objective with ART's clip defaults: PPO's
    clipped surrogate (epsilon 0.2) or, ART's default, CISPO (clipped IS weight, epsilon 1.0,
    epsilon_high 4.0). Raises training.config.ConfigError naming the key it cannot honour.
    """
    from training.config import ConfigError

    experimental = experimental or {}
    if not isinstance(experimental, dict):
        raise ConfigError("experimental_config", "must be an object or null")
    for key in experimental:
        if key not in EXPERIMENTAL_KEYS:
            raise ConfigError(str(key), "unknown experimental_config key")
    for key, (off, shown) in _ONLY_OFF.items():
        value = experimental.get(key)
        if value is not None and value != off:
            raise ConfigError(key, f"artweb cannot honour {value!r}: only {shown} is supported")
    ppo = experimental.get("ppo")
    if ppo is not None and not isinstance(ppo, bool):
        raise ConfigError("ppo", "expected a boolean")
    level = experimental.get("importance_sampling_level")
    if level not in (None, "token", "sequence"):
        raise ConfigError(
            "importance_sampling_level", f"artweb cannot honour {level!r}: token and sequence are supported"
        )
    values: dict[str, Any] = {
        "steps": 1,
        "loss_type": "ppo" if ppo else "cispo",
        "epsilon": 0.2 if ppo else 1.0,
        "epsilon_high": None if ppo else 4.0,
        "normalization": "sequence",
    }
    renamed = {"importance_sampling_level": "importance_level"}
    for key in ("learning_rate", "epsilon", "epsilon_high", "scale_rewards", "importance_sampling_level"):
        if experimental.get(key) is not None:
            values[renamed.get(key, key)] = experimental[key]
    return TrainConfig(**values)


def art_advantages(rewards: list[list[float]], *, scale: bool) -> list[list[float]]:
    """Each group's advantages, as ART computes them (see the module doc); exact zeros for a
    zero-variance group."""
    advantages, _ = compute_advantages(rewards, scale=scale)
    return [[0.0 if abs(a) <= ZERO_ADVANTAGE else a for a in group] for group in advantages]


def train_client_step(spec: ClientStepSpec, hooks: ClientStepHooks) -> ClientStepResult:
    from training.trainer import Trainer

    started = time.monotonic()
    base_model, tokenizer, _ = load_policy_model(
        spec.base_model_source, spec.model_cache_dir, device=spec.device, unsloth=spec.unsloth
    )
    if spec.resume_from is None:
        trainer = Trainer(base_model, tokenizer, spec.config, spec.lora, device=spec.device)
        trainer.step = spec.from_step
    else:
        trainer = Trainer.resume(
            base_model, tokenizer, spec.resume_from, spec.config, spec.lora, device=spec.device
        )
    load_seconds = time.monotonic() - started

    started = time.monotonic()
    max_length = getattr(getattr(base_model, "config", None), "max_position_embeddings", None)
    tokenize = TrajectoryTokenizer(tokenizer, accepts_model=spec.accepts_model, max_length=max_length)
    rewards = [[t.reward for t in group.trajectories] for group in spec.groups]
    advantages = art_advantages(rewards, scale=spec.config.scale_rewards)
    scored: list[ScoredTrajectory] = []
    samples: list[tuple[TrainSample, float]] = []
    for group_index, (group, group_advantages) in enumerate(zip(spec.groups, advantages, strict=True)):
        for trajectory, advantage in zip(group.trajectories, group_advantages, strict=True):
            # Every trajectory is tokenized, trained on or not: a bad one fails the job either way.
            tokenized = tokenize.tokenize(trajectory)
            scored.append(ScoredTrajectory(group_index, trajectory, tokenized, advantage))
            if advantage != 0.0:
                samples.extend((sample, advantage) for sample in tokenized.samples)
    hooks.started(num_sequences=1)  # one update: the client counts gradient steps by it
    update = trainer.train_samples(samples)
    update_seconds = time.monotonic() - started

    started = time.monotonic()
    step = spec.from_step + 1
    path = checkpoint_path(spec.checkpoint_root, step)
    if path.exists():  # left by a worker that died before recording it
        shutil.rmtree(path)
    metrics = _step_metrics(spec, scored, rewards, advantages, update)
    trainer.save_checkpoint(path, step=step, metrics=metrics)
    metrics.update(load_seconds=load_seconds, update_seconds=update_seconds,
                   save_seconds=time.monotonic() - started)  # fmt: skip
    # The job's whole wall clock on this worker (load, update, save) is what the step cost.
    worker_seconds = load_seconds + update_seconds + metrics["save_seconds"]
    metrics.update(device_usage(spec.device, worker_seconds))
    return ClientStepResult(step, path, metrics, art_metrics(metrics), scored)


def _step_metrics(
    spec: ClientStepSpec,
    scored: list[ScoredTrajectory],
    rewards: list[list[float]],
    advantages: list[list[float]],
    update: dict[str, float],
) -> dict[str, float]:
    all_rewards = [reward for group in rewards for reward in group]
    group_stds = [statistics.pstdev(group) for group in rewards if len(group) > 1]
    trainable_groups = sum(1 for group in advantages if any(a != 0.0 for a in group))
    submitted = len(spec.groups)
    exact = sum(1 for s in scored if s.tokenized.token_source == "gateway")
    return {
        **update,
        "reward_mean": statistics.fmean(all_rewards) if all_rewards else 0.0,
        "reward_std": statistics.pstdev(all_rewards) if all_rewards else 0.0,
        "reward_group_std_mean": statistics.fmean(group_stds) if group_stds else 0.0,
        "zero_variance_fraction": (submitted - trainable_groups) / max(submitted, 1),
        "num_groups_submitted": float(submitted),
        "num_groups_trainable": float(trainable_groups),
        "num_trajectories": float(len(scored)),
        "num_exceptions": float(sum(group.exceptions for group in spec.groups)),
        "completion_tokens": float(sum(s.tokenized.trainable_tokens for s in scored)),
        "exact_token_fraction": exact / max(len(scored), 1),
        "learning_rate": spec.config.learning_rate,
    }


# artweb's metric → ART's canonical name (art/serverless/backend.py canonicalises these further).
ART_NAMES = {
    "reward_mean": "reward",
    "reward_group_std_mean": "reward_std_dev",
    "loss": "loss",
    "entropy": "entropy",
    "kl": "kl_div",
    "grad_norm": "grad_norm",
    "learning_rate": "learning_rate",
    "num_groups_submitted": "num_groups_submitted",
    "num_groups_trainable": "num_groups_trainable",
    "num_trajectories": "num_trajectories",
    "trainable_tokens": "num_trainable_tokens",
    "clip_fraction": "clip_fraction",
    "exact_token_fraction": "exact_token_fraction",
}
# Names with a "/" pass through the client unchanged.
ART_TIMES = {
    "queue_seconds": "time/step_queue_wait_s",
    "load_seconds": "time/step_load_s",
    "update_seconds": "time/step_update_s",
    "save_seconds": "time/step_save_s",
}


def art_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The gradient_step event's data: ART's names, numbers only."""
    names = {**ART_NAMES, **ART_TIMES}
    return {names[key]: float(value) for key, value in metrics.items() if key in names}
