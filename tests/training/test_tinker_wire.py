"""training.wire.tinker against the tinker SDK's own codecs: what the SDK encodes parses into the
session's datums, and what the server encodes the SDK decodes to the same numbers."""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from training.engines.base import Choice
from training.session.contract import ForwardBackwardResult
from training.wire.tinker import (
    WireError,
    forward_backward_output,
    model_input_tokens,
    parse_forward_backward,
    prompt_logprobs,
    prompt_scoring,
    sample_response,
)


def _request(data: list[types.Datum], **config: float | str) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=data, loss_fn="ppo", loss_fn_config=config or None
        ),
        model_id="s:train:0",
        seq_id=7,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def test_an_sdk_request_parses_into_the_sessions_datums():
    tokens = [5, 9, 2, 7]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "advantages": [0.0, 0.5, -1.25],
            "logprobs": [0.0, -0.5, -2.0],
        },
    )
    call = parse_forward_backward(_request([datum], clip_low_threshold=0.7))
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("s:train:0", 7, "ppo", False)
    assert call.loss_fn_config == {"clip_low_threshold": pytest.approx(0.7)}
    [parsed] = call.data
    assert parsed.model_input == [5, 9, 2]
    assert parsed.loss_fn_inputs["target_tokens"] == [9.0, 2.0, 7.0]
    assert parsed.loss_fn_inputs["advantages"] == [0.0, 0.5, -1.25]
    assert parsed.loss_fn_inputs["logprobs"] == [0.0, -0.5, -2.0]


def test_bad_requests_name_the_part():
    shifted_wrong = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [9, 9, 9]}
    )
    with pytest.raises(WireError) as error:
        parse_forward_backward(_request([shifted_wrong]))
    assert error.value.param == "data[0]" and "shifted by one" in str(error.value)
    short = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0]})  # fmt: skip
    with pytest.raises(WireError, match="weights has 2 values for 3 tokens"):
        parse_forward_backward(_request([short]))
    with pytest.raises(WireError) as error:
        parse_forward_backward(b"\xff\xff not protobuf")
    assert error.value.param == "body"
    empty = pb.ForwardBackwardRequest(model_id="m", seq_id=1).SerializeToString()
    with pytest.raises(WireError, match="at least one datum"):
        parse_forward_backward(empty)
    with pytest.raises(WireError) as error:
        model_input_tokens({"chunks": [{"type": "image", "data": "x"}]}, "prompt")
    assert error.value.param == "prompt.chunks[0]"


def test_results_decode_in_the_sdk_to_the_same_numbers():
    result = ForwardBackwardResult(
        loss=3.5, metrics={"loss:sum": 3.5, "entropy": 1.25, "positions": 7.0, "clip_fraction": 0.25},
        logprobs=[[0.0, -1.5, -0.25], [-2.0]],
    )  # fmt: skip
    output = deserialize_forward_backward_output(forward_backward_output(result))
    assert [o["logprobs"].tolist() for o in output.loss_fn_outputs] == [[0.0, -1.5, -0.25], [-2.0]]
    # Every metric carries the reduction the SDK combines chunks with.
    assert output.metrics == {
        "loss:sum": 3.5,
        "entropy:mean": 1.25,
        "positions:sum": 7.0,
        "clip_fraction:mean": 0.25,
    }

    choices = [
        Choice(
            text="",
            prompt_token_ids=[1],
            token_ids=[4, 5, 0],
            logprobs=[-0.5, -1.0, -0.125],
            finish_reason="stop",
        ),
        Choice(
            text="", prompt_token_ids=[1], token_ids=[6, 6], logprobs=[-2.0, -3.0], finish_reason="length"
        ),
    ]
    response = deserialize_sample_response(sample_response(choices))
    assert [s.stop_reason for s in response.sequences] == ["stop", "length"]
    assert [list(s.tokens) for s in response.sequences] == [[4, 5, 0], [6, 6]]
    assert np.allclose(response.sequences[0].logprobs, [-0.5, -1.0, -0.125])


def test_prompt_logprobs_score_each_token_given_the_ones_before_and_decode_in_the_sdk():
    prompt = [7, 3, 9, 4, 2]
    datum = prompt_scoring(prompt)
    assert datum is not None and datum.model_input == [7, 3, 9, 4]
    assert datum.loss_fn_inputs["target_tokens"] == [3.0, 9.0, 4.0, 2.0] and datum.first_computed == 0
    scored = [-1.0, -2.0, -3.0, -4.0]  # forward's answer: token i + 1 given tokens 0..i
    choice = Choice(text="", prompt_token_ids=prompt, token_ids=[5], logprobs=[-0.5], finish_reason="length")
    response = deserialize_sample_response(sample_response([choice], prompt_logprobs(prompt, scored)))
    assert response.prompt_logprobs == [None, -1.0, -2.0, -3.0, -4.0]
    # Only the last two: the datum weighs them alone; the rest are None in the SDK.
    last = prompt_scoring(prompt, 2)
    assert last is not None and last.first_computed == 2 and last.loss_fn_inputs["weights"] == [0, 0, 1, 1]
    partial = [0.0, 0.0, -3.0, -4.0]
    response = deserialize_sample_response(sample_response([choice], prompt_logprobs(prompt, partial, 2)))
    assert response.prompt_logprobs == [None, None, None, -3.0, -4.0]
    # A one-token prompt has nothing to score; not asked, no prompt logprobs at all.
    assert prompt_scoring([7]) is None and np.isnan(prompt_logprobs([7], None)).all()
    assert deserialize_sample_response(sample_response([choice])).prompt_logprobs is None
