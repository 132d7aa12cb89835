"""The endpoint grader (training.rewards.endpoint) against a real loopback HTTP server: what it sends,
how it reads the reward, and every failure as the documented error entry, never a crash."""

from __future__ import annotations

import time

import pytest

from tests.grader_endpoint_stub import grader_endpoint
from tests.openai_stub import LOOPBACK
from training.rewards import (
    GraderSpecError,
    RewardFailure,
    Sample,
    build_grader,
    grade_trajectories,
    validate_grader,
)
from training.rewards.endpoint import MAX_REPLY_BYTES
from training.rollouts.trajectory import Trajectory

TOOL_TRACE = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 21}'},
    {"role": "assistant", "content": "It is 21 °C in Paris."},
]  # fmt: skip


@pytest.fixture
def endpoint():
    with grader_endpoint() as server:
        yield server


def spec_for(server, **fields):
    return {"type": "endpoint", "name": "checker", "url": server.url, "retries": 0, **fields}


def grader_for(server, **fields):
    return build_grader(spec_for(server, **fields), outbound=LOOPBACK)


def trajectory(messages):
    return Trajectory(
        messages=messages, prompt_token_ids=[], completion_token_ids=[], logprobs=[], finish_reason="stop"
    )


def test_the_endpoint_receives_the_whole_trace_with_item_and_ids(endpoint):
    endpoint.answer = lambda body: {"reward": 0.25}
    groups = [[trajectory(TOOL_TRACE), trajectory(TOOL_TRACE[:1] + TOOL_TRACE[-1:])]]
    rows = [{"index": 7, "data": {"item": {"city": "Paris", "expected_c": 21}}}]
    spec = spec_for(endpoint, headers={"Authorization": "Bearer team-secret"})
    metrics = grade_trajectories(spec, groups, rows, 0.0, outbound=LOOPBACK, context={"step": 3})
    assert [t.reward for t in groups[0]] == [0.25, 0.25] and metrics["grader_errors"] == 0
    first = min(endpoint.requests, key=lambda body: body["ids"]["rollout"])
    assert first["grader"] == "checker" and first["item"] == {"city": "Paris", "expected_c": 21}
    assert first["ids"] == {"step": 3, "group": 0, "rollout": 0, "row_index": 7}
    sample = first["sample"]
    assert sample["messages"] == TOOL_TRACE  # tool calls and the tool's output, as the policy saw them
    assert sample["output_text"] == "It is 21 °C in Paris."
    assert sample["output_tools"] == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert {h["Authorization"] for h in endpoint.headers} == {"Bearer team-secret"}


@pytest.mark.parametrize("answer", [0.25, {"reward": 0.25}, {"reward": 0.25, "why": "partly"}])
def test_a_reward_in_range_is_the_reward(endpoint, answer):
    endpoint.answer = lambda body: answer
    result = grader_for(endpoint).grade(Sample(output_text="x"), {})
    assert result.reward == 0.25 and result.errors == [] and result.sub_rewards == {"checker": 0.25}


@pytest.mark.parametrize(
    "answer",
    [1.5, -0.1, {"reward": 2}, {"score": 1}, True, {"reward": "0.5"}, None, (200, "reward: 1"), (200, "")],
)
def test_a_reply_that_is_no_reward_in_range_is_a_parse_error(endpoint, answer):
    endpoint.answer = lambda body: answer
    result = grader_for(endpoint, error_reward=0.0).grade(Sample(output_text="x"), {})
    assert result.reward == 0.0
    (error,) = result.errors
    assert error["code"] == "endpoint_grader_parse_error" and error["grader"] == "checker", error


def test_a_transient_500_is_retried_and_the_second_answer_counts(endpoint):
    endpoint.script = [(500, '{"error": {"message": "warming up"}}'), {"reward": 0.5}]
    result = grader_for(endpoint, retries=2).grade(Sample(output_text="x"), {})
    assert result.reward == 0.5 and result.errors == [] and len(endpoint.requests) == 2


def test_retries_are_capped_then_the_status_is_the_error(endpoint):
    endpoint.answer = lambda body: (503, '{"error": {"message": "down"}}')
    result = grader_for(endpoint, retries=1).grade(Sample(output_text="x"), {})
    assert len(endpoint.requests) == 2
    (error,) = result.errors
    assert error["code"] == "endpoint_grader_server_error" and "HTTP 503" in error["detail"]
    assert validate_grader(spec_for(endpoint, retries=5))["retries"] == 5
    with pytest.raises(GraderSpecError):
        validate_grader(spec_for(endpoint, retries=6))


def test_a_4xx_is_not_retried_and_never_echoes_the_headers(endpoint):
    endpoint.answer = lambda body: (401, '{"error": {"message": "bad token Bearer team-secret"}}')
    result = grader_for(endpoint, retries=3, headers={"Authorization": "Bearer team-secret"}).grade(
        Sample(output_text="x"), {}
    )
    (error,) = result.errors
    assert len(endpoint.requests) == 1 and "HTTP 401" in error["detail"]
    assert "team-secret" not in str(result.to_dict())


def test_an_endpoint_that_hangs_is_a_timeout_flagged_unresponsive(endpoint):
    endpoint.answer = lambda body: ("hang", 2.0)
    started = time.monotonic()
    result = grader_for(endpoint, timeout_s=0.3).grade(Sample(output_text="x"), {})
    assert time.monotonic() - started < 1.5
    (error,) = result.errors
    assert error["code"] == "endpoint_grader_timeout" and "0.3 s" in error["detail"]
    assert result.to_openai_dict()["metadata"]["errors"]["unresponsive_reward_error"] is True


def test_a_host_the_outbound_policy_refuses_is_never_called(endpoint):
    grader = build_grader(spec_for(endpoint))  # no policy given: public addresses only
    result = grader.grade(Sample(output_text="x"), {})
    (error,) = result.errors
    assert error["code"] == "endpoint_grader_server_error" and "outbound policy" in error["detail"]
    assert endpoint.requests == []


def test_a_redirect_is_refused(endpoint):
    endpoint.answer = lambda body: (302, "")
    (error,) = grader_for(endpoint).grade(Sample(output_text="x"), {}).errors
    assert error["code"] == "endpoint_grader_server_error" and "302" in error["detail"]


def test_a_reply_over_the_size_cap_is_refused(endpoint):
    endpoint.answer = lambda body: {"reward": 1.0, "padding": "x" * MAX_REPLY_BYTES}
    (error,) = grader_for(endpoint).grade(Sample(output_text="x"), {}).errors
    assert error["code"] == "endpoint_grader_server_error" and "larger than 64 KiB" in error["detail"]


def test_inside_multi_the_endpoint_is_one_named_sub_grader(endpoint):
    endpoint.answer = lambda body: {"reward": 0.5}
    spec = {
        "type": "multi",
        "graders": {
            "judge": {"type": "endpoint", "url": endpoint.url, "retries": 0},
            "exact": {"type": "string_check", "input": "{{sample.output_text}}",
                      "reference": "{{item.answer}}", "operation": "eq"},
        },
        "calculate_output": "0.5 * judge + 0.5 * exact",
    }  # fmt: skip
    grader = build_grader(spec, outbound=LOOPBACK)
    results = grader.grade_batch([Sample(output_text="4"), Sample(output_text="5")], [{"answer": "4"}] * 2)
    assert [r.reward for r in results] == [0.75, 0.25]
    assert results[0].sub_rewards == {"judge": 0.5, "exact": 1.0}
    assert endpoint.requests[0]["grader"] == "judge" and endpoint.requests[0]["item"] == {"answer": "4"}


def test_too_many_failures_fail_the_step_naming_the_code(endpoint):
    endpoint.answer = lambda body: (200, "not json")
    groups, rows = [[trajectory(TOOL_TRACE)] * 2], [{"index": 0, "data": {"item": {}}}]
    with pytest.raises(RewardFailure, match="endpoint_grader_parse_error"):
        grade_trajectories(spec_for(endpoint), groups, rows, 0.5, outbound=LOOPBACK)
    metrics = grade_trajectories(spec_for(endpoint), groups, rows, 1.0, outbound=LOOPBACK)
    assert metrics["grader_errors.endpoint_grader_parse_error"] == 2.0


@pytest.mark.parametrize(
    "fields, path",
    [
        ({"url": "ftp://x/grade"}, "grader.url"),
        ({"url": "https://"}, "grader.url"),
        ({"timeout_s": 0}, "grader.timeout_s"),
        ({"timeout_s": 121}, "grader.timeout_s"),
        ({"max_concurrency": 0.5}, "grader.max_concurrency"),
        ({"headers": {"X-Key": 3}}, "grader.headers.X-Key"),
        ({"headers": {"X-Key": "a\r\nHost: evil"}}, "grader.headers.X-Key"),
        ({"headers": {"Bad Name": "v"}}, "grader.headers.Bad Name"),
        ({"headers": {"Content-Length": "1"}}, "grader.headers.Content-Length"),
        ({"headers": {"X-Key": "k" * 8193}}, "grader.headers.X-Key"),
    ],
)
def test_a_bad_spec_names_the_field(fields, path):
    with pytest.raises(GraderSpecError) as caught:
        validate_grader({"type": "endpoint", "url": "https://grader.example.com/grade", **fields})
    assert path in [problem["path"] for problem in caught.value.problems]


def test_defaults_are_filled_in():
    spec = validate_grader({"type": "endpoint", "url": "https://grader.example.com/grade"})
    assert spec == {
        "type": "endpoint", "name": "endpoint", "error_reward": 0.0, "url": "https://grader.example.com/grade",
        "headers": {}, "timeout_s": 10.0, "retries": 2, "max_concurrency": 16,
    }  # fmt: skip


class _ScriptedPolicy:
    """A policy whose rollouts are fixed traces: what an evaluation grades, without a model."""

    name = "scripted"

    def rollout(self, rows, env, samples_per_row):
        return [[trajectory(TOOL_TRACE) for _ in range(samples_per_row)] for _ in rows]


def test_an_evaluation_grades_through_the_endpoint_with_the_policy_it_is_given(endpoint):
    from training.runs.evaluation import evaluate

    endpoint.answer = lambda body: {"reward": 0.25}
    rows = [{"index": 0, "data": {"item": {"city": "Paris"}}}]
    result = evaluate(_ScriptedPolicy(), rows, None, spec_for(endpoint), samples_per_row=2, outbound=LOOPBACK)
    assert [sample.reward for sample in result.samples] == [0.25, 0.25]
    refused = evaluate(_ScriptedPolicy(), rows, None, spec_for(endpoint), samples_per_row=1)
    assert refused.samples[0].errors[0]["code"] == "endpoint_grader_server_error"


def test_a_real_run_sends_each_steps_trajectories_with_their_ids(endpoint, tiny_model_dir, tmp_path):
    from tests.training.test_learning_signal import ROWS, Hooks
    from training.config import LoraSpec, TrainConfig
    from training.environments import build_environment
    from training.runs.loop import run_training
    from training.runs.spec import RunSpec

    endpoint.answer = lambda body: {"reward": 1.0 if body["ids"].get("rollout") == 0 else 0.0}
    spec = RunSpec.resolving(
        base_model_source=str(tiny_model_dir),
        model_cache_dir=tiny_model_dir.parent,
        checkpoint_root=tmp_path,
        config=TrainConfig(steps=1, group_size=2, groups_per_step=2, max_new_tokens=3),
        lora=LoraSpec(rank=2, alpha=4),
        environment=build_environment("chat"),
        grader_spec=spec_for(endpoint),
        train_rows=ROWS,
        start_step=0,
        resume_step=None,
        outbound=LOOPBACK,
    )
    assert run_training(spec, Hooks()) == "succeeded"
    ids = [body["ids"] for body in endpoint.requests]
    assert len(ids) == 4 and {i["step"] for i in ids} == {1} and {i["rollout"] for i in ids} == {0, 1}
    assert {i["row_index"] for i in ids} <= {row["index"] for row in ROWS}
