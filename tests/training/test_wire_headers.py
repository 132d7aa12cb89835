"""One header rule (training.wire.headers) for the three places a team sets headers on artweb's calls
to its services: an MCP server's `config.headers`, an http_tools tool's `headers` and an endpoint
grader's `headers`. Each caller keeps its own error (a ConfigError, a grader spec problem) and words."""

from __future__ import annotations

import pytest

from training.config import ConfigError
from training.environments import validate_environment
from training.rewards import validate_grader
from training.rewards.errors import GraderSpecError
from training.wire.headers import MAX_HEADER_VALUE_CHARS, header_problem


@pytest.mark.parametrize(
    ("name", "value", "problem"),
    [
        ("Authorization", "Bearer t", None),
        ("X-" + "k" * 254, "v" * MAX_HEADER_VALUE_CHARS, None),  # the longest name and value
        ("X-Key", 3, "not_string"),
        ("Host", "evil.example", "reserved"),
        ("content-LENGTH", "1", "reserved"),  # names are case-insensitive
        ("Transfer-Encoding", "chunked", "reserved"),
        ("Connection", "close\r\nX: 1", "reserved"),  # refused for its name before its value
        ("Bad Name", "v", "name"),
        ("X-Key:", "v", "name"),
        ("", "v", "name"),
        ("X-" + "k" * 255, "v", "name"),
        ("X-Clé", "v", "name"),
        ("X-Key", "a\r\nHost: evil", "value"),
        ("X-Key", "a\nb", "value"),
        ("X-Key", "a\0b", "value"),
        ("X-Key", "v" * (MAX_HEADER_VALUE_CHARS + 1), "value"),
    ],
)
def test_header_problem_names_the_first_rule_a_header_breaks(name, value, problem):
    assert header_problem(name, value) == problem


def test_a_callers_own_names_are_reserved_besides_the_framing_ones():
    assert header_problem("X-Call-Id", "1") is None
    assert header_problem("X-Call-Id", "1", reserved={"x-call-id"}) == "reserved"
    assert header_problem("Host", "h", reserved={"x-call-id"}) == "reserved"


def mcp_refusal(headers: dict) -> tuple[str, str] | None:
    try:
        validate_environment(
            "mcp", config={"url": "https://mcp.example.com/mcp", "headers": headers}, tools=[], max_turns=None
        )
    except ConfigError as error:
        return error.field, error.message
    return None


def http_tools_refusal(headers: dict) -> tuple[str, str] | None:
    tool = {"name": "lookup", "server_url": "https://tools.example.com/lookup", "headers": headers}
    try:
        validate_environment("http_tools", config={"tools": [tool]}, tools=None, max_turns=None)
    except ConfigError as error:
        return error.field, error.message
    return None


def grader_refusal(headers: dict) -> tuple[str, str] | None:
    try:
        validate_grader({"type": "endpoint", "url": "https://grader.example.com/grade", "headers": headers})
    except GraderSpecError as error:
        (problem,) = error.problems
        return problem["path"], problem["message"]
    return None


ONE_LINE = f"must be one line of at most {MAX_HEADER_VALUE_CHARS} characters"
GRADER_RULE = f"must be a header name and one line of at most {MAX_HEADER_VALUE_CHARS} characters"


@pytest.mark.parametrize(
    ("headers", "mcp", "http_tools", "grader"),
    [
        ({"Authorization": "Bearer t", "X-Team": "alpha"}, None, None, None),
        ({"X-Key": "a\r\nHost: evil"},
         ("config.headers.X-Key", ONE_LINE), ("config.tools[0].headers.X-Key", ONE_LINE),
         ("grader.headers.X-Key", GRADER_RULE)),
        ({"X-Key": "k" * (MAX_HEADER_VALUE_CHARS + 1)},
         ("config.headers.X-Key", ONE_LINE), ("config.tools[0].headers.X-Key", ONE_LINE),
         ("grader.headers.X-Key", GRADER_RULE)),
        ({"Bad Name": "v"},
         ("config.headers", "'Bad Name' is not a header name"),
         ("config.tools[0].headers", "'Bad Name' is not a header name"),
         ("grader.headers.Bad Name", GRADER_RULE)),
        ({"X-" + "k" * 255: "v"},  # over 256 characters: no HTTP server takes such a name
         ("config.headers", f"{'X-' + 'k' * 255!r} is not a header name"),
         ("config.tools[0].headers", f"{'X-' + 'k' * 255!r} is not a header name"),
         ("grader.headers.X-" + "k" * 255, GRADER_RULE)),
        ({"Content-Length": "1"},
         ("config.headers.Content-Length", "is set by the HTTP client"),
         ("config.tools[0].headers.Content-Length", "is set by artweb on every call"),
         ("grader.headers.Content-Length", "is set by the HTTP client")),
        ({"X-Call-Id": "1"},
         None, ("config.tools[0].headers.X-Call-Id", "is set by artweb on every call"), None),
        ({"X-Key": 3},
         ("config.headers", "must be an object of strings"),
         ("config.tools[0].headers", "must be an object of strings"),
         ("grader.headers.X-Key", "must be a string")),
    ],
)  # fmt: skip
def test_mcp_servers_http_tools_and_endpoint_graders_refuse_the_same_headers_in_their_own_words(
    headers, mcp, http_tools, grader
):
    assert mcp_refusal(headers) == mcp
    assert http_tools_refusal(headers) == http_tools
    assert grader_refusal(headers) == grader
