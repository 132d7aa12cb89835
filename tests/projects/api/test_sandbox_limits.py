"""The API side of issue 22's sandbox findings: an MCP stdio config cannot steer the child
(400 naming the key), the reported attack through task-set generation runs nothing, and a flood
of grader runs or tool listings meets the host's sandbox caps as a 429 (training/safety/slots.py)."""

from __future__ import annotations

import json

import pytest
from django.test import override_settings

from projects.models import Environment
from projects.services import judges
from tests.conftest import error_of
from tests.openai_stub import openai_stub
from training.environments.mcp import DEMO_MODULE
from training.safety.slots import SlotPolicy, sandbox_slot

pytestmark = pytest.mark.django_db

DEMO = ["python", "-m", DEMO_MODULE]
PYTHON_GRADER = {"type": "python", "source": "def grade(sample, item):\n    return 1.0\n"}


def _environment(client, project, config, name="mcp"):
    return client.post(
        "/api/v1/environments/",
        {"project": project.pk, "name": name, "kind": "mcp", "config": config},
        format="json",
    )


@pytest.mark.parametrize(
    "env, key",
    [
        ({"PYTHONWARNINGS": "ignore::antigravity.x", "BROWSER": "/bin/sh -c 'id' #%s"}, "PYTHONWARNINGS"),
        ({"BROWSER": "/bin/sh -c 'id' #%s"}, "BROWSER"),
        ({"PYTHONSTARTUP": "/tmp/x.py"}, "PYTHONSTARTUP"),
        ({"LD_PRELOAD": "/tmp/x.so"}, "LD_PRELOAD"),
        ({"PYTHONINSPECT": "1"}, "PYTHONINSPECT"),
        ({"PYTHONPATH": "/tmp"}, "PYTHONPATH"),
    ],
)
def test_an_env_variable_that_steers_the_child_is_a_400_naming_the_key(alice_client, alpha_setup, env, key):
    with override_settings(MCP_STDIO_ENV=("*",)):  # even an operator who allows every name
        response = _environment(alice_client, alpha_setup.project, {"command": DEMO, "env": env})
    assert response.status_code == 400, response.content
    assert error_of(response)["param"] == f"config.env.{key}"
    assert not Environment.objects.filter(name="mcp").exists()


def test_extra_arguments_to_the_demo_server_are_a_400(alice_client, alpha_setup):
    for command in (
        [*DEMO, "--http", "--port", "8765"],
        ["python", "-c", "print(1)"],
        ["python", "-I", *DEMO[1:]],
    ):
        response = _environment(alice_client, alpha_setup.project, {"command": command})
        assert response.status_code == 400 and error_of(response)["param"] == "config.command", command


def test_the_reported_attack_through_task_set_generation_runs_nothing(
    alice_client, alpha_setup, tmp_path, cast
):
    """The finding as reported: a stored environment with the payload, then generate (which lists
    the environment's tools in the web process). On the old code `touch` ran on the host."""
    marker = tmp_path / "pwned"
    environment = Environment.objects.create(  # stored as an old row could hold it: no validation
        project=alpha_setup.project,
        name="attack",
        kind="mcp",
        max_turns=2,
        config={
            "command": DEMO,
            "env": {"PYTHONWARNINGS": "ignore::antigravity.x", "BROWSER": f"/bin/sh -c 'touch {marker}' #%s"},
        },
    )
    rows = "\n".join(json.dumps({"prompt": f"q{i}", "item": {"answer": "a"}}) for i in range(2))
    with openai_stub([rows] * 4) as stub:
        endpoint = judges.judge_endpoint_create(
            team=cast.alpha, name="writer", base_url=stub.url, api_key="sk-w", default_model="m"
        )
        with override_settings(OUTBOUND_ALLOW=("127.0.0.1",)):
            response = alice_client.post(
                "/api/v1/task-sets/generate",
                {
                    "project": alpha_setup.project.pk,
                    "environment": environment.pk,
                    "endpoint": endpoint.pk,
                    "n": 2,
                    "instruction": "short answers",
                    "name": "generated",
                },
                format="json",
            )
    assert response.status_code < 500, response.content
    assert not marker.exists()


@pytest.fixture
def one_slot_per_team(settings, tmp_path):
    settings.SANDBOX_SLOT_DIR = tmp_path / "slots"
    settings.SANDBOX_MAX_PER_TEAM = 1
    settings.SANDBOX_MAX_TOTAL = 2
    settings.SANDBOX_WEB_WAIT_S = 0.2
    return SlotPolicy(directory=str(tmp_path / "slots"), total=2, per_team=1)


def test_grader_runs_past_the_teams_cap_are_429_and_other_teams_still_run(
    key_client, charlie_client, cast, one_slot_per_team
):
    body = {"grader": PYTHON_GRADER, "model_sample": "x", "item": {}}
    with sandbox_slot(one_slot_per_team, str(cast.alpha.pk)):  # alpha's one sandbox is busy
        busy = key_client.post("/api/v1/graders/run", body, format="json")
        assert busy.status_code == 429, busy.content
        assert error_of(busy)["code"] == "sandbox_busy" and busy["Retry-After"] == "1"
        assert "for this team" in error_of(busy)["message"]
        other = charlie_client.post("/api/v1/graders/run", body, format="json")
        assert other.status_code == 200 and other.json()["reward"] == 1.0
    done = key_client.post("/api/v1/graders/run", body, format="json")
    assert done.status_code == 200 and done.json()["reward"] == 1.0


def test_tool_listing_on_a_full_host_is_429(alice_client, alpha_setup, cast, one_slot_per_team):
    environment = Environment.objects.create(
        project=alpha_setup.project, name="demo", kind="mcp", max_turns=2, config={"command": DEMO}
    )
    endpoint = judges.judge_endpoint_create(
        team=cast.alpha,
        name="writer",
        base_url="https://judge.example.com/v1",
        api_key="sk",
        default_model="m",
    )
    with sandbox_slot(one_slot_per_team, "other-1"), sandbox_slot(one_slot_per_team, "other-2"):
        response = alice_client.post(
            "/api/v1/task-sets/generate",
            {
                "project": alpha_setup.project.pk,
                "environment": environment.pk,
                "endpoint": endpoint.pk,
                "n": 1,
                "instruction": "short answers",
                "name": "generated",
            },
            format="json",
        )
    assert response.status_code == 429, response.content
    assert "on this host" in error_of(response)["message"]
