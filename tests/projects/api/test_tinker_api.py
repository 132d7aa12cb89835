"""The Tinker API's answers that need no worker: keys, tenancy, bad input, futures.

(The SDK driving a live stack end to end: tests/integration/test_tinker_sdk.py.)"""

from __future__ import annotations

import json

import pytest
from django.test import Client

from projects import services
from projects.jobs.tasks import expire_tinker_names
from projects.models import Checkpoint, Run, RunKind, TinkerFuture, TinkerModel
from projects.services.tinker import export_record

pytestmark = pytest.mark.django_db

BASE = "tinker-tiny"


@pytest.fixture
def tinker(cast, tiny_model_dir, settings, tmp_path):
    settings.TINKER_POLL_S = 1
    settings.CHECKPOINT_DIR = tmp_path / "checkpoints"  # the local store's root: this test's own
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
    assert status == 200 and reply.json()["sample_cancel_enabled"] is True
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


def test_a_read_only_key_changes_nothing(tinker, cast):
    """Issue 51: a read-only key finished another key's session (its run failed), created a project
    and sampled; every state-changing route is now a 403 that leaves the rows as they were."""
    from projects.models import Project, TinkerSampler, TinkerSession

    reader, alpha = f"tml-{tinker['reader']}", f"tml-{tinker['alpha']}"
    status, reply = call("create_session", {"tags": []}, key=reader)
    assert status == 403 and "read-write key" in reply.json()["error"]["message"], reply.content
    assert not Project.objects.filter(team=cast.alpha).exists() and not TinkerSession.objects.exists()
    model_id = _model(tinker["alpha"])
    run = TinkerModel.objects.get(pk=model_id).run
    session = model_id.split(":")[0]
    sample = {"sampling_session_id": f"{session}:sample:0", "num_samples": 1, "sampling_params": {"max_tokens": 2},
              "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}}  # fmt: skip
    for route, body in (
        (f"sessions/{session}/finish", {"reason": {"type": "closed"}}),
        ("session_heartbeat", {"session_id": session}),
        (
            "create_sampling_session",
            {"session_id": session, "sampling_session_seq_id": 0, "base_model": BASE},
        ),
        ("asample", {**sample, "sampling_session_id": None, "base_model": BASE}),
        ("telemetry", {"events": []}),
    ):
        status, reply = call(route, body, key=reader)
        assert status == 403, (route, reply.content)
    run.refresh_from_db()
    assert (
        run.status == "running"
        and not TinkerSampler.objects.exists()
        and not TinkerFuture.objects.filter(kind="sample").exists()
    )
    # The same calls from the team's read-write key do change state (so the 403s are the key's).
    assert call("create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0,
                                            "base_model": BASE}, key=alpha)[0] == 200  # fmt: skip
    assert call("asample", sample, key=alpha)[0] == 200
    assert call(f"sessions/{session}/finish", {"reason": {"type": "closed"}}, key=alpha)[0] == 200
    run.refresh_from_db()
    assert run.status != "running"


def test_a_training_client_asks_for_devices_in_its_user_metadata(tinker):
    key = f"tml-{tinker['alpha']}"
    session_id = call("create_session", {"tags": []}, key=key)[1].json()["session_id"]
    for seq, value in enumerate(["two", "0", "17", "1.5", True]):
        status, reply = call("create_model", {"session_id": session_id, "model_seq_id": seq, "base_model": BASE,
                                              "user_metadata": {"devices": value}}, key=key)  # fmt: skip
        error = reply.json()["error"]
        assert status == 400 and error["param"] == "user_metadata.devices", (value, error)
        assert "from 1 to 16" in error["message"]
    assert not TinkerModel.objects.exists()
    status, reply = call("create_model", {"session_id": session_id, "model_seq_id": 0, "base_model": BASE,
                                          "user_metadata": {"devices": "2", "team": "x"}}, key=key)  # fmt: skip
    assert status == 200, reply.content
    run = TinkerModel.objects.get(pk=reply.json()["model_id"]).run
    assert run.config["devices"] == 2 and "data-parallel on 2 devices" in run.events.first().message
    from projects.jobs.tinker import _config

    assert _config(TinkerModel.objects.get(pk=reply.json()["model_id"]))[0].devices == 2
    status, reply = call("create_model", {"session_id": session_id, "model_seq_id": 1, "base_model": BASE,
                                          "user_metadata": {"team": "x"}}, key=key)  # fmt: skip
    assert "devices" not in TinkerModel.objects.get(pk=reply.json()["model_id"]).run.config
    # The base sharded across the devices (FSDP2): a boolean word, and only with several devices.
    for seq, metadata, reason in ((2, {"devices": "2", "fsdp": "yes"}, "true or false"),
                                  (3, {"fsdp": "true"}, "devices of 2 or more")):  # fmt: skip
        status, reply = call("create_model", {"session_id": session_id, "model_seq_id": seq, "base_model": BASE,
                                              "user_metadata": metadata}, key=key)  # fmt: skip
        error = reply.json()["error"]
        assert status == 400 and error["param"] == "user_metadata.fsdp" and reason in error["message"], error
    status, reply = call("create_model", {"session_id": session_id, "model_seq_id": 4, "base_model": BASE,
                                          "user_metadata": {"devices": "2", "fsdp": "true"}}, key=key)  # fmt: skip
    assert status == 200, reply.content
    sharded = TinkerModel.objects.get(pk=reply.json()["model_id"])
    assert (
        sharded.run.config["fsdp"] is True
        and "the base sharded across them" in sharded.run.events.first().message
    )
    assert _config(sharded)[0].fsdp and _config(sharded)[0].devices == 2


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
    record = export_record(recipients=recipients, ttl_seconds=None)
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
    status, reply = call("sessions/search", key=key)
    assert status == 400 and "does not offer" in reply.json()["error"]["message"]
    assert reply["x-should-retry"] == "false"
    status, reply = call(f"training_runs/{model_id}/checkpoints/external_weights/final/publish", key=key)
    assert status == 400 and "signed URLs" in reply.json()["error"]["message"]
    # A path nothing serves is a JSON 404, not an HTML page.
    status, reply = call("no_such_route", key=key)
    assert status == 404 and "No endpoint" in reply.json()["error"]["message"]


# ---------------------------------------------------------------------- publish, copy, cancel
def _saved(tinker, tmp_path, *, name="weights/w", team="alpha"):
    """A training client of ``team`` with step 1 saved as ``name`` (real adapter and state files)."""
    import torch
    from safetensors.torch import save_file

    from projects.storage import checkpoint_upload

    model_id = _model(tinker[team])
    model = TinkerModel.objects.get(pk=model_id)
    folder = tmp_path / f"{team}-step-000001"
    folder.mkdir()
    save_file({"lora_A": torch.arange(8.0).reshape(2, 4)}, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text('{"r": 4}')
    (folder / "state.json").write_text('{"format_version": 1, "step": 1}')
    (folder / "optimizer.pt").write_bytes(b"moments")
    (folder / "rng_state.pt").write_bytes(b"rng")
    stored = checkpoint_upload(model_id=model.model_id, step=1, folder=folder)
    services.tinker_checkpoint_record(model=model, step=1, path=str(folder), stored=stored, name=name)
    return model_id, folder


def _send(method: str, route: str, key: str, body=None):
    response = getattr(Client(), method)(f"/tinker/api/v1/{route}", json.dumps(body or {}),
                                         content_type="application/json", HTTP_X_API_KEY=key)  # fmt: skip
    return response.status_code, response


def test_a_published_checkpoint_is_readable_by_every_team_until_unpublished(tinker, tmp_path):
    from projects.jobs import tinker as tinker_jobs

    alpha, beta = f"tml-{tinker['alpha']}", f"tml-{tinker['beta']}"
    model_id, _ = _saved(tinker, tmp_path)
    path, publish = (
        f"tinker://{model_id}/weights/w",
        f"training_runs/{model_id}/checkpoints/weights/w/publish",
    )
    assert call("weights_info", {"tinker_path": path}, key=beta)[0] == 404
    assert call(publish, key=f"tml-{tinker['reader']}")[0] == 403  # a read-only key
    assert call(publish, key=beta)[0] == 404  # only its own team publishes it
    assert call(publish, key=alpha)[0] == 204
    status, reply = call(publish, key=alpha)
    assert status == 400 and "already public" in reply.json()["error"]["message"]
    (row,) = call(f"training_runs/{model_id}/checkpoints", key=alpha, method="GET")[1].json()["checkpoints"]
    assert row["public"] is True
    # Another team reads it by its path: weights info, a training client made from it, a sampler.
    status, reply = call("weights_info", {"tinker_path": path}, key=beta)
    assert status == 200 and reply.json()["lora_rank"] == 4
    session = call("create_session", {"tags": []}, key=beta)[1].json()["session_id"]
    status, reply = call("load_weights", {"session_id": session, "model_seq_id": 0, "path": path,
                                          "optimizer": False}, key=beta)  # fmt: skip
    assert status == 200 and reply.json()["model_id"] == f"{session}:train:0", reply.content
    status, reply = call("create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0,
                                                     "model_path": path}, key=beta)  # fmt: skip
    assert status == 200, reply.content
    sampler = reply.json()["sampling_session_id"]
    # ... but it stays alpha's: not listed, deleted, re-timed or unpublished by beta.
    assert call(f"training_runs/{model_id}/checkpoints", key=beta, method="GET")[0] == 404
    assert _send("delete", f"training_runs/{model_id}/checkpoints/weights/w", beta)[0] == 404
    assert (
        _send("put", f"training_runs/{model_id}/checkpoints/weights/w/ttl", beta, {"ttl_seconds": 3600})[0]
        == 404
    )
    assert _send("delete", publish, beta)[0] == 404
    # A weights access token is not how artweb crosses teams.
    status, reply = call("load_weights", {"session_id": session, "model_seq_id": 1, "path": path,
                                          "optimizer": False, "weights_access_token": "t"}, key=beta)  # fmt: skip
    assert status == 400 and reply.json()["error"]["param"] == "weights_access_token"
    # Unpublished, it is alpha's alone again, for new requests and for beta's sampler alike.
    assert _send("delete", publish, alpha)[0] == 204
    status, reply = _send("delete", publish, alpha)
    assert status == 400 and "already private" in reply.json()["error"]["message"]
    assert call("weights_info", {"tinker_path": path}, key=beta)[0] == 404
    status, reply = call("asample", {"sampling_session_id": sampler, "num_samples": 1,
                                     "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                                     "sampling_params": {"max_tokens": 2}}, key=beta)  # fmt: skip
    assert status == 200, reply.content
    request_id = reply.json()["request_id"]
    tinker_jobs.sample(request_id)  # the worker's side: refused before any model is loaded
    status, reply = call("retrieve_future", {"request_id": request_id}, key=beta)
    assert reply.json()["category"] == "user" and "no checkpoint" in reply.json()["error"], reply.content


def test_a_published_name_crosses_teams_only_for_reading(tinker, tmp_path, cast):
    # checkpoint_for_path's one cross-team rule: another team's published name resolves where the
    # caller reads (public=True) and is a 404 wherever it would be written or trained (public=False).
    from projects.errors import NotFound
    from projects.selectors.tinker_paths import checkpoint_for_path

    model_id, _ = _saved(tinker, tmp_path)
    path = f"tinker://{model_id}/weights/w"
    assert (
        call(f"training_runs/{model_id}/checkpoints/weights/w/publish", key=f"tml-{tinker['alpha']}")[0]
        == 204
    )
    own = checkpoint_for_path(cast.alpha, path, param="path")
    assert checkpoint_for_path(cast.beta, path, param="path", public=True) == own
    with pytest.raises(NotFound):
        checkpoint_for_path(cast.beta, path, param="path")


def test_copy_weights_makes_a_stored_copy_that_is_not_trained(tinker, tmp_path, cast):
    from projects.storage import checkpoint_local_dir, checkpoint_store

    alpha, beta = f"tml-{tinker['alpha']}", f"tml-{tinker['beta']}"
    model_id, folder = _saved(tinker, tmp_path)
    path = f"tinker://{model_id}/weights/w"
    status, reply = call("copy_weights", {"source_path": path, "destination_project_id": "tinker"}, key=alpha,
                         HTTP_X_IDEMPOTENCY_KEY="k1")  # fmt: skip
    assert status == 200, reply.content
    copy_path = reply.json()["tinker_path"]
    copy_id = copy_path.removeprefix("tinker://").rsplit("/", 2)[0]
    assert copy_path == f"tinker://{copy_id}/weights/w" and copy_id != model_id
    # The same idempotency key (an SDK retry) gets the same copy; another key another copy.
    assert call("copy_weights", {"source_path": path, "destination_project_id": "tinker"}, key=alpha,
                HTTP_X_IDEMPOTENCY_KEY="k1")[1].json()["tinker_path"] == copy_path  # fmt: skip
    assert TinkerModel.objects.filter(run__config__copied_from=path).count() == 1
    copy = TinkerModel.objects.select_related("model", "run").get(pk=copy_id)
    assert copy.run.status == "succeeded" and copy.run.kind == RunKind.TINKER
    # Its own stored object: whole after the source's files are gone.
    source = Checkpoint.objects.get(model__tinker__pk=model_id, step=1)
    stored = Checkpoint.objects.get(model=copy.model, step=0)
    assert stored.storage_key and stored.storage_key != source.storage_key
    checkpoint_store().delete(source.storage_key)
    copied = checkpoint_local_dir(stored)
    assert (copied / "adapter_model.safetensors").read_bytes() == (
        folder / "adapter_model.safetensors"
    ).read_bytes()
    # Listed under its name; readable as a path; not trainable.
    status, reply = call("weights_info", {"tinker_path": copy_path}, key=alpha)
    assert status == 200 and reply.json()["lora_rank"] == 4
    status, reply = call("optim_step", {"model_id": copy_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}},
                         key=alpha)  # fmt: skip
    assert status == 400 and "copy" in reply.json()["error"]["message"], reply.content
    # Into a session's slot, with a TTL; the slot taken is a 400.
    session = call("create_session", {"tags": []}, key=alpha)[1].json()["session_id"]
    body = {"source_path": copy_path, "session_id": session, "model_seq_id": 5, "ttl_seconds": 3600}
    status, reply = call("copy_weights", body, key=alpha)
    assert status == 200 and reply.json()["tinker_path"] == f"tinker://{session}:train:5/weights/w", (
        reply.content
    )
    (row,) = call(f"training_runs/{session}:train:5/checkpoints", key=alpha, method="GET")[1].json()[
        "checkpoints"
    ]
    assert row["expires_at"] is not None
    status, reply = call("copy_weights", body, key=alpha)
    assert status == 400 and reply.json()["error"]["param"] == "model_seq_id"
    # Another team copies it only once it is published, into a project of its own.
    to_beta = {"source_path": path, "destination_project_id": "tinker"}
    assert call("copy_weights", to_beta, key=beta)[0] == 404
    source_model = TinkerModel.objects.get(pk=model_id)
    services.tinker_checkpoint_publish(checkpoint=stored, name="weights/w", public=True)
    status, reply = call("copy_weights", {**to_beta, "source_path": copy_path}, key=beta)
    assert status == 200, reply.content
    theirs = TinkerModel.objects.get(
        pk=reply.json()["tinker_path"].removeprefix("tinker://").rsplit("/", 2)[0]
    )
    assert theirs.session.team == cast.beta and theirs.model.project.team == cast.beta
    assert source_model.session.team == cast.alpha
    # Bad input: a 400 naming the field.
    for body, param in (({"source_path": path}, "destination_project_id"),
                        ({"source_path": path, "destination_project_id": "tinker", "ttl_seconds": 5}, "ttl_seconds"),
                        ({"source_path": "nope", "destination_project_id": "tinker"}, "source_path"),
                        ({"source_path": path, "destination_project_id": "tinker", "weights_access_token": "x"},
                         "weights_access_token")):  # fmt: skip
        status, reply = call("copy_weights", body, key=alpha)
        assert status == 400 and reply.json()["error"]["param"] == param, (body, reply.content)
    status, reply = call("copy_weights", {"source_path": path, "destination_project_id": "nope"}, key=alpha)
    assert status == 404 and reply.json()["error"]["param"] == "destination_project_id"
    assert call("copy_weights", {"source_path": path, "destination_project_id": "tinker"},
                key=f"tml-{tinker['reader']}")[0] == 403  # fmt: skip


def test_cancel_future_stops_a_queued_sample_and_nothing_else(tinker):
    from projects.jobs import tinker as tinker_jobs
    from projects.models import TinkerFutureStatus

    alpha, beta = f"tml-{tinker['alpha']}", f"tml-{tinker['beta']}"
    session = call("create_session", {"tags": []}, key=alpha)[1].json()["session_id"]
    sampler = call("create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0,
                                               "base_model": BASE}, key=alpha)[1].json()["sampling_session_id"]  # fmt: skip
    body = {"sampling_session_id": sampler, "num_samples": 1, "sampling_params": {"max_tokens": 2},
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}}  # fmt: skip
    request_id = call("asample", body, key=alpha)[1].json()["request_id"]
    assert call("cancel_future", {"request_id": request_id}, key=beta)[0] == 404
    assert call("cancel_future", {"request_id": "req-nope"}, key=alpha)[0] == 404
    # Only the team's read-write keys cancel: a read-only key is refused and the sample stays queued.
    status, reply = call("cancel_future", {"request_id": request_id}, key=f"tml-{tinker['reader']}")
    assert status == 403 and TinkerFuture.objects.get(pk=request_id).status == TinkerFutureStatus.PENDING
    status, reply = call("cancel_future", {"request_id": request_id}, key=alpha)
    assert status == 200, reply.content
    future = TinkerFuture.objects.get(pk=request_id)
    assert future.status == TinkerFutureStatus.CANCELLED
    status, reply = call("retrieve_future", {"request_id": request_id}, key=alpha)
    assert reply.json() == {"error": "cancelled by its client (cancel_future)", "category": "user"}
    tinker_jobs.sample(request_id)  # the worker skips it; a late result (a running sample) is dropped
    services.tinker_future_finish(future=future, blob=b"late")
    future.refresh_from_db()
    assert future.status == TinkerFutureStatus.CANCELLED and future.blob is None
    assert call("cancel_future", {"request_id": request_id}, key=alpha)[0] == 200  # again: a no-op
    # A finished sample stays finished; a training request is never cancelled.
    done = call("asample", body, key=alpha)[1].json()["request_id"]
    services.tinker_future_finish(future=TinkerFuture.objects.get(pk=done), blob=b"answer")
    assert call("cancel_future", {"request_id": done}, key=alpha)[0] == 200
    assert TinkerFuture.objects.get(pk=done).status == TinkerFutureStatus.DONE
    model_id = _model(tinker["alpha"])
    step = call("optim_step", {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}},
                key=alpha)[1].json()["request_id"]  # fmt: skip
    status, reply = call("cancel_future", {"request_id": step}, key=alpha)
    assert status == 400 and reply.json()["error"]["param"] == "request_id"
    assert TinkerFuture.objects.get(pk=step).status == TinkerFutureStatus.PENDING


def test_a_samples_prompt_logprobs_are_checked_and_are_the_models_own(tinker, settings, tiny_model_dir):
    import torch
    from tinker.proto.response_conv import deserialize_sample_response
    from transformers import AutoModelForCausalLM

    from projects.jobs import tinker as tinker_jobs

    settings.TRAINER_SERVICE_URL = ""  # the worker process's own sessions (training.hosting.resident)
    key = f"tml-{tinker['alpha']}"
    session = call("create_session", {"tags": []}, key=key)[1].json()["session_id"]
    sampler = call("create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0,
                                               "base_model": BASE}, key=key)[1].json()["sampling_session_id"]  # fmt: skip
    body = {"sampling_session_id": sampler, "num_samples": 1, "sampling_params": {"max_tokens": 1},
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}, "prompt_logprobs": True}  # fmt: skip
    for extra, param in (({"prompt_logprobs_last_n": 3}, "prompt_logprobs_last_n"),
                         ({"prompt_logprobs_last_n": 0}, "prompt_logprobs_last_n"),
                         ({"target_prompt_logprobs": {"data": [1]}}, "target_prompt_logprobs"),
                         ({"topk_prompt_logprobs": 2}, "topk_prompt_logprobs")):  # fmt: skip
        status, reply = call("asample", {**body, **extra}, key=key)
        assert status == 400 and reply.json()["error"]["param"] == param, reply.content
    status, reply = call("asample", body, key=key)
    assert status == 200, reply.content
    request_id = reply.json()["request_id"]
    tinker_jobs.sample(request_id)  # the worker's side, in this process
    future = TinkerFuture.objects.get(pk=request_id)
    assert future.status == "done", future.error
    scored = deserialize_sample_response(bytes(future.blob)).prompt_logprobs
    # The base model's own logprob of each prompt token given the ones before it.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits.log_softmax(-1)[0]
    expected = [logits[0, 2].item(), logits[1, 3].item()]
    assert scored[0] is None and scored[1:] == pytest.approx(expected, abs=1e-4), (scored, expected)
