"""`python_tools`: vetted tools shipped with the platform, declared by JSON schemas.

    {"kind": "python_tools", "tools": ["calculator", "lookup"], "max_turns": 4,
     "config": {"now": "2026-01-01T12:00:00+00:00", "lookup_field": "facts"}}

`tools` names the tools to enable (empty: all of them):
- `calculator(expression)`: arithmetic (+ - * / // % **, parentheses, sqrt/abs/round/min/max),
  parsed with `ast` and evaluated node by node, never `eval`; huge powers are refused.
- `convert_units(value, from_unit, to_unit)`: length, mass, volume, time, temperature.
- `lookup(key)`: the task row's own facts, `row["item"][config.lookup_field][key]` (default field
  `facts`), so each task carries the data its questions need: `{"item": {"facts": {"capital": ...}}}`.
- `current_time()`: the fixed time `config.now` (ISO 8601), so answers are reproducible.

A turn without a tool call is the final answer (output_text); every call is in output_tools.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from datetime import datetime
from typing import Any, ClassVar

from training.environments.base import (
    TOOL_CALLING_ANSWER,
    ConfigError,
    Environment,
    EpisodeState,
    _item,
    _object,
    _turns,
    known_keys,
)
from training.rollouts.tools import Tool

DEFAULT_NOW = "2026-01-01T12:00:00+00:00"
CONFIG_HELP = {
    "now": f"ISO 8601 time the current_time tool reports (default {DEFAULT_NOW})",
    "lookup_field": "key of the task row's item holding the lookup tool's facts (default 'facts')",
}


class PythonToolsEnvironment(Environment):
    kind: ClassVar[str] = "python_tools"
    description: ClassVar[str] = (
        "The model may call built-in tools (calculator, unit converter, fact lookup over the task row's "
        "item, a fixed clock); a turn without a tool call is its final answer."
    )
    answer: ClassVar[str] = TOOL_CALLING_ANSWER
    default_max_turns: ClassVar[int] = 4
    config_help: ClassVar[dict[str, str]] = CONFIG_HELP
    tools_help: ClassVar[str] = "names of built-in tools to enable; empty enables all"

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        self.lookup_field: str = self.config.get("lookup_field", "facts")
        self.now: str = self.config.get("now", DEFAULT_NOW)

    @classmethod
    def validate(cls, config: Any, tools: Any, max_turns: int | None) -> dict[str, Any]:
        config = _object(config, "config")
        known_keys(config, CONFIG_HELP)
        if "now" in config:
            if not isinstance(config["now"], str):
                raise ConfigError("config.now", "must be an ISO 8601 time string")
            try:
                datetime.fromisoformat(config["now"])
            except ValueError:
                raise ConfigError(
                    "config.now", "must be an ISO 8601 time, e.g. 2026-01-01T12:00:00+00:00"
                ) from None
        if "lookup_field" in config and not (
            isinstance(config["lookup_field"], str) and config["lookup_field"]
        ):
            raise ConfigError("config.lookup_field", "must be a non-empty string")
        names = tool_names(tools)
        return {"config": config, "tools": names, "max_turns": _turns(max_turns, cls.default_max_turns)}

    @classmethod
    def tool_arguments(cls, tools: list[Any], config: dict[str, Any]) -> dict[str, Any]:
        return {"tools": build_tools(tools, config)}

    @classmethod
    def available_tools(cls) -> list[dict[str, Any]]:
        return [
            tool.schema()["function"]
            for tool in builtin_tools(item={}, lookup_field="facts", now=DEFAULT_NOW)
        ]

    def start(self, row: dict[str, Any], *, seed: int | None = None) -> EpisodeState:
        state = super().start(row, seed=seed)
        # lookup reads this row's facts: the episode gets its own bound copies of the tools.
        item = _item(row)
        bound = {
            tool.name: tool for tool in builtin_tools(item=item, lookup_field=self.lookup_field, now=self.now)
        }
        state.tools = [bound[tool.name] for tool in self.tools]
        return state


def tool_names(tools: Any) -> list[str]:
    """The enabled tool names, validated; empty means all."""
    if tools is None:
        return []
    if not isinstance(tools, list) or not all(isinstance(name, str) for name in tools):
        raise ConfigError("tools", f"must be a list of tool names ({', '.join(BUILTIN_NAMES)})")
    for name in tools:
        if name not in BUILTIN_NAMES:
            raise ConfigError("tools", f"unknown tool {name!r} (built-in tools: {', '.join(BUILTIN_NAMES)})")
    if len(set(tools)) != len(tools):
        raise ConfigError("tools", "lists a tool twice")
    return list(tools)


def build_tools(names: list[str], config: dict[str, Any]) -> list[Tool]:
    """The Tool objects shown to the model (functions bound to an empty item; `start` rebinds)."""
    tools = builtin_tools(
        item={}, lookup_field=config.get("lookup_field", "facts"), now=config.get("now", DEFAULT_NOW)
    )
    by_name = {tool.name: tool for tool in tools}
    return [by_name[name] for name in (names or BUILTIN_NAMES)]


def builtin_tools(*, item: dict[str, Any], lookup_field: str, now: str) -> list[Tool]:
    raw_facts = item.get(lookup_field)
    facts: dict[str, Any] = raw_facts if isinstance(raw_facts, dict) else {}

    def lookup(key: str) -> Any:
        if not isinstance(key, str):
            raise ValueError("key must be a string")
        if key in facts:
            return facts[key]
        folded = {str(k).casefold(): v for k, v in facts.items()}
        if key.strip().casefold() in folded:
            return folded[key.strip().casefold()]
        raise KeyError(f"no fact named {key!r} (known: {', '.join(map(str, facts)) or 'none'})")

    def current_time() -> dict[str, str]:
        moment = datetime.fromisoformat(now)
        return {
            "iso": moment.isoformat(),
            "date": moment.date().isoformat(),
            "time": moment.strftime("%H:%M"),
            "weekday": moment.strftime("%A"),
        }

    return [
        Tool(
            "calculator",
            "Evaluate an arithmetic expression, e.g. '(12 + 7) * 3' or 'sqrt(2) ** 2'.",
            {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "the expression"}},
                "required": ["expression"],
            },
            calculate,
        ),
        Tool(
            "convert_units",
            f"Convert a value between units ({', '.join(sorted(UNITS))}, celsius, fahrenheit, kelvin).",
            {
                "type": "object",
                "properties": {
                    "value": {"type": "number"},
                    "from_unit": {"type": "string"},
                    "to_unit": {"type": "string"},
                },
                "required": ["value", "from_unit", "to_unit"],
            },
            convert_units,
        ),
        Tool(
            "lookup",
            "Look up a fact about this task by its key.",
            {
                "type": "object",
                "properties": {"key": {"type": "string", "description": "the fact's name"}},
                "required": ["key"],
            },
            lookup,
        ),
        Tool(
            "current_time",
            "The current date and time.",
            {"type": "object", "properties": {}},
            current_time,
        ),
    ]


BUILTIN_NAMES = ("calculator", "convert_units", "lookup", "current_time")

# ------------------------------------------------------------------------------- calculator

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "sqrt": math.sqrt,
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
    "floor": math.floor,
    "ceil": math.ceil,
}
_CONSTANTS = {"pi": math.pi, "e": math.e}
MAX_EXPRESSION = 200
MAX_MAGNITUDE = 1e100


def calculate(expression: str) -> int | float:
    """Arithmetic only: the expression is parsed, and only numbers, operators and a few functions
    are evaluated. Anything else (names, attributes, calls to other functions) is refused."""
    if not isinstance(expression, str):
        raise ValueError("expression must be a string")
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.replace("^", "**").replace("×", "*").replace("÷", "/"), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return round(value, 10) if isinstance(value, float) else value


def _evaluate(node: ast.AST) -> Any:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    ):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (
            abs(right) > 1000 or (abs(left) > 1 and abs(right) * math.log10(abs(left)) > 100)
        ):
            raise ValueError("power too large")
        result = _BINARY[type(node.op)](left, right)
        if abs(result) > MAX_MAGNITUDE:
            raise ValueError("result too large")
        return result
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCTIONS
        and not node.keywords
    ):
        return _FUNCTIONS[node.func.id](*[_evaluate(argument) for argument in node.args])
    raise ValueError(f"unsupported in an arithmetic expression: {ast.unparse(node)!r}")


# ------------------------------------------------------------------------------- units

# Factors to the base unit of each dimension (metre, kilogram, litre, second).
UNITS: dict[str, tuple[str, float]] = {
    "mm": ("length", 0.001),
    "cm": ("length", 0.01),
    "m": ("length", 1.0),
    "km": ("length", 1000.0),
    "in": ("length", 0.0254),
    "ft": ("length", 0.3048),
    "yd": ("length", 0.9144),
    "mi": ("length", 1609.344),
    "g": ("mass", 0.001),
    "kg": ("mass", 1.0),
    "lb": ("mass", 0.45359237),
    "oz": ("mass", 0.028349523125),
    "ml": ("volume", 0.001),
    "l": ("volume", 1.0),
    "gal": ("volume", 3.785411784),
    "s": ("time", 1.0),
    "min": ("time", 60.0),
    "h": ("time", 3600.0),
    "day": ("time", 86400.0),
}
_ALIASES = {
    "meter": "m", "meters": "m", "metre": "m", "metres": "m", "kilometer": "km", "kilometers": "km",
    "kilometre": "km", "kilometres": "km", "centimeter": "cm", "centimeters": "cm", "millimeter": "mm",
    "millimeters": "mm", "inch": "in", "inches": "in", "foot": "ft", "feet": "ft", "yard": "yd",
    "yards": "yd", "mile": "mi", "miles": "mi", "gram": "g", "grams": "g", "kilogram": "kg",
    "kilograms": "kg", "pound": "lb", "pounds": "lb", "lbs": "lb", "ounce": "oz", "ounces": "oz",
    "liter": "l", "liters": "l", "litre": "l", "litres": "l", "milliliter": "ml", "milliliters": "ml",
    "gallon": "gal", "gallons": "gal", "second": "s", "seconds": "s", "minute": "min", "minutes": "min",
    "hour": "h", "hours": "h", "days": "day", "c": "celsius", "°c": "celsius", "f": "fahrenheit",
    "°f": "fahrenheit", "k": "kelvin",
}  # fmt: skip
_TEMPERATURES = ("celsius", "fahrenheit", "kelvin")


def convert_units(value: float, from_unit: str, to_unit: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("value must be a number")
    source, target = _unit(from_unit), _unit(to_unit)
    if source in _TEMPERATURES or target in _TEMPERATURES:
        if not (source in _TEMPERATURES and target in _TEMPERATURES):
            raise ValueError(f"cannot convert {from_unit} to {to_unit}")
        kelvin = {"celsius": value + 273.15, "fahrenheit": (value - 32) * 5 / 9 + 273.15, "kelvin": value}[
            source
        ]
        result = {"celsius": kelvin - 273.15, "fahrenheit": (kelvin - 273.15) * 9 / 5 + 32, "kelvin": kelvin}[
            target
        ]
        return round(result, 6)
    (source_dimension, source_factor), (target_dimension, target_factor) = UNITS[source], UNITS[target]
    if source_dimension != target_dimension:
        raise ValueError(f"cannot convert {source_dimension} ({from_unit}) to {target_dimension} ({to_unit})")
    return round(value * source_factor / target_factor, 6)


def _unit(name: str) -> str:
    if not isinstance(name, str):
        raise ValueError("units must be strings")
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in UNITS and key not in _TEMPERATURES:
        raise ValueError(f"unknown unit {name!r}")
    return key
