"""Every free-text field has a stated maximum (issue 22): over it is a 400 naming the field and
the limit, in the API's error shape, and nothing is stored; the services refuse it too, for the
dashboard's forms. Before, a 3 MB project description was stored."""

from __future__ import annotations

import pytest

from projects import services
from projects.errors import ValidationFailed
from projects.models import Environment, JudgeEndpoint, Project, TaskSet
from projects.services.environments import SYSTEM_PROMPT_MAX_CHARS
from projects.services.judges import API_KEY_MAX_CHARS
from projects.services.projects import DESCRIPTION_MAX_CHARS
from projects.services.scenarios import MAX_INSTRUCTION_CHARS
from tests.conftest import error_of

pytestmark = pytest.mark.django_db


def test_the_stated_maximums():
    assert (DESCRIPTION_MAX_CHARS, SYSTEM_PROMPT_MAX_CHARS, API_KEY_MAX_CHARS, MAX_INSTRUCTION_CHARS) == (
        10_000, 100_000, 4_096, 4_000,
    )  # fmt: skip


def test_a_3_mb_project_description_is_a_400_and_not_stored(key_client, cast):
    response = key_client.post(
        "/api/v1/projects/", {"name": "big", "description": "x" * 3_000_000}, format="json"
    )
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == "description"
    assert "10000 characters" in error["fields"]["description"][0]
    assert not Project.objects.filter(name="big").exists()


def test_a_project_description_of_exactly_the_maximum_is_stored(key_client, cast):
    response = key_client.post(
        "/api/v1/projects/", {"name": "full", "description": "x" * DESCRIPTION_MAX_CHARS}, format="json"
    )
    assert response.status_code == 201, response.content[:300]
    assert len(Project.objects.get(name="full").description) == DESCRIPTION_MAX_CHARS


def test_a_project_description_over_the_maximum_is_refused_on_update_too(key_client, alpha_setup):
    project = alpha_setup.project
    response = key_client.patch(
        f"/api/v1/projects/{project.id}/", {"description": "x" * (DESCRIPTION_MAX_CHARS + 1)}, format="json"
    )
    assert response.status_code == 400 and error_of(response)["param"] == "description"
    project.refresh_from_db()
    assert len(project.description) <= DESCRIPTION_MAX_CHARS


def _environment_post(setup):
    return "post", "/api/v1/environments/", {"project": setup.project.id, "name": "long"}


def _environment_patch(setup):
    return "patch", f"/api/v1/environments/{setup.environment.id}/", {}


def _judge_post(setup):
    return "post", "/api/v1/judge-endpoints/", {"name": "judge", "base_url": "http://127.0.0.1:9/v1"}


def _generate_post(setup):
    return "post", "/api/v1/task-sets/generate", {
        "project": setup.project.id, "environment": setup.environment.id, "endpoint": 1, "n": 1,
        "name": "generated",
    }  # fmt: skip


def _task_set_post(setup):
    return "post", "/api/v1/task-sets/", {"project": setup.project.id, "name": "long"}


@pytest.mark.parametrize(
    ("request_of", "field", "maximum"),
    [
        (_environment_post, "system_prompt", SYSTEM_PROMPT_MAX_CHARS),
        (_environment_patch, "system_prompt", SYSTEM_PROMPT_MAX_CHARS),
        (_judge_post, "api_key", API_KEY_MAX_CHARS),
        (_generate_post, "instruction", MAX_INSTRUCTION_CHARS),
        (_task_set_post, "jsonl", 4096),  # MAX_TASKSET_BYTES, as for an uploaded file
    ],
)
def test_free_text_over_its_maximum_is_a_400_naming_the_field(
    settings, alice_client, alpha_setup, request_of, field, maximum
):
    settings.MAX_TASKSET_BYTES = 4096  # the default is 50 MB, more than a JSON body may be
    method, path, body = request_of(alpha_setup)
    # A JSONL row per line, so the jsonl case is valid but for its length.
    text = (
        ('{"prompt": "q", "item": {}}\n' * (maximum // 27 + 1)) if field == "jsonl" else "x" * (maximum + 1)
    )
    assert len(text) > maximum
    stored = (Environment.objects.count(), JudgeEndpoint.objects.count(), TaskSet.objects.count())
    response = getattr(alice_client, method)(path, {**body, field: text}, format="json")
    assert response.status_code == 400, response.content[:300]
    error = error_of(response)
    assert error["param"] == field
    assert str(maximum) in error["message"]
    assert (Environment.objects.count(), JudgeEndpoint.objects.count(), TaskSet.objects.count()) == stored
    alpha_setup.environment.refresh_from_db()
    assert len(alpha_setup.environment.system_prompt) <= SYSTEM_PROMPT_MAX_CHARS


@pytest.mark.parametrize(
    ("write", "field"),
    [
        (lambda s: services.project_create(team=s.project.team, name="d", description="x" * 10_001), "description"),
        (lambda s: services.project_update(project=s.project, description="x" * 10_001), "description"),
        (lambda s: services.environment_create(project=s.project, name="p", system_prompt="x" * 100_001),
         "system_prompt"),
        (lambda s: services.environment_update(environment=s.environment, system_prompt="x" * 100_001),
         "system_prompt"),
        (lambda s: services.judge_endpoint_create(team=s.project.team, name="j", base_url="http://127.0.0.1:9/v1",
                                                  api_key="k" * 4_097), "api_key"),
    ],
)  # fmt: skip
def test_the_services_refuse_it_for_the_dashboard_too(alpha_setup, write, field):
    with pytest.raises(ValidationFailed) as refused:
        write(alpha_setup)
    assert refused.value.field == field
    assert "must be at most" in str(refused.value)
