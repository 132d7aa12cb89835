"""The tenancy walk of the gateway, ``/v1/`` (issue 51: the REST walk in test_tenancy_walk.py skipped
it): OpenAI's files and fine-tuning jobs, ART's preview protocol, models and chat completions.

Every ``/v1/`` route from the URL resolver, every method it answers, every caller: another team's key
gets 404 on every route naming one of alpha's objects; alpha's read-only key gets 403 on every
method that is not a read and changes nothing; alpha's read-write key reads every route and succeeds
on every write to one of its objects (so the 404s are not an accident of a badly filled URL or body).
Chat completions and the model list are reads (inference writes only its usage record): a read-only
key may call them, another team's key finds none of alpha's checkpoints.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.urls import URLPattern, get_resolver, reverse

from projects import services
from projects.api.base import TeamViewSet
from projects.models import Run, TrainingJob
from tests.asgi import asgi_json
from tests.conftest import _client
from tests.projects.api.test_preview_api import groups
from tests.projects.test_tenancy_walk import _walk

pytestmark = pytest.mark.django_db

# The async gateway views: they authenticate the key themselves through projects.access
# (projects.gateway.views._authenticate → resolve_team_and_role) and are walked below on their own.
GATEWAY_VIEWS = {"gateway-chat-completions", "gateway-models", "gateway-model"}
JSONL = "".join(
    json.dumps(
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
    )
    + "\n"
    for i in range(10)
)


def v1_patterns() -> list[tuple[str, URLPattern, str]]:
    return [
        (route, entry, name)
        for route, entry, name in _walk(get_resolver().url_patterns)
        if route.startswith("v1/")
    ]


@pytest.fixture
def keys(cast):
    return {
        "owner": services.api_key_create(team=cast.alpha, name="rw").plaintext,
        "reader": services.api_key_create(team=cast.alpha, name="ro", read_only=True).plaintext,
        "outsider": services.api_key_create(team=cast.beta, name="rw").plaintext,
    }


def _world(cast, alpha_setup, owner) -> dict[str, str]:
    """One of each ``/v1/`` object in alpha, made through the API as its clients make them."""
    from django.core.files.uploadedfile import SimpleUploadedFile

    # Two client models and two files: a queued job or run holds the one it uses (a 409 on delete).
    models = [
        services.client_model_register(team=cast.alpha, entity=None, project="math",
                                       name=f"client-{Run.objects.count()}", base_model=alpha_setup.base.name)
        for _ in range(2)
    ]  # fmt: skip
    job = TrainingJob.objects.create(model=models[1][0], run=models[1][1])
    files = []
    for _ in range(2):
        upload = SimpleUploadedFile("train.jsonl", JSONL.encode(), content_type="application/jsonl")
        reply = owner.post("/v1/files", {"file": upload, "purpose": "fine-tune"}, format="multipart")
        assert reply.status_code == 200, reply.content
        files.append(reply.json()["id"])
    reply = owner.post("/v1/fine_tuning/jobs", {"model": alpha_setup.base.name, "training_file": files[1]},
                       format="json")  # fmt: skip
    assert reply.status_code == 200, reply.content
    completion = services.stored_completion_create(
        team_id=cast.alpha.pk, completion_id=f"chatcmpl-walk{Run.objects.count()}", api_key_id=None,
        model="math/agent:0", served_by="math/agent:0", checkpoint_id=None, stream=False, metadata={},
        conversation_id="", request={"messages": [{"role": "user", "content": "hi"}]},
        response={"choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"},
                               "finish_reason": "stop", "logprobs": None}]},
        prompt_token_ids=[1, 2], token_ids=[[3]], logprobs=[[-0.5]], latency_ms=5,
    )  # fmt: skip
    assert completion is not None
    return {"model_id": str(models[0][0].pk), "training_job": str(job.pk), "file_id": files[0],
            "ftjob": reply.json()["id"], "completion_id": completion.completion_id}  # fmt: skip


def _kwargs(name: str, entry: URLPattern, world: dict[str, str]) -> dict[str, str]:
    kwargs = {}
    for key in entry.pattern.regex.groupindex:
        if key == "job_id":
            kwargs[key] = world["training_job"] if name.startswith("preview-") else world["ftjob"]
        else:
            kwargs[key] = world[key]
    return kwargs


# What the owner's key sends to write to one of its objects, and what it gets back.
OWNER_WRITES: dict[tuple[str, str], tuple[Any, int]] = {
    ("preview-model", "delete"): (None, 200),
    ("preview-checkpoints", "delete"): ({"steps": []}, 200),
    ("preview-model-log", "post"): ({"trajectory_groups": groups(0.25, 0.75), "split": "val"}, 200),
    ("openai-file", "delete"): (None, 200),
    ("openai-job-cancel", "post"): (None, 200),
    ("openai-job-pause", "post"): (None, 200),
    ("openai-job-resume", "post"): (None, 200),
    ("stored-completion", "post"): ({"metadata": {"reviewed": "yes"}}, 200),
    ("stored-completion", "delete"): (None, 200),
}


def _send(client: Any, method: str, url: str, body: Any = None) -> Any:
    if method == "get":
        return client.get(url)
    return getattr(client, method)(url, body if body is not None else {}, format="json")


def test_every_v1_view_derives_from_the_tenancy_base():
    unscoped = [
        f"{route} ({name})"
        for route, entry, name in v1_patterns()
        if name not in GATEWAY_VIEWS
        and not (getattr(entry.callback, "cls", None) and issubclass(entry.callback.cls, TeamViewSet))
    ]
    assert not unscoped, "/v1/ views outside projects.api.base:\n" + "\n".join(unscoped)


def test_v1_outsiders_get_404_read_only_keys_403_and_the_owner_succeeds(cast, alpha_setup, keys):
    owner, reader, outsider = (_client(key=keys[who]) for who in ("owner", "reader", "outsider"))
    problems: list[str] = []
    walked_objects = 0
    for _route, entry, name in v1_patterns():
        if name in GATEWAY_VIEWS:
            continue
        world = _world(cast, alpha_setup, owner)  # fresh: the owner's writes below change it
        url = reverse(name, kwargs=_kwargs(name, entry, world))
        methods = [m for m in entry.callback.actions if m not in {"head", "options"}]
        for method in methods:
            if method != "get":
                status = _send(reader, method, url).status_code
                if status != 403:
                    problems.append(f"read-only key {method.upper()} {url} → {status}, not 403")
            if entry.pattern.regex.groupindex:
                walked_objects += 1
                status = _send(outsider, method, url).status_code
                if status != 404:
                    problems.append(f"outsider {method.upper()} {url} → {status}, not 404")
        for method in sorted(methods, key=lambda m: m != "get"):  # reads first, then the owner's write
            if method == "get":
                reply = owner.get(url)
                if reply.status_code != 200:
                    problems.append(f"owner GET {url} → {reply.status_code} {reply.content[:200]!r}")
                reply = reader.get(url)
                if reply.status_code != 200:
                    problems.append(f"read-only key GET {url} → {reply.status_code}")
            elif entry.pattern.regex.groupindex:
                body, expected = OWNER_WRITES[(name, method)]
                if name == "openai-job-resume":  # only a paused job resumes
                    assert owner.post(url.replace("/resume", "/pause")).status_code == 200
                reply = _send(owner, method, url, body)
                if reply.status_code != expected:
                    problems.append(
                        f"owner {method.upper()} {url} → {reply.status_code} {reply.content[:200]!r}"
                    )
    assert not problems, "\n".join(problems)
    assert walked_objects >= 15, "the walk reached too few object routes to mean anything"


# ---------------------------------------------------------------------- models and chat completions
def _asgi(method: str, path: str, key: str | None, body: bytes = b"") -> tuple[int, Any]:
    """A request through the ASGI application that serves /v1/ (projects.gateway.asgi)."""
    return asgi_json(method, path, body, key=key)


@pytest.mark.django_db(transaction=True)  # the gateway reads on its own database threads
def test_models_and_chat_completions_find_no_other_teams_checkpoint(cast, alpha_setup, keys):
    from projects.gateway.db import close_db_thread_connections

    services.checkpoint_record(model=alpha_setup.model, run=None, step=0, path="/ckpt/model/step-0")
    chat = json.dumps({"model": "math/agent:0", "messages": [{"role": "user", "content": "hi"}]}).encode()
    try:
        for path in ("/v1/models", "/v1/models/math/agent:0", "/v1/chat/completions"):
            allowed = {"GET", "POST"} if path == "/v1/chat/completions" else {"GET"}
            for method in {"GET", "POST", "PUT", "DELETE", "PATCH"} - allowed:
                assert _asgi(method, path, keys["owner"], chat)[0] == 405, (method, path)
        assert _asgi("GET", "/v1/models/math/agent:0", None)[0] == 401
        assert _asgi("POST", "/v1/chat/completions", None, chat)[0] == 401
        for who in ("owner", "reader"):
            status, body = _asgi("GET", "/v1/models/math/agent:0", keys[who])
            assert status == 200 and body["id"] == "math/agent:0", (who, body)
            status, body = _asgi("GET", "/v1/models", keys[who])
            assert "math/agent:0" in {model["id"] for model in body["data"]}, (who, body)
            # No inference server runs here: a 503 says the model was found (never a 404).
            status, body = _asgi("POST", "/v1/chat/completions", keys[who], chat)
            assert status == 503 and body["error"]["code"] != "model_not_found", (who, body)
        status, body = _asgi("GET", "/v1/models/math/agent:0", keys["outsider"])
        assert status == 404 and body["error"]["code"] == "model_not_found", body
        status, body = _asgi("GET", "/v1/models", keys["outsider"])
        assert status == 200 and not any(model["id"].startswith("math/") for model in body["data"]), body
        status, body = _asgi("POST", "/v1/chat/completions", keys["outsider"], chat)
        assert status == 404 and body["error"]["code"] == "model_not_found", body
        # GET lists the caller's stored completions (projects.api.completions): alpha's only to alpha.
        _world_completion = services.stored_completion_create(
            team_id=cast.alpha.pk, completion_id="chatcmpl-alpha", api_key_id=None, model="m", served_by="m",
            checkpoint_id=None, stream=False, metadata={}, conversation_id="", request={"messages": []},
            response={"choices": []}, prompt_token_ids=None, token_ids=None, logprobs=None, latency_ms=1,
        )  # fmt: skip
        assert _world_completion is not None
        for who, expected in (
            ("owner", ["chatcmpl-alpha"]),
            ("reader", ["chatcmpl-alpha"]),
            ("outsider", []),
        ):
            status, body = _asgi("GET", "/v1/chat/completions", keys[who])
            assert status == 200 and [row["id"] for row in body["data"]] == expected, (who, body)
        assert _asgi("GET", "/v1/chat/completions", None)[0] == 401
    finally:
        close_db_thread_connections()
