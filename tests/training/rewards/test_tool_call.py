import time

import pytest

from training.rewards import GraderSpecError, Sample, SandboxConfig, build_grader, validate_grader

WEATHER = {
    "type": "tool_call",
    "tool": "get_weather",
    "arguments": {"city": "{{item.city}}", "units": "metric"},
    "argument_patterns": {"date": r"\d{4}-\d{2}-\d{2}"},
}


def call(name, **arguments):
    return {"name": name, "arguments": arguments}


def grade(spec, tools, item=None):
    return build_grader(spec).grade(Sample(output_text="", output_tools=tools), item or {"city": "Paris"})


@pytest.mark.parametrize(
    ("tools", "all_reward", "fraction_reward"),
    [
        ([call("get_weather", city="Paris", units="metric", date="2025-01-31")], 1.0, 1.0),
        ([call("get_weather", city="Paris", units="imperial", date="2025-01-31")], 0.0, 2 / 3),
        ([call("get_weather", city="Lyon", units="imperial", date="tomorrow")], 0.0, 0.0),
        ([call("search", city="Paris", units="metric", date="2025-01-31")], 0.0, 0.0),
        ([], 0.0, 0.0),
        # The best call counts.
        (
            [
                call("get_weather", city="Lyon"),
                call("get_weather", city="Paris", units="metric", date="2025-01-31"),
            ],
            1.0,
            1.0,
        ),
    ],
)
def test_scoring_all_or_fraction(tools, all_reward, fraction_reward):
    assert grade(WEATHER, tools).reward == all_reward
    assert grade({**WEATHER, "scoring": "fraction"}, tools).reward == pytest.approx(fraction_reward)


def test_just_calling_the_tool():
    spec = {"type": "tool_call", "tool": "search"}
    assert grade(spec, [call("search")]).reward == 1.0
    result = grade(spec, [call("lookup")])
    assert (result.reward, result.errors, result.scores["calls"]) == (0.0, [], 0)


def test_calls_are_read_from_openai_style_messages_with_json_string_arguments():
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "units": "metric", "date": "2025-02-01"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12C"},
        {"role": "assistant", "content": "It is 12C."},
    ]
    sample = Sample(output_text="It is 12C.", messages=messages)
    assert sample.output_tools[0]["name"] == "get_weather"
    assert build_grader(WEATHER).grade(sample, {"city": "Paris"}).reward == 1.0


def test_nested_arguments_typed_values_and_unparseable_arguments():
    spec = {
        "type": "tool_call",
        "tool": "book",
        "arguments": {"guest.count": "{{item.count}}", "confirm": True},
    }
    ok = [{"name": "book", "arguments": {"guest": {"count": 2}, "confirm": True}}]
    assert grade(spec, ok, {"count": 2}).reward == 1.0
    assert (
        grade(
            spec, [{"name": "book", "arguments": {"guest": {"count": "2"}, "confirm": 1}}], {"count": 2}
        ).reward
        == 0.0
    )
    assert grade(spec, [{"name": "book", "arguments": "{not json"}], {"count": 2}).errors == []


def test_spec_problems():
    spec = {
        "type": "tool_call",
        "tool": "{{item.tool",
        "argument_patterns": {"a": "(", "b": 3},
        "scoring": "some",
    }
    with pytest.raises(GraderSpecError) as caught:
        validate_grader(spec)
    assert {p["path"] for p in caught.value.problems} == {
        "grader.tool",
        "grader.argument_patterns.a",
        "grader.argument_patterns.b",
        "grader.scoring",
    }


def test_a_catastrophic_argument_pattern_is_a_regex_timeout_error():
    # Python's `re` takes hours on this; the regex package stops at the operator's timeout.
    spec = {"type": "tool_call", "tool": "f", "argument_patterns": {"x": "^(a|a)+$"}, "error_reward": -1}
    grader = build_grader(spec, sandbox=SandboxConfig(regex_timeout_seconds=0.3))
    started = time.process_time()  # what the timeout counts
    result = grader.grade(Sample(output_text="", output_tools=[call("f", x="a" * 40 + "b")]), {})
    assert time.process_time() - started < 0.6
    assert [error["code"] for error in result.errors] == ["regex_timeout"]
    assert result.reward == -1.0


def test_an_argument_pattern_too_large_to_compile_is_refused():
    with pytest.raises(GraderSpecError, match="repeats too large"):
        validate_grader({"type": "tool_call", "tool": "f", "argument_patterns": {"x": "x{4294967294}"}})
