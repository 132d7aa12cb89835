import math

import pytest

from training.rewards.formula import FormulaError, FormulaEvaluationError, parse_formula


def value(text, **names):
    return parse_formula(text, set(names)).evaluate(names)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("10 - 4 - 3", 3),  # left-associative
        ("16 / 4 / 2", 2),
        ("2 ^ 3 ^ 2", 512),  # right-associative: 2^(3^2)
        ("(2 ^ 3) ^ 2", 64),
        ("-2 ^ 2", -4),  # unary minus binds looser than ^
        ("2 ^ -1", 0.5),
        ("-3 * -2", 6),
        ("--3", 3),
        ("+4 - -1", 5),
        ("2 * 3 ^ 2", 18),
        ("1.5e1 + .5", 15.5),
        ("min(3, 1, 2) + max(4)", 5),
        ("abs(-2) + floor(2.7) + ceil(2.1)", 7),
        ("sqrt(16) + log(exp(2))", 6),
        ("max(min(1, 2), -abs(-5))", 1),
    ],
)
def test_precedence_associativity_and_functions(text, expected):
    assert value(text) == pytest.approx(expected)


def test_names_are_sub_grader_rewards():
    assert value("0.7 * accuracy + 0.3 * style", accuracy=1.0, style=0.5) == pytest.approx(0.85)
    formula = parse_formula("a * b + a", {"a", "b", "c"})
    assert formula.names == frozenset({"a", "b"})


@pytest.mark.parametrize(
    ("text", "position", "message"),
    [
        ("1 +", 3, "unexpected end of formula"),
        ("(1 + 2", 6, "expected ')'"),
        ("1 + 2)", 5, "unexpected ')'"),
        ("a b", 2, "unexpected 'b'"),
        ("1 $ 2", 2, "unexpected character '$'"),
        ("sqrt(1, 2)", 0, "sqrt takes one argument, got 2"),
        ("max()", 4, "unexpected ')'"),
        ("min + 1", 4, "function min needs '('"),
        ("accuracy + styel", 11, "unknown name 'styel' (sub-graders: accuracy, style)"),
        ("", 0, "unexpected end of formula"),
        ("2 * * 3", 4, "unexpected '*'"),
    ],
)
def test_parse_errors_carry_the_position(text, position, message):
    with pytest.raises(FormulaError) as caught:
        parse_formula(text, {"accuracy", "style"})
    assert caught.value.position == position
    assert message in caught.value.message
    assert str(caught.value).startswith(f"formula_parse_error at position {position}: ")


def test_deep_nesting_and_long_formulas_are_refused():
    with pytest.raises(FormulaError, match="nested more than"):
        parse_formula("(" * 100 + "1" + ")" * 100)
    with pytest.raises(FormulaError, match="longer than"):
        parse_formula("1+" * 1500 + "1")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1 / a", "division by zero"),
        ("sqrt(a - 1)", "math domain error"),
        ("log(a)", "math domain error"),
        ("(a - 8) ^ (1 / 3)", "math domain error"),  # no complex results
        ("exp(1000)", "overflow"),
        ("10 ^ 400", "overflow"),
    ],
)
def test_values_without_a_finite_result_raise_an_evaluation_error(text, message):
    with pytest.raises(FormulaEvaluationError, match=message):
        parse_formula(text, {"a"}).evaluate({"a": 0.0})


def test_never_evaluates_python():
    with pytest.raises(FormulaError):
        parse_formula("__import__('os').system('true')")
    assert math.isfinite(value("1"))
