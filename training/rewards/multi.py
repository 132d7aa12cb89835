"""`multi`: named sub-graders combined by a formula, compatible with OpenAI's grader of that name.

    {"type": "multi", "name": "total",
     "graders": {"accuracy": {"type": "string_check", ...}, "style": {"type": "label_model", ...}},
     "calculate_output": "0.8 * accuracy + 0.2 * style"}

Sub-graders may be of any type except `ruler` (which needs a whole group); each is named by its
key (a name valid in formulas, not a function name). The formula (see `formula.py`) is checked
against those names when the spec is validated. A sub-grader that fails on a sample contributes
its `error_reward` and its error entry; a formula without a finite value (1/0, sqrt(-1)) is a
`formula_evaluation_error` and this grader's `error_reward`. `sub_rewards` holds each sub-grader's
reward by key (a nested multi's as `key.subkey`).
"""

from __future__ import annotations

import re
import time
from typing import Any, ClassVar

from training.rewards.base import (
    GRADER_TYPES,
    Field,
    Grader,
    GradeResult,
    GraderRuntime,
    Sample,
    validate_grader,
)
from training.rewards.errors import GraderSpecError
from training.rewards.formula import FUNCTIONS, FormulaError, FormulaEvaluationError, parse_formula
from training.rewards.judge import merge_usage

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class MultiGrader(Grader):
    type: ClassVar[str] = "multi"
    fields: ClassVar[dict[str, Field]] = {
        "graders": Field("object", required=True),
        "calculate_output": Field("string", required=True),
    }

    @classmethod
    def check_spec(cls, spec: dict[str, Any], path: str) -> list[dict[str, str]]:
        problems: list[dict[str, str]] = []
        graders = spec.get("graders")
        names: set[str] | None = None
        if graders is not None:
            names = set()
            if not graders:
                problems.append({"path": f"{path}.graders", "message": "must hold at least one grader"})
            for key, sub_spec in graders.items():
                where = f"{path}.graders.{key}"
                if not NAME.fullmatch(key) or key in FUNCTIONS:
                    problems.append(
                        {
                            "path": where,
                            "message": "must be named like a variable (letters, digits, _), not a function",
                        }
                    )
                    continue
                names.add(key)
                sub_type = sub_spec.get("type") if isinstance(sub_spec, dict) else None
                if (
                    isinstance(sub_type, str)
                    and sub_type in GRADER_TYPES
                    and GRADER_TYPES[sub_type].grades_groups
                ):
                    problems.append(
                        {
                            "path": f"{where}.type",
                            "message": f"{sub_type} grades whole groups: not allowed in multi",
                        }
                    )
                    continue
                try:
                    normalised = validate_grader(sub_spec, where)
                except GraderSpecError as error:
                    problems += error.problems
                    continue
                normalised["name"] = key  # a sub-grader is known by its key
                graders[key] = normalised
        if "calculate_output" in spec:
            try:
                # Unknown names are only worth reporting when the sub-graders themselves were readable.
                parse_formula(spec["calculate_output"], names)
            except FormulaError as error:
                problems.append({"path": f"{path}.calculate_output", "message": str(error)})
        return problems

    def __init__(self, spec: dict[str, Any], runtime: GraderRuntime | None = None) -> None:
        super().__init__(spec, runtime)
        self.graders: dict[str, Grader] = {
            key: GRADER_TYPES[sub_spec["type"]](sub_spec, self.runtime)
            for key, sub_spec in spec["graders"].items()
        }
        self.formula = parse_formula(spec["calculate_output"], set(self.graders))

    def score(self, sample: Sample, item: dict[str, Any]) -> float:
        return self.grade(sample, item).reward

    def grade(self, sample: Sample, item: dict[str, Any]) -> GradeResult:
        return self.grade_batch([sample], [item])[0]

    def grade_batch(self, samples: list[Sample], items: list[dict[str, Any]]) -> list[GradeResult]:
        # Each sub-grader grades the whole batch at once, so a python sub-grader keeps one sandbox
        # and a judge keeps several calls in flight.
        if len(samples) != len(items):
            raise ValueError(f"got {len(samples)} samples but {len(items)} items")
        started = time.perf_counter()
        by_grader = {key: grader.grade_batch(samples, items) for key, grader in self.graders.items()}
        per_sample = (time.perf_counter() - started) / max(1, len(samples))
        return [
            self._combine({key: results[index] for key, results in by_grader.items()}, per_sample)
            for index in range(len(samples))
        ]

    def _combine(self, results: dict[str, GradeResult], execution_time: float) -> GradeResult:
        values = {key: result.reward for key, result in results.items()}
        errors = [error for result in results.values() for error in result.errors]
        try:
            reward = self.formula.evaluate(values)
        except FormulaEvaluationError as error:
            reward = self.error_reward
            errors.append({"code": "formula_evaluation_error", "detail": str(error), "grader": self.name})
        sub_rewards: dict[str, float] = {}
        scores: dict[str, Any] = {}
        for key, result in results.items():
            sub_rewards[key] = result.reward
            for sub_key, value in result.sub_rewards.items():
                if sub_key != key:
                    sub_rewards[f"{key}.{sub_key}"] = value
            for score_key, value in result.scores.items():
                scores[f"{key}.{score_key}"] = value
        models = [result.sampled_model_name for result in results.values() if result.sampled_model_name]
        return GradeResult(
            reward=reward,
            sub_rewards=sub_rewards,
            errors=errors,
            execution_time=execution_time,
            name=self.name,
            type=self.type,
            scores=scores,
            token_usage=merge_usage(*(result.token_usage for result in results.values())),
            sampled_model_name=models[0] if models else None,
        )
