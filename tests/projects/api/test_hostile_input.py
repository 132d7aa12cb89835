"""No 500 on any input, every error as JSON (issue 12, item 4): each crash found by the security
review, with its payload, answered as a 4xx OpenAI error object; nothing invalid is stored; a row
that was stored, however odd, never breaks a list; bodies over the limit are 413 and an unhandled
exception is a 500 error object with a request id. The gateway's side is in
tests/projects/gateway/test_gateway_errors.py."""

from __future__ import annotations

import json

import pytest

from projects import services
from projects.errors import ValidationFailed
from projects.models import (
    JudgeEndpoint,
    Project,
    RewardDefinition,
    Run,
    RunEvent,
    StepMetrics,
    TaskRow,
    TaskSet,
    Trajectory,
)
from projects.services import judges
from tests.conftest import REWARD_SPEC, error_of

pytestmark = pytest.mark.django_db

DEEP = "[" * 100_000 + "]" * 100_000
LONE_SURROGATE = '"\\ud800"'  # as JSON text: the escape, not the character


def post_raw(client, path: str, text: str, method: str = "post"):
    return getattr(client, method)(path, data=text.encode(), content_type="application/json")


def assert_json_error(response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.content[:300]
    assert response["Content-Type"].startswith("application/json")
    error = error_of(response)
    assert set(error) >= {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code, error
    return error


# --- the JSON reader ---------------------------------------------------------------------------


def test_json_nested_100k_deep_is_a_400_on_a_post_and_a_patch(key_client, alpha_setup):
    error = assert_json_error(post_raw(key_client, "/api/v1/projects/", DEEP), 400, "invalid_json")
    assert "nested deeper than 64 levels" in error["message"] and "column 65" in error["message"]
    patch = post_raw(key_client, f"/api/v1/projects/{alpha_setup.project.id}/", '{"description": ' + DEEP + "}",
                     method="patch")  # fmt: skip
    assert "nested deeper" in assert_json_error(patch, 400, "invalid_json")["message"]


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('{"name": "x", "description": NaN}', "NaN is not a JSON number"),
        ('{"name": "x", "description": -Infinity}', "-Infinity is not a JSON number"),
        ('{"name": "x", "description": 1e400}', "number too large for a float"),
        ('{"name": "x", "description": ' + "1" * 4301 + "}", "integer out of range"),
        ('{"name": "x", "description": ' + LONE_SURROGATE + "}", "lone UTF-16 surrogate"),
        ('{"name": "x", "description": "a\\u0000b"}', "NUL character"),
        ('{"name": "x",}', "Expecting property name"),
    ],
)
def test_refused_json_is_a_400_naming_the_position(key_client, cast, text, reason):
    error = assert_json_error(post_raw(key_client, "/api/v1/projects/", text), 400, "invalid_json")
    assert reason in error["message"] and "line 1 column" in error["message"]
    assert not Project.objects.filter(team=cast.alpha, name="x").exists()


def test_the_json_reader_keeps_what_json_allows(key_client):
    body = '{"name": "fine", "description": "\\ud83d\\ude00 \\\\ud800 caf\\u00e9"}'  # a pair, an escaped backslash
    response = post_raw(key_client, "/api/v1/projects/", body)
    assert response.status_code == 201, response.json()
    assert response.json()["description"] == "\U0001f600 \\ud800 café"


# --- task sets -----------------------------------------------------------------------------------


def test_jsonl_lines_deep_nan_infinity_and_surrogates_are_refused_per_line(key_client, alpha_setup):
    lines = [
        '{"prompt": "ok", "item": {"answer": "1"}}',
        '{"prompt": "deep", "item": ' + "[" * 1000 + "]" * 1000 + "}",
        '{"prompt": "nan", "item": {"answer": NaN}}',
        '{"prompt": "inf", "item": {"answer": Infinity}}',
        '{"prompt": ' + LONE_SURROGATE + "}",
        '{"prompt": "big", "item": {"answer": ' + "9" * 4301 + "}}",
    ]
    body = {"project": alpha_setup.project.id, "name": "hostile", "jsonl": "\n".join(lines)}
    error = assert_json_error(key_client.post("/api/v1/task-sets/", body, format="json"), 400, "invalid")
    assert error["param"] == "file" and error["message"].startswith("file: line 2: invalid JSON")
    assert sorted(error["fields"]) == ["line 2", "line 3", "line 4", "line 5", "line 6"]
    assert "nested deeper than 64 levels" in error["fields"]["line 2"][0]
    assert "NaN" in error["fields"]["line 3"][0] and "Infinity" in error["fields"]["line 4"][0]
    assert "surrogate" in error["fields"]["line 5"][0] and "out of range" in error["fields"]["line 6"][0]
    assert not TaskSet.objects.filter(name="hostile").exists()


def test_a_task_row_with_a_lone_surrogate_or_nan_is_refused_not_saved_and_lists_still_work(
    key_client, alpha_setup
):
    rows_before = TaskRow.objects.count()
    for row in ({"prompt": "\ud800"}, {"prompt": "q", "item": {"answer": float("nan")}}):
        with pytest.raises(ValidationFailed) as refused:
            services.task_set_create(project=alpha_setup.project, name="odd", rows=[row])
        assert refused.value.field == "rows" and refused.value.problems[0][0].startswith("line 1")
    jsonl = '{"prompt": "q", "item": {"answer": ' + LONE_SURROGATE + "}}"
    body = {"project": alpha_setup.project.id, "name": "odd", "jsonl": jsonl}
    assert_json_error(key_client.post("/api/v1/task-sets/", body, format="json"), 400)
    assert TaskRow.objects.count() == rows_before and not TaskSet.objects.filter(name="odd").exists()
    assert key_client.get("/api/v1/task-sets/").status_code == 200
    assert key_client.get(f"/api/v1/task-sets/{alpha_setup.task_set.id}/rows/").status_code == 200


# --- reward definitions --------------------------------------------------------------------------


def test_a_reward_spec_with_a_lone_surrogate_or_nan_is_refused_not_saved_and_lists_still_work(
    key_client, alpha_setup
):
    before = RewardDefinition.objects.count()
    spec_text = '{"type": "string_check", "input": "{{sample.output_text}}", "reference": ' + LONE_SURROGATE
    body = f'{{"project": {alpha_setup.project.id}, "name": "odd", "spec": {spec_text}, "operation": "eq"}}}}'
    assert_json_error(post_raw(key_client, "/api/v1/reward-definitions/", body), 400, "invalid_json")
    for odd in ({**REWARD_SPEC, "reference": "\ud800"}, {**REWARD_SPEC, "weight": float("inf")}):
        with pytest.raises(ValidationFailed) as refused:
            services.reward_definition_create(project=alpha_setup.project, name="odd", spec=odd)
        assert refused.value.field.startswith("spec.")
        with pytest.raises(ValidationFailed):
            services.reward_definition_update(definition=alpha_setup.reward, spec=odd)
    assert RewardDefinition.objects.count() == before
    listed = key_client.get("/api/v1/reward-definitions/")
    assert listed.status_code == 200 and [d["name"] for d in listed.json()["data"]] == ["exact"]


# --- run config ----------------------------------------------------------------------------------


def run_body(setup, config_text: str) -> str:
    return (
        f'{{"model": {setup.model.id}, "task_set": {setup.task_set.id}, "environment": {setup.environment.id}, '
        f'"reward": {setup.reward.id}, "config": {config_text}}}'
    )


@pytest.mark.parametrize(
    "config_text",
    ['{"learning_rate": 1' + "0" * 400 + "}", '{"learning_rate": 1e400}', '{"steps": ' + "7" * 4301 + "}"],
)
def test_numbers_past_any_range_in_run_config_are_a_400(key_client, alpha_setup, config_text):
    response = post_raw(key_client, "/api/v1/runs/", run_body(alpha_setup, config_text))
    assert_json_error(response, 400, "invalid_json")
    assert not Run.objects.exists()


def test_run_config_maxima_give_their_reason_and_every_problem_at_once(key_client, alpha_setup):
    config = {"steps": 10**6, "group_size": 1, "learning_rate": 5.0, "seed": 2**40, "max_new_tokens": 0}
    body = {"model": alpha_setup.model.id, "task_set": alpha_setup.task_set.id,
            "environment": alpha_setup.environment.id, "reward": alpha_setup.reward.id, "config": config}  # fmt: skip
    error = assert_json_error(key_client.post("/api/v1/runs/", body, format="json"), 400, "invalid")
    assert sorted(error["fields"]) == [
        "config.group_size", "config.learning_rate", "config.max_new_tokens", "config.seed", "config.steps",
    ]  # fmt: skip
    assert "start another run from the last checkpoint" in error["fields"]["config.steps"][0]
    assert "32-bit seed" in error["fields"]["config.seed"][0]
    # The same numbers from code (no JSON on the way): refused by TrainConfig, not crashed on.
    for config in ({"learning_rate": 10**400}, {"steps": 10**4301}):
        with pytest.raises(ValidationFailed):
            services.run_create(model=alpha_setup.model, task_set=alpha_setup.task_set,
                                environment=alpha_setup.environment, reward=alpha_setup.reward, config=config)  # fmt: skip
    assert not Run.objects.exists()


def test_bodies_with_ids_and_counts_past_64_bits_are_a_400(key_client, alpha_setup):
    body = {"project": 2**63, "name": "m", "base_model": "tiny"}  # past bigint: the reader refuses it
    assert_json_error(key_client.post("/api/v1/models/", body, format="json"), 400, "invalid_json")
    body["project"] = 2**63 - 1  # within: a 400 on the field
    error = assert_json_error(key_client.post("/api/v1/models/", body, format="json"), 400)
    assert error["param"] == "project"
    evaluation = {"model": "tiny", "task_set": alpha_setup.task_set.id, "environment": alpha_setup.environment.id,
                  "reward": alpha_setup.reward.id, "max_rows": 2**62}  # fmt: skip
    error = assert_json_error(key_client.post("/api/v1/evaluations/", evaluation, format="json"), 400)
    assert error["param"] == "max_rows"


# --- query parameters ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "param"),
    [
        ("/api/v1/projects/?limit=9223372036854775808", "limit"),
        ("/api/v1/projects/?after=-9223372036854775809", "after"),
        ("/api/v1/models/?project=99999999999999999999", "project"),
        ("/api/v1/runs/?project=%C2%B2", "project"),  # "²" is a digit to str.isdigit, not to int()
        ("/api/v1/evaluations/?run=99999999999999999999", "run"),
        ("/api/v1/evaluations/?checkpoint=1" + "0" * 4300, "checkpoint"),
        ("/api/v1/reward-definitions/?name=%00x", "name"),
    ],
)
def test_query_values_past_64_bits_or_unstorable_are_a_400_naming_them(key_client, path, param):
    assert assert_json_error(key_client.get(path), 400)["param"] == param


def test_a_step_filter_past_64_bits_is_a_400(key_client, alpha_setup):
    run = services.run_create(model=alpha_setup.model, task_set=alpha_setup.task_set,
                              environment=alpha_setup.environment, reward=alpha_setup.reward)  # fmt: skip
    response = key_client.get(f"/api/v1/runs/{run.id}/trajectories/?step=18446744073709551616")
    assert assert_json_error(response, 400)["param"] == "step"


# --- unique names ----------------------------------------------------------------------------------


def test_renaming_a_judge_endpoint_onto_another_name_is_a_400_on_name(alice_client, cast):
    for name in ("first", "second"):
        judges.judge_endpoint_create(team=cast.alpha, name=name, base_url="http://127.0.0.1:9/v1")
    second = JudgeEndpoint.objects.get(name="second")
    alice_client.credentials(HTTP_X_TEAM="alpha")  # judge endpoints are an owner's to write
    response = alice_client.patch(f"/api/v1/judge-endpoints/{second.id}/", {"name": "first"}, format="json")
    error = assert_json_error(response, 400)
    assert error["param"] == "name" and "already exists" in error["message"]
    again = alice_client.post("/api/v1/judge-endpoints/", {"name": "first", "base_url": "http://127.0.0.1:9/v1"},
                            format="json")  # fmt: skip
    assert assert_json_error(again, 400)["param"] == "name"
    assert sorted(JudgeEndpoint.objects.values_list("name", flat=True)) == ["first", "second"]


def test_renaming_a_project_onto_another_name_is_a_400_on_name(key_client, alpha_setup, cast):
    other = services.project_create(team=cast.alpha, name="other")
    response = key_client.patch(f"/api/v1/projects/{other.id}/", {"name": "math"}, format="json")
    assert assert_json_error(response, 400)["param"] == "name"


def test_strings_longer_than_their_column_are_a_400_not_a_database_error(alice_client, cast):
    alice_client.credentials(HTTP_X_TEAM="alpha")
    body = {"name": "long", "base_url": "http://127.0.0.1:9/v1", "default_model": "m" * 201}
    error = assert_json_error(alice_client.post("/api/v1/judge-endpoints/", body, format="json"), 400)
    assert error["param"] == "default_model"


# --- limits and the last resort --------------------------------------------------------------------


def test_a_body_over_the_upload_limit_is_a_413_error_object(key_client, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 2048
    body = '{"name": "big", "description": "' + "x" * 4096 + '"}'
    response = post_raw(key_client, "/api/v1/projects/", body)
    error = assert_json_error(response, 413, "body_too_large")
    assert "2048 bytes" in error["message"] and response["X-Request-Id"].startswith("req_")


def test_an_unhandled_exception_is_a_500_error_object_naming_the_request_id(key_client, monkeypatch):
    from projects.api.views import ProjectViewSet

    def broken(self, request):
        raise RuntimeError("a bug with a secret: postgres://user:pw@db/artweb")

    monkeypatch.setattr(ProjectViewSet, "list", broken)
    key_client.raise_request_exception = False  # the test client re-raises it otherwise
    response = key_client.get("/api/v1/projects/")
    error = assert_json_error(response, 500, "server_error")
    assert error["type"] == "api_error"
    request_id = response["X-Request-Id"]
    assert request_id.startswith("req_") and request_id in error["message"]
    assert "secret" not in error["message"] and "postgres" not in response.content.decode()


def test_every_response_has_a_request_id_and_unknown_api_paths_are_json(key_client, client):
    first, second = key_client.get("/api/v1/projects/"), key_client.get("/api/v1/projects/")
    assert first["X-Request-Id"] != second["X-Request-Id"]
    assert_json_error(key_client.get("/api/v1/no-such-thing/"), 404)
    page = client.get("/no-such-page/")  # the dashboard keeps its HTML pages
    assert page.status_code == 404 and not page["Content-Type"].startswith("application/json")


# --- what was stored -----------------------------------------------------------------------------

ODD_TEXT = "\U0001f600 \u202eRTL\u202c zero\u200bwidth <script>alert(1)</script> " + "é" * 5000
ODD_VALUE = {
    "": ODD_TEXT,
    "a.b[0]": [2**62, -(2**63), 1e308, -0.0, 5e-324, True, None],
    "deep": json.loads("[" * 60 + '"bottom"' + "]" * 60),  # 61 levels with the object
    "\\ud800": "an escaped backslash, not a surrogate",
}


def test_a_row_stored_with_odd_but_storable_content_never_breaks_a_list(
    key_client, alice_client, alpha_setup
):
    """Written straight through the ORM (no service checks): every list and page still renders it."""
    setup = alpha_setup
    RewardDefinition.objects.filter(pk=setup.reward.pk).update(spec={**REWARD_SPEC, "odd": ODD_VALUE})
    TaskRow.objects.filter(task_set=setup.task_set, index=0).update(
        data={"prompt": ODD_TEXT, "item": ODD_VALUE}
    )
    run = services.run_create(model=setup.model, task_set=setup.task_set, environment=setup.environment,
                              reward=setup.reward)  # fmt: skip
    RunEvent.objects.create(run=run, message=ODD_TEXT, data=ODD_VALUE)
    StepMetrics.objects.create(
        run=run, step=1, reward_mean=None, reward_std=1e308, loss=-0.0, metrics=ODD_VALUE
    )
    Trajectory.objects.create(run=run, step=1, group_index=0, sample_index=0, messages=[{"role": "assistant",
                              "content": ODD_TEXT}], reward=-1e308, sub_rewards=ODD_VALUE, metrics=ODD_VALUE)  # fmt: skip
    for path in (
        "/api/v1/reward-definitions/",
        f"/api/v1/reward-definitions/{setup.reward.id}/versions/",
        f"/api/v1/task-sets/{setup.task_set.id}/rows/",
        f"/api/v1/runs/{run.id}/events/",
        f"/api/v1/runs/{run.id}/metrics/",
        f"/api/v1/runs/{run.id}/trajectories/",
    ):
        response = key_client.get(path)
        assert response.status_code == 200, (path, response.content[:300])
        assert response.json()["object"] == "list"
    for page in (f"/rewards/{setup.reward.id}/", f"/task-sets/{setup.task_set.id}/", f"/runs/{run.id}/",
                 f"/runs/{run.id}/trajectories"):  # fmt: skip
        assert alice_client.get(page, HTTP_X_TEAM="alpha").status_code == 200, page
