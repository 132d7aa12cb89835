"""How the gateway rewrites vLLM's replies (projects.gateway.vllm), on canned bytes."""

from __future__ import annotations

import json

from projects.gateway.vllm import StreamRewriter, openai_error, request_body, rewrite_completion
from training.serving.protocol import Limits, parse_chat_request


def events(*chunks: dict) -> bytes:
    return (
        b"".join(b"data: " + json.dumps(chunk).encode() + b"\n\n" for chunk in chunks) + b"data: [DONE]\n\n"
    )


STREAM = events(
    {"model": "model-3-step-1", "choices": [{"index": 0, "delta": {"content": "hé"}}]},
    {"model": "model-3-step-1", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    {"model": "model-3-step-1", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}},
)


def parsed(raw: bytes) -> list:
    return [json.loads(e[6:]) if e != b"data: [DONE]" else "[DONE]" for e in raw.split(b"\n\n") if e]


def test_events_split_anywhere_are_rewritten_whole_and_usage_is_hidden_unless_asked():
    for size in (1, 7, 64, len(STREAM)):
        rewriter = StreamRewriter("math/agent:1", client_wants_usage=False)
        out = b"".join(rewriter.feed(STREAM[i : i + size]) for i in range(0, len(STREAM), size))
        chunks = parsed(out)
        assert chunks[-1] == "[DONE]" and len(chunks) == 3  # the usage chunk is gone
        assert {c["model"] for c in chunks[:-1]} == {"math/agent:1"}
        assert chunks[0]["choices"][0]["delta"]["content"] == "hé"
        assert rewriter.usage == (5, 2)  # still metered
    asked = StreamRewriter("math/agent:1", client_wants_usage=True)
    assert parsed(asked.feed(STREAM))[2]["usage"] == {"prompt_tokens": 5, "completion_tokens": 2}


def test_completions_get_the_public_id_and_errors_become_openai_error_objects():
    body, usage = rewrite_completion(json.dumps({"model": "model-3-step-1", "usage": {
        "prompt_tokens": 4, "completion_tokens": 1}}).encode(), "math/agent:1")  # fmt: skip
    assert json.loads(body)["model"] == "math/agent:1" and usage == (4, 1)
    old_style = {"object": "error", "message": "bad n", "type": "BadRequestError", "param": "n", "code": 400}
    assert openai_error(400, json.dumps(old_style).encode()) == {
        "error": {"message": "bad n", "type": "invalid_request_error", "param": "n", "code": "upstream_error"}
    }
    new_style = {"error": {"message": "gone", "type": "NotFoundError", "param": None, "code": 404}}
    assert openai_error(404, json.dumps(new_style).encode())["error"] == {
        "message": "gone",
        "type": "not_found_error",
        "param": None,
        "code": "model_not_found",
    }
    assert openai_error(502, b"<html>Bad Gateway</html>")["error"]["message"] == "<html>Bad Gateway</html>"


def test_response_format_passes_the_gateway_and_reaches_vllm_unchanged():
    schema = {"type": "object", "properties": {"score": {"type": "number"}}, "required": ["score"]}
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "Score", "schema": schema, "strict": True},
    }
    decoded = {"model": "math/agent:1", "messages": [{"role": "user", "content": "Rate it"}],
               "response_format": response_format, "stream": True}  # fmt: skip
    assert parse_chat_request(decoded, Limits.shape_only()).response_format is not None  # not refused
    sent = json.loads(request_body(decoded, model="model-3-step-1"))
    assert sent["response_format"] == response_format and sent["model"] == "model-3-step-1"
