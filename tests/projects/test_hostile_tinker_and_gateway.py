"""No 500 from hostile input on the Tinker API, the gateway and OpenAI's files and fine-tuning routes
(issue 51, must-have 7): each payload the security review sent, answered as a 4xx OpenAI error
object, on PostgreSQL and on SQLite. Bodies go through the one strict JSON reader
(training.rollouts.strict_json); numbers written as text (steps in ``tinker://`` paths and model names,
query parameters, metadata) through its ``parse_int``; ids that no database can store (NUL, a lone
surrogate) name nothing. The REST API's own cases are in tests/projects/api/test_hostile_input.py."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from projects import services
from tests.asgi import asgi_json

BASE = "hostile-tiny"
DEEP = "[" * 100_000 + "]" * 100_000
DIGITS = "9" * 5000  # past Python's 4,300-digit int() limit
PAST_64_BITS = "99999999999999999999"  # 20 digits: int() reads it, the database does not


@pytest.fixture
def tinker(cast, tiny_model_dir, settings, tmp_path):
    """A team's write key (tml-…) with a session and a training client of the tiny model."""
    settings.CHECKPOINT_DIR = tmp_path / "checkpoints"
    services.base_model_register(name=BASE, source=str(tiny_model_dir))
    key = "tml-" + services.api_key_create(team=cast.alpha, name="ci").plaintext
    session = tinker_call(key, "create_session", '{"tags": [], "sdk_version": "0.38.0"}').json()["session_id"]
    body = {"session_id": session, "model_seq_id": 0, "base_model": BASE, "lora_config": {"rank": 4}}
    model = tinker_call(key, "create_model", json.dumps(body)).json()["model_id"]
    return type("Tinker", (), {"key": key, "session": session, "model": model})


def tinker_call(key: str, route: str, text: str | None = None):
    headers = {"HTTP_X_API_KEY": key}
    if text is None:
        return Client().get(f"/tinker/api/v1/{route}", **headers)
    return Client().post(
        f"/tinker/api/v1/{route}", data=text.encode(), content_type="application/json", **headers
    )


def error_of(response, *statuses: int) -> dict:
    assert response.status_code in statuses, (response.status_code, response.content[:300])
    assert response["Content-Type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    return error


# --- Tinker bodies: the strict reader ----------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("route", "text", "reason"),
    [
        ("create_session", '{"tags": [], "user_metadata": {"a": ' + DEEP + "}}", "nested deeper than 64"),
        ("create_session", '{"tags": [], "user_metadata": {"a": NaN}}', "NaN is not a JSON number"),
        ("create_session", '{"tags": [], "user_metadata": {"a": 1e400}}', "number too large for a float"),
        ("create_session", '{"tags": [], "user_metadata": {"a": ' + DIGITS + "}}", "integer out of range"),
        ("create_session", '{"tags": ["\\ud800"]}', "lone UTF-16 surrogate"),
        ("session_heartbeat", '{"session_id": "\\ud800"}', "lone UTF-16 surrogate"),
        ("session_heartbeat", '{"session_id": "a\\u0000b"}', "NUL character"),
        (
            "optim_step",
            '{"model_id": "{model}", "seq_id": 1, "adam_params": {"learning_rate": 0.0001, "beta1": NaN}}',
            "NaN is not a JSON number",
        ),  # fmt: skip
        (
            "optim_step",
            '{"model_id": "{model}", "seq_id": 1, "adam_params": {"learning_rate": 0.0001, "eps": 1e400}}',
            "number too large for a float",
        ),  # fmt: skip
        ("optim_step", '{"model_id": "{model}", "seq_id": 1, "adam_params": ' + DEEP + "}", "nested deeper"),
        ("cancel_future", '{"request_id": "\\udfff"}', "lone UTF-16 surrogate"),
        ("retrieve_future", '{"request_id": "\\ud800x"}', "lone UTF-16 surrogate"),
        ("weights_info", '{"tinker_path": "tinker://\\ud800/weights/x"}', "lone UTF-16 surrogate"),
    ],
)
def test_a_tinker_body_the_strict_reader_refuses_is_a_400_naming_the_position(tinker, route, text, reason):
    text = text.replace("{model}", tinker.model)
    error = error_of(tinker_call(tinker.key, route, text), 400)
    assert reason in error["message"] and "line 1 column" in error["message"], error


@pytest.mark.django_db
def test_devices_in_user_metadata_past_any_range_is_a_400(tinker):
    for devices in (DIGITS, "²", PAST_64_BITS):
        body = {"session_id": tinker.session, "model_seq_id": 1, "base_model": BASE,
                "user_metadata": {"devices": devices}}  # fmt: skip
        error = error_of(tinker_call(tinker.key, "create_model", json.dumps(body)), 400)
        assert error["param"] == "user_metadata.devices", error


# --- Tinker: numbers and ids in paths and query parameters ---------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("step", [DIGITS, PAST_64_BITS, "²", "-1", "١"])
@pytest.mark.parametrize(
    ("route", "field"),
    [("weights_info", "tinker_path"), ("load_weights", "path"), ("create_sampling_session", "model_path"),
     ("copy_weights", "source_path")],
)  # fmt: skip
def test_a_tinker_step_path_past_any_range_is_a_404(tinker, step, route, field):
    body = {field: f"tinker://default.model/step/{step}", "session_id": tinker.session, "model_seq_id": 5,
            "destination_project_id": "tinker"}  # fmt: skip
    error = error_of(tinker_call(tinker.key, route, json.dumps(body)), 404)
    assert error["param"] == field, error


@pytest.mark.django_db
@pytest.mark.parametrize(
    "query",
    [f"limit={DIGITS}", f"limit={PAST_64_BITS}", "limit=²", "limit=-5", f"offset={DIGITS}", "offset=١٢"],
)
def test_a_tinker_list_parameter_past_any_range_is_a_400_naming_it(tinker, query):
    error = error_of(tinker_call(tinker.key, f"checkpoints?{query}"), 400)
    assert error["param"] == query.partition("=")[0], error


@pytest.mark.django_db
@pytest.mark.parametrize(
    "route",
    ["sessions/{bad}", "samplers/{bad}", "training_runs/{bad}", "training_runs/{bad}/checkpoints",
     "training_runs/{model}/checkpoints/external_weights/{bad}/external_weights_urls"],
)  # fmt: skip
@pytest.mark.parametrize("bad", ["%00", "a%00b", "%ED%A0%80", "%F0%9F"])
def test_an_id_no_database_can_store_in_a_tinker_path_is_a_404(tinker, route, bad):
    error_of(tinker_call(tinker.key, route.replace("{bad}", bad).replace("{model}", tinker.model)), 404)


# --- the gateway (/v1/, served by the bare ASGI handler) ----------------------------------------


def gateway(method: str, path: str, key: str, body: bytes = b"", query: str = "") -> tuple[int, dict]:
    return asgi_json(method, path, body, key=key, query=query)


@pytest.fixture
def gateway_key(cast):
    from projects.gateway.db import close_db_thread_connections

    yield services.api_key_create(team=cast.alpha, name="ci").plaintext
    close_db_thread_connections()  # the views ran on the gateway's database threads


MODEL_NAMES = [
    f"proj/model:{DIGITS}",
    f"proj/model:{PAST_64_BITS}",
    "proj/model:١٢",
    f"wandb-artifact:///alpha/proj/model:step{DIGITS}",
    f"wandb-artifact:///alpha/proj/model:step{PAST_64_BITS}",
    "model\x00name",
    "\ud800",
]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("name", MODEL_NAMES, ids=range(len(MODEL_NAMES)))
def test_a_model_name_past_any_range_is_a_404_on_chat_completions_and_models(gateway_key, name):
    # As JSON text (json.dumps escapes a surrogate), so the body is what a client can send.
    body = json.dumps({"model": name, "messages": [{"role": "user", "content": "hi"}]}).encode()
    status, answer = gateway("POST", "/v1/chat/completions", gateway_key, body)
    if "\ud800" in name or "\x00" in name:  # refused by the strict reader (NUL: not in a model name)
        assert status in (400, 404) and set(answer["error"]) >= {"message", "code"}, answer
    else:
        assert status == 404 and answer["error"]["code"] == "model_not_found", answer
    status, answer = gateway("GET", f"/v1/models/{name}", gateway_key)
    assert status == 404 and set(answer["error"]) >= {"message", "type", "param", "code"}, answer


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "path",
    [f"/v1/files?limit={DIGITS}", "/v1/files?after=²", f"/v1/fine_tuning/jobs?limit={PAST_64_BITS}",
     "/v1/files/a\x00b", "/v1/files/\ud800/content", "/v1/fine_tuning/jobs/\x00", "/v1/fine_tuning/jobs/\udfff/events"],
)  # fmt: skip
def test_files_and_fine_tuning_answer_hostile_ids_and_parameters_with_a_4xx(gateway_key, path):
    path, _, query = path.partition("?")
    status, answer = gateway("GET", path, gateway_key, query=query)
    assert status in (400, 404) and set(answer["error"]) >= {"message", "type", "param", "code"}, answer


# --- /api/ --------------------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("start_from", [DIGITS, PAST_64_BITS, "١٢", "-1"])
def test_a_run_start_from_written_as_a_huge_number_is_a_400_naming_it(alpha_setup, key_client, start_from):
    from tests.projects.api.test_run_control_api import body

    response = key_client.post("/api/v1/runs/", body(alpha_setup, start_from=start_from), format="json")
    assert response.status_code == 400, response.content[:300]
    assert response.json()["error"]["param"] == "start_from"
