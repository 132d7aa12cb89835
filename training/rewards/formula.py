"""The `calculate_output` formula of a `multi` grader: arithmetic over sub-grader names.

    0.7 * accuracy + 0.3 * max(format, 0.5) - 0.1 * abs(length - 1) ^ 2

Operators, loosest first: `+ -`, `* /`, unary `-`/`+`, `^` (right-associative, so `2^3^2` is 2^9,
and `-2^2` is -(2^2) as in mathematics). Functions: min, max (one or more arguments), abs, floor,
ceil, exp, sqrt, log (natural; one argument). A precedence-climbing parser builds a small tree;
nothing is ever passed to `eval`. Parse errors carry the 0-based character position.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

MAX_LENGTH = 2000
MAX_DEPTH = 64

ONE_ARGUMENT: dict[str, Callable[[float], float]] = {
    "abs": abs,
    "floor": math.floor,
    "ceil": math.ceil,
    "exp": math.exp,
    "sqrt": math.sqrt,
    "log": math.log,
}
FUNCTIONS = ("min", "max", *ONE_ARGUMENT)
BINARY_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2, "^": 4}
UNARY_PRECEDENCE = 3  # binds tighter than * and /, looser than ^
TOKEN = re.compile(
    r"\s*(?:(?P<number>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)|(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<op>[-+*/^(),]))"
)


class FormulaError(ValueError):
    """A formula that does not parse; `position` is the 0-based offset of the offending token."""

    def __init__(self, message: str, position: int) -> None:
        self.message = message
        self.position = position
        super().__init__(f"formula_parse_error at position {position}: {message}")


class FormulaEvaluationError(ArithmeticError):
    """A formula that parses but has no finite value for these inputs (1/0, sqrt(-1), overflow)."""


@dataclass(frozen=True)
class Number:
    value: float


@dataclass(frozen=True)
class Name:
    name: str


@dataclass(frozen=True)
class Unary:
    op: str
    operand: Node


@dataclass(frozen=True)
class Binary:
    op: str
    left: Node
    right: Node


@dataclass(frozen=True)
class Call:
    function: str
    arguments: tuple[Node, ...]


Node = Number | Name | Unary | Binary | Call


@dataclass(frozen=True)
class Token:
    kind: str  # "number", "name", "op" or "end"
    text: str
    position: int


@dataclass(frozen=True)
class Formula:
    text: str
    tree: Node
    names: frozenset[str]  # the variables it reads

    def evaluate(self, values: dict[str, float]) -> float:
        try:
            result = _evaluate(self.tree, values)
        except ZeroDivisionError:
            raise FormulaEvaluationError("division by zero") from None
        except OverflowError:
            raise FormulaEvaluationError("numeric overflow") from None
        except ValueError as error:  # math domain errors: sqrt(-1), log(0), (-8)^(1/3)
            raise FormulaEvaluationError(f"math domain error ({error})") from None
        if not math.isfinite(result):
            raise FormulaEvaluationError(f"result is {result}")
        return result


def parse_formula(text: str, names: set[str] | None = None) -> Formula:
    """Parse `text`; with `names`, every variable must be one of them."""
    if len(text) > MAX_LENGTH:
        raise FormulaError(f"longer than {MAX_LENGTH} characters", MAX_LENGTH)
    parser = _Parser(_tokenize(text))
    tree = parser.expression(0, 0)
    end = parser.peek()
    if end.kind != "end":
        raise FormulaError(f"unexpected {end.text!r}", end.position)
    if names is not None:
        for position, name in parser.variables:
            if name not in names:
                known = ", ".join(sorted(names)) or "none"
                raise FormulaError(f"unknown name {name!r} (sub-graders: {known})", position)
    return Formula(text, tree, frozenset(name for _, name in parser.variables))


def _tokenize(text: str) -> list[Token]:
    tokens = []
    position = 0
    while True:
        match = TOKEN.match(text, position)
        if match is None or match.end() == position:
            rest = len(text) - len(text[position:].lstrip())
            if rest == len(text):
                break
            raise FormulaError(f"unexpected character {text[rest]!r}", rest)
        kind = match.lastgroup or "op"
        tokens.append(Token(kind, match.group(kind), match.start(kind)))
        position = match.end()
    tokens.append(Token("end", "end of formula", len(text)))
    return tokens


class _Parser:
    def __init__(self, tokens: list[Token]) -> None:
        self.tokens = tokens
        self.index = 0
        self.variables: list[tuple[int, str]] = []

    def peek(self) -> Token:
        return self.tokens[self.index]

    def take(self) -> Token:
        token = self.tokens[self.index]
        self.index += 1
        return token

    def expect(self, text: str) -> Token:
        token = self.take()
        if token.text != text or token.kind != "op":
            raise FormulaError(f"expected {text!r} but found {token.text!r}", token.position)
        return token

    def expression(self, min_precedence: int, depth: int) -> Node:
        if depth > MAX_DEPTH:
            raise FormulaError(f"nested more than {MAX_DEPTH} deep", self.peek().position)
        left = self.unary(depth)
        while True:
            token = self.peek()
            precedence = BINARY_PRECEDENCE.get(token.text) if token.kind == "op" else None
            if precedence is None or precedence < min_precedence:
                return left
            self.take()
            # Right-associative ^ parses its right side at its own level; the others one above.
            next_min = precedence if token.text == "^" else precedence + 1
            left = Binary(token.text, left, self.expression(next_min, depth + 1))

    def unary(self, depth: int) -> Node:
        token = self.peek()
        if token.kind == "op" and token.text in "+-":
            self.take()
            return Unary(token.text, self.expression(UNARY_PRECEDENCE, depth + 1))
        return self.primary(depth)

    def primary(self, depth: int) -> Node:
        token = self.take()
        if token.kind == "number":
            return Number(float(token.text))
        if token.kind == "name":
            if token.text in FUNCTIONS:
                return self.call(token, depth)
            self.variables.append((token.position, token.text))
            return Name(token.text)
        if token.kind == "op" and token.text == "(":
            inner = self.expression(0, depth + 1)
            self.expect(")")
            return inner
        if token.kind == "end":
            raise FormulaError("unexpected end of formula", token.position)
        raise FormulaError(f"unexpected {token.text!r}", token.position)

    def call(self, function: Token, depth: int) -> Node:
        opening = self.peek()
        if opening.text != "(":
            raise FormulaError(f"function {function.text} needs '(' and arguments", opening.position)
        self.take()
        arguments = [self.expression(0, depth + 1)]
        while self.peek().text == ",":
            self.take()
            arguments.append(self.expression(0, depth + 1))
        self.expect(")")
        if function.text in ONE_ARGUMENT and len(arguments) != 1:
            raise FormulaError(f"{function.text} takes one argument, got {len(arguments)}", function.position)
        return Call(function.text, tuple(arguments))


def _evaluate(node: Node, values: dict[str, float]) -> float:
    if isinstance(node, Number):
        return node.value
    if isinstance(node, Name):
        return values[node.name]
    if isinstance(node, Unary):
        operand = _evaluate(node.operand, values)
        return -operand if node.op == "-" else operand
    if isinstance(node, Binary):
        left, right = _evaluate(node.left, values), _evaluate(node.right, values)
        if node.op == "+":
            return left + right
        if node.op == "-":
            return left - right
        if node.op == "*":
            return left * right
        if node.op == "/":
            return left / right
        return math.pow(left, right)  # never complex, unlike **: raises ValueError instead
    arguments = [_evaluate(argument, values) for argument in node.arguments]
    if node.function == "min":
        return min(arguments)
    if node.function == "max":
        return max(arguments)
    return float(ONE_ARGUMENT[node.function](arguments[0]))
