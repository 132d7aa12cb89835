"""The http_tools environment (Agent RFT): every tool call a real HTTP POST to an endpoint on
loopback, tagged with the episode's rollout id and the call id, through the outbound policy, with
retries, a timeout, a response cap and a budget shared by every episode. Driven through
`start`/`respond`/`respond_batch` directly: no model needed."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from training.config import ConfigError
from training.environments import build_environment, validate_environment
from training.rollouts.tools import ToolCall
from training.safety.outbound import PUBLIC_ONLY, OutboundPolicy

LOOPBACK = OutboundPolicy(allow=("127.0.0.1",))  # the operator's allow-list, for this test's server


class _QuietServer(ThreadingHTTPServer):
    request_queue_size = 128  # http.server's backlog of 5 drops SYNs of many calls at once (1 s retransmit)

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that gave up on /hang closed its socket: not this test's concern


class ToolServer:
    """A tool endpoint on 127.0.0.1: records every request; the path picks the behaviour."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.hits: dict[str, int] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                count = server.hits[self.path] = server.hits.get(self.path, 0) + 1
                if self.path == "/flaky" and count == 1:
                    return self.reply(500, b'{"error": {"message": "warming up"}}')
                if self.path == "/hang":
                    time.sleep(3)
                if self.path == "/slow":
                    time.sleep(0.3)
                if self.path == "/missing":
                    return self.reply(404, b'{"error": {"message": "no such tool"}}')
                if self.path == "/text":
                    return self.reply(200, b"plain words", "text/plain")
                if self.path == "/big":
                    return self.reply(200, json.dumps({"output": "x" * 5000}).encode())
                if self.path == "/failing":
                    return self.reply(200, b'{"error": "no stock for that item"}')
                if self.path == "/redirect":
                    self.send_response(302)
                    self.send_header("Location", "http://127.0.0.1:9/")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
                output = {"echo": body["arguments"], "item": body["item"]}
                return self.reply(200, json.dumps({"output": output}).encode())

            def reply(self, status: int, data: bytes, content_type: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = _QuietServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True  # a hung handler does not hold the test up at shutdown
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    running = ToolServer()
    yield running
    running.close()


def tool(server: ToolServer, name: str, path: str = "/echo", **extra) -> dict:
    return {
        "name": name,
        "description": f"the {name} tool",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "server_url": server.url + path,
        **extra,
    }


def environment(tools: list[dict], *, outbound=LOOPBACK, tool_timeout_s: float = 5.0, max_turns=4, **config):
    return build_environment(
        "http_tools",
        config={"tools": tools, **config},
        max_turns=max_turns,
        tool_timeout_s=tool_timeout_s,
        outbound=outbound,
    )


def call(name: str, call_id: str = "call_1_0", **arguments) -> ToolCall:
    return ToolCall(id=call_id, name=name, arguments=arguments, arguments_json=json.dumps(arguments))


ROW = {"prompt": "How many are in stock?", "item": {"sku": "A-1"}}


def test_a_call_reaches_the_endpoint_with_the_rollout_id_and_the_call_id(server):
    env = environment([tool(server, "lookup", headers={"Authorization": "Bearer team-token"})])
    state = env.start(ROW, seed=0)
    reply = env.respond(state, "<tool_call>...</tool_call>", [call("lookup", x=1)])
    (request,) = server.requests
    rollout_id = request["body"]["rollout_id"]
    assert rollout_id.startswith("rollout_")
    assert request["headers"]["X-Rollout-Id"] == rollout_id
    assert request["headers"]["X-Call-Id"] == request["body"]["call_id"] == "call_1_0"
    assert request["headers"]["Authorization"] == "Bearer team-token"
    assert request["body"]["name"] == "lookup"
    assert request["body"]["arguments"] == {"x": 1}
    assert request["body"]["item"] == {"sku": "A-1"}
    assert reply.messages == [
        {"role": "tool", "tool_call_id": "call_1_0", "content": '{"echo": {"x": 1}, "item": {"sku": "A-1"}}'}
    ]


def test_calls_of_one_episode_share_a_rollout_id_and_episodes_differ(server):
    env = environment([tool(server, "lookup")])
    first, second = env.start(ROW, seed=0), env.start(ROW, seed=1)
    env.respond_batch([first, second], ["", ""], [[call("lookup", "call_1_0")], [call("lookup", "call_1_0")]])
    env.respond(first, "", [call("lookup", "call_2_0"), call("lookup", "call_2_1")])
    by_rollout: dict[str, list[str]] = {}
    for request in server.requests:
        by_rollout.setdefault(request["headers"]["X-Rollout-Id"], []).append(request["headers"]["X-Call-Id"])
    assert sorted(len(ids) for ids in by_rollout.values()) == [1, 3]
    assert sorted(by_rollout[first.data["rollout_id"]]) == ["call_1_0", "call_2_0", "call_2_1"]
    assert by_rollout[second.data["rollout_id"]] == ["call_1_0"]


def test_the_output_continues_the_episode_until_a_turn_without_a_call(server):
    env = environment([tool(server, "lookup"), tool(server, "read", "/text")], max_turns=3)
    state = env.start(ROW, seed=0)
    reply = env.respond(state, "", [call("read", "call_1_0")])
    assert not reply.done and reply.messages[0]["content"] == "plain words"
    final = env.respond(state, "There are 3.", [])
    assert final.done and final.messages == []
    assert state.metrics["tool_endpoint_calls"] == 1 and state.metrics["tool_errors"] == 0
    assert state.metrics["tool_latency_s"] > 0
    assert state.metrics["tool_latency_mean_s"] == state.metrics["tool_latency_s"]
    outcome = env.outcome(state)
    assert outcome["rollout_id"] == state.data["rollout_id"]
    (record,) = outcome["tool_requests"]
    assert (record["call_id"], record["name"], record["status"]) == ("call_1_0", "read", "ok")
    assert record["latency_ms"] > 0


def test_a_host_the_policy_refuses_is_an_error_message_not_a_crash(server):
    env = environment([tool(server, "lookup")], outbound=PUBLIC_ONLY)
    state = env.start(ROW)
    reply = env.respond(state, "", [call("lookup")])
    content = json.loads(reply.messages[0]["content"])
    assert "refused by the outbound policy" in content["error"] and "loopback" in content["error"]
    assert server.requests == []
    assert state.metrics["tool_errors"] == 1 and state.metrics["tool_timeouts"] == 0
    assert env.outcome(state)["tool_requests"][0]["status"] == "error"


def test_a_500_then_a_200_is_retried(server):
    env = environment([tool(server, "lookup", "/flaky")])
    state = env.start(ROW)
    reply = env.respond(state, "", [call("lookup", x=2)])
    assert server.hits["/flaky"] == 2
    assert json.loads(reply.messages[0]["content"])["echo"] == {"x": 2}
    assert state.metrics["tool_errors"] == 0 and state.metrics["tool_endpoint_calls"] == 1


def test_a_hung_endpoint_times_out_within_the_tool_timeout(server):
    env = environment([tool(server, "lookup", "/hang")], tool_timeout_s=0.5)
    state = env.start(ROW)
    started = time.monotonic()
    reply = env.respond(state, "", [call("lookup")])
    assert time.monotonic() - started < 2.0
    # Whichever gives up first at 0.5 s, the runner ("did not finish") or the HTTP client's socket
    # timeout ("did not answer"; first when the machine is busy), it is one timeout, not an error.
    error = json.loads(reply.messages[0]["content"])["error"]
    assert "did not finish within 0.5 s" in error or "did not answer within 0.5 s" in error, error
    assert state.metrics["tool_timeouts"] == 1 and state.metrics["tool_errors"] == 0
    (record,) = env.outcome(state)["tool_requests"]
    assert record["status"] == "timeout" and 500.0 <= record["latency_ms"] < 2000.0
    time.sleep(1.0)  # past a retry's backoff: the episode moved on, so the call is not sent again
    assert server.hits["/hang"] == 1


def test_the_budget_stops_calls_across_episodes(server):
    env = environment([tool(server, "lookup")], max_tool_calls=2)
    first, second = env.start(ROW), env.start(ROW)
    env.respond(first, "", [call("lookup", "call_1_0"), call("lookup", "call_1_1")])
    reply = env.respond(second, "", [call("lookup", "call_1_0")])
    assert len(server.requests) == 2
    assert "budget" in json.loads(reply.messages[0]["content"])["error"]
    assert second.metrics["tool_budget_refused"] == 1 and second.metrics["tool_errors"] == 1
    assert second.metrics["tool_endpoint_calls"] == 0
    assert env.outcome(second)["tool_requests"][0]["status"] == "over_budget"


def test_error_answers_are_tool_errors_the_model_reads(server):
    env = environment(
        [
            tool(server, "missing", "/missing"),
            tool(server, "big", "/big"),
            tool(server, "failing", "/failing"),
            tool(server, "moved", "/redirect"),
        ],
        max_response_bytes=1024,
    )
    state = env.start(ROW)
    calls = [
        call(name, f"call_1_{i}") for i, name in enumerate(["missing", "big", "failing", "moved", "nope"])
    ]
    errors = [json.loads(m["content"])["error"] for m in env.respond(state, "", calls).messages]
    assert errors[0] == "tool 'missing' answered HTTP 404: no such tool"
    assert errors[1] == "tool 'big' response larger than 1 KiB"
    assert errors[2] == "no stock for that item"
    assert "answered HTTP 302" in errors[3] and server.hits.get("/redirect") == 1  # not followed
    assert "unknown tool 'nope'" in errors[4]
    assert state.metrics["tool_errors"] == 5
    assert state.metrics["tool_endpoint_calls"] == 4  # the unknown tool was never sent
    assert server.url not in json.dumps(errors)


def test_an_episodes_calls_run_at_once(server):
    env = environment([tool(server, "slow", "/slow")])
    states = [env.start(ROW) for _ in range(4)]
    started = time.monotonic()
    env.respond_batch(
        states, [""] * 4, [[call("slow", "call_1_0"), call("slow", "call_1_1")] for _ in states]
    )
    assert time.monotonic() - started < 1.5  # 8 calls of 0.3 s each, together
    assert all(
        s.metrics["tool_endpoint_calls"] == 2 and 0.3 <= s.metrics["tool_wait_s"] < 1.5 for s in states
    )


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({}, "config.tools"),
        ({"tools": []}, "config.tools"),
        ({"tools": [{"name": "a b", "server_url": "http://h.example/"}]}, "config.tools[0].name"),
        ({"tools": [{"name": "a", "server_url": "ftp://h.example/"}]}, "config.tools[0].server_url"),
        ({"tools": [{"name": "a"}]}, "config.tools[0].server_url"),
        ({"tools": [{"name": "a", "server_url": "http://h/", "parameters": {"type": "array"}}]},
         "config.tools[0].parameters"),
        ({"tools": [{"name": "a", "server_url": "http://h/", "headers": {"X-Call-Id": "1"}}]},
         "config.tools[0].headers.X-Call-Id"),
        ({"tools": [{"name": "a", "server_url": "http://h/", "headers": {"A": 1}}]}, "config.tools[0].headers"),
        ({"tools": [{"name": "a", "server_url": "http://h/", "headers_encrypted": {}}]},
         "config.tools[0].headers_encrypted"),
        ({"tools": [{"name": "a", "server_url": "http://h/"}, {"name": "a", "server_url": "http://h/"}]},
         "config.tools"),
        ({"tools": [{"name": "a", "server_url": "http://h/"}], "max_tool_calls": 0}, "config.max_tool_calls"),
        ({"tools": [{"name": "a", "server_url": "http://h/"}], "retries": 1}, "config.retries"),
    ],
)  # fmt: skip
def test_bad_settings_name_the_field(config, field):
    with pytest.raises(ConfigError) as raised:
        validate_environment("http_tools", config=config, tools=[], max_turns=None)
    assert raised.value.field == field


def test_defaults_are_filled_in_and_tools_are_shown_to_the_model():
    settings = validate_environment(
        "http_tools",
        config={"tools": [{"name": "a", "server_url": "http://h.example/"}]},
        tools=None,
        max_turns=None,
    )
    assert settings["max_turns"] == 4
    assert settings["config"]["tools"] == [
        {"name": "a", "description": "", "parameters": {"type": "object", "properties": {}},
         "server_url": "http://h.example/"}
    ]  # fmt: skip
    env = build_environment("http_tools", config=settings["config"])
    assert [t.schema()["function"]["name"] for t in env.tools] == ["a"]


def test_a_steps_metrics_show_the_tool_latency_its_rollouts_added(server):
    from types import SimpleNamespace

    from training.runs.steps import tool_endpoint_metrics

    env = environment([tool(server, "slow", "/slow")])
    states = [env.start(ROW) for _ in range(2)]
    env.respond_batch(
        states, ["", ""], [[call("slow", "call_1_0")], [call("slow", "call_1_0"), call("slow", "call_1_1")]]
    )
    metrics = tool_endpoint_metrics([SimpleNamespace(metrics=dict(s.metrics)) for s in states])
    assert metrics["tool_endpoint_calls"] == 3
    assert 0.3 <= metrics["tool_latency_mean_s"] < 1.0 and 0.3 <= metrics["tool_wait_s"] < 1.0
    assert tool_endpoint_metrics([SimpleNamespace(metrics={"turns": 1})]) == {}  # no endpoint: nothing added
