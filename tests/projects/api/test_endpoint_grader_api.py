"""The endpoint grader on the platform: its URL is checked on every write, its header values are
encrypted at rest and masked wherever a spec is read back (reward definitions, fine-tuning jobs),
and OpenAI's grader endpoints run and validate it, driven by the real `openai` client."""

from __future__ import annotations

import json

import openai
import pytest

from projects import services
from projects.grader_secrets import grader_for_build
from projects.models import RewardDefinition, Run
from tests.conftest import error_of
from tests.factories import ProjectFactory
from tests.grader_endpoint_stub import grader_endpoint
from tests.projects.api.test_fine_tuning_api import (  # noqa: F401 - the fixture is used by name
    RL_ROWS,
    _connection_kept_open,
    client_for,
    upload,
)

pytestmark = pytest.mark.django_db

SECRET = "Bearer team-grader-secret"


@pytest.fixture
def endpoint():
    with grader_endpoint() as server:
        server.answer = lambda body: {"reward": 0.25}
        yield server


def endpoint_spec(url: str, **fields) -> dict:
    return {"type": "endpoint", "name": "checker", "url": url, "headers": {"Authorization": SECRET},
            "retries": 0, **fields}  # fmt: skip


def test_header_values_are_encrypted_at_rest_and_masked_on_read(alice_client, cast, endpoint):
    project = ProjectFactory(team=cast.alpha, name="p")
    spec = {"type": "multi", "graders": {"check": endpoint_spec(endpoint.url)}, "calculate_output": "check"}
    created = alice_client.post(
        "/api/v1/reward-definitions/", {"project": project.pk, "name": "r", "spec": spec}, format="json"
    )
    assert created.status_code == 201, created.content
    assert created.json()["spec"]["graders"]["check"]["headers"] == {"Authorization": "********"}
    stored = RewardDefinition.objects.get(pk=created.json()["id"])
    assert "team-grader-secret" not in json.dumps(stored.spec)
    assert set(stored.spec["graders"]["check"]["headers_encrypted"]) == {"Authorization"}
    for path in (f"/api/v1/reward-definitions/{stored.pk}/", "/api/v1/reward-definitions/"):
        assert b"team-grader-secret" not in alice_client.get(path).content
    # Read, edit the formula, write back with the mask: the stored value is kept.
    edited = {**created.json()["spec"], "calculate_output": "0.5 * check"}
    updated = alice_client.patch(f"/api/v1/reward-definitions/{stored.pk}/", {"spec": edited}, format="json")
    assert updated.status_code == 201, updated.content
    newer = RewardDefinition.objects.get(pk=updated.json()["id"])
    assert grader_for_build(newer.spec)["graders"]["check"]["headers"] == {"Authorization": SECRET}
    # A masked value never follows a changed URL.
    moved = {**edited, "graders": {"check": {**edited["graders"]["check"], "url": "http://127.0.0.1:9/x"}}}
    refused = alice_client.patch(f"/api/v1/reward-definitions/{newer.pk}/", {"spec": moved}, format="json")
    assert (
        refused.status_code == 400
        and error_of(refused)["param"] == "spec.graders.check.headers.Authorization"
    )


def test_the_dashboard_reward_page_shows_the_mask_and_saving_it_keeps_the_value(alice_client, cast, endpoint):
    project = ProjectFactory(team=cast.alpha, name="p")
    definition = services.reward_definition_create(
        project=project, name="r", spec=endpoint_spec(endpoint.url)
    )
    page = alice_client.get(f"/rewards/{definition.pk}/").content.decode()
    assert "team-grader-secret" not in page and "********" in page
    shown = services.grader_problems(
        {**endpoint_spec(endpoint.url), "headers": {"Authorization": "********"}}, field="spec"
    )
    saved = alice_client.post(f"/rewards/{definition.pk}/", {"name": "r", "spec": json.dumps(shown)})
    assert saved.status_code == 302, saved.content
    newest = RewardDefinition.objects.filter(project=project, name="r").order_by("-version").first()
    assert newest.version == 2
    assert grader_for_build(newest.spec)["headers"] == {"Authorization": SECRET}


def test_a_grader_url_the_outbound_policy_refuses_is_a_400_naming_the_field(alice_client, cast, settings):
    settings.OUTBOUND_ALLOW = ()
    project = ProjectFactory(team=cast.alpha, name="p")
    body = {"project": project.pk, "name": "r", "spec": endpoint_spec("http://127.0.0.1:8000/grade")}
    refused = alice_client.post("/api/v1/reward-definitions/", body, format="json")
    assert refused.status_code == 400 and error_of(refused)["param"] == "spec.url", refused.content
    checked = alice_client.post(
        "/api/v1/graders/validate", {"grader": endpoint_spec("http://169.254.169.254/")}, format="json"
    )
    assert checked.status_code == 400 and error_of(checked)["param"] == "grader.url"


def test_openai_client_runs_and_validates_an_endpoint_grader(alpha_key, endpoint):
    client = client_for(alpha_key)
    spec = endpoint_spec(endpoint.url)
    result = client.fine_tuning.alpha.graders.run(
        grader=spec, model_sample="It is 21 °C.", item={"expected_c": 21}
    )
    assert result.reward == 0.25 and result.metadata.type == "endpoint"
    (body,) = endpoint.requests
    assert body["sample"]["output_text"] == "It is 21 °C." and body["item"] == {"expected_c": 21}
    assert endpoint.headers[0]["Authorization"] == SECRET
    valid = client.fine_tuning.alpha.graders.validate(grader=spec)
    assert valid.grader.type == "endpoint"
    with pytest.raises(openai.BadRequestError) as caught:
        client.fine_tuning.alpha.graders.validate(grader={**spec, "timeout_s": 0})
    assert caught.value.body["param"] == "grader.timeout_s"


def test_an_endpoint_error_reaches_graders_run_as_openais_flags(alpha_key, endpoint):
    endpoint.answer = lambda body: (200, "<html>oops</html>")
    result = client_for(alpha_key).fine_tuning.alpha.graders.run(
        grader=endpoint_spec(endpoint.url), model_sample="x"
    )
    assert result.reward == 0.0 and result.metadata.errors.other_error is True
    details = result.model_dump()["metadata"]["error_details"]
    assert details[0]["code"] == "endpoint_grader_parse_error"


def test_a_fine_tuning_jobs_endpoint_grader_reads_back_masked(alpha_key, tiny_model_dir, endpoint):
    services.base_model_register(name="tiny", source=str(tiny_model_dir))
    client = client_for(alpha_key)
    training_file = upload(client, RL_ROWS)
    job = client.fine_tuning.jobs.create(
        model="tiny",
        training_file=training_file.id,
        method={"type": "reinforcement", "reinforcement": {"grader": endpoint_spec(endpoint.url)}},
    )
    assert job.method.reinforcement.grader.model_dump()["headers"] == {"Authorization": "********"}
    again = client.fine_tuning.jobs.retrieve(job.id)
    assert again.method.reinforcement.grader.model_dump()["headers"] == {"Authorization": "********"}
    run = Run.objects.get(pk=int(job.id.removeprefix("ftjob-")))
    assert "team-grader-secret" not in json.dumps(run.fine_tuning)
    assert "team-grader-secret" not in json.dumps(run.reward.spec)
    assert grader_for_build(run.reward.spec)["headers"] == {"Authorization": SECRET}
