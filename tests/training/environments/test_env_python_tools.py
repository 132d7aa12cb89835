"""python_tools: the built-in tools (safe arithmetic, units, the row's facts, a fixed clock) and
whole episodes through the agent loop, scripted and sampled from the tiny model."""

import json
import re

import pytest

from training.base_models import load_base_model
from training.engines.base import SamplingParams
from training.engines.transformers_engine import TransformersEngine
from training.environments import build_environment
from training.environments.python_tools import calculate, convert_units
from training.rewards import grade_trajectories
from training.rollouts.agent import rollout_groups
from training.rollouts.trajectory import to_train_group

SAMPLING = SamplingParams(max_new_tokens=48, seed=0)


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.mark.parametrize(
    ("expression", "value"),
    [("2 + 3 * 4", 14), ("(2 + 3) * 4", 20), ("7 / 2", 3.5), ("2 ^ 10", 1024), ("sqrt(16) + abs(-2)", 6),
     ("-3 ** 2", -9), ("10 // 3 + 10 % 3", 4), ("round(pi, 2)", 3.14)],
)  # fmt: skip
def test_calculator_does_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("__import__('os').system('true')", "unsupported"),
        ("().__class__", "unsupported"),
        ("open('/etc/passwd')", "unsupported"),
        ("x + 1", "unsupported"),
        ("9 ** 9 ** 9", "power too large"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 300, "longer than"),
    ],
)
def test_calculator_refuses_anything_but_arithmetic(expression, error):
    with pytest.raises(ValueError, match=error):
        calculate(expression)


def test_unit_converter_converts_within_a_dimension_only():
    assert convert_units(5, "km", "m") == 5000
    assert convert_units(1, "mile", "km") == pytest.approx(1.609344)
    assert convert_units(100, "celsius", "fahrenheit") == 212
    assert convert_units(32, "F", "C") == 0
    with pytest.raises(ValueError, match="cannot convert length"):
        convert_units(1, "km", "kg")
    with pytest.raises(ValueError, match="unknown unit 'parsec'"):
        convert_units(1, "parsec", "m")


def test_lookup_reads_each_rows_own_facts_and_the_clock_is_fixed(policy_engine):
    env = build_environment(
        "python_tools",
        tools=["lookup", "current_time"],
        max_turns=3,
        config={"now": "2026-03-04T09:30:00+00:00"},
    )
    rows = [
        {"prompt": "Capital of Zorbia?", "item": {"facts": {"capital of Zorbia": "Quel"}}},
        {"prompt": "Capital of Mirth?", "item": {"facts": {"capital of Mirth": "Ost"}}},
    ]

    def policy(text: str) -> str:
        if "<|im_start|>tool" not in text:
            country = re.findall(r"Capital of (\w+)\?", text)[-1]
            return call("lookup", key=f"capital of {country}") + call("current_time")
        return "It is " + re.findall(r'tool\n"?(\w+)"?<\|im_end\|>', text)[0] + "."

    groups = rollout_groups(policy_engine(policy), rows, env, SAMPLING, group_size=1)
    (zorbia,), (mirth,) = groups
    tool_replies = [m["content"] for m in zorbia.messages if m["role"] == "tool"]
    assert tool_replies[0] == "Quel"
    assert json.loads(tool_replies[1]) == {
        "iso": "2026-03-04T09:30:00+00:00", "date": "2026-03-04", "time": "09:30", "weekday": "Wednesday"
    }  # fmt: skip
    assert zorbia.output_text == "It is Quel." and mirth.output_text == "It is Ost."
    assert [m["content"] for m in mirth.messages if m["role"] == "tool"][0] == "Ost"
    assert zorbia.output_tools[0] == {"name": "lookup", "arguments": {"key": "capital of Zorbia"}}
    assert zorbia.outcome == {}

    # A key the row does not have is an error the model reads, counted in the metrics.
    (missing,) = rollout_groups(
        policy_engine(lambda text: call("lookup", key="moon") if "tool\n" not in text else "Unknown."),
        [rows[0]],
        env,
        SAMPLING,
        group_size=1,
    )[0]
    error = json.loads(missing.messages[3]["content"])["error"]
    assert error == "KeyError: \"no fact named 'moon' (known: capital of Zorbia)\""
    assert missing.metrics == {"turns": 2, "tool_calls": 1, "tool_errors": 1, "tool_timeouts": 0}


def test_a_policy_writing_a_huge_number_in_a_tool_call_gets_an_error_turn_not_a_failed_step(policy_engine):
    env = build_environment("python_tools", tools=["calculator"], max_turns=2)
    huge = "1" * 5000  # past Python's 4,300-digit int limit: json.loads raises ValueError
    reply = '<tool_call>{"name": "calculator", "arguments": {"expression": ' + huge
    engine = policy_engine(lambda text: reply)
    ((trajectory,),) = rollout_groups(engine, [{"prompt": "1+1?", "item": {}}], env, SAMPLING, group_size=1)
    assert trajectory.metrics["tool_errors"] >= 1


def test_a_multi_turn_tool_episode_is_token_exact_and_graded_by_tool_use(policy_engine, token_exact):
    env = build_environment("python_tools", tools=["calculator"], max_turns=4)
    script = iter([call("calculator", expression="12 * 7"), call("calculator", expression="84 + 1"), "85"])
    engine = policy_engine(lambda text: next(script))
    row = {"prompt": "What is 12 * 7 + 1?", "item": {"answer": "85"}}
    ((trajectory,),) = rollout_groups(engine, [row], env, SAMPLING, group_size=1)

    assert [m["role"] for m in trajectory.messages] == [
        "system", "user", "assistant", "tool", "assistant", "tool", "assistant"
    ]  # fmt: skip
    assert [m["content"] for m in trajectory.messages if m["role"] == "tool"] == ["84", "85"]
    assert trajectory.metrics == {"turns": 3, "tool_calls": 2, "tool_errors": 0, "tool_timeouts": 0}
    token_exact(engine, trajectory)
    assert sum(trajectory.completion_mask) == sum(len(c[0].token_ids) for c in engine.choices)

    spec = {
        "type": "multi",
        "graders": {
            "used": {"type": "tool_call", "tool": "calculator"},
            "right": {"type": "string_check", "input": "{{sample.output_text}}", "reference": "{{item.answer}}", "operation": "eq"},
            "turns": {"type": "python", "source": "def grade(sample, item):\n    return len(sample['messages']) / 10"},
        },
        "calculate_output": "(used + right + turns) / 3",
    }  # fmt: skip
    grade_trajectories(spec, [[trajectory]], [{"index": 0, "data": row}], max_error_fraction=0.0)
    assert trajectory.sub_rewards == {"used": 1.0, "right": 1.0, "turns": 0.7}
    assert trajectory.reward == pytest.approx(2.7 / 3)


def test_the_tiny_model_samples_whole_episodes_with_consistent_tokens(tiny_model_dir, tmp_path):
    model, tokenizer = load_base_model(str(tiny_model_dir), tmp_path)
    engine = TransformersEngine(model.eval(), tokenizer)
    env = build_environment("python_tools", tools=["calculator"], max_turns=3)
    rows = [
        {"prompt": "What is 2 + 2?", "item": {"answer": "4"}},
        {"prompt": "And 3 * 3?", "item": {"answer": "9"}},
    ]
    groups = rollout_groups(engine, rows, env, SamplingParams(max_new_tokens=16, seed=1), group_size=2)
    for group in groups:
        assert len(group) == 2
        train_group = to_train_group(group)
        for trajectory, sample in zip(group, train_group.samples, strict=True):
            assert 1 <= trajectory.metrics["turns"] <= 3
            assert (
                len(trajectory.completion_token_ids)
                == len(trajectory.completion_mask)
                == len(trajectory.logprobs)
            )
            assert sum(trajectory.completion_mask) >= trajectory.metrics["turns"]
            assert sample.completion_mask == trajectory.completion_mask
            assert trajectory.messages[0]["content"].startswith("You can call tools.")
            assert trajectory.outcome == {}
