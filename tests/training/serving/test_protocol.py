"""The OpenAI request/response shapes, on plain objects (no server, no database)."""

from __future__ import annotations

import json

import pytest

from training.engines.base import Choice
from training.serving.chunks import ChunkContext, choice_chunks, token_pieces
from training.serving.protocol import (
    ChatRequest,
    Limits,
    RequestError,
    ResponseFormat,
    parse_chat_request,
    parse_usage,
    usage_comment,
)
from training.serving.responses import completion_body, render_choice

USER = [{"role": "user", "content": "Hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def parse(**body) -> ChatRequest:
    return parse_chat_request({"model": "m", "messages": USER, **body}, Limits(max_n=4, max_tokens=100))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 5}, "n"),
        ({"max_tokens": 101}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
            "tool_choice",
        ),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a name", "schema": {}}}},
            "response_format.json_schema.name",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "json_object"}, "tools": [WEATHER]}, "response_format"),
        ({"temprature": 1}, "temprature"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"model": ""}, "model"),
    ],
)
def test_bad_parameters_are_refused_naming_the_parameter(body, param):
    with pytest.raises(RequestError) as error:
        parse(**body)
    assert error.value.status == 400
    assert error.value.param == param
    assert set(error.value.body()["error"]) == {"message", "type", "param", "code"}


def test_a_request_is_normalised():
    request = parse(
        messages=[
            {
                "role": "developer",
                "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            },
            {"role": "user", "content": "Hi"},
        ],
        max_tokens=7,
        max_completion_tokens=9,
        stop="END",
        n=2,
        logprobs=True,
        top_logprobs=3,
        stream=True,
        stream_options={"include_usage": True},
        return_token_ids=True,
        user="someone",
    )
    assert request.messages[0] == {"role": "system", "content": "Be brief."}
    assert request.max_tokens == 9  # max_completion_tokens wins, as at OpenAI
    assert (request.stop, request.n, request.top_logprobs) == (["END"], 2, 3)
    assert request.include_usage and request.return_token_ids
    assert parse().max_tokens == Limits().default_max_tokens


def test_json_mode_is_accepted_only_where_the_engine_honours_it():
    body = {"model": "m", "messages": USER, "response_format": {"type": "json_object"}}
    assert parse_chat_request(body, Limits.shape_only()).response_format == ResponseFormat("json_object")
    with pytest.raises(RequestError) as error:
        parse_chat_request(body, Limits(json_mode=False))
    assert (error.value.param, error.value.code) == ("response_format", "unsupported_value")
    assert parse(response_format={"type": "text"}).response_format is None


def test_a_json_schema_response_format_is_read_in_openais_shape():
    schema = {"type": "object", "properties": {"score": {"type": "number"}}, "required": ["score"]}
    request = parse(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "Score_1", "schema": schema, "strict": True},
        }
    )
    assert request.response_format == ResponseFormat(
        "json_schema", schema=schema, name="Score_1", strict=True
    )
    loose = parse(response_format={"type": "json_schema", "json_schema": {"name": "any"}})
    assert loose.response_format == ResponseFormat("json_schema", schema=None, name="any", strict=False)
    # tool_choice "none" keeps the tools out of the reply, so a format may go with them.
    assert parse(response_format={"type": "json_object"}, tools=[WEATHER], tool_choice="none").response_format


def choice(text: str, token_ids=(1, 2), finish="stop") -> Choice:
    return Choice(
        text=text, prompt_token_ids=[9], token_ids=list(token_ids), logprobs=[-0.5] * len(token_ids),
        finish_reason=finish,
    )  # fmt: skip


def test_hermes_tool_calls_become_openai_tool_calls():
    request = parse(tools=[WEATHER])
    rendered = render_choice(
        request,
        choice(
            'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
        ),
    )
    assert rendered.finish_reason == "tool_calls"
    assert rendered.content == "Let me check."
    (call,) = rendered.tool_calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_a_malformed_tool_call_stays_content():
    request = parse(tools=[WEATHER])
    rendered = render_choice(request, choice("<tool_call>{not json</tool_call>"))
    assert rendered.tool_calls == [] and rendered.content == "<tool_call>{not json</tool_call>"
    # Without tools in the request, tool-call text is just text.
    assert (
        render_choice(parse(), choice('<tool_call>{"name": "x", "arguments": {}}</tool_call>')).tool_calls
        == []
    )


def test_a_forced_tool_choice_is_prefilled_and_parsed_with_the_prefill():
    request = parse(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert request.tool_prefill() == '<tool_call>{"name": "get_weather", "arguments": '
    rendered = render_choice(request, choice('{"city": "Oslo"}}</tool_call>'))
    assert rendered.tool_calls[0]["function"]["arguments"] == '{"city": "Oslo"}'


def test_completion_body_has_openai_shape_logprobs_and_token_ids():
    request = parse(logprobs=True, top_logprobs=2, return_token_ids=True, n=2)
    body = completion_body(
        request, [choice("ab"), choice("c", (3,), "length")], completion_id="chatcmpl-1", created=5, model="p/m:3",
        prompt_token_ids=[7, 8], token_text=lambda token: f"<{token}>",
    )  # fmt: skip
    assert body["object"] == "chat.completion" and body["model"] == "p/m:3"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert body["prompt_token_ids"] == [7, 8]
    first = body["choices"][0]
    assert first["message"] == {"role": "assistant", "content": "ab", "refusal": None}
    assert first["token_ids"] == [1, 2]
    entry = first["logprobs"]["content"][0]
    assert entry == {
        "token": "<1>", "logprob": -0.5, "bytes": list(b"<1>"),
        # Only the sampled token is known: top_logprobs lists it alone (documented).
        "top_logprobs": [{"token": "<1>", "logprob": -0.5, "bytes": list(b"<1>")}],
    }  # fmt: skip
    assert body["choices"][1]["finish_reason"] == "length"
    json.dumps(body)


def test_stream_chunks_join_to_the_text_one_token_each():
    request = parse(stream=True, logprobs=True, return_token_ids=True)
    context = ChunkContext(request, "chatcmpl-1", 5, "m")
    words = {1: "Hel", 2: "lo", 3: "<|im_end|>"}
    chunks = list(
        choice_chunks(
            context, 0, choice("Hello", (1, 2, 3)),
            decode=lambda ids: "".join(words[i] for i in ids if i != 3), token_text=words.__getitem__,
        )
    )  # fmt: skip
    deltas = [c["choices"][0]["delta"].get("content") for c in chunks[:-1]]
    assert deltas == ["Hel", "lo", ""]
    assert [c["choices"][0]["token_ids"] for c in chunks[:-1]] == [[1], [2], [3]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_token_pieces_hold_back_a_split_character_and_respect_a_stop_cut():
    # Token 1 is the first half of "é": decoding it alone gives U+FFFD.
    decoded = {(1,): "\ufffd", (1, 2): "é", (1, 2, 3): "é!", (1, 2, 3, 4): "é!STOP"}
    pieces = token_pieces([1, 2, 3, 4], "é!", lambda ids: decoded[tuple(ids)])
    assert pieces == ["", "é", "!", ""]


def test_usage_travels_in_a_header_or_an_sse_comment():
    assert parse_usage("12 3") == (12, 3)
    assert parse_usage(usage_comment(12, 3)) == (12, 3)
    assert usage_comment(1, 2).startswith(b":")  # an SSE comment: clients ignore it
    assert parse_usage(b"data: {}") is None and parse_usage("x") is None
