"""Grader templates, OpenAI's syntax: `{{sample.output_text}}`, `{{sample.output_json.a.b}}`,
`{{sample.output_tools}}`, `{{sample.messages.0.content}}`, `{{sample.outcome.result}}` (the
environment's verdict), `{{item.answers.0}}`.

Text outside `{{ }}` is kept as is; a string without `{{` is a literal. A path walks dict keys and,
on lists, integer indices. Strings render as themselves, anything else as JSON (so `true`, not
`True`). A path that is missing for a given sample or item is a `template_error`, not a crash.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from training.rewards.errors import GradingError

if TYPE_CHECKING:
    from training.rewards.base import Sample

PLACEHOLDER = re.compile(r"\{\{(.*?)\}\}")
# What may follow `sample.`; only output_text has no inner structure to walk.
SAMPLE_FIELDS = ("output_text", "output_json", "output_tools", "messages", "outcome")


class TemplateSyntaxError(ValueError):
    pass


@dataclass(frozen=True)
class Template:
    """A parsed template: `parts` alternates literal text (str) and variable paths (tuples)."""

    text: str
    parts: tuple[str | tuple[str, ...], ...]

    @classmethod
    def parse(cls, text: str) -> Template:
        parts: list[str | tuple[str, ...]] = []
        position = 0
        for match in PLACEHOLDER.finditer(text):
            parts.append(text[position : match.start()])
            parts.append(_parse_path(match.group(1).strip()))
            position = match.end()
        parts.append(text[position:])
        if any(isinstance(part, str) and "{{" in part for part in parts):
            raise TemplateSyntaxError("unclosed '{{' (variables are written {{item.key}})")
        return cls(text, tuple(part for part in parts if part != ""))

    @property
    def is_literal(self) -> bool:
        return all(isinstance(part, str) for part in self.parts)

    def render(self, sample: Sample, item: dict[str, Any]) -> str:
        return "".join(
            part if isinstance(part, str) else _to_text(_lookup(part, sample, item)) for part in self.parts
        )

    def value(self, sample: Sample, item: dict[str, Any]) -> Any:
        """The looked-up value itself (a dict stays a dict) when the template is one variable and
        nothing else, as `{{item.expected}}`; otherwise the rendered text."""
        if len(self.parts) == 1 and isinstance(self.parts[0], tuple):
            return _lookup(self.parts[0], sample, item)
        return self.render(sample, item)

    @property
    def variables(self) -> list[tuple[str, ...]]:
        return [part for part in self.parts if isinstance(part, tuple)]

    def with_stand_in(self, stand_in: str) -> str:
        """The template with every variable replaced by `stand_in`, to check the literal parts."""
        return "".join(part if isinstance(part, str) else stand_in for part in self.parts)


def _parse_path(expression: str) -> tuple[str, ...]:
    path = tuple(expression.split("."))
    if not expression or "" in path:
        raise TemplateSyntaxError(f"invalid variable {{{{{expression}}}}}")
    if path[0] == "item":
        return path
    if path[0] == "sample" and len(path) >= 2 and path[1] in SAMPLE_FIELDS:
        if path[1] == "output_text" and len(path) > 2:
            raise TemplateSyntaxError(f"{{{{{expression}}}}}: sample.output_text has no fields")
        return path
    allowed = ", ".join(["item.<path>"] + [f"sample.{name}" for name in SAMPLE_FIELDS])
    raise TemplateSyntaxError(f"unknown variable {{{{{expression}}}}} (use {allowed})")


def _lookup(path: tuple[str, ...], sample: Sample, item: dict[str, Any]) -> Any:
    if path[0] == "item":
        value: Any = item
        rest = path[1:]
    else:
        value = getattr(sample, path[1])  # output_json may raise sample_parse_error here
        rest = path[2:]
    for key in rest:
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and key.isdecimal() and len(key) < 19 and int(key) < len(value):
            value = value[int(key)]
        else:
            raise GradingError("template_error", f"{'.'.join(path)} not found (no {key!r})")
    return value


def _to_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
