"""`response_format` through the inference server's ASGI app (in process, on the tiny random
model): json_schema and json_object replies are JSON of the schema, streamed or not; a schema the
grammar engine cannot compile is a 400 naming response_format; constrained and free requests
share a batch."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
import pytest

from training.engines.transformers_engine import TransformersEngine
from training.serving.app import InferenceApp, ServerConfig

MODEL = "tiny"
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "reason": {"type": "string", "maxLength": 16},
    },
    "required": ["answer", "score", "reason"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}}


def chat(**body: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Is it so?"}], "max_tokens": 200, **body}


async def post(app: InferenceApp, body: dict[str, Any]) -> tuple[int, bytes]:
    """One POST /v1/chat/completions through the ASGI callable: (status, the whole body)."""
    data = json.dumps(body).encode()
    sent: list[dict[str, Any]] = []
    delivered = False
    forever = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": data, "more_body": False}
        await forever.wait()  # the client never leaves
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def serve(engine: TransformersEngine, tmp_path, *bodies: dict[str, Any]) -> tuple[InferenceApp, list]:
    app = InferenceApp(engine, ServerConfig(model_name=MODEL, adapter_root=tmp_path, batch_window_s=0.05))

    async def scenario() -> list:
        task = asyncio.create_task(app.scheduler.run())
        try:
            return await asyncio.gather(*(post(app, body) for body in bodies))
        finally:
            task.cancel()

    return app, asyncio.run(scenario())


def stream_events(raw: bytes) -> list[dict[str, Any]]:
    events = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: ") and block != b"data: [DONE]":
            events.append(json.loads(block[len(b"data: ") :]))
    return events


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_json_schema_reply_is_json_of_the_schema(engine, tmp_path, seed):
    _, [(status, raw)] = serve(engine, tmp_path, chat(response_format=JSON_SCHEMA, seed=seed, logprobs=True))
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    assert all(entry["logprob"] <= 0 for entry in choice["logprobs"]["content"])


def test_a_json_object_reply_that_stops_is_a_json_object(engine, tmp_path):
    _, replies = serve(
        engine, tmp_path, chat(response_format={"type": "json_object"}, n=6, seed=0, max_tokens=300)
    )
    [(status, raw)] = replies
    assert status == 200, raw
    choices = json.loads(raw)["choices"]
    stopped = [c for c in choices if c["finish_reason"] == "stop"]
    assert stopped  # a random model may also write keys until max_tokens: "length", as at OpenAI
    assert all(isinstance(json.loads(c["message"]["content"]), dict) for c in stopped)


@pytest.mark.parametrize(
    "schema", [{"type": "colour"}, {"$ref": "#/$defs/missing"}, {"type": "string", "format": "postcode"}]
)
def test_a_schema_the_engine_cannot_compile_is_a_400_naming_response_format(engine, tmp_path, schema):
    response_format = {"type": "json_schema", "json_schema": {"name": "bad", "schema": schema}}
    _, [(status, raw)] = serve(engine, tmp_path, chat(response_format=response_format))
    assert status == 400
    error = json.loads(raw)["error"]
    assert error["param"] == "response_format"
    assert "response_format" in error["message"] and "cannot be used" in error["message"]


def test_an_engine_that_cannot_constrain_refuses_response_format(engine, tmp_path):
    class Unconstrained(TransformersEngine):
        def check_grammar(self, grammar: str) -> None:
            raise NotImplementedError("no grammars here")

    plain = Unconstrained(engine.model, engine.tokenizer)
    _, [(status, raw)] = serve(plain, tmp_path, chat(response_format={"type": "json_object"}))
    assert status == 400
    assert json.loads(raw)["error"]["code"] == "unsupported_value"


def test_streamed_deltas_join_to_the_same_valid_json(engine, tmp_path):
    body = chat(response_format=JSON_SCHEMA, seed=4, temperature=1.0)
    _, [(_, whole), (status, streamed)] = serve(engine, tmp_path, body, {**body, "stream": True})
    assert status == 200
    expected = json.loads(whole)["choices"][0]["message"]["content"]
    events = stream_events(streamed)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    assert text == expected
    jsonschema.validate(json.loads(text), SCHEMA)
    assert [e["choices"][0]["finish_reason"] for e in events if e.get("choices")][-1] == "stop"


def test_constrained_and_free_requests_are_sampled_in_one_batch(engine, tmp_path):
    app, replies = serve(
        engine, tmp_path, chat(response_format=JSON_SCHEMA), chat(), chat(response_format=JSON_SCHEMA)
    )
    assert [status for status, _ in replies] == [200, 200, 200]
    assert app.scheduler.stats.batches == 1 and app.scheduler.stats.sequences == 3
    for _, raw in (replies[0], replies[2]):
        jsonschema.validate(json.loads(json.loads(raw)["choices"][0]["message"]["content"]), SCHEMA)
