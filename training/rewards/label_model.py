"""`label_model`: an LLM judge picks a label, compatible with OpenAI's grader of that name.

    {"type": "label_model", "name": "tone", "model": "gpt-4o-mini",
     "input": [{"role": "user", "content": "Is this reply polite? Answer polite or rude.\\n{{sample.output_text}}"}],
     "labels": ["polite", "rude"], "passing_labels": ["polite"]}

Reward 1.0 when the judge's label is a passing label, else 0.0 (usable inside `multi`). The reply
is read as, in order: JSON with a `label` field, the reply itself being one label (case, quotes and
final punctuation ignored), or exactly one of the labels appearing in it as a whole word. Anything
else (no label, two different labels, a label not in `labels`) is a `model_grader_parse_error`, as
is a refusal (detail starting "refusal").
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from training.rewards.base import Field, GraderRuntime, Sample, Score
from training.rewards.errors import GradingError
from training.rewards.model_grader import MODEL_FIELDS, ModelGrader, looks_like_refusal

PARSE_ERROR = "model_grader_parse_error"
FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL | re.IGNORECASE)


class LabelModelGrader(ModelGrader):
    type: ClassVar[str] = "label_model"
    fields: ClassVar[dict[str, Field]] = {
        **MODEL_FIELDS,
        "labels": Field("string_list", required=True),
        "passing_labels": Field("string_list", required=True),
    }

    @classmethod
    def check_spec(cls, spec: dict[str, Any], path: str) -> list[dict[str, str]]:
        problems = super().check_spec(spec, path)
        labels = spec.get("labels")
        if labels is not None:
            if not labels:
                problems.append({"path": f"{path}.labels", "message": "must hold at least one label"})
            folded = [label.strip().casefold() for label in labels]
            if any(not label for label in folded):
                problems.append({"path": f"{path}.labels", "message": "labels must not be blank"})
            if len(set(folded)) != len(folded):
                problems.append({"path": f"{path}.labels", "message": "labels must differ (ignoring case)"})
        passing = spec.get("passing_labels")
        if passing is not None:
            if not passing:
                problems.append({"path": f"{path}.passing_labels", "message": "must hold at least one label"})
            for index, label in enumerate(passing):
                if labels is not None and label not in labels:
                    problems.append(
                        {"path": f"{path}.passing_labels.{index}", "message": "is not one of labels"}
                    )
        return problems

    def __init__(self, spec: dict[str, Any], runtime: GraderRuntime | None = None) -> None:
        super().__init__(spec, runtime)
        self.labels: list[str] = spec["labels"]
        self.passing_labels = set(spec["passing_labels"])

    def score(self, sample: Sample, item: dict[str, Any]) -> Score:
        reply = self.ask(sample, item)
        spent: dict[str, Any] = {
            "token_usage": reply.token_usage,
            "sampled_model_name": reply.sampled_model_name,
        }
        if reply.refusal:
            raise GradingError(PARSE_ERROR, f"refusal: {reply.refusal[:200]}", **spent)
        label, problem = parse_label(reply.content, self.labels)
        if label is None:
            if looks_like_refusal(reply):
                raise GradingError(PARSE_ERROR, f"refusal: {reply.content[:200]}", **spent)
            raise GradingError(PARSE_ERROR, f"{problem}: {reply.content[:200]!r}", **spent)
        reward = 1.0 if label in self.passing_labels else 0.0
        return Score(reward, {"label": label}, **spent)


def parse_label(text: str, labels: list[str]) -> tuple[str | None, str]:
    """(the label, "") or (None, why not)."""
    by_folded = {label.strip().casefold(): label for label in labels}
    for candidate in [match.group(1) for match in FENCE.finditer(text)] + [text]:
        try:
            data = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(data, dict) and isinstance(data.get("label"), str):
            label = by_folded.get(data["label"].strip().casefold())
            if label is None:
                return None, f"label {data['label']!r} is not one of {labels}"
            return label, ""
    bare = text.strip().strip("\"'`*").rstrip(".!").strip().casefold()
    if bare in by_folded:
        return by_folded[bare], ""
    found = {
        label
        for folded, label in by_folded.items()
        if re.search(rf"(?<!\w){re.escape(folded)}(?!\w)", text.casefold())
    }
    if len(found) == 1:
        return found.pop(), ""
    if found:
        return None, f"the reply names several labels ({', '.join(sorted(found))})"
    return None, "no label in the judge's reply"
