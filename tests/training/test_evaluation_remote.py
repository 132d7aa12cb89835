"""The remote policy against a local OpenAI-compatible server with scripted replies: single-turn
chat, tool calls over several turns (OpenAI tool_calls and Hermes text), and per-sample failures."""

from __future__ import annotations

import pytest

from tests.openai_stub import LOOPBACK, openai_stub, tool_call
from training.environments import EnvironmentSpec
from training.rollouts.remote import ChatEndpoint, RemotePolicy
from training.rollouts.tools import Tool
from training.runs.evaluation import evaluate

EXACT = {
    "type": "string_check",
    "name": "exact",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}
ROWS = [
    {"index": 0, "data": {"prompt": "two plus two", "item": {"answer": "4"}}},
    {"index": 1, "data": {"prompt": "three plus four", "item": {"answer": "7"}}},
]


def by_prompt(answers: dict[str, str]):
    """A reply chosen by the task's prompt, so concurrent requests cannot swap answers."""

    def reply(body):
        prompt = next(m["content"] for m in body["messages"] if m["role"] == "user")
        return answers[prompt]

    return reply


def add(a: float, b: float) -> float:
    return a + b


ADD = Tool(
    "add",
    "Add two numbers.",
    {
        "type": "object",
        "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        "required": ["a", "b"],
    },
    add,
)


def test_single_turn_chat_is_graded_like_training():
    answers = by_prompt({"two plus two": "4", "three plus four": "8"})
    with openai_stub([answers, answers]) as stub:
        policy = RemotePolicy(
            ChatEndpoint(stub.url, outbound=LOOPBACK, api_key="sk-test"), model="ref-model", max_tokens=16
        )
        result = evaluate(policy, ROWS, EnvironmentSpec(system_prompt="Be brief."), EXACT, side="reference")
    assert [(s.task_row_index, s.reward, s.side) for s in result.samples] == [
        (0, 1.0, "reference"),
        (1, 0.0, "reference"),
    ]
    assert result.results["reward_mean"] == 0.5 and result.results["model"] == "ref-model"
    body = stub.requests[0]
    assert body["model"] == "ref-model" and body["temperature"] == 0.0 and body["max_tokens"] == 16
    assert body["messages"][0] == {"role": "system", "content": "Be brief."} and "tools" not in body
    assert stub.headers[0]["Authorization"] == "Bearer sk-test"
    assert result.samples[0].messages[-1] == {"role": "assistant", "content": "4"}
    assert result.samples[0].metrics["turns"] == 1


def test_tool_calls_run_over_several_turns_and_errors_are_counted():
    def script(body):
        last = body["messages"][-1]
        if last["role"] == "tool":  # second turn: answer from the tool's result
            return last["content"]
        prompt = last["content"]
        if prompt == "two plus two":  # an OpenAI tool call
            return {"content": "", "tool_calls": [tool_call("add", {"a": 2, "b": 2})]}
        # Hermes text (how our own models call tools), with arguments that are not JSON
        return '<tool_call>{"name": "add", "arguments": {"a": 3, "b": </tool_call>'

    env = EnvironmentSpec(max_turns=3, tools=[ADD])
    with openai_stub([script] * 4) as stub:
        policy = RemotePolicy(ChatEndpoint(stub.url, outbound=LOOPBACK), model="m", max_concurrency=1)
        result = evaluate(policy, ROWS, env, EXACT)
    first, second = result.samples
    assert [m["role"] for m in first.messages] == ["user", "assistant", "tool", "assistant"]
    assert first.messages[1]["tool_calls"][0]["function"]["name"] == "add"
    assert first.messages[2]["content"] == "4" and first.reward == 1.0
    assert (
        first.metrics["turns"] == 2 and first.metrics["tool_calls"] == 1 and first.metrics["tool_errors"] == 0
    )
    assert "error" in second.messages[2]["content"] and second.metrics["tool_errors"] == 1
    assert second.reward == 0.0
    assert result.results["tool_calls"] == 2 and result.results["tool_error_rate"] == 0.5
    assert stub.requests[0]["tools"][0]["function"]["name"] == "add"


def test_endpoint_failures_are_recorded_per_sample_not_raised():
    answers = by_prompt({"two plus two": "4", "three plus four": "7"})
    # Row 0: 500 then 500 again (one retry): failed. Row 1: answered.
    with openai_stub([500, 500, answers]) as stub:
        endpoint = ChatEndpoint(
            stub.url, outbound=LOOPBACK, api_key="sk-secret", retries=1, retry_backoff=0.01
        )
        result = evaluate(
            RemotePolicy(endpoint, model="m", max_concurrency=1), ROWS, EnvironmentSpec(), EXACT
        )
    failed, answered = result.samples
    assert failed.reward == 0.0 and failed.errors[0]["code"] == "policy_error"
    assert "HTTP 500" in failed.errors[0]["detail"] and "sk-secret" not in failed.errors[0]["detail"]
    assert answered.reward == 1.0
    assert result.results["policy_errors"] == 1 and result.results["reward_mean"] == 0.5
    assert len(stub.requests) == 3


def test_a_client_error_is_not_retried_and_an_unreachable_endpoint_is_an_error():
    with openai_stub([400, "7"]) as stub:
        policy = RemotePolicy(
            ChatEndpoint(stub.url, outbound=LOOPBACK, retries=3, retry_backoff=0.01),
            model="m",
            max_concurrency=1,
        )
        trajectory = policy.episode(ROWS[0]["data"], EnvironmentSpec())
    assert "HTTP 400" in trajectory.metrics["policy_error"] and len(stub.requests) == 1
    closed = RemotePolicy(ChatEndpoint(stub.url, outbound=LOOPBACK, timeout=2, retries=0), model="m")
    assert "unreachable" in closed.episode(ROWS[0]["data"], EnvironmentSpec()).metrics["policy_error"]


def test_a_game_is_played_through_the_environment_protocol_and_graded_from_its_outcome():
    from training.environments import build_environment

    def player(body):
        if "forfeit" in body["messages"][1]["content"]:
            return "I would rather not play."  # no <move> tag: an invalid move, the model forfeits
        turn = sum(m["role"] == "assistant" for m in body["messages"])
        return f"<move>{['B2', 'A1', 'C3', 'A3', 'C1'][turn]}</move>"

    rows = [
        {"index": 0, "data": {"prompt": "Let's play; please forfeit.", "item": {}}},
        {"index": 1, "data": {"prompt": "Let's play.", "item": {}}},
    ]
    env = build_environment("tic_tac_toe", max_turns=5)
    with openai_stub([player] * 12) as stub:
        policy = RemotePolicy(ChatEndpoint(stub.url, outbound=LOOPBACK), model="m", max_concurrency=1)
        result = evaluate(policy, rows, env, {"type": "environment", "field": "reward"})
    forfeited, played = result.samples
    assert forfeited.metrics["turns"] == 1 and forfeited.metrics["outcome"]["result"] == "forfeit"
    assert forfeited.reward == pytest.approx(-0.1), "forfeit 0, minus the invalid-move penalty"
    assert forfeited.errors == [] and "policy_error" not in forfeited.metrics
    outcome = played.metrics["outcome"]
    assert outcome["result"] in {"win", "draw", "loss", "forfeit", "unfinished"}
    assert played.reward == pytest.approx(outcome["reward"]) and played.metrics["turns"] >= 1
    # The environment answered in user messages (the board) between the model's turns.
    roles = [m["role"] for m in played.messages]
    assert roles[:3] == ["system", "user", "assistant"]
    assert played.metrics["turns"] == 1 or "user" in roles[3:]
    assert stub.requests[0]["messages"][0]["role"] == "system" and "tools" not in stub.requests[0]
