"""The API forgives what a newcomer types: paths with or without the trailing slash (never a
redirect, never a 500), a JSON 404 naming the path that exists, every config error at once, each
with its path once, and unknown names answered with the valid ones and a close match."""

from __future__ import annotations

import pytest
from django.test import override_settings

from tests.conftest import error_of

pytestmark = pytest.mark.django_db


def _run_body(setup, **config):
    return {
        "model": setup.model.pk, "task_set": setup.task_set.pk, "environment": setup.environment.pk,
        "reward": setup.reward.pk, "config": {"steps": 2, **config},
    }  # fmt: skip


@pytest.mark.parametrize("debug", [False, True])
def test_a_post_without_the_trailing_slash_creates(alice_client, debug):
    with override_settings(DEBUG=debug):  # DEBUG's APPEND_SLASH answered this with a 500 page
        response = alice_client.post("/api/v1/projects", {"name": "noslash"}, format="json")
    assert response.status_code == 201, response.content
    assert alice_client.get("/api/v1/projects").json()["data"][0]["name"] == "noslash"


@pytest.mark.parametrize(
    "url",
    [
        "/api/v1/hyperparameters", "/api/v1/hyperparameters/", "/api/v1/environment-kinds/",
        "/api/v1/usage/", "/api/v1/base-models", "/api/v1/models/{model}", "/api/v1/models/{model}/checkpoints",
        "/api/v1/runs/{run}/events", "/api/v1/runs/{run}/events/", "/api/v1/runs/{run}/metrics",
        "/api/v1/runs/{run}/evaluations", "/api/v1/evaluations", "/api/v1/schema",
    ],
)  # fmt: skip
def test_paths_answer_with_and_without_the_trailing_slash(alpha_setup, key_client, url):
    run = key_client.post("/api/v1/runs", _run_body(alpha_setup), format="json")
    assert run.status_code == 201, run.json()
    response = key_client.get(url.format(model=alpha_setup.model.pk, run=run.json()["id"]))
    assert response.status_code == 200, (url, response.status_code)


@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.parametrize(
    ("path", "meant"),
    [
        ("/api/v1/project/", "/api/v1/projects/"),
        ("/api/v1/hyperparameter", "/api/v1/hyperparameters"),
        ("/api/v1/runs/7/event", "/api/v1/runs/7/events"),
        ("/api/v1/run/7/event/", "/api/v1/runs/7/events/"),
        ("/v1/chat/completion", "/v1/chat/completions"),
        ("/v1/chat/completions/", "/v1/chat/completions"),
        ("/v1/preview/models/", "/v1/preview/models"),
    ],
)
def test_a_near_miss_is_a_json_404_naming_the_right_path(key_client, path, meant, debug):
    with override_settings(DEBUG=debug):
        response = key_client.get(path)
    assert response.status_code == 404
    assert error_of(response)["message"] == f"No endpoint at {path}; did you mean {meant}?"


def test_a_path_near_nothing_is_a_plain_json_404(key_client):
    response = key_client.get("/api/v1/zzzzzz")
    assert response.status_code == 404 and error_of(response)["message"] == "No endpoint at /api/v1/zzzzzz."


def test_every_config_error_is_reported_at_once_with_suggestions(alpha_setup, key_client):
    response = key_client.post(
        "/api/v1/runs", _run_body(alpha_setup, lr=1e-4, learning_rate="fast", group_size=0), format="json"
    )
    assert response.status_code == 400
    error = error_of(response)
    assert set(error["fields"]) == {"config.lr", "config.learning_rate", "config.group_size"}
    assert error["fields"]["config.lr"] == ["unknown hyperparameter; did you mean learning_rate?"]
    assert error["message"].count("config.lr") == 1


def test_an_unknown_base_model_lists_the_valid_ones(alpha_setup, alice_client):
    response = alice_client.post(
        "/api/v1/models",
        {"project": alpha_setup.project.pk, "name": "m", "base_model": "tinny"},
        format="json",
    )
    assert response.status_code == 400
    assert (
        error_of(response)["message"]
        == "base_model: unknown base model 'tinny' (valid: tiny); did you mean tiny?"
    )


def test_a_grader_error_names_its_path_once(alice_client):
    response = alice_client.post("/api/v1/graders/validate", {"grader": {"type": "regex"}}, format="json")
    assert response.status_code == 400
    assert error_of(response)["message"] == "grader.pattern: is required"
    typo = alice_client.post("/api/v1/graders/validate", {"grader": {"type": "regexp"}}, format="json")
    assert "did you mean regex?" in error_of(typo)["message"]
