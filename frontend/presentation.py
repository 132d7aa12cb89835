"""Presentation helpers for templates: transcripts for the trajectory viewer, chart series,
and which environment kinds this installation can run. No domain rules live here.

Why one module of this length: the dashboard's view models (transcripts, chart series, group
summaries) are pure functions over what the selectors return, each short and tested alone.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from django.core.paginator import Paginator
from django.http import HttpRequest

from projects import catalog
from projects.models import EnvironmentKind, EvaluationStatus

# The per-step series the run page charts (key, caption), read from StepMetrics.metrics
# (training/runs/loop.py and training/recipes/grpo_update.py write these keys), except completion length, the mean
# over the step's trajectories.
CHART_SERIES = [
    ("loss", "Loss"),
    ("grad_norm", "Grad norm (before clipping)"),
    ("completion_tokens", "Completion length (mean tokens)"),
    ("entropy", "Entropy"),
    ("kl", "KL to the base model"),
    ("clip_fraction", "Clip fraction"),
    ("ratio_std", "Importance ratio spread (std)"),
    ("learning_rate", "Learning rate"),
    ("zero_variance_fraction", "Zero-variance groups"),
    ("groups_dropped", "Groups dropped (dynamic sampling)"),
    ("off_policy_steps", "Sample staleness (updates behind)"),
    ("heldout_loss", "Held-out loss (SFT / DPO)"),
    ("heldout_preference_accuracy", "Held-out preference accuracy (DPO)"),
    ("tokens_per_second", "Tokens / s (rollouts)"),
]

# The series each kind of run measures (projects.models.RunKind): a GRPO run no held-out loss, an
# SFT or DPO run no rollouts, a Tinker client only what its optim_steps report.
_GRPO_ONLY = {"completion_tokens", "entropy", "kl", "clip_fraction", "ratio_std", "zero_variance_fraction",
              "groups_dropped", "off_policy_steps", "tokens_per_second"}  # fmt: skip
_SUPERVISED = {"heldout_loss", "heldout_preference_accuracy"}
_KIND_SERIES = {
    "platform": {key for key, _ in CHART_SERIES} - _SUPERVISED,
    "sft": {key for key, _ in CHART_SERIES} - _GRPO_ONLY - {"heldout_preference_accuracy"},
    "dpo": {key for key, _ in CHART_SERIES} - _GRPO_ONLY,
    # An ART client's steps: its own rollouts (no dynamic sampling, no rollout speed here), ART's loss.
    "client": {key for key, _ in CHART_SERIES}
    - _SUPERVISED
    - {"groups_dropped", "tokens_per_second", "ratio_std"},
    "tinker": {"loss", "grad_norm", "learning_rate"},
}
# Whether a kind's steps have rewards (the reward and sub-reward charts) and whether the run
# evaluates its validation rows itself (a client run never does: its client evaluates, if at all).
KIND_HAS_REWARDS = {"platform", "client"}
KIND_EVALUATES = {"platform", "sft", "dpo"}


def chart_series(kind: str) -> list[tuple[str, str]]:
    """The (key, label) series a run of ``kind`` draws."""
    keys = _KIND_SERIES.get(kind, _KIND_SERIES["platform"])
    return [(key, label) for key, label in CHART_SERIES if key in keys]


# The trainer writes these as 0 on a step without an update (every group had one reward, so
# trainable_tokens is 0; training/recipes/grpo_update.py): there they were not measured and are not drawn.
UPDATE_METRICS = {"loss", "grad_norm", "entropy", "clip_fraction", "kl", "ratio_std"}

CLIP_FRACTION_NOTE = (
    "One policy update per batch: the ratio to the sampler's policy is 1 up to numerical noise, "
    "so clipping stays near 0 unless sampler and trainer disagree."
)
SEVERAL_UPDATES_NOTE = (
    "{updates} optimizer steps per batch (num_minibatches × ppo_epochs): after the first, the policy "
    "has moved from the sampler's, and the ratio and clipping measure by how much."
)

EARLY_UPDATES_NOTE = (
    "{which} {updates} optimizer steps per batch (early_ppo_epochs): there the ratio and clipping "
    "measure how far the policy moved."
)


def _number(raw: Any) -> float | None:
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw):
        return None
    return float(raw)


def chart_data(
    step_metrics: list[Any],
    *,
    config: dict[str, Any] | None = None,
    sample_means: dict[int, dict[str, Any]] | None = None,
    evaluations: Sequence[Any] = (),
    reward_range: tuple[tuple[float, float], str] | None = None,
    kind: str = "platform",
    heldout_before: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The run page's chart series (``/runs/<id>/metrics.json``). What was not measured is null,
    never 0, and a series with a reason to read it carefully carries a ``note``: KL with
    ``kl_coef`` 0 is not computed at all, a step without an update measured no loss, grad norm,
    entropy, KL or clip fraction. ``sample_means`` (selectors.run_step_sample_means) gives the
    completion length and the per-sub-reward means; ``evaluations`` the validation reward per
    evaluated step, with what each evaluated (task set, split, rows, samples: evaluations of
    different rows are not one trend); ``reward_range`` (selectors.run_reward_range) the bounds
    the mean ± std band is clipped to, with their source. Only the series of the run's ``kind``
    (``chart_series``), with the notes that apply to it; ``heldout_before`` (an SFT or DPO run's
    held-out figures before its first step, ``{"step", "heldout_loss", …}``) is their first point."""
    config = config or {}
    sample_means = sample_means or {}
    steps = [row.step for row in step_metrics]
    no_update = [row.step for row in step_metrics if row.metrics.get("trainable_tokens") == 0]

    def values(key: str) -> list[float | None]:
        if key == "completion_tokens":
            return [_number(sample_means.get(row.step, {}).get("completion_tokens")) for row in step_metrics]
        return [
            None if key in UPDATE_METRICS and row.step in no_update else _number(row.metrics.get(key))
            for row in step_metrics
        ]

    def note(key: str, series: list[float | None]) -> str:
        if key == "kl" and _number(config.get("kl_coef")) == 0:
            return "Not measured: kl_coef is 0, so the policy is never compared with the base model."
        notes = []
        minibatches = int(_number(config.get("num_minibatches")) or 1)
        epochs = int(_number(config.get("ppo_epochs")) or 1)
        updates = minibatches * epochs
        early_updates = minibatches * max(epochs, int(_number(config.get("early_ppo_epochs")) or 1))
        early_steps = int(_number(config.get("early_ppo_epochs_steps")) or 0)
        if key in ("clip_fraction", "ratio_std") and kind == "platform":  # GRPO's minibatches and epochs
            notes.append(SEVERAL_UPDATES_NOTE.format(updates=updates) if updates > 1 else CLIP_FRACTION_NOTE)
            # (steps count from the base model: a run continuing a checkpoint made no extra passes)
            if early_steps and early_updates > updates and (not steps or min(steps) <= early_steps):
                which = "Step 1 makes" if early_steps == 1 else f"The first {early_steps} steps make"
                notes.append(EARLY_UPDATES_NOTE.format(which=which, updates=early_updates))
        if (
            key in ("heldout_loss", "heldout_preference_accuracy")
            and series
            and all(v is None for v in series)
        ):
            notes.append("SFT and DPO runs only, at their evaluation steps (eval_interval).")
        if key == "groups_dropped" and not config.get("dynamic_sampling"):
            notes.append("Not measured: dynamic_sampling is off, so every group drawn is trained on.")
        if key == "off_policy_steps" and not config.get("max_off_policy_steps") and not any(series):
            # (an ART client's PipelineTrainer samples ahead on its own: its staleness is drawn as measured)
            notes.append("Synchronous run (max_off_policy_steps 0): every step samples the newest policy.")
        if key in UPDATE_METRICS and no_update:
            shown = ", ".join(str(step) for step in no_update[:8]) + (" …" if len(no_update) > 8 else "")
            notes.append(f"No update at step {shown} (every group had the same reward): not drawn there.")
        if steps and all(value is None for value in series) and not notes:
            notes.append("Not measured in this run.")
        return " ".join(notes)

    series: dict[str, dict[str, Any]] = {}
    for key, label in chart_series(kind):
        measured = values(key)
        if key == "kl" and _number(config.get("kl_coef")) == 0:
            measured = [None] * len(step_metrics)
        series[key] = {"label": label, "values": measured, "note": note(key, measured)}

    names = sorted({name for means in sample_means.values() for name in means.get("sub_rewards", {})})
    sub_rewards = {
        name: [_number(sample_means.get(step, {}).get("sub_rewards", {}).get(name)) for step in steps]
        for name in names
    }
    validation = [
        (evaluation, _number((evaluation.results or {}).get("reward_mean")))
        for evaluation in evaluations
        if evaluation.step is not None and evaluation.status == EvaluationStatus.SUCCEEDED
    ]
    validation = [(evaluation, value) for evaluation, value in validation if value is not None]
    band = None
    if reward_range is not None:
        (low, high), source = reward_range
        band = {"low": low, "high": high, "source": source}
    reward_mean = [_number(row.reward_mean) for row in step_metrics]
    reward_std = [_number(row.reward_std) for row in step_metrics]
    before = (heldout_before or {}).get("step")
    if isinstance(before, int) and steps and before < steps[0]:
        # The held-out figures before training are an event, not a step: the first point.
        steps = [before, *steps]
        for key, entry in series.items():
            entry["values"] = [_number((heldout_before or {}).get(key)) if key in _SUPERVISED else None,
                               *entry["values"]]  # fmt: skip
        reward_mean, reward_std = [None, *reward_mean], [None, *reward_std]
        sub_rewards = {name: [None, *values] for name, values in sub_rewards.items()}
    return {
        "steps": steps,
        "reward_mean": reward_mean,
        "reward_std": reward_std,
        "reward_range": band,
        "series": series,
        "sub_rewards": sub_rewards,
        "validation": {
            "steps": [evaluation.step for evaluation, _ in validation],
            "reward_mean": [value for _, value in validation],
            "evaluated": [evaluated_rows(evaluation) for evaluation, _ in validation],
        },
    }


def evaluated_rows(evaluation: Any) -> dict[str, Any]:
    """What an evaluation measured on: its task set, split and how many rows and samples (its
    results' ``rows`` and ``n``). Two evaluations compare only when these agree."""
    results = evaluation.results or {}
    return {
        "task_set": evaluation.task_set_id,
        "split": evaluation.split,
        "rows": results.get("rows") if isinstance(results.get("rows"), int) else None,
        "n": results.get("n") if isinstance(results.get("n"), int) else None,
    }


@dataclass
class Part:
    text: str
    diverged: bool = False  # after the point where the best and worst trajectories part ways


@dataclass
class Message:
    role: str
    parts: list[Part]
    tool_calls: list[dict[str, str]] = field(default_factory=list)
    tool_call_id: str = ""
    name: str = ""
    first_divergence: bool = False
    # A tool endpoint's call behind this tool message (http_tools): status, latency_ms, error.
    tool_request: dict[str, Any] | None = None


@dataclass
class Column:
    trajectory: Any  # a Trajectory or an EvaluationSample: messages, reward, sub_rewards, errors
    messages: list[Message]
    rank: str  # "best", "worst" or ""
    side: str = ""  # an evaluation sample's side: "subject" or "reference"
    advantage: float | None = None  # the sample's advantage in the update (trajectory viewer)
    signal: Any = None  # selectors.UpdateSignal: length penalty, whether it was trained on


def _tool_calls(message: dict[str, Any]) -> list[dict[str, str]]:
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call) if isinstance(call, dict) else {}
        arguments = function.get("arguments", "")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, indent=2)
        else:
            # Past the int-digit limit json raises ValueError, past the recursion limit
            # RecursionError: either way the viewer shows the text as stored.
            with contextlib.suppress(ValueError, TypeError, RecursionError):
                arguments = json.dumps(json.loads(arguments), indent=2)
        calls.append(
            {"name": str(function.get("name", "?")), "arguments": arguments, "id": str(call.get("id", ""))}
        )
    return calls


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts
        return "\n".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return "" if content is None else str(content)


def _key(message: dict[str, Any]) -> str:
    return json.dumps([message.get("role"), _text(message), _tool_calls(message)], sort_keys=True)


def _divergence(a: Any, b: Any) -> tuple[int | None, int]:
    """(message index, character index) where transcripts ``a`` and ``b`` first differ; (None, 0)
    when they are the same or got the same reward (nothing to explain)."""
    if a.reward == b.reward:
        return None, 0
    for index in range(max(len(a.messages), len(b.messages))):
        x = a.messages[index] if index < len(a.messages) else None
        y = b.messages[index] if index < len(b.messages) else None
        if x is None or y is None or _key(x) != _key(y):
            split_char = 0
            if x is not None and y is not None:
                text_x, text_y = _text(x), _text(y)
                while split_char < min(len(text_x), len(text_y)) and text_x[split_char] == text_y[split_char]:
                    split_char += 1
            return index, split_char
    return None, 0


def tool_requests(row: Any) -> dict[str, dict[str, Any]]:
    """A trajectory's or sample's tool endpoint calls by call id (the http_tools environment's
    ``outcome.tool_requests``, stored in its metrics); {} for other environments."""
    outcome = (getattr(row, "metrics", None) or {}).get("outcome")
    listed = outcome.get("tool_requests") if isinstance(outcome, dict) else None
    if not isinstance(listed, list):
        return {}
    return {str(r["call_id"]): r for r in listed if isinstance(r, dict) and "call_id" in r}


def _messages(
    raw_messages: list[dict[str, Any]],
    split: tuple[int | None, int] | None,
    requests: dict[str, dict[str, Any]] | None = None,
) -> list[Message]:
    """Messages for the template; with ``split`` (from ``_divergence``), the text from there on is
    marked ``diverged`` and the first differing message gets ``first_divergence``; a tool message
    gets its endpoint call from ``requests`` (``tool_requests``)."""
    split_message, split_char = split if split is not None else (None, 0)
    messages = []
    for index, raw in enumerate(raw_messages):
        text = _text(raw)
        if split_message is not None and index == split_message:
            parts = [Part(text[:split_char]), Part(text[split_char:], diverged=True)]
        elif split_message is not None and index > split_message:
            parts = [Part(text, diverged=True)]
        else:
            parts = [Part(text)]
        messages.append(
            Message(
                role=str(raw.get("role", "?")),
                parts=[part for part in parts if part.text],
                tool_calls=_tool_calls(raw),
                tool_call_id=str(raw.get("tool_call_id", "")),
                name=str(raw.get("name", "")),
                first_divergence=split_message is not None and index == split_message,
                tool_request=(requests or {}).get(str(raw.get("tool_call_id", "")))
                if raw.get("role") == "tool"
                else None,
            )
        )
    return messages


def message_views(raw_messages: list[dict[str, Any]]) -> list[Message]:
    """Messages for the transcript template, without a divergence to mark."""
    return _messages(raw_messages, None)


def transcript_columns(trajectories: Sequence[Any], summary: GroupSummary | None = None) -> list[Column]:
    """Columns best first; in the best and the worst, the text from their first difference on is
    marked ``diverged`` (the first differing message gets ``first_divergence``). With ``summary``
    (``group_summary``) each column carries its sample's advantage."""
    if not trajectories:
        return []
    best, worst = trajectories[0], trajectories[-1]
    split = _divergence(best, worst) if len(trajectories) > 1 else None
    columns = []
    for trajectory in trajectories:
        marked = trajectory.pk in (best.pk, worst.pk)
        rank = "best" if trajectory.pk == best.pk else "worst" if trajectory.pk == worst.pk else ""
        columns.append(
            Column(
                trajectory,
                _messages(trajectory.messages, split if marked else None, tool_requests(trajectory)),
                rank if len(trajectories) > 1 else "",
                advantage=summary.advantages.get(trajectory.pk) if summary is not None else None,
                signal=summary.signals.get(trajectory.pk) if summary is not None else None,
            )
        )
    return columns


@dataclass
class GroupSummary:
    mean: float  # of the training rewards (the grader's plus any length penalty)
    std: float  # population std (divide by G), as GRPO's advantages use it
    zero_variance: bool
    scaled: bool  # advantages divided by the std (the run's TrainConfig.scale_rewards)
    advantages: dict[int, float]  # by trajectory pk
    penalised: bool  # some sample's reward carried a length penalty
    signals: dict[int, Any]  # by trajectory pk: selectors.UpdateSignal


def group_summary(
    trajectories: Sequence[Any], signals: dict[int, Any], *, scale_rewards: bool
) -> GroupSummary | None:
    """A group's training-reward mean and std and each sample's advantage as the update used it
    (``signals``: selectors.trajectory_update_signals, the trainer's stored values or the same
    computation, training.recipes.grpo.update_advantages); a zero-variance group gets zeros."""
    if not trajectories:
        return None
    rewards = [signals[t.pk].training_reward for t in trajectories]
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return GroupSummary(
        mean,
        std,
        catalog.is_zero_variance(rewards),
        scale_rewards,
        {t.pk: signals[t.pk].advantage for t in trajectories},
        any(signals[t.pk].length_penalty != 0.0 for t in trajectories),
        signals,
    )


@dataclass
class SampleRow:
    task_row_index: int
    columns: list[Column]


def evaluation_sample_rows(samples: Sequence[Any]) -> list[SampleRow]:
    """An evaluation's samples per task row: the subject's, then the reference's, side by side.
    Where the first subject sample and the first reference sample got different rewards, the point
    where their transcripts part ways is marked as in the trajectory viewer."""
    by_row: dict[int, list[Any]] = {}
    for sample in samples:
        by_row.setdefault(sample.task_row_index, []).append(sample)
    rows = []
    for index, row_samples in sorted(by_row.items()):
        ordered = sorted(row_samples, key=lambda s: (s.side != "subject", s.sample_index))
        subject = next((s for s in ordered if s.side == "subject"), None)
        reference = next((s for s in ordered if s.side != "subject"), None)
        split = _divergence(subject, reference) if subject is not None and reference is not None else None
        rows.append(
            SampleRow(
                index,
                [
                    Column(
                        sample,
                        _messages(
                            sample.messages,
                            split if sample in (subject, reference) else None,
                            tool_requests(sample),
                        ),
                        "",
                        side=sample.side,
                    )
                    for sample in ordered
                ],
            )
        )
    return rows


# The numbers of one side of an evaluation (training.runs.evaluation.aggregate): (label, key, decimals;
# None for a count).
RESULT_ROWS = [
    ("Samples", "n", None),
    ("Task rows", "rows", None),
    ("Mean reward", "reward_mean", 3),
    ("Reward std", "reward_std", 3),
    ("Pass rate", "pass_rate", 3),
    ("Mean turns", "turns_mean", 2),
    ("Tool calls", "tool_calls", None),
    ("Tool error rate", "tool_error_rate", 3),
    ("Grader error rate", "grader_error_rate", 3),
    ("Failed rollouts", "policy_errors", None),
]


def _show(value: Any, decimals: int | None) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "–"
    return str(int(value)) if decimals is None else f"{value:.{decimals}f}"


def evaluation_results(results: dict[str, Any], *, has_reference: bool) -> dict[str, Any]:
    """An evaluation's ``results`` as table rows (label, subject, reference), the per-grader means
    of both sides, and the comparison with the reference (or, for a run's later evaluation, with
    its first one)."""
    raw_reference = results.get("reference")
    reference: dict[str, Any] = raw_reference if isinstance(raw_reference, dict) else {}
    rows = [
        {
            "label": label,
            "key": key,
            "subject": _show(results.get(key), d),
            "reference": _show(reference.get(key), d),
        }
        for label, key, d in RESULT_ROWS
    ]
    if isinstance(results.get("pass_threshold"), int | float):
        rows[4]["label"] = f"Pass rate (reward ≥ {results['pass_threshold']:g})"
    subject_graders = results.get("grader_means") or {}
    reference_graders = reference.get("grader_means") or {}
    graders = [
        {
            "name": name,
            "subject": _show(subject_graders.get(name), 3),
            "reference": _show(reference_graders.get(name), 3),
        }
        for name in sorted({*subject_graders, *reference_graders})
    ]

    def comparison(raw: Any) -> dict[str, str] | None:
        if not isinstance(raw, dict):
            return None
        return {
            "win_rate": _show(raw.get("win_rate"), 3),
            "wins": _show(raw.get("wins"), None),
            "ties": _show(raw.get("ties"), None),
            "losses": _show(raw.get("losses"), None),
            "rows": _show(raw.get("rows"), None),
            "reward_delta": _show(raw.get("reward_delta"), 3),
        }

    return {
        "any": bool(results),
        "rows": rows,
        "graders": graders,
        "has_reference": has_reference or bool(reference),
        "comparison": comparison(results.get("comparison")),
        "baseline": comparison(results.get("comparison_to_baseline")),
        "baseline_step": results.get("baseline_step"),
    }


def environment_kinds() -> list[dict[str, Any]]:
    """Every EnvironmentKind with whether this installation can run it (the environment registry,
    ``training.environments``, has it) and the registry's one-line description. Without the
    registry only the single-turn chat environment runs."""
    try:
        kinds = catalog.environment_kinds()
    except ImportError:
        described = {EnvironmentKind.CHAT.value: {"description": "A single model turn; no tools."}}
    else:
        described = {str(entry["kind"]): entry for entry in kinds}
    return [
        {
            "value": kind.value,
            "label": kind.label,
            "available": kind.value in described,
            "description": described.get(kind.value, {}).get("description", ""),
        }
        for kind in EnvironmentKind
    ]


PAGE_SIZE = 20


def page_of(request: HttpRequest, items: Any) -> Any:
    """One dashboard page of ``items`` (``?page=``)."""
    return Paginator(items, PAGE_SIZE).get_page(request.GET.get("page"))


def query_without_page(request: HttpRequest) -> str:
    query = request.GET.copy()
    query.pop("page", None)
    return query.urlencode()
