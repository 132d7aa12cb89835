"""The Tinker API's answers that need no worker: keys, tenancy, bad input, futures.

(The SDK driving a live stack end to end: tests/integration/test_tinker_sdk.py.)"""

from __future__ import annotations

import json

import pytest
from django.test import Client

from projects import services
from projects.jobs.tasks import expire_tinker_names
from projects.models import Checkpoint, Run, RunKind, TinkerFuture, TinkerModel
from projects.tinker import exports

pytestmark = pytest.mark.django_db

BASE = "tinker-tiny"


@pytest.fixture
def tinker(cast, tiny_model_dir, settings):
    settings.TINKER_POLL_S = 1
    services.base_model_register(name=BASE, source=str(tiny_model_dir))
    keys = {
        "alpha": services.api_key_create(team=cast.alpha, name="t").plaintext,
        "beta": services.api_key_create(team=cast.beta, name="t").plaintext,
        "reader": services.api_key_create(team=cast.alpha, name="r", read_only=True).plaintext,
    }
    return keys


def call(
    route: str, body=None, *, key: str | None, method: str = "POST", raw: bytes | None = None, **headers
):
    client = Client()
    extra = {"HTTP_X_API_KEY": key} if key else {}
    extra.update(headers)
    url = f"/tinker/api/v1/{route}"
    if method == "GET":
        response = client.get(url, **extra)
    else:
        data = raw if raw is not None else json.dumps(body or {})
        content_type = extra.pop("content_type", "application/json")
        response = client.post(url, data=data, content_type=content_type, **extra)
    return response.status_code, response


def _model(key: str) -> str:
    status, reply = call("create_session", {"tags": [], "sdk_version": "0.38.0"}, key=f"tml-{key}")
    assert status == 200, reply.content
    session = reply.json()["session_id"]
    status, reply = call("create_model", {"session_id": session, "model_seq_id": 0, "base_model": BASE,
                                          "lora_config": {"rank": 4}}, key=f"tml-{key}")  # fmt: skip
    assert status == 200, reply.content
    return reply.json()["model_id"]


def test_keys_are_tml_prefixed_team_keys(tinker):
    assert call("client/config", key=None)[0] == 401
    assert call("client/config", key="tml-aw_nope_nope")[0] == 401
    status, reply = call("client/config", key=f"tml-{tinker['alpha']}")
    assert status == 200 and reply.json()["use_pyqwest_transport"] is False
    # Read when the SDK's client starts (anything but a 200 or a 404 fails the client's construction).
    status, reply = call("client/dynamic_config", {"sdk_version": "0.38.0"}, key=f"tml-{tinker['alpha']}")
    assert status == 200 and reply.json()["sample_cancel_enabled"] is False
    status, reply = call("get_server_capabilities", key=f"tml-{tinker['alpha']}", method="GET")
    assert BASE in [m["model_name"] for m in reply.json()["supported_models"]]


def test_a_training_client_is_a_tinker_run_of_the_team(tinker, cast):
    model_id = _model(tinker["alpha"])
    assert model_id.endswith(":train:0")
    run = Run.objects.get(kind=RunKind.TINKER)
    assert run.project.team == cast.alpha and run.model.lora["rank"] == 4
    status, reply = call("get_info", {"model_id": model_id}, key=f"tml-{tinker['alpha']}")
    assert status == 200 and reply.json()["model_data"]["model_name"] == BASE
    # Another team's key: the model, its checkpoints and futures do not exist.
    status, reply = call("get_info", {"model_id": model_id}, key=f"tml-{tinker['beta']}")
    assert status == 404 and reply.json()["error"]["param"] == "model_id"
    assert call(f"training_runs/{model_id}/checkpoints", key=f"tml-{tinker['beta']}", method="GET")[0] == 404
    status, reply = call("optim_step", {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}},
                         key=f"tml-{tinker['alpha']}")  # fmt: skip
    request_id = reply.json()["request_id"]
    assert call("retrieve_future", {"request_id": request_id}, key=f"tml-{tinker['beta']}")[0] == 404
    # A read-only key may read but not train.
    status, reply = call("optim_step", {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 1e-3}},
                         key=f"tml-{tinker['reader']}")  # fmt: skip
    assert status == 403 and "read-only" in reply.json()["error"]["message"]
    assert call("get_info", {"model_id": model_id}, key=f"tml-{tinker['reader']}")[0] == 200


def test_bad_input_is_a_400_naming_the_field(tinker):
    key = f"tml-{tinker['alpha']}"
    status, reply = call("create_session", raw=b"{not json", key=key)
    assert status == 400 and "not JSON" in reply.json()["error"]["message"]
    status, session = call("create_session", {"tags": []}, key=key)
    session_id = session.json()["session_id"]
    status, reply = call(
        "create_model", {"session_id": session_id, "model_seq_id": 0, "base_model": "nope"}, key=key
    )
    assert (
        status == 400
        and reply.json()["error"]["param"] == "base_model"
        and BASE in reply.json()["error"]["message"]
    )
    status, reply = call("create_model", {"session_id": session_id, "model_seq_id": 0, "base_model": BASE,
                                          "lora_config": {"rank": 0}}, key=key)  # fmt: skip
    assert status == 400 and reply.json()["error"]["param"] == "lora_config.rank"
    model_id = _model(tinker["alpha"])
    status, reply = call(
        "optim_step", {"model_id": model_id, "seq_id": 0, "adam_params": {"learning_rate": 1e-3}}, key=key
    )
    assert status == 400 and reply.json()["error"]["param"] == "seq_id"
    status, reply = call(
        "optim_step", {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 5}}, key=key
    )
    assert status == 400 and reply.json()["error"]["param"] == "adam_params.learning_rate"
    status, reply = call("forward_backward", {"model_id": model_id}, key=key)
    assert status == 400 and "x-protobuf" in reply.json()["error"]["message"]
    status, reply = call(
        "load_weights", {"model_id": model_id, "seq_id": 1, "path": "s3://x", "optimizer": True}, key=key
    )
    assert status == 400 and reply.json()["error"]["param"] == "path"
    status, reply = call("load_weights", {"model_id": model_id, "seq_id": 1, "path": f"tinker://{model_id}/weights/none",
                                          "optimizer": True}, key=key)  # fmt: skip
    assert status == 404
    status, reply = call("asample", {"sampling_session_id": "nope", "prompt": {"chunks": []}, "num_samples": 1,
                                     "sampling_params": {}}, key=key)  # fmt: skip
    assert status == 404 and reply.json()["error"]["param"] == "sampling_session_id"


def test_futures_are_long_polled_deduplicated_and_fail_readably(tinker):
    key = f"tml-{tinker['alpha']}"
    model_id = _model(tinker["alpha"])
    body = {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}}
    first = call("optim_step", body, key=key)[1].json()["request_id"]
    again = call("optim_step", body, key=key)[1].json()["request_id"]
    assert first == again  # a retried submission is the same request, run once
    # Nothing runs it here (no worker): the poll is held, then the SDK is told to ask again.
    status, reply = call("retrieve_future", {"request_id": first}, key=key)
    assert status == 200 and reply.json() == {
        "type": "try_again",
        "request_id": first,
        "queue_state": "active",
    }
    future = TinkerFuture.objects.get(pk=first)
    services.tinker_future_finish(future=future, error="the loss is not finite", category="user")
    status, reply = call("retrieve_future", {"request_id": first}, key=key)
    assert status == 200 and reply.json() == {"error": "the loss is not finite", "category": "user"}
    assert TinkerModel.objects.get(pk=model_id).done_seq == 1  # the next request may run


# ---------------------------------------------------------------------- external weights (exports)
def _exported(tinker, tmp_path, *, recipients=None):
    """A training client with a saved step whose adapter is exported as external_weights/final."""
    from projects.storage import checkpoint_upload

    model_id = _model(tinker["alpha"])
    model = TinkerModel.objects.get(pk=model_id)
    folder = tmp_path / "step-000001"
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"r": 4}')
    (folder / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 40)
    (folder / "optimizer.pt").write_bytes(b"not exported")
    stored = checkpoint_upload(model_id=model.model_id, step=1, folder=folder)
    record = exports.export_record(recipients=recipients, ttl_seconds=None)
    services.tinker_checkpoint_record(model=model, step=1, path=str(folder), stored=stored,
                                      name="external_weights/final", export=record)  # fmt: skip
    return model_id, folder


def _get(url: str):
    return Client().get(url.removeprefix("http://testserver"))


def test_an_export_is_downloaded_file_by_file_from_signed_urls(tinker, tmp_path):
    key = f"tml-{tinker['alpha']}"
    model_id, folder = _exported(tinker, tmp_path)
    route = f"training_runs/{model_id}/checkpoints/external_weights/final/external_weights_urls"
    status, reply = call(route, key=key, method="GET")
    assert status == 200, reply.content
    urls = reply.json()["urls"]
    assert set(urls) == {"adapter_config.json", "adapter_model.safetensors"}  # the optimizer stays home
    for name, url in urls.items():
        response = _get(url)  # no key: the signature is the permission
        assert (
            response.status_code == 200
            and b"".join(response.streaming_content) == (folder / name).read_bytes()
        )
    # Another team sees no such training run; a forged or altered URL is refused.
    assert call(route, key=f"tml-{tinker['beta']}", method="GET")[0] == 404
    url = urls["adapter_model.safetensors"]
    assert _get(url[:-3] + ("AAA" if not url.endswith("AAA") else "BBB")).status_code == 403
    # Training weights are not downloadable this way: a 400 saying what is.
    status, reply = call(f"training_runs/{model_id}/checkpoints/weights/final/external_weights_urls",
                         key=key, method="GET")  # fmt: skip
    assert status == 400 and "save_weights_external" in reply.json()["error"]["message"]
    rows = call(f"training_runs/{model_id}/checkpoints", key=key, method="GET")[1].json()["checkpoints"]
    assert [(r["checkpoint_id"], r["checkpoint_type"]) for r in rows] == [
        ("external_weights/final", "external")
    ]
    # Deleting the export's name ends its URLs.
    response = Client().delete(f"/tinker/api/v1/training_runs/{model_id}/checkpoints/external_weights/final",
                               HTTP_X_API_KEY=key)  # fmt: skip
    assert response.status_code == 204
    assert _get(url).status_code == 404


def test_an_encrypted_export_serves_only_age_ciphertext_its_recipient_opens(tinker, tmp_path):
    import pyrage

    identity = pyrage.x25519.Identity.generate()
    model_id, folder = _exported(tinker, tmp_path, recipients=[str(identity.to_public())])
    route = f"training_runs/{model_id}/checkpoints/external_weights/final/external_weights_urls"
    urls = call(route, key=f"tml-{tinker['alpha']}", method="GET")[1].json()["urls"]
    assert set(urls) == {"adapter_config.json.age", "adapter_model.safetensors.age"}
    response = _get(urls["adapter_model.safetensors.age"])
    assert response.status_code == 200
    plain = (folder / "adapter_model.safetensors").read_bytes()
    assert plain not in response.content
    assert pyrage.decrypt(response.content, [identity]) == plain


def test_an_exports_ttl_is_set_checked_and_ends_it(tinker, tmp_path):
    key = f"tml-{tinker['alpha']}"
    model_id, _ = _exported(tinker, tmp_path)
    ttl_route = f"/tinker/api/v1/training_runs/{model_id}/checkpoints/external_weights/final/ttl"
    response = Client().put(ttl_route, json.dumps({"ttl_seconds": 10}), content_type="application/json",
                            HTTP_X_API_KEY=key)  # fmt: skip
    assert response.status_code == 400 and response.json()["error"]["param"] == "ttl_seconds"
    response = Client().put(ttl_route, json.dumps({"ttl_seconds": 3600}), content_type="application/json",
                            HTTP_X_API_KEY=key)  # fmt: skip
    assert response.status_code == 204
    (row,) = call(f"training_runs/{model_id}/checkpoints", key=key, method="GET")[1].json()["checkpoints"]
    assert row["expires_at"] is not None
    route = f"training_runs/{model_id}/checkpoints/external_weights/final/external_weights_urls"
    url = call(route, key=key, method="GET")[1].json()["urls"]["adapter_config.json"]
    # Past its expiry the export is gone: its URLs and the name answer 404.
    checkpoint = TinkerModel.objects.get(pk=model_id).model.checkpoints.get(step=1)
    checkpoint.metrics["tinker_exports"]["external_weights/final"]["expires_at"] = "2020-01-01T00:00:00+00:00"
    checkpoint.save(update_fields=["metrics"])
    response = _get(url)
    assert response.status_code == 404 and "expired" in response.json()["error"]["message"]
    # Expired, the export is gone from the list and its route at once ...
    assert call(route, key=key, method="GET")[0] == 404
    assert call(f"training_runs/{model_id}/checkpoints", key=key, method="GET")[1].json()["checkpoints"] == []
    assert "external_weights/final" in Checkpoint.objects.get(pk=checkpoint.pk).metrics["tinker_names"]
    # ... and the sweep (a beat task) drops the name: the step is the model's latest, so it stays.
    assert expire_tinker_names() == 1 and expire_tinker_names() == 0
    assert Checkpoint.objects.get(pk=checkpoint.pk).metrics["tinker_names"] == {}


def test_a_names_ttl_ends_it_for_loading_and_the_sweep_deletes_the_checkpoint_it_named(tinker, tmp_path):
    from projects.storage import checkpoint_upload

    key = f"tml-{tinker['alpha']}"
    model_id = _model(tinker["alpha"])
    model = TinkerModel.objects.get(pk=model_id)
    for step in (1, 2):
        folder = tmp_path / f"step-{step}"
        folder.mkdir()
        (folder / "adapter_model.safetensors").write_bytes(b"x" * 64)
        stored = checkpoint_upload(model_id=model.model_id, step=step, folder=folder)
        services.tinker_checkpoint_record(model=model, step=step, path=str(folder), stored=stored,
                                          name=f"weights/s{step}")  # fmt: skip
    path = f"tinker://{model_id}/weights/s1"
    ttl_route = f"/tinker/api/v1/training_runs/{model_id}/checkpoints/weights/s1/ttl"
    response = Client().put(ttl_route, json.dumps({"ttl_seconds": 3600}), content_type="application/json",
                            HTTP_X_API_KEY=key)  # fmt: skip
    assert response.status_code == 204
    status, reply = call("weights_info", {"tinker_path": path}, key=key)
    assert status == 200, reply.content
    old = Checkpoint.objects.get(model=model.model, step=1)
    old.metrics["tinker_exports"]["weights/s1"]["expires_at"] = "2020-01-01T00:00:00+00:00"
    old.save(update_fields=["metrics"])
    # Past its TTL the name loads nothing and is not listed ...
    status, reply = call("load_weights", {"model_id": model_id, "seq_id": 1, "path": path}, key=key)
    assert status == 404 and "expired" in reply.json()["error"]["message"], reply.content
    listed = call(f"training_runs/{model_id}/checkpoints", key=key, method="GET")[1].json()["checkpoints"]
    assert [row["checkpoint_id"] for row in listed] == ["weights/s2"]
    # ... and the sweep deletes the checkpoint it was the only name of (step 2, the latest, stays).
    assert expire_tinker_names() == 1
    steps = set(Checkpoint.objects.filter(model=model.model).values_list("step", flat=True))
    assert 1 not in steps and 2 in steps


def test_save_weights_external_checks_its_input(tinker):
    key = f"tml-{tinker['alpha']}"
    model_id = _model(tinker["alpha"])
    body = {"model_id": model_id, "seq_id": 1, "path": "final"}
    for extra, param in (({"path": None}, "path"), ({"ttl_seconds": 60}, "ttl_seconds"),
                         ({"age_encryption_recipients": ["ssh-ed25519 AAAA"]}, "age_encryption_recipients[0]"),
                         ({"age_encryption_recipients": ["age1x"] * 11}, "age_encryption_recipients")):  # fmt: skip
        status, reply = call("save_weights_external", {**body, **extra}, key=key)
        assert status == 400 and reply.json()["error"]["param"] == param, reply.content
    status, reply = call("save_weights_external", body, key=f"tml-{tinker['reader']}")
    assert status == 403
    status, reply = call("save_weights_external", body, key=key)
    assert status == 200 and reply.json()["request_id"]


def test_user_checkpoints_weights_info_and_what_is_not_offered(tinker, tmp_path):
    key = f"tml-{tinker['alpha']}"
    model_id, _ = _exported(tinker, tmp_path)
    status, reply = call("checkpoints?limit=5&offset=0", key=key, method="GET")
    assert status == 200 and reply.json()["cursor"] == {"offset": 0, "limit": 5, "total_count": 1}
    assert [c["tinker_path"] for c in reply.json()["checkpoints"]] == [
        f"tinker://{model_id}/external_weights/final"
    ]
    assert call("checkpoints", key=f"tml-{tinker['beta']}", method="GET")[1].json()["checkpoints"] == []
    assert call("checkpoints?limit=0", key=key, method="GET")[1].json()["error"]["param"] == "limit"
    status, reply = call(
        "weights_info", {"tinker_path": f"tinker://{model_id}/external_weights/final"}, key=key
    )
    assert status == 200 and reply.json()["base_model"] == BASE and reply.json()["lora_rank"] == 4
    assert call("weights_info", {"tinker_path": f"tinker://{model_id}/external_weights/final"},
                key=f"tml-{tinker['beta']}")[0] == 404  # fmt: skip
    # An SDK call artweb does not offer: a 400 saying so, which the SDK must not retry.
    status, reply = call("copy_weights", {"tinker_path": "x"}, key=key)
    assert status == 400 and "does not offer" in reply.json()["error"]["message"]
    assert reply["x-should-retry"] == "false"
    status, reply = call(f"training_runs/{model_id}/checkpoints/external_weights/final/publish", key=key)
    assert status == 400 and "public checkpoints" in reply.json()["error"]["message"]
    # A path nothing serves is a JSON 404, not an HTML page.
    status, reply = call("no_such_route", key=key)
    assert status == 404 and "No endpoint" in reply.json()["error"]["message"]
