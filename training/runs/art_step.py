"""One training job on a client's scored trajectory groups (OpenPipe ART's protocol), top to bottom:
load the policy at the model's latest checkpoint, tokenize the groups on the exact ids that were
sampled (training.runs.art_groups), compute ART's group advantages, pack the trajectories into
sequences by ART's rule and take one optimizer step per sequence with ART's loss
(training.recipes.art, training.recipes.art_loss), save checkpoint N+1. A job is one *model* step (one
checkpoint) made of ``num_sequences`` *optimizer* steps, as on ART's own backends.

No Django: the caller (projects.jobs.training_jobs) records the checkpoint, the step's metrics and
trajectories, and only then tells the client the step is over. The checkpoint files are complete
(atomic rename, training.session.policy) before this function returns.

Advantages as ART computes them: reward minus the group's mean, divided by the group's population
std (+1e-6) unless ``scale_rewards`` is off; a trajectory whose advantage is zero (a zero-variance
group, or one exactly at its group's mean) is dropped, and so is one with no choice to train on
(no logprobs; counted: ``num_trajectories_without_logprobs``). The step advances even when nothing is
left to train on (``num_groups_trainable`` 0): the checkpoint is saved unchanged, as ART does.
"""

from __future__ import annotations

import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from training.config import ConfigError, LoraSpec, TrainConfig
from training.cost import device_usage
from training.recipes.art import BASE_MODEL, Sequenced, art_update
from training.recipes.art_config import ArtOptions
from training.recipes.art_loss import art_shaped_advantages, art_token_weights
from training.recipes.grpo import compute_advantages
from training.runs.art_groups import ClientGroup, ClientTrajectory
from training.runs.art_tokens import TokenizedTrajectory, TrajectoryTokenizer
from training.runs.steps import checkpoint_path
from training.session.contract import Session
from training.session.local import TrainingSession
from training.session.packing import plan_sequences
from training.session.policy import Policy, load_policy_model

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
    options: ArtOptions = field(default_factory=ArtOptions)
    reference_dir: Path | None = None  # the KL reference checkpoint's folder (options.reference_step > 0)
    # A session at exactly checkpoint from_step, kept by the caller (a worker's SessionPool or the
    # host's trainer service), with its tokenizer and context length; None: loaded here from disk.
    session: Session | None = None
    tokenizer: Any = None
    model_max: int | None = None
    load_seconds: float = 0.0  # what getting ``session`` cost the caller
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
    events: list[dict[str, float]]  # one per optimizer step: the client's gradient_step events (ART's names)
    trajectories: list[ScoredTrajectory]
    session: Session | None = None  # the session, now at checkpoint ``step``: the caller may keep it


class ClientStepHooks(Protocol):
    def started(self, *, num_sequences: int) -> None:
        """The groups tokenized and packed: ``num_sequences`` optimizer steps begin (the client's
        ``training_started``)."""


def art_advantages(rewards: list[list[float]], *, scale: bool) -> list[list[float]]:
    """Each group's advantages, as ART computes them (see the module doc); exact zeros for a
    zero-variance group."""
    advantages, _ = compute_advantages(rewards, scale=scale)
    return [[0.0 if abs(a) <= ZERO_ADVANTAGE else a for a in group] for group in advantages]


def load_session(spec: ClientStepSpec) -> tuple[TrainingSession, Any, int | None]:
    """A session of its own at checkpoint ``from_step``, loaded from disk: the session, its
    tokenizer and the model's context length."""
    base_model, tokenizer, _ = load_policy_model(spec.base_model_source, spec.model_cache_dir, device=spec.device,
                                                 unsloth=spec.unsloth, fsdp=spec.config.fsdp)  # fmt: skip
    if spec.resume_from is None:
        policy = Policy(base_model, tokenizer, spec.config, spec.lora, device=spec.device)
        policy.step = spec.from_step
    else:
        policy = Policy.resume(
            base_model, tokenizer, spec.resume_from, spec.config, spec.lora, device=spec.device
        )
    return TrainingSession(policy), tokenizer, context_length(base_model)


def context_length(model: Any) -> int | None:
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)


def train_client_step(spec: ClientStepSpec, hooks: ClientStepHooks) -> ClientStepResult:
    started = time.monotonic()
    session, tokenizer, model_max = spec.session, spec.tokenizer, spec.model_max
    if session is None:
        session, tokenizer, model_max = load_session(spec)
    load_seconds = spec.load_seconds + time.monotonic() - started

    started = time.monotonic()
    options = spec.options
    tokenize = TrajectoryTokenizer(
        tokenizer,
        accepts_model=spec.accepts_model,
        max_length=model_max,
        allow_without_logprobs=options.allow_training_without_logprobs,
    )
    rewards = [[t.reward for t in group.trajectories] for group in spec.groups]
    advantages = art_advantages(rewards, scale=spec.config.scale_rewards)
    scored: list[ScoredTrajectory] = []
    for group_index, (group, group_advantages) in enumerate(zip(spec.groups, advantages, strict=True)):
        for trajectory, advantage in zip(group.trajectories, group_advantages, strict=True):
            # Every trajectory is tokenized, trained on or not: a bad one fails the job either way.
            scored.append(ScoredTrajectory(group_index, trajectory, tokenize.tokenize(trajectory), advantage))
    job, counts = _sequenced(scored, options, model_max)
    rows = plan_sequences(job.samples, counts.sequence_length, groups=job.group) if job.samples else []
    hooks.started(num_sequences=len(rows))
    reference_step = options.reference_step(spec.from_step)
    reference: Path | str | None = None
    if reference_step is not None:
        reference = BASE_MODEL if reference_step == 0 else spec.reference_dir
        if reference is None:
            raise ConfigError(
                "kl_penalty_reference_step", f"the model has no checkpoint at step {reference_step}"
            )
    update, sequence_metrics = art_update(
        session, job, rows, options, learning_rate=spec.config.peak_learning_rate,
        reward_std=_mean_group_std(rewards), reference=reference,
    )  # fmt: skip
    update_seconds = time.monotonic() - started

    started = time.monotonic()
    step = spec.from_step + 1
    path = checkpoint_path(spec.checkpoint_root, step)
    if path.exists():  # left by a worker that died before recording it
        shutil.rmtree(path)
    metrics = _step_metrics(spec, scored, rewards, advantages, update)
    metrics.update(counts.metrics())
    session.save_state(path, step=step, metrics=metrics)
    metrics.update(load_seconds=load_seconds, update_seconds=update_seconds,
                   save_seconds=time.monotonic() - started)  # fmt: skip
    # The job's whole wall clock on this worker (load, update, save) is what the step cost.
    worker_seconds = load_seconds + update_seconds + metrics["save_seconds"]
    metrics.update(device_usage(spec.device, worker_seconds))
    events = [art_metrics(sequence) for sequence in sequence_metrics]
    if events:  # the job's own figures ride on its last gradient_step, as ART's last one carries them
        events[-1] = {**art_metrics(metrics), **events[-1]}
    else:
        events = [art_metrics(metrics)]
    return ClientStepResult(step, path, metrics, events, scored, session)


@dataclass
class _Counts:
    sequence_length: int = 0
    without_logprobs: int = 0
    too_long: int = 0

    def metrics(self) -> dict[str, float]:
        return {
            "packed_sequence_length": float(self.sequence_length),
            "num_trajectories_without_logprobs": float(self.without_logprobs),
            "num_trajectories_too_long": float(self.too_long),
        }


def _sequenced(
    scored: list[ScoredTrajectory], options: ArtOptions, model_max: int | None
) -> tuple[Sequenced, _Counts]:
    """The job's trainable samples with ART's weights and shaped advantages (training.recipes.art_loss):
    trajectories with a non-zero advantage and something to train on, none longer than the
    packed sequence (ART drops those, as here, and says how many)."""
    counts = _Counts()
    kept: list[ScoredTrajectory] = []
    for item in scored:
        if not item.tokenized.samples:
            counts.without_logprobs += 1
        elif item.advantage != 0.0:
            kept.append(item)
    longest = max((len(s.prompt_token_ids) + len(s.completion_token_ids)
                   for item in kept for s in item.tokenized.samples), default=1)  # fmt: skip
    counts.sequence_length = options.sequence_length(longest, model_max)
    fitting = []
    for item in kept:
        if any(len(s.prompt_token_ids) + len(s.completion_token_ids) > counts.sequence_length
               for s in item.tokenized.samples):  # fmt: skip
            counts.too_long += 1
        else:
            fitting.append(item)
    lengths = [item.tokenized.trainable_tokens for item in fitting]
    weights = art_token_weights(lengths)
    shaped = art_shaped_advantages(
        [item.advantage for item in fitting], lengths, weights, balance=options.advantage_balance
    )
    job = Sequenced(samples=[], advantages=[], weights=[], trajectory=[], group=[])
    for index, (item, weight, advantage) in enumerate(zip(fitting, weights, shaped, strict=True)):
        for sample in item.tokenized.samples:
            job.samples.append(sample)
            job.advantages.append(advantage)
            job.weights.append(weight)
            job.trajectory.append(index)
            job.group.append(item.group_index)
    return job, counts


def _mean_group_std(rewards: list[list[float]]) -> float:
    stds = [statistics.pstdev(group) for group in rewards if len(group) > 1]
    return statistics.fmean(stds) if stds else 0.0


def off_policy_steps(scored: ScoredTrajectory, from_step: int) -> int | None:
    """Updates between the checkpoint that sampled the trajectory and ``from_step`` (the one this
    step updates); None when no choice names its checkpoint."""
    sampled = scored.tokenized.policy_step
    return None if sampled is None else max(0, from_step - sampled)


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
    # How far behind the updated checkpoint (from_step) each trajectory's sampler was: ART's
    # PipelineTrainer samples on while earlier steps train (its max_steps_off_policy).
    behind = [off_policy_steps(s, spec.from_step) for s in scored]
    known = [b for b in behind if b is not None]
    staleness = (
        {"off_policy_steps": statistics.fmean(known), "off_policy_steps_max": float(max(known))}
        if known
        else {}
    )
    return {
        **staleness,
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
        "learning_rate": spec.config.peak_learning_rate,
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
    "kl_policy_ref": "kl_policy_ref",
    "clip_fraction": "loss/clipped_token_fraction",
    "ratio_mean": "loss/importance_ratio_mean",
    "exact_token_fraction": "exact_token_fraction",
    "num_trajectories_without_logprobs": "data/step_num_trajectories_without_logprobs",
    "num_trajectories_too_long": "data/step_num_trajectories_too_long",
    "gradient_steps": "data/step_num_gradient_steps",
    "packed_sequence_length": "data/packed_sequence_length",
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
