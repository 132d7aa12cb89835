"""The dashboard with Agent RFT's http_tools environments: the project page's form creates one (its
tools' header values stored encrypted), and the trajectory viewer shows beside each tool message
how its endpoint call went (status, latency, the error in its title)."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from projects import environment_config, services
from projects.models import Trajectory


@pytest.fixture(autouse=True)
def _no_enqueue(monkeypatch):
    monkeypatch.setattr(services.runs, "_enqueue_run", lambda run_id: None)  # no worker here


def client_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_the_environment_form_creates_an_http_tools_environment_with_encrypted_headers(cast, alpha_setup):
    config = {"tools": [{"name": "lookup", "server_url": "http://127.0.0.1:9/lookup",
                         "headers": {"Authorization": "Bearer s3cret"}}]}  # fmt: skip
    response = client_for(cast.alice).post(
        f"/projects/{alpha_setup.project.pk}/",
        {
            "environment-name": "shop-tools",
            "environment-kind": "http_tools",
            "environment-config": json.dumps(config),
        },
    )
    assert response.status_code == 302, response.context["environment_form"].errors
    environment = alpha_setup.project.environments.get(name="shop-tools")
    assert environment.kind == "http_tools" and environment.max_turns == 4
    assert "s3cret" not in json.dumps(environment.config)
    assert environment_config.config_for_build(environment.config)["tools"][0]["headers"] == {
        "Authorization": "Bearer s3cret"
    }
    page = client_for(cast.alice).get(f"/projects/{alpha_setup.project.pk}/").content.decode()
    assert "s3cret" not in page and "Http Tools" in page


def test_the_trajectory_viewer_shows_each_tool_calls_status_and_latency(cast, alpha_setup):
    run = services.run_create(
        model=alpha_setup.model, task_set=alpha_setup.task_set, environment=alpha_setup.environment,
        reward=alpha_setup.reward, config={"steps": 2}, created_by=cast.alice,
    )  # fmt: skip
    calls = [
        {"id": f"call_1_{i}", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
        for i in range(2)
    ]
    messages = [
        {"role": "user", "content": "Stock of A-1?"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1_0", "content": "3 in stock"},
        {
            "role": "tool",
            "tool_call_id": "call_1_1",
            "content": '{"error": "tool \'lookup\' did not finish"}',
        },
        {"role": "assistant", "content": "3"},
    ]
    outcome = {
        "rollout_id": "rollout_abc",
        "tool_requests": [
            {"call_id": "call_1_0", "name": "lookup", "status": "ok", "latency_ms": 12.5},
            {"call_id": "call_1_1", "name": "lookup", "status": "timeout", "latency_ms": 10000.0,
             "error": "tool 'lookup' did not finish within 10 s"},
        ],
    }  # fmt: skip
    Trajectory.objects.create(
        run=run, step=1, group_index=0, sample_index=0, messages=messages, reward=1.0,
        metrics={"tool_endpoint_calls": 2, "outcome": outcome},
    )  # fmt: skip
    response = client_for(cast.alice).get(f"/runs/{run.pk}/trajectories?step=1&group=0")
    tool_messages = [m for m in response.context["columns"][0].messages if m.role == "tool"]
    assert [m.tool_request["status"] for m in tool_messages] == ["ok", "timeout"]
    html = response.content.decode()
    assert "ok · 12.5 ms" in html and "timeout · 10000.0 ms" in html
    assert "did not finish within 10 s" in html
