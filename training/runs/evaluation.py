"""Evaluation: roll a policy out on task rows, grade every episode, aggregate, compare to a reference.

No Django here. A *policy* is anything that turns rows into episodes (`Policy.rollout`): our own
engine with or without a LoRA adapter (`LocalPolicy`), or a model behind any OpenAI-compatible
endpoint (`training.rollouts.remote.RemotePolicy`). Episodes are `training.rollouts.trajectory.Trajectory` objects, so
the run's graders see exactly what they see during training (output_text, output_tools, messages).

The aggregation functions (`aggregate`, `compare`) are pure and unit-tested on hand-computed values.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from training.cost import device_usage, sampled_tokens
from training.environments import Environment
from training.rewards import grade_trajectories
from training.rollouts.agent import OnProgress, rollout_groups
from training.rollouts.trajectory import Trajectory
from training.runs.progress import progress_events

logger = logging.getLogger(__name__)

SUBJECT = "subject"
REFERENCE = "reference"
# Two mean rewards this close are a tie (float noise from averaging must not decide a win).
TIE_TOLERANCE = 1e-9


class Policy(Protocol):
    """Turns task rows into graded-to-be episodes: `samples_per_row` trajectories per row, in row
    order. A sample whose rollout failed carries `metrics["policy_error"]` (a message) instead of
    raising: one bad sample must not lose the others."""

    name: str

    def rollout(
        self, rows: list[dict[str, Any]], env: Environment, samples_per_row: int
    ) -> list[list[Trajectory]]: ...


@dataclass
class EvalSample:
    """One graded episode, as stored (``projects.models.EvaluationSample``)."""

    side: str  # "subject" or "reference"
    task_row_index: int
    sample_index: int
    messages: list[dict[str, Any]]
    reward: float
    sub_rewards: dict[str, float] = field(default_factory=dict)
    errors: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class EvalResult:
    """What `evaluate` returns: the aggregates and every sample."""

    results: dict[str, Any]
    samples: list[EvalSample]


# --- aggregation (pure) ----------------------------------------------------------------------


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def aggregate(samples: Iterable[EvalSample], *, pass_threshold: float) -> dict[str, Any]:
    """The numbers of one side of an evaluation.

    - ``reward_mean``: mean reward over all samples (a sample whose rollout failed counts as 0:
      a model that does not answer must not look better for it);
    - ``pass_rate``: fraction of samples with reward >= ``pass_threshold``;
    - ``grader_means``: per sub-grader name, the mean of that sub-reward over the samples that have it;
    - ``turns_mean``: mean model turns per episode;
    - ``tool_error_rate``: failed tool calls / tool calls, where a failure is an error result or a
      timeout (``tool_errors + tool_timeouts``); None when no tool was called;
    - ``grader_error_rate``: fraction of samples a grader reported an error on;
    - ``n``: samples, ``rows``: distinct task rows, ``policy_errors``: samples whose rollout failed.
    """
    samples = list(samples)
    n = len(samples)
    rewards = [s.reward for s in samples]
    by_grader: dict[str, list[float]] = {}
    for sample in samples:
        for name, value in sample.sub_rewards.items():
            by_grader.setdefault(name, []).append(float(value))
    tool_calls = sum(int(s.metrics.get("tool_calls", 0)) for s in samples)
    tool_failures = sum(
        int(s.metrics.get("tool_errors", 0)) + int(s.metrics.get("tool_timeouts", 0)) for s in samples
    )
    # A failed rollout carries a policy_error, not a grader error: counted apart.
    grader_failed = sum(bool(s.errors) and not s.metrics.get("policy_error") for s in samples)
    mean = _mean(rewards)
    variance = _mean([(r - mean) ** 2 for r in rewards]) if mean is not None else None
    return {
        "n": n,
        "rows": len({s.task_row_index for s in samples}),
        "reward_mean": mean,
        "reward_std": math.sqrt(variance) if variance is not None else None,
        "pass_threshold": pass_threshold,
        "pass_rate": sum(r >= pass_threshold for r in rewards) / n if n else None,
        "grader_means": {name: sum(values) / len(values) for name, values in sorted(by_grader.items())},
        "turns_mean": _mean([float(s.metrics.get("turns", 0)) for s in samples]),
        "tool_calls": tool_calls,
        "tool_errors": tool_failures,
        "tool_error_rate": tool_failures / tool_calls if tool_calls else None,
        "grader_error_rate": grader_failed / n if n else None,
        "policy_errors": sum(bool(s.metrics.get("policy_error")) for s in samples),
    }


def compare(subject: Iterable[EvalSample], reference: Iterable[EvalSample]) -> dict[str, Any]:
    """Subject against reference on the same rows, by reward.

    Per task row, the subject's mean reward over its samples is compared with the reference's: a
    higher mean is a win (1), an equal one (within ``TIE_TOLERANCE``) a tie that counts half (0.5),
    a lower one a loss (0). ``win_rate`` is the mean of those over the rows both sides have, so 0.5
    means "no better, no worse". ``reward_delta`` is subject minus reference mean over those rows.
    """
    subject_rows = _row_means(subject)
    reference_rows = _row_means(reference)
    common = sorted(subject_rows.keys() & reference_rows.keys())
    wins = ties = losses = 0
    for row in common:
        difference = subject_rows[row] - reference_rows[row]
        if abs(difference) <= TIE_TOLERANCE:
            ties += 1
        elif difference > 0:
            wins += 1
        else:
            losses += 1
    rows = len(common)
    return {
        "rows": rows,
        "wins": wins,
        "ties": ties,
        "losses": losses,
        "win_rate": (wins + 0.5 * ties) / rows if rows else None,
        "reward_delta": (
            sum(subject_rows[r] for r in common) / rows - sum(reference_rows[r] for r in common) / rows
            if rows
            else None
        ),
    }


def _row_means(samples: Iterable[EvalSample]) -> dict[int, float]:
    by_row: dict[int, list[float]] = {}
    for sample in samples:
        by_row.setdefault(sample.task_row_index, []).append(sample.reward)
    return {row: sum(values) / len(values) for row, values in by_row.items()}


# --- running an evaluation --------------------------------------------------------------------


def grade_episodes(
    groups: list[list[Trajectory]],
    rows: list[dict[str, Any]],
    grader_spec: dict[str, Any],
    *,
    side: str,
    judge: Any = None,
    sandbox: Any = None,
    outbound: Any = None,
) -> list[EvalSample]:
    """Grade every episode with the run's grader (errors are data: nothing here raises for a bad
    sample) and flatten to EvalSamples. A failed rollout gets reward 0 and its error, ungraded."""
    grade_trajectories(
        grader_spec, groups, rows, max_error_fraction=1.0, judge=judge, sandbox=sandbox, outbound=outbound
    )
    return episode_samples(groups, rows, side=side)


def episode_samples(
    groups: list[list[Trajectory]], rows: list[dict[str, Any]], *, side: str
) -> list[EvalSample]:
    """Graded episodes as EvalSamples (see ``grade_episodes``)."""
    samples = []
    for group, row in zip(groups, rows, strict=True):
        for sample_index, trajectory in enumerate(group):
            metrics = {**trajectory.metrics, "finish_reason": trajectory.finish_reason}
            if trajectory.outcome:  # a game's result, for the sample viewer
                metrics["outcome"] = trajectory.outcome
            reward, sub_rewards, errors = trajectory.reward, trajectory.sub_rewards, trajectory.errors
            if metrics.get("policy_error"):
                reward, sub_rewards = 0.0, {}
                errors = [{"code": "policy_error", "detail": str(metrics["policy_error"]), "grader": ""}]
            samples.append(
                EvalSample(
                    side=side,
                    task_row_index=int(row["index"]),
                    sample_index=sample_index,
                    messages=trajectory.messages,
                    reward=float(reward),
                    sub_rewards=dict(sub_rewards),
                    errors=list(errors),
                    metrics=metrics,
                )
            )
    return samples


def evaluate(
    policy: Policy,
    rows: list[dict[str, Any]],
    env: Environment,
    grader_spec: dict[str, Any],
    *,
    samples_per_row: int = 1,
    pass_threshold: float = 1.0,
    side: str = SUBJECT,
    judge: Any = None,
    sandbox: Any = None,
    outbound: Any = None,  # training.safety.outbound.OutboundPolicy for endpoint graders
) -> EvalResult:
    """Roll ``policy`` out on ``rows`` (each ``{"index": int, "data": task row}``), grade, aggregate."""
    if not rows:
        raise ValueError("an evaluation needs at least one task row")
    started = time.monotonic()
    groups = policy.rollout(rows, env, samples_per_row)
    rollout_seconds = time.monotonic() - started
    grading = grade_trajectories(
        grader_spec, groups, rows, max_error_fraction=1.0, judge=judge, sandbox=sandbox, outbound=outbound
    )
    samples = episode_samples(groups, rows, side=side)
    results = aggregate(samples, pass_threshold=pass_threshold)
    results["model"] = policy.name
    results["rollout_seconds"] = rollout_seconds
    results["seconds"] = time.monotonic() - started
    # What it used (training.cost): tokens sampled, judge tokens, and this worker's device time
    # (none for a policy behind someone else's endpoint: a RemotePolicy has no ``device``).
    results["completion_tokens"] = sum(sampled_tokens(t) for group in groups for t in group)
    results["judge_prompt_tokens"] = int(grading["judge_prompt_tokens"])
    results["judge_completion_tokens"] = int(grading["judge_completion_tokens"])
    device = getattr(policy, "device", None)
    if device is not None:
        results.update(device_usage(device, results["seconds"]))
    return EvalResult(results=results, samples=samples)


def with_reference(subject: EvalResult, reference: EvalResult) -> EvalResult:
    """The subject's result with the reference's aggregates and the comparison added."""
    results = {
        **subject.results,
        "reference": reference.results,
        "comparison": compare(subject.samples, reference.samples),
    }
    return EvalResult(results=results, samples=subject.samples + reference.samples)


# --- policies on our own engines ----------------------------------------------------------------


@dataclass
class LocalPolicy:
    """Our engine (TransformersEngine or vLLM), optionally with a LoRA adapter loaded on it."""

    engine: Any
    sampling: Any  # training.engines.base.SamplingParams
    adapter: str | None = None
    name: str = "local"
    device: str = "cpu"  # where its engine runs (training.cost counts its device-seconds)
    on_progress: OnProgress | None = None  # hears how far the rollouts are (training.runs.progress)

    def rollout(
        self, rows: list[dict[str, Any]], env: Environment, samples_per_row: int
    ) -> list[list[Trajectory]]:
        data = [row["data"] for row in rows]
        return rollout_groups(
            self.engine,
            data,
            env,
            self.sampling,
            samples_per_row,
            adapter=self.adapter,
            on_progress=self.on_progress,
        )


def load_local_policy(
    *,
    base_model_source: str,
    model_cache_dir: Path,
    adapter_path: str | Path | None,
    sampling: Any,
    name: str,
    device: str = "cpu",
) -> LocalPolicy:
    """A base model on a TransformersEngine, with the checkpoint's adapter when given. (Standalone
    evaluations use transformers even on GPU: one model, a few rows; vLLM's start-up would dominate.)"""
    from training.base_models import load_base_model, resolve_dtype
    from training.engines.transformers_engine import TransformersEngine

    model, tokenizer = load_base_model(
        base_model_source, model_cache_dir, dtype=resolve_dtype("auto", device), device=device
    )
    model.to(device)  # type: ignore[arg-type]  # transformers types `to` oddly
    engine = TransformersEngine(model, tokenizer, device=device)
    adapter = None
    if adapter_path is not None:
        engine.load_adapter("evaluated", Path(adapter_path))
        adapter = "evaluated"
    return LocalPolicy(engine=engine, sampling=sampling, adapter=adapter, name=name, device=device)


# --- in-run evaluation ----------------------------------------------------------------------------


def is_evaluation_step(step: int, *, start_step: int, final_step: int, interval: int) -> bool:
    """Evaluate at the run's first checkpoint, every ``interval`` steps after it (0 = never in
    between) and at its last step."""
    if step in (start_step, final_step):
        return True
    return interval > 0 and (step - start_step) % interval == 0


def validation_rows(rows: list[dict[str, Any]], max_rows: int) -> list[dict[str, Any]]:
    """The first ``max_rows`` validation rows by index: the same rows at every step, so the curve
    compares checkpoints, not row samples."""
    return sorted(rows, key=lambda row: row["index"])[:max_rows]


def evaluate_during_run(spec: Any, engine: Any, adapter: str | None, step: int, hooks: Any) -> None:
    """Evaluate the run's current policy on its validation rows and hand the result to
    ``hooks.record_evaluation``. Called by ``training.runs.loop.run_training``; ``spec`` is its RunSpec.

    Evaluation is a measurement, not training: it samples with its own seed (the training RNG
    streams are untouched, so a resumed run still replays its steps exactly) and a failure here is
    an event, never a failed run.
    """
    from training.engines.base import SamplingParams

    config = spec.config
    rows = validation_rows(getattr(spec, "validation_rows", []) or [], config.eval_max_rows)
    if not rows:
        if step == spec.start_step:
            hooks.event(
                "No validation rows in the task set: the run is not evaluated (a fine-tuning job: "
                "give a validation_file; a run: rows split 'validation', or a validation_fraction "
                "when uploading its task set)",
                level="warn",
            )
        return
    hooks.event(
        f"Evaluating step {step} on {len(rows)} validation rows",
        data={"phase": "evaluating", "step": step, "rows": len(rows)},
    )
    sampling = SamplingParams(
        temperature=config.eval_temperature,
        top_p=1.0,
        max_new_tokens=config.max_new_tokens,
        stop=spec.stop,
        seed=config.seed * 100_003 + 99_991,  # one seed for every step: checkpoints see the same draws
    )
    try:
        result = evaluate(
            LocalPolicy(
                engine=engine,
                sampling=sampling,
                adapter=adapter,
                name=f"step {step}",
                device=spec.device,
                on_progress=progress_events(hooks, "evaluating", f"Evaluating step {step}", step=step),
            ),
            rows,
            spec.environment,
            spec.grader_spec,
            samples_per_row=config.eval_samples_per_row,
            pass_threshold=config.eval_pass_threshold,
            judge=spec.judge,
            sandbox=spec.sandbox,
            outbound=spec.outbound,
        )
    except Exception as exc:  # a measurement failing must not fail the training run
        logger.exception("evaluation at step %d failed", step)
        hooks.event(f"Evaluation at step {step} failed: {type(exc).__name__}: {exc}", level="warn")
        return
    hooks.record_evaluation(step=step, results=result.results, samples=result.samples)
