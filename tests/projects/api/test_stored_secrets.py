"""Stored secrets never follow a URL: judge endpoints' api_key and MCP environments' headers are
sent only to the URL they were entered for; no stored URL carries a credential of its own."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from projects.models import JudgeEndpoint
from tests.conftest import error_of

pytestmark = pytest.mark.django_db

SCORE = {
    "type": "score_model",
    "model": "judge-model",
    "input": [{"role": "user", "content": "Score 0..1: {{sample.output_text}}"}],
    "range": [0, 1],
}


class _Judge:
    """A local OpenAI-compatible judge that records the Authorization header of every call."""

    def __init__(self) -> None:
        self.auth_seen: list[str | None] = []
        seen = self.auth_seen

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                seen.append(self.headers.get("Authorization"))
                message = {"role": "assistant", "content": "0.5"}
                data = json.dumps(
                    {
                        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                        "model": body["model"],
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def two_judges() -> Iterator[tuple[_Judge, _Judge]]:
    old, new = _Judge(), _Judge()
    yield old, new
    old.server.shutdown()
    new.server.shutdown()


def _endpoint(client, url: str, api_key: str = "sk-old") -> dict:
    created = client.post(
        "/api/v1/judge-endpoints/", {"name": "default", "base_url": url, "api_key": api_key}, format="json"
    )
    assert created.status_code == 201, created.content
    return created.json()


def _grade(client) -> None:
    graded = client.post("/api/v1/graders/run", {"grader": SCORE, "model_sample": "hi"}, format="json")
    assert graded.status_code == 200 and graded.json()["reward"] == pytest.approx(0.5), graded.content


def test_judge_endpoint_writes_are_owner_only(alice_client, bob_client, key_client, charlie_client):
    endpoint = _endpoint(alice_client, "http://127.0.0.1:9/v1")
    url = f"/api/v1/judge-endpoints/{endpoint['id']}/"
    # A read-write key acts as a member: it reads, but writes to judge endpoints are the owners'.
    assert key_client.get(url).status_code == 200
    for client in (key_client, bob_client):
        assert client.patch(url, {"base_url": "http://127.0.0.1:10/v1"}, format="json").status_code == 403
        assert client.delete(url).status_code == 403
        created = client.post("/api/v1/judge-endpoints/", {"name": "x", "base_url": "http://a.example/v1"})
        assert created.status_code == 403
    assert charlie_client.patch(url, {"timeout_s": 5}, format="json").status_code == 404
    assert JudgeEndpoint.objects.get(pk=endpoint["id"]).base_url == "http://127.0.0.1:9/v1"


def test_a_new_base_url_needs_the_api_key_again_and_the_old_key_never_reaches_it(alice_client, two_judges):
    old, new = two_judges
    endpoint = _endpoint(alice_client, old.url)
    url = f"/api/v1/judge-endpoints/{endpoint['id']}/"
    _grade(alice_client)
    assert old.auth_seen == ["Bearer sk-old"]

    moved = alice_client.patch(url, {"base_url": new.url}, format="json")
    assert moved.status_code == 400 and error_of(moved)["param"] == "api_key"
    assert "give api_key again" in error_of(moved)["message"]
    assert JudgeEndpoint.objects.get(pk=endpoint["id"]).base_url == old.url
    # Other fields change without the key; the URL with the key given again.
    assert alice_client.patch(url, {"timeout_s": 5}, format="json").status_code == 200
    moved = alice_client.patch(url, {"base_url": new.url, "api_key": "sk-new"}, format="json")
    assert moved.status_code == 200, moved.content
    assert moved.json()["base_url"] == new.url and moved.json()["has_api_key"] is True
    _grade(alice_client)
    assert new.auth_seen == ["Bearer sk-new"]
    assert old.auth_seen == ["Bearer sk-old"]  # nothing more went to the old URL either


def test_an_explicitly_empty_api_key_moves_the_url_and_drops_the_stored_key(alice_client, two_judges):
    old, new = two_judges
    endpoint = _endpoint(alice_client, old.url)
    moved = alice_client.patch(
        f"/api/v1/judge-endpoints/{endpoint['id']}/", {"base_url": new.url, "api_key": ""}, format="json"
    )
    assert moved.status_code == 200 and moved.json()["has_api_key"] is False
    _grade(alice_client)
    assert all(auth is None or "sk-old" not in auth for auth in new.auth_seen) and new.auth_seen
    assert old.auth_seen == []


def test_a_url_without_a_stored_key_changes_freely(alice_client):
    endpoint = _endpoint(alice_client, "http://127.0.0.1:9/v1", api_key="")
    moved = alice_client.patch(
        f"/api/v1/judge-endpoints/{endpoint['id']}/", {"base_url": "http://127.0.0.1:10/v1"}, format="json"
    )
    assert moved.status_code == 200, moved.content


@pytest.mark.parametrize(
    "url",
    [
        "http://user:pw@judge.example/v1",
        "http://user@judge.example/v1",
        "https://judge.example/v1?api_key=sk-1",
        "https://judge.example/v1?key=sk-1",
        "https://judge.example/v1?token=t",
        "https://judge.example/v1?access_token=t",
        "https://judge.example/v1?api-version=1&sig=abc",
        "https://judge.example/v1?X-Amz-Signature=abc",
        "https://judge.example/v1?client_secret=abc",
    ],
)
def test_credentials_in_a_judge_url_are_refused(alice_client, url):
    created = alice_client.post(
        "/api/v1/judge-endpoints/", {"name": "j", "base_url": url, "api_key": "sk"}, format="json"
    )
    assert created.status_code == 400 and error_of(created)["param"] == "base_url", created.content
    assert not JudgeEndpoint.objects.exists()


def test_credentials_in_a_judge_url_are_refused_on_update(alice_client):
    endpoint = _endpoint(alice_client, "https://judge.example/v1")
    changed = alice_client.patch(
        f"/api/v1/judge-endpoints/{endpoint['id']}/",
        {"base_url": "https://judge.example/v1?token=x", "api_key": "sk"},
        format="json",
    )
    assert changed.status_code == 400 and error_of(changed)["param"] == "base_url"


def test_harmless_query_parameters_are_kept(alice_client):
    endpoint = _endpoint(alice_client, "https://judge.example/openai?api-version=2024-06-01")
    assert endpoint["base_url"] == "https://judge.example/openai?api-version=2024-06-01"


def test_a_credential_stored_before_the_rule_is_masked_for_every_role(cast, alice_client, bob_client):
    JudgeEndpoint.objects.create(
        team=cast.alpha, name="legacy", base_url="https://u:hunter2@judge.example/v1?api_key=sk-9&v=2"
    )
    for client in (alice_client, bob_client):
        body = client.get("/api/v1/judge-endpoints/").content.decode()
        assert "hunter2" not in body and "sk-9" not in body and "u:" not in body
        shown = client.get("/api/v1/judge-endpoints/").json()["data"][0]["base_url"]
        assert shown == "https://********@judge.example/v1?api_key=********&v=2"


MCP_URL = "http://127.0.0.1:9/mcp"


def _mcp(client, project_id: int, config: dict):
    return client.post(
        "/api/v1/environments/",
        {"project": project_id, "name": "tools", "kind": "mcp", "config": config},
        format="json",
    )


@pytest.mark.parametrize("url", ["http://a:b@127.0.0.1:9/mcp", "http://127.0.0.1:9/mcp?token=abc"])
def test_credentials_in_an_mcp_url_are_refused(alpha_setup, alice_client, url):
    created = _mcp(alice_client, alpha_setup.project.pk, {"url": url})
    assert created.status_code == 400 and error_of(created)["param"] == "config.url", created.content


def test_an_mcp_url_change_needs_the_headers_again(alpha_setup, alice_client):
    created = _mcp(alice_client, alpha_setup.project.pk, {"url": MCP_URL, "headers": {"Authorization": "s"}})
    assert created.status_code == 201, created.content
    url = f"/api/v1/environments/{created.json()['id']}/"
    moved = alice_client.patch(url, {"config": {"url": "http://127.0.0.1:10/mcp"}}, format="json")
    assert moved.status_code == 400 and error_of(moved)["param"] == "config.headers"
    assert "give config.headers again" in error_of(moved)["message"]
    dropped = alice_client.patch(
        url, {"config": {"url": "http://127.0.0.1:10/mcp", "headers": {}}}, format="json"
    )
    assert dropped.status_code == 200 and "headers" not in dropped.json()["config"]


def test_an_mcp_url_stored_with_a_credential_is_masked(alpha_setup, alice_client, bob_client):
    from projects.models import Environment

    Environment.objects.create(
        project=alpha_setup.project,
        name="legacy",
        kind="mcp",
        config={"url": "http://u:pw@h.example/mcp?key=k"},
    )
    for client in (alice_client, bob_client):
        body = client.get("/api/v1/environments/").content.decode()
        assert "u:pw" not in body and "key=k" not in body
