"""Scenario generation against a local OpenAI-compatible server with scripted replies: valid rows
are kept, malformed JSON, missing fields, duplicates and endpoint failures are reported per row."""

from __future__ import annotations

import json

import pytest

from tests.openai_stub import LOOPBACK, openai_stub
from training.rollouts.remote import ChatEndpoint
from training.rollouts.scenarios import generate_rows, parse_candidates

TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {"type": "object"}}}
]


def rows_json(*prompts: str) -> str:
    return json.dumps([{"prompt": p, "item": {"answer": str(len(p))}} for p in prompts])


def test_valid_rows_are_kept_and_the_prompt_shows_tools_and_instruction():
    with openai_stub([rows_json("What is 2+2?", "What is 3+4?", "What is 5+6?")]) as stub:
        report = generate_rows(
            ChatEndpoint(stub.url, outbound=LOOPBACK),
            "writer",
            tools=TOOLS,
            instruction="sums of two numbers",
            n=3,
            environment="python_tools",
        )
    assert report.accepted == 3 and report.errors == [] and report.requests == 1 and report.stopped == ""
    assert report.rows[0] == {"prompt": "What is 2+2?", "item": {"answer": "12"}}
    prompt = stub.requests[0]["messages"][1]["content"]
    assert (
        '"name": "add"' in prompt
        and "sums of two numbers" in prompt
        and "Write 3 different task rows" in prompt
    )
    assert stub.requests[0]["model"] == "writer"


def test_malformed_missing_and_duplicate_rows_are_reported_per_row():
    first = "\n".join(
        [
            json.dumps({"prompt": "Add 1 and 2", "item": {"answer": "3"}}),
            '{"prompt": "Add 2 and 2", "item": ',  # malformed JSON
            json.dumps({"item": {"answer": "9"}}),  # no prompt
            json.dumps({"prompt": "  add 1 AND 2", "item": {"answer": "3"}}),  # duplicate of row 1
        ]
    )
    second = rows_json("Add 5 and 5")

    def validate(row):
        problems = []
        if not isinstance(row, dict) or "prompt" not in row:
            problems.append(("prompt", "give exactly one of 'messages' or 'prompt'"))
        return problems

    with openai_stub([first, second]) as stub:
        report = generate_rows(
            ChatEndpoint(stub.url, outbound=LOOPBACK),
            "m",
            tools=[],
            instruction="additions",
            n=2,
            validate=validate,
        )
    assert [row["prompt"] for row in report.rows] == ["Add 1 and 2", "Add 5 and 5"]
    errors = [(e.request, e.row, e.field, e.error.split(":")[0]) for e in report.errors]
    assert errors == [
        (1, 2, "", "malformed JSON"),
        (1, 3, "prompt", "give exactly one of 'messages' or 'prompt'"),
        (1, 4, "prompt", "duplicate of accepted row 1"),
    ]
    assert report.requests == 2 and report.candidates == 5
    stored = report.to_dict()
    assert stored["requested"] == 2 and stored["accepted"] == 2 and stored["rejected"] == 3
    # The second request asked only for what was missing and showed what exists.
    assert "Write 1 different task rows" in stub.requests[1]["messages"][1]["content"]
    assert "- Add 1 and 2" in stub.requests[1]["messages"][1]["content"]


def test_endpoint_failures_and_empty_replies_stop_after_the_request_budget():
    with openai_stub([500, "", "not json at all"]) as stub:
        report = generate_rows(
            ChatEndpoint(stub.url, outbound=LOOPBACK, retries=0), "m", tools=[], instruction="x", n=5
        )
    assert report.accepted == 0 and report.requests == 3  # one batch + two retries
    assert report.stopped == "stopped after 3 requests"
    assert "HTTP 500" in report.errors[0].error and report.errors[0].row is None
    assert report.errors[1].error == "the reply holds no rows"
    assert report.errors[2].error.startswith("malformed JSON")
    assert len(stub.requests) == 3


def test_fenced_arrays_rows_objects_and_extra_rows():
    assert parse_candidates('```json\n[{"prompt": "a"}]\n```') == ([{"prompt": "a"}], [])
    assert parse_candidates('{"rows": [{"prompt": "b"}]}') == ([{"prompt": "b"}], [])
    with openai_stub([rows_json("one", "two", "three")]) as stub:
        report = generate_rows(ChatEndpoint(stub.url, outbound=LOOPBACK), "m", tools=[], instruction="x", n=2)
    assert report.accepted == 2 and report.errors[0].error == "more rows than the 2 requested"


def test_n_is_bounded():
    with pytest.raises(ValueError):
        generate_rows(ChatEndpoint("http://127.0.0.1:9/v1"), "m", tools=[], instruction="x", n=101)
