"""The grader registry and the functions callers use. Adding a grader type is one module with a
`Grader` subclass plus one line in GRADER_TYPES; an explicit dict (not import-time registration
by decorator) so the full list of types is readable in one place.

    spec = validate_grader(payload)                               # on save; GraderSpecError lists problems
    grader = build_grader(spec, judge=team_judge, sandbox=limits)  # GraderSetupError if a judge is missing
    result = grade(grader, Sample(output_text="4"), {"answer": "4"})
    results = grade_group(grader, group_samples, group_items)     # one GRPO group (needed by ruler)
    metrics = grade_trajectories(spec, groups, rows, max_error_fraction=0.5)  # a step's rollouts
"""

from __future__ import annotations

from typing import Any

from training.cost import judge_token_usage
from training.rewards.base import GRADER_TYPES, Grader, GradeResult, GraderRuntime, Sample, validate_grader
from training.rewards.endpoint import EndpointGrader
from training.rewards.environment import EnvironmentGrader
from training.rewards.errors import RewardFailure
from training.rewards.json_match import JsonMatchGrader
from training.rewards.judge import JudgeClient
from training.rewards.label_model import LabelModelGrader
from training.rewards.multi import MultiGrader
from training.rewards.python_grader import PythonGrader
from training.rewards.regex import RegexGrader
from training.rewards.ruler import RulerGrader
from training.rewards.sandbox import SandboxConfig
from training.rewards.score_model import ScoreModelGrader
from training.rewards.string_check import StringCheckGrader
from training.rewards.text_similarity import TextSimilarityGrader
from training.rewards.tool_call import ToolCallGrader
from training.rollouts.trajectory import Trajectory
from training.safety.outbound import PUBLIC_ONLY, OutboundPolicy

# The table composite graders (multi, ruler) build their parts from (training.rewards.base), filled here.
GRADER_TYPES.update(
    {
        StringCheckGrader.type: StringCheckGrader,
        TextSimilarityGrader.type: TextSimilarityGrader,
        RegexGrader.type: RegexGrader,
        JsonMatchGrader.type: JsonMatchGrader,
        ToolCallGrader.type: ToolCallGrader,
        PythonGrader.type: PythonGrader,
        ScoreModelGrader.type: ScoreModelGrader,
        LabelModelGrader.type: LabelModelGrader,
        MultiGrader.type: MultiGrader,
        RulerGrader.type: RulerGrader,
        EnvironmentGrader.type: EnvironmentGrader,
        EndpointGrader.type: EndpointGrader,
    }
)


def build_grader(
    spec: dict[str, Any],
    *,
    judge: JudgeClient | None = None,
    sandbox: SandboxConfig | None = None,
    outbound: OutboundPolicy | None = None,
) -> Grader:
    """A ready grader. `judge` is the team's judge endpoint (needed by score_model, label_model and
    ruler, also inside multi); `sandbox` the operator's limits for python graders; `outbound` the
    operator's policy for endpoint graders (public addresses only when None)."""
    normalised = validate_grader(spec)
    runtime = GraderRuntime(judge=judge, sandbox=sandbox or SandboxConfig(), outbound=outbound or PUBLIC_ONLY)
    return GRADER_TYPES[normalised["type"]](normalised, runtime)


def _built(grader: dict[str, Any] | Grader) -> Grader:
    return grader if isinstance(grader, Grader) else build_grader(grader)


def grade(spec_or_grader: dict[str, Any] | Grader, sample: Sample, item: dict[str, Any]) -> GradeResult:
    return _built(spec_or_grader).grade(sample, item)


def grade_many(
    grader: dict[str, Any] | Grader, samples: list[Sample], items: list[dict[str, Any]]
) -> list[GradeResult]:
    """Grade samples[i] against items[i], each on its own; a spec is validated once for the batch.
    A grader that compares a group (`ruler`) refuses: use grade_group per group."""
    if len(samples) != len(items):
        raise ValueError(f"got {len(samples)} samples but {len(items)} items")
    built = _built(grader)
    if built.grades_groups:
        raise ValueError(f"{built.type} grades whole groups: call grade_group once per group")
    return built.grade_batch(samples, items)


def grade_group(
    grader: dict[str, Any] | Grader, samples: list[Sample], items: list[dict[str, Any]] | dict[str, Any]
) -> list[GradeResult]:
    """Grade one group: all the samples answering one task (one item, or one per sample). Works
    for every grader type; `ruler` needs it, the others grade each sample on its own."""
    item_list = [items] * len(samples) if isinstance(items, dict) else items
    if len(samples) != len(item_list):
        raise ValueError(f"got {len(samples)} samples but {len(item_list)} items")
    return _built(grader).grade_group(samples, item_list)


def grade_trajectories(
    grader_spec: dict[str, Any],
    groups: list[list[Trajectory]],
    rows: list[dict[str, Any]],
    max_error_fraction: float,
    reward_name: str = "",
    *,
    judge: JudgeClient | None = None,
    sandbox: SandboxConfig | None = None,
    outbound: OutboundPolicy | None = None,
    context: dict[str, Any] | None = None,
) -> dict[str, float]:
    """Fill in reward, sub_rewards and errors of every trajectory, one group at a time (a relative
    judge like RULER compares a group's trajectories). Errors are data, not crashes, unless more
    than ``max_error_fraction`` of the step's samples failed. ``context`` (e.g. ``{"step": 3}``)
    joins each sample's ids, which an endpoint grader sends along."""
    grader = build_grader(grader_spec, judge=judge, sandbox=sandbox, outbound=outbound)
    trajectories = [t for group in groups for t in group]
    samples = [
        Sample(output_text=t.output_text, messages=t.messages, output_tools=t.output_tools, outcome=t.outcome,
               ids={**(context or {}), "group": group_index, "rollout": rollout, "row_index": row.get("index")})
        for group_index, (group, row) in enumerate(zip(groups, rows, strict=True))
        for rollout, t in enumerate(group)
    ]  # fmt: skip
    if grader.grades_groups:  # a relative judge (RULER) compares the trajectories of one group
        results, offset = [], 0
        for group, row in zip(groups, rows, strict=True):
            results += grade_group(grader, samples[offset : offset + len(group)], row["data"].get("item", {}))
            offset += len(group)
    else:  # one batch for the step: a python grader starts one sandbox, not one per group
        items = [row["data"].get("item", {}) for group, row in zip(groups, rows, strict=True) for _ in group]
        results = grade_many(grader, samples, items)
    failed = total = 0
    errors_by_code: dict[str, int] = {}
    example = ""
    for trajectory, result in zip(trajectories, results, strict=True):
        total += 1
        trajectory.reward = float(result.reward)
        trajectory.sub_rewards = dict(result.sub_rewards)
        trajectory.errors = list(result.errors)
        if result.scores:
            trajectory.metrics = {**trajectory.metrics, "grader_scores": result.scores}
        if result.errors:
            failed += 1
            for error in result.errors:
                code = error.get("code", "error")
                errors_by_code[code] = errors_by_code.get(code, 0) + 1
            if not example:
                first = result.errors[0]
                example = f"{first.get('grader', '?')}: {first.get('code')}: {first.get('detail')}"
    fraction = failed / max(1, total)
    if fraction > max_error_fraction:
        name = grader_spec.get("name") or grader_spec.get("type")
        owner = f"reward definition {reward_name}: " if reward_name else ""
        raise RewardFailure(
            f"{owner}grader {name!r} failed on {failed} of {total} samples (limit {max_error_fraction:.0%}); e.g. {example}"
        )
    metrics = {"grader_error_fraction": fraction, "grader_errors": float(failed)}
    metrics.update(judge_token_usage(result.token_usage for result in results))  # the judge's bill
    metrics.update({f"grader_errors.{code}": float(count) for code, count in errors_by_code.items()})
    return metrics
