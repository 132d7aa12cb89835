"""OpenAI's fine-tuning lines with tools (issue 56) as task rows and back
(projects.services.fine_tuning_rows): tools, tool_calls, tool messages, weight 0 and
parallel_tool_calls in all three formats; each bad one named by its field; every row written back
by ``openai_line`` as the line it came from."""

from __future__ import annotations

import copy
import json

import pytest

from projects.errors import ValidationFailed
from projects.services import task_sets
from projects.services.fine_tuning_rows import _RowError, openai_line, task_row

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def call(call_id: str, city: str) -> dict:
    arguments = json.dumps({"city": city})
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def supervised_line() -> dict:
    return {
        "messages": [
            {"role": "developer", "content": "Answer with the weather."},
            {"role": "user", "content": "Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call("c1", "Paris")]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "assistant", "content": "Maybe sunny.", "weight": 0},
            {"role": "user", "content": "Sure?"},
            {"role": "assistant", "content": "Sunny in Paris."},
        ],
        "tools": [WEATHER],
        "parallel_tool_calls": False,
    }


def test_a_supervised_line_with_tools_keeps_calls_tool_messages_and_weights():
    row = task_row(supervised_line())
    assert row["tools"] == [WEATHER] and row["parallel_tool_calls"] is False
    assert row["completion"] == "Sunny in Paris."  # the last reply as every supervised row's
    assert row["item"] == {"reference": "Sunny in Paris."}  # tools are not the grader's item
    assert row["messages"] == [
        {"role": "system", "content": "Answer with the weather."},
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call("c1", "Paris")]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "assistant", "content": "Maybe sunny.", "weight": 0},
        {"role": "user", "content": "Sure?"},
    ]


def test_a_supervised_line_ending_in_a_call_or_a_weight_0_reply_keeps_its_targets_in_the_messages():
    calling = {"messages": [{"role": "user", "content": "Rome?"},
                            {"role": "assistant", "content": "", "tool_calls": [call("a", "Rome"), call("b", "Oslo")]}],
               "tools": [WEATHER]}  # fmt: skip
    row = task_row(calling)
    assert "completion" not in row and row["messages"][-1]["tool_calls"] == [
        call("a", "Rome"),
        call("b", "Oslo"),
    ]
    ending_in_context = supervised_line()
    ending_in_context["messages"][-1]["weight"] = 0
    row = task_row(ending_in_context)
    assert "completion" not in row and row["messages"][-1] == {
        "role": "assistant",
        "content": "Sunny in Paris.",
        "weight": 0,
    }
    assert row["item"] == {"reference": ""}  # the last target: the call, which says nothing


def test_a_plain_supervised_line_is_stored_as_before():
    line = {
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
        "x": 1,
    }
    assert task_row(line) == {
        "messages": [{"role": "user", "content": "Hi"}],
        "completion": "Hello",
        "item": {"x": 1, "reference": "Hello"},
    }


def test_a_reinforcement_line_offers_its_tools_and_keeps_the_rest_as_the_item():
    line = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER],
            "parallel_tool_calls": False, "expected_city": "Oslo"}  # fmt: skip
    assert task_row(line) == {
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [WEATHER],
        "parallel_tool_calls": False,
        "item": {"expected_city": "Oslo"},
    }


def test_a_preference_line_with_tools_keeps_the_outputs_calls():
    line = {
        "input": {"messages": [{"role": "user", "content": "Paris?"}], "tools": [WEATHER],
                  "parallel_tool_calls": True},
        "preferred_output": [{"role": "assistant", "content": "", "tool_calls": [call("p", "Paris")]}],
        "non_preferred_output": [{"role": "assistant", "content": "No idea."}],
    }  # fmt: skip
    row = task_row(line)
    assert row["chosen"] == {"role": "assistant", "content": "", "tool_calls": [call("p", "Paris")]}
    assert row["rejected"] == "No idea." and row["tools"] == [WEATHER] and row["parallel_tool_calls"] is True
    assert row["item"] == {"reference": ""}


@pytest.mark.parametrize(
    "line",
    [
        supervised_line(),
        {"messages": [{"role": "user", "content": "Rome?"},
                      {"role": "assistant", "content": "", "tool_calls": [call("a", "Rome")]}], "tools": [WEATHER]},
        {"messages": [{"role": "user", "content": "Oslo?"}], "tools": [WEATHER], "parallel_tool_calls": True, "k": 2},
        {"input": {"messages": [{"role": "user", "content": "Paris?"}], "tools": [WEATHER]},
         "preferred_output": [{"role": "assistant", "content": "", "tool_calls": [call("p", "Paris")]}],
         "non_preferred_output": [{"role": "assistant", "content": "No idea."}]},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
    ],
)  # fmt: skip
def test_openai_line_writes_a_row_back_as_its_line(line):
    expected = copy.deepcopy(line)
    for message in expected.get("messages", []):  # what is normalised: developer is system, no null content
        message["role"] = "system" if message["role"] == "developer" else message["role"]
        if message.get("content") is None:
            message["content"] = ""
    written = openai_line(json.loads(json.dumps(task_row(line))))
    assert written == expected
    assert task_row(written) == task_row(line)


def test_a_line_in_the_deprecated_functions_format_is_read_as_tools():
    line = {
        "messages": [
            {"role": "user", "content": "Paris?"},
            {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"role": "function", "name": "get_weather", "content": "sunny"},
            {"role": "assistant", "content": "Sunny."},
        ],
        "functions": [WEATHER["function"]],
    }  # fmt: skip
    modern = {
        "messages": [
            {"role": "user", "content": "Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call("call_1", "Paris")]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "assistant", "content": "Sunny."},
        ],
        "tools": [WEATHER],
    }
    assert task_row(line) == task_row(modern)
    assert task_row(openai_line(task_row(line))) == task_row(line)  # written back as tools


TOOLS = {"tools": [WEATHER]}
USER = {"role": "user", "content": "Paris?"}


def calling(*calls: dict) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": list(calls)}


@pytest.mark.parametrize(
    ("line", "field", "says"),
    [
        ({"messages": [USER], "tools": []}, "tools", "non-empty"),
        ({"messages": [USER], "tools": [{"type": "retrieval"}]}, "tools[0]", "function"),
        ({"messages": [USER], "tools": [WEATHER, WEATHER]}, "tools[1].function.name", "unique"),
        ({"messages": [USER], **TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls", "true or false"),
        ({"messages": [USER], "functions": [WEATHER["function"]], **TOOLS}, "functions", "not both"),
        ({"messages": [USER], "functions": [{"description": "x"}]}, "functions[0]", "function definition"),
        ({"messages": [USER, {"role": "function", "name": "get_weather", "content": "x"}]}, "messages[1].role",
         "earlier function_call"),
        ({"messages": [USER, calling(call("a", "Rome"))]}, "messages[1].tool_calls", "offers no tools"),
        ({"messages": [USER, {**calling(call("a", "Rome")), "tool_calls": [{**call("a", "R"), "id": ""}]}], **TOOLS},
         "messages[1].tool_calls[0].id", "non-empty"),
        ({"messages": [USER, calling({**call("a", "Rome"), "function": {"name": "search", "arguments": "{}"}})], **TOOLS},
         "messages[1].tool_calls[0].function.name", "row's tools"),
        ({"messages": [USER, calling({**call("a", "Rome"), "function": {"name": "get_weather", "arguments": "Rome"}})], **TOOLS},
         "messages[1].tool_calls[0].function.arguments", "JSON object"),
        ({"messages": [USER, calling(call("a", "Rome"), call("b", "Oslo"))], **TOOLS, "parallel_tool_calls": False},
         "messages[1].tool_calls", "at most one call"),
        ({"messages": [USER, calling(call("a", "Rome")), {"role": "tool", "tool_call_id": "zzz", "content": "x"},
                       {"role": "assistant", "content": "ok"}], **TOOLS},
         "messages[2].tool_call_id", "earlier assistant"),
        ({"messages": [USER, {"role": "user", "content": "x", "tool_calls": []}]}, "messages[1].tool_calls", "only an assistant"),
        ({"messages": [USER, {"role": "assistant", "content": "x", "weight": 2}]}, "messages[1].weight", "0 or 1"),
        ({"messages": [USER, {"role": "assistant", "content": "x", "weight": 0}]}, "messages", "weight 0"),
        ({"messages": [USER, {"role": "assistant", "function_call": {"name": "get_weather"}}], "functions": [WEATHER["function"]]},
         "messages[1].tool_calls[0].function.arguments", "JSON object"),
        ({"input": {"messages": [USER]}, "preferred_output": [{"role": "assistant", "function_call": {"name": "f"}}],
          "non_preferred_output": [{"role": "assistant", "content": "b"}]}, "preferred_output[0]", "chat row only"),
        ({"messages": [USER, calling(call("a", "Rome")), {"role": "tool", "tool_call_id": "a", "content": "x"}], **TOOLS},
         "messages[1]", "reinforcement row's prompt"),
        ({"input": {"messages": [USER], "tools": "all"}, "preferred_output": [{"role": "assistant", "content": "a"}],
          "non_preferred_output": [{"role": "assistant", "content": "b"}]}, "input.tools", "non-empty"),
        ({"input": {"messages": [USER], "tool_choice": "auto"}, "preferred_output": [], "non_preferred_output": []},
         "input.tool_choice", "unknown field"),
        ({"input": {"messages": [USER]}, "preferred_output": [calling(call("a", "Rome"))],
          "non_preferred_output": [{"role": "assistant", "content": "b"}]}, "preferred_output[0].tool_calls", "offers no tools"),
        ({"input": {"messages": [USER]}, "preferred_output": [{"role": "assistant", "content": "a", "weight": 0}],
          "non_preferred_output": [{"role": "assistant", "content": "b"}]}, "preferred_output[0].weight", "target"),
    ],
)  # fmt: skip
def test_a_bad_tools_line_names_its_field(line, field, says):
    with pytest.raises(_RowError) as caught:
        task_row(line)
    assert caught.value.field == field and says in caught.value.message, (
        caught.value.field,
        caught.value.message,
    )


@pytest.mark.parametrize(
    "tools", [{"get_weather": {}}, [{"type": "function", "function": "get_weather"}], [{"type": "function"}]]
)
def test_a_task_set_row_offers_only_function_definitions(tools):
    """A task set uploaded outside the fine-tuning API may carry tools too: a rollout reads each
    one's function name, so a malformed one is refused at upload."""
    with pytest.raises(ValidationFailed) as caught:
        task_sets.parse_rows(rows=[{"prompt": "Weather?", "tools": tools}])
    assert caught.value.field == "rows" and "tools" in str(caught.value)
    assert task_sets.parse_rows(
        rows=[{"prompt": "Weather?", "tools": [WEATHER], "parallel_tool_calls": False}]
    )
