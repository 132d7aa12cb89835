"""Grader endpoints (validate, run) and team judge endpoints."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from projects.models import JudgeEndpoint
from tests.conftest import error_of

pytestmark = pytest.mark.django_db

STRING_CHECK = {
    "type": "string_check",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}


def test_validate_returns_the_normalised_grader(key_client):
    response = key_client.post("/api/v1/graders/validate", {"grader": STRING_CHECK}, format="json")
    assert response.status_code == 200, response.json()
    grader = response.json()["grader"]
    assert grader["name"] == "string_check" and grader["error_reward"] == 0.0


def test_validate_reports_every_problem_with_its_path(key_client):
    bad = {"type": "string_check", "input": "{{sample.output_text}}", "operation": "equals", "colour": 1}
    response = key_client.post("/api/v1/graders/validate", {"grader": bad}, format="json")
    assert response.status_code == 400
    fields = error_of(response)["fields"]
    assert {"grader.reference", "grader.operation", "grader.colour"} <= set(fields), fields


def test_validate_nested_multi_paths(key_client):
    spec = {
        "type": "multi",
        "graders": {"exact": STRING_CHECK, "fmt": {"type": "regex", "pattern": "("}},
        "calculate_output": "0.5 * exact + 0.5 * missing",
    }
    response = key_client.post("/api/v1/graders/validate", {"grader": spec}, format="json")
    assert response.status_code == 400
    paths = set(error_of(response)["fields"])
    assert any("fmt" in path and "pattern" in path for path in paths), paths
    assert any("calculate_output" in path for path in paths), paths


def test_run_string_check_in_openai_shape(key_client):
    body = {"grader": STRING_CHECK, "model_sample": "42", "item": {"answer": "42"}}
    response = key_client.post("/api/v1/graders/run", body, format="json")
    assert response.status_code == 200, response.json()
    result = response.json()
    assert result["reward"] == 1.0
    assert result["metadata"]["type"] == "string_check" and result["metadata"]["execution_time"] >= 0
    miss = key_client.post("/api/v1/graders/run", {**body, "model_sample": "41"}, format="json").json()
    assert miss["reward"] == 0.0


def test_run_multi_formula(key_client):
    spec = {
        "type": "multi",
        "graders": {"exact": STRING_CHECK, "short": {"type": "regex", "pattern": "^.{1,3}$"}},
        "calculate_output": "0.25 * exact + 0.75 * short",
    }
    body = {"grader": spec, "model_sample": "41", "item": {"answer": "42"}}
    result = key_client.post("/api/v1/graders/run", body, format="json").json()
    assert result["reward"] == pytest.approx(0.75)
    assert result["sub_rewards"] == {"exact": 0.0, "short": 1.0}


def test_run_python_grader_in_the_sandbox(key_client):
    source = "def grade(sample, item):\n    return len(sample['output_text']) / 10\n"
    body = {"grader": {"type": "python", "source": source}, "model_sample": "abcd", "item": {}}
    response = key_client.post("/api/v1/graders/run", body, format="json")
    assert response.status_code == 200, response.json()
    assert response.json()["reward"] == pytest.approx(0.4)


def test_run_python_grader_error_is_data_not_a_500(key_client):
    source = "def grade(sample, item):\n    return 1 / 0\n"
    body = {"grader": {"type": "python", "source": source}, "model_sample": "x"}
    response = key_client.post("/api/v1/graders/run", body, format="json")
    assert response.status_code == 200
    result = response.json()
    assert result["reward"] == 0.0
    assert result["metadata"]["errors"]["python_grader_runtime_error"] is True


def test_run_needs_exactly_one_sample_form(key_client):
    response = key_client.post("/api/v1/graders/run", {"grader": STRING_CHECK}, format="json")
    assert response.status_code == 400 and error_of(response)["param"] == "model_sample"


class _ScriptedJudge(BaseHTTPRequestHandler):
    replies: list[str] = []
    seen: list[dict] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append({"body": body, "auth": self.headers.get("Authorization")})
        content = type(self).replies.pop(0)
        payload = {
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
            "model": body["model"],
        }
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def judge_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ScriptedJudge)
    _ScriptedJudge.replies, _ScriptedJudge.seen = [], []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", _ScriptedJudge
    server.shutdown()


def test_judge_endpoint_key_is_encrypted_and_never_returned(alice_client, cast):
    body = {"name": "default", "base_url": "http://127.0.0.1:9/v1", "api_key": "sk-secret-123"}
    created = alice_client.post("/api/v1/judge-endpoints/", body, format="json")
    assert created.status_code == 201, created.json()
    assert "api_key" not in created.json() and created.json()["has_api_key"] is True
    stored = JudgeEndpoint.objects.get(team=cast.alpha)
    assert "sk-secret-123" not in stored.api_key_encrypted
    listed = alice_client.get("/api/v1/judge-endpoints/").content
    assert b"sk-secret" not in listed


def test_judge_endpoint_tenancy_and_roles(alice_client, bob_client, charlie_client):
    endpoint = alice_client.post(
        "/api/v1/judge-endpoints/", {"name": "j", "base_url": "http://127.0.0.1:9/v1"}, format="json"
    ).json()
    assert charlie_client.get(f"/api/v1/judge-endpoints/{endpoint['id']}/").status_code == 404
    assert (
        bob_client.patch(
            f"/api/v1/judge-endpoints/{endpoint['id']}/", {"timeout_s": 5}, format="json"
        ).status_code
        == 403
    )
    bad = alice_client.post("/api/v1/judge-endpoints/", {"name": "k", "base_url": "ftp://x"}, format="json")
    assert bad.status_code == 400 and error_of(bad)["param"] == "base_url"


def test_score_model_runs_against_the_teams_judge(alice_client, judge_server):
    url, judge = judge_server
    alice_client.post(
        "/api/v1/judge-endpoints/", {"name": "default", "base_url": url, "api_key": "sk-judge"}, format="json"
    )
    spec = {
        "type": "score_model",
        "model": "judge-model",
        "input": [{"role": "user", "content": "Score 0..1: {{sample.output_text}}"}],
        "range": [0, 1],
    }
    judge.replies = ["0.8", "I cannot help with that.", "7"]
    good = alice_client.post(
        "/api/v1/graders/run", {"grader": spec, "model_sample": "hi"}, format="json"
    ).json()
    assert good["reward"] == pytest.approx(0.8)
    assert judge.seen[0]["auth"] == "Bearer sk-judge"
    assert "Score 0..1: hi" in json.dumps(judge.seen[0]["body"]["messages"])
    refusal = alice_client.post(
        "/api/v1/graders/run", {"grader": spec, "model_sample": "x"}, format="json"
    ).json()
    assert refusal["reward"] == 0.0 and refusal["metadata"]["errors"]["model_grader_parse_error"] is True
    out_of_range = alice_client.post(
        "/api/v1/graders/run", {"grader": spec, "model_sample": "x"}, format="json"
    ).json()
    assert out_of_range["reward"] == 0.0 and out_of_range["metadata"]["error_details"]


def test_unknown_judge_endpoint_is_400(key_client):
    spec = {"type": "score_model", "model": "m", "input": [{"role": "user", "content": "x"}], "range": [0, 1]}
    body = {"grader": spec, "model_sample": "x", "judge_endpoint": "nope"}
    response = key_client.post("/api/v1/graders/run", body, format="json")
    assert response.status_code == 400 and error_of(response)["param"] == "judge_endpoint"
