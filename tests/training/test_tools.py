import json
import threading
import time

import pytest

from training.rollouts.tools import (
    Tool,
    ToolCall,
    parse_tool_calls,
    run_tool,
    run_tool_calls,
    tools_system_prompt,
)

NUMBERS = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}
ADD = Tool("add", "Add a and b.", NUMBERS, lambda a, b: a + b)


def test_several_hermes_calls_in_one_turn_are_parsed_in_order():
    text = (
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "search", "arguments": {"query": "Paris"}}</tool_call> done'
    )
    calls = parse_tool_calls(text, id_prefix="call_3_")
    assert [(c.id, c.name, c.arguments, c.error) for c in calls] == [
        ("call_3_0", "add", {"a": 1, "b": 2}, None),
        ("call_3_1", "search", {"query": "Paris"}, None),
    ]
    assert calls[0].to_openai() == {
        "id": "call_3_0",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
    }
    assert parse_tool_calls("no calls here") == []


def test_argument_variants_models_write_are_accepted():
    # Arguments as a JSON string (OpenAI's wire format), Llama's "parameters", none at all, and
    # a call cut before its closing tag (e.g. by a "</tool_call>" stop string).
    text = (
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
        '<tool_call>{"name": "add", "parameters": {"a": 3}}</tool_call>'
        '<tool_call>{"name": "now"}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 5, "b": 6}}'
    )
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("add", {"a": 1, "b": 2}, None),
        ("add", {"a": 3}, None),
        ("now", {}, None),
        ("add", {"a": 5, "b": 6}, None),
    ]


@pytest.mark.parametrize(
    "body, name, message",
    [
        ('{"name": "add", "arguments": {"a": 1,', "", "not valid JSON"),
        ('["add"]', "", "must be a JSON object"),
        ('{"arguments": {}}', "", "must be a JSON object"),
        ('{"name": "add", "arguments": [1, 2]}', "add", "must be a JSON object"),
        ('{"name": "add", "arguments": "{oops"}', "add", "not valid JSON"),
    ],
)
def test_malformed_calls_carry_an_error_instead_of_raising(body, name, message):
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert call.name == name
    assert message in call.error
    assert call.arguments == {}
    assert call.arguments_json == body  # the transcript keeps what the model wrote


def test_results_are_text_the_model_reads():
    assert run_tool(ADD, {"a": 2, "b": 3}, timeout_s=5).content == "5"
    echo = Tool("echo", "Echo.", {}, lambda text: text)
    assert run_tool(echo, {"text": "plain"}, timeout_s=5).content == "plain"  # strings as they are
    table = Tool("table", "Rows.", {}, lambda: {"rows": [1, "é"]})
    assert json.loads(run_tool(table, {}, timeout_s=5).content) == {"rows": [1, "é"]}


def test_a_failing_tool_becomes_an_error_result():
    def divide(a, b):
        return a / b

    result = run_tool(Tool("divide", "a / b", NUMBERS, divide), {"a": 1, "b": 0}, timeout_s=5)
    assert result.error == "ZeroDivisionError: division by zero"
    assert json.loads(result.content) == {"error": "ZeroDivisionError: division by zero"}
    assert not result.timed_out
    wrong = run_tool(ADD, {"a": 1, "c": 2}, timeout_s=5)  # arguments the function does not take
    assert wrong.error.startswith("TypeError")


def test_a_hanging_tool_is_cut_off_at_the_timeout():
    release = threading.Event()
    hang = Tool("hang", "Never returns on its own.", {}, lambda: release.wait(30))
    start = time.monotonic()
    try:
        result = run_tool(hang, {}, timeout_s=0.2)
    finally:
        release.set()  # let the abandoned thread end
    assert time.monotonic() - start < 5
    assert result.timed_out
    assert json.loads(result.content) == {"error": "tool 'hang' did not finish within 0.2 s"}


def test_calls_of_a_turn_run_concurrently_and_errors_keep_their_place():
    # Each of the two calls waits for the other: they can only both finish if they run at once.
    barrier = threading.Barrier(2, timeout=5)

    def wait_for_the_other():
        barrier.wait()
        return 1

    meet = Tool("meet", "Wait for the other.", {}, wait_for_the_other)
    calls = [
        ToolCall("c0", "meet", {}, "{}"),
        ToolCall("c1", "nope", {}, "{}"),
        ToolCall("c2", "", {}, "{bad", error="the tool call is not valid JSON"),
        ToolCall("c3", "meet", {}, "{}"),
    ]
    results = run_tool_calls(calls, [meet, ADD], timeout_s=5)
    assert [r.content for r in (results[0], results[3])] == ["1", "1"]
    assert results[1].error == "unknown tool 'nope' (tools: add, meet)"
    assert results[2].error == "the tool call is not valid JSON"
    assert not any(r.timed_out for r in results)


def test_system_prompt_lists_each_schema_and_the_call_format():
    text = tools_system_prompt([ADD, Tool("now", "The time.", {"type": "object"}, lambda: 0)])
    schemas = text.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line) for line in schemas] == [
        {"name": "add", "description": "Add a and b.", "parameters": NUMBERS},
        {"name": "now", "description": "The time.", "parameters": {"type": "object"}},
    ]
    assert '<tool_call>{"name": "<tool name>", "arguments": {<arguments as JSON>}}</tool_call>' in text
