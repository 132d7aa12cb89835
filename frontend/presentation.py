"""Presentation helpers for templates: transcripts for the trajectory viewer, chart series,
and which environment kinds this installation can run. No domain rules live here."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

from projects.models import EnvironmentKind, Trajectory

# The per-step series the run page charts, read from StepMetrics.metrics (training/loop.py and
# training/trainer.py write these keys).
CHART_SERIES = [
    ("reward", "Mean reward ± std", None),
    ("loss", "Loss", "loss"),
    ("kl", "KL to the base model", "kl"),
    ("entropy", "Entropy", "entropy"),
    ("clip_fraction", "Clip fraction", "clip_fraction"),
    ("zero_variance_fraction", "Zero-variance groups", "zero_variance_fraction"),
    ("tokens_per_second", "Tokens / s (rollouts)", "tokens_per_second"),
]


def chart_data(step_metrics: list[Any]) -> dict[str, Any]:
    def value(row: Any, key: str) -> float | None:
        raw = row.metrics.get(key)
        return raw if isinstance(raw, int | float) else None

    return {
        "steps": [row.step for row in step_metrics],
        "reward_mean": [row.reward_mean for row in step_metrics],
        "reward_std": [row.reward_std for row in step_metrics],
        "series": {
            key: {"label": label, "values": [value(row, metric) for row in step_metrics]}
            for key, label, metric in CHART_SERIES
            if metric
        },
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


@dataclass
class Column:
    trajectory: Trajectory
    messages: list[Message]
    rank: str  # "best", "worst" or ""


def _tool_calls(message: dict[str, Any]) -> list[dict[str, str]]:
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call) if isinstance(call, dict) else {}
        arguments = function.get("arguments", "")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, indent=2)
        else:
            with contextlib.suppress(ValueError, TypeError):
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


def transcript_columns(trajectories: list[Trajectory]) -> list[Column]:
    """Columns best first; in the best and the worst, the text from their first difference on is
    marked ``diverged`` (the first differing message gets ``first_divergence``)."""
    if not trajectories:
        return []
    best, worst = trajectories[0], trajectories[-1]
    split_message, split_char = None, 0
    if len(trajectories) > 1 and best.reward != worst.reward:
        for index in range(max(len(best.messages), len(worst.messages))):
            a = best.messages[index] if index < len(best.messages) else None
            b = worst.messages[index] if index < len(worst.messages) else None
            if a is None or b is None or _key(a) != _key(b):
                split_message = index
                if a is not None and b is not None:
                    text_a, text_b = _text(a), _text(b)
                    while (
                        split_char < min(len(text_a), len(text_b))
                        and text_a[split_char] == text_b[split_char]
                    ):
                        split_char += 1
                break
    columns = []
    for trajectory in trajectories:
        marked = split_message is not None and trajectory.pk in (best.pk, worst.pk)
        messages = []
        for index, raw in enumerate(trajectory.messages):
            text = _text(raw)
            if marked and index == split_message:
                parts = [Part(text[:split_char]), Part(text[split_char:], diverged=True)]
            elif marked and split_message is not None and index > split_message:
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
                    first_divergence=marked and index == split_message,
                )
            )
        rank = "best" if trajectory.pk == best.pk else "worst" if trajectory.pk == worst.pk else ""
        columns.append(Column(trajectory, messages, rank if len(trajectories) > 1 else ""))
    return columns


def environment_kinds() -> list[dict[str, Any]]:
    """Every EnvironmentKind with whether this installation can run it (the environment registry,
    ``training.environments``, has it) and the registry's one-line description. Without the
    registry only the single-turn chat environment runs."""
    try:
        from training.environments import describe_kinds
    except ImportError:
        described = {EnvironmentKind.CHAT.value: {"description": "A single model turn; no tools."}}
    else:
        described = {str(entry["kind"]): entry for entry in describe_kinds()}
    return [
        {
            "value": kind.value,
            "label": kind.label,
            "available": kind.value in described,
            "description": described.get(kind.value, {}).get("description", ""),
        }
        for kind in EnvironmentKind
    ]
