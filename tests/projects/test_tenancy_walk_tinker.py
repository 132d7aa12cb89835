"""The tenancy walk of the Tinker API (``/tinker/``): every route, from the URL resolver, every method,
every caller (issue 51: the REST walk in test_tenancy_walk.py skipped ``/tinker/``).

Each route of ``ROUTES`` is called on a fresh world of alpha's Tinker objects (a session, a training
client, a sampler, a pending sample, a done future, saved and exported checkpoints) by: no key (401);
another team's read-write key (404 on every route that names one of alpha's objects); alpha's
read-only key (403 on every state-changing route, and no alpha row changed by anything it or the
outsider sent); and alpha's read-write key, which succeeds, so the 404s and 403s are not an
accident of a badly filled URL or body. A route the resolver knows and ``ROUTES`` does not fails here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver

from projects import services
from projects.models import (
    Checkpoint,
    Project,
    Run,
    TinkerFuture,
    TinkerModel,
    TinkerSampler,
    TinkerSession,
)
from projects.selectors import scoped
from projects.services.tinker import export_record
from projects.tinker import rest
from tests.projects.api.test_tinker_api import BASE, call
from tests.projects.api.test_tinker_api import tinker as tinker  # noqa: F401 (the fixture)
from tests.projects.jobs.test_tinker_recovery import forward_backward

pytestmark = pytest.mark.django_db

API = "tinker/api/v1/"
METHODS = ("get", "post", "put", "delete", "patch")


def tinker_routes(patterns: list | None = None, prefix: str = "") -> list[tuple[str, URLPattern]]:
    """Every URL pattern under ``/tinker/`` as (route, pattern): ``sessions/<str:session_id>``…"""
    found = []
    for entry in get_resolver().url_patterns if patterns is None else patterns:
        if isinstance(entry, URLResolver):
            found += tinker_routes(entry.url_patterns, prefix + str(entry.pattern))
        elif (prefix + str(entry.pattern)).startswith("tinker/"):
            found.append((prefix + str(entry.pattern), entry))
    return found


@dataclass
class World:
    session: str
    model: str
    sampler: str
    sample: str  # a pending sample's request id
    done: str  # a finished future's request id (create_model's)
    saved: str  # a second training client, with steps saved as weights/w, sampler_weights/s, external_weights/final


def _world(key: str, tmp_path) -> World:
    from projects.storage import checkpoint_upload

    owner = f"tml-{key}"
    session = call("create_session", {"tags": []}, key=owner)[1].json()["session_id"]
    reply = call("create_model", {"session_id": session, "model_seq_id": 0, "base_model": BASE,
                                  "lora_config": {"rank": 4}}, key=owner)[1].json()  # fmt: skip
    saved_id = call("create_model", {"session_id": session, "model_seq_id": 1, "base_model": BASE,
                                     "lora_config": {"rank": 4}}, key=owner)[1].json()["model_id"]  # fmt: skip
    model = TinkerModel.objects.get(pk=saved_id)
    for step, name in ((1, "weights/w"), (2, "sampler_weights/s"), (3, "external_weights/final")):
        folder = tmp_path / f"{session}-step-{step}"
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text('{"r": 4}')
        (folder / "adapter_model.safetensors").write_bytes(b"w" * 64)
        (folder / "state.json").write_text(json.dumps({"format_version": 1, "step": step}))
        for other in ("optimizer.pt", "rng_state.pt"):
            (folder / other).write_bytes(b"state")
        stored = checkpoint_upload(model_id=model.model_id, step=step, folder=folder)
        record = export_record(recipients=None, ttl_seconds=None) if step == 3 else None
        services.tinker_checkpoint_record(model=model, step=step, path=str(folder), stored=stored, name=name,
                                          export=record)  # fmt: skip
    sampler = call("create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0,
                                               "base_model": BASE}, key=owner)[1].json()["sampling_session_id"]  # fmt: skip
    sample = call("asample", _sample_body(sampler), key=owner)[1].json()["request_id"]
    return World(session, reply["model_id"], sampler, sample, reply["request_id"], saved_id)


def _sample_body(sampler: str) -> dict[str, Any]:
    return {"sampling_session_id": sampler, "num_samples": 1, "sampling_params": {"max_tokens": 2},
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}}  # fmt: skip


Body = Callable[[World], Any]


@dataclass
class Route:
    """What a route answers: ``methods`` (the others are 405), whether it changes state (``write``),
    whether it names one of alpha's objects (``alpha``: the outsider gets 404), the body a client
    sends, the URL's keywords, and the owner's status for each method."""

    methods: tuple[str, ...]
    write: bool
    alpha: bool
    body: Body = lambda w: {}  # noqa: E731
    kwargs: Callable[[World], dict[str, str]] = lambda w: {}  # noqa: E731
    owner: dict[str, int] = field(default_factory=dict)  # default 200
    protobuf: bool = False


def _model_kw(w: World, kind: str = "weights", name: str = "w") -> dict[str, str]:
    return {"model_id": w.saved, "kind": kind, "name": name}


ROUTES: dict[str, Route] = {
    "healthz": Route(("get", "post", "put", "delete", "patch"), write=False, alpha=False),
    "client/config": Route(("post",), write=False, alpha=False),
    "client/dynamic_config": Route(("post",), write=False, alpha=False, body=lambda w: {"sdk_version": "0.38.0"}),
    "telemetry": Route(("post",), write=True, alpha=False, body=lambda w: {"events": []}),
    "get_server_capabilities": Route(("get",), write=False, alpha=False),
    # project_id names alpha's project: another team's key finds none.
    "create_session": Route(("post",), write=True, alpha=True, body=lambda w: {"tags": [], "project_id": "math"}),
    "session_heartbeat": Route(("post",), write=True, alpha=True, body=lambda w: {"session_id": w.session}),
    "sessions/<str:session_id>": Route(("get",), write=False, alpha=True,
                                       kwargs=lambda w: {"session_id": w.session}),
    "sessions/<str:session_id>/finish": Route(("post",), write=True, alpha=True,
                                              body=lambda w: {"reason": {"type": "success"}},
                                              kwargs=lambda w: {"session_id": w.session}),
    "create_model": Route(("post",), write=True, alpha=True,
                          body=lambda w: {"session_id": w.session, "model_seq_id": 2, "base_model": BASE}),
    "get_info": Route(("post",), write=False, alpha=True, body=lambda w: {"model_id": w.model}),
    "forward_backward": Route(("post",), write=True, alpha=True, protobuf=True,
                              body=lambda w: forward_backward(w.model, 1, [1, 2, 3])),
    "optim_step": Route(("post",), write=True, alpha=True,
                        body=lambda w: {"model_id": w.model, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}}),
    "save_weights": Route(("post",), write=True, alpha=True,
                          body=lambda w: {"model_id": w.model, "seq_id": 1, "path": "again"}),
    "save_weights_for_sampler": Route(("post",), write=True, alpha=True,
                                      body=lambda w: {"model_id": w.model, "seq_id": 1, "path": "again"}),
    "load_weights": Route(("post",), write=True, alpha=True,
                          body=lambda w: {"model_id": w.model, "seq_id": 1, "path": f"tinker://{w.saved}/weights/w",
                                          "optimizer": True}),
    "create_sampling_session": Route(("post",), write=True, alpha=True,
                                     body=lambda w: {"session_id": w.session, "sampling_session_seq_id": 1,
                                                     "base_model": BASE}),
    "samplers/<str:sampler_id>": Route(("get",), write=False, alpha=True,
                                       kwargs=lambda w: {"sampler_id": w.sampler}),
    "asample": Route(("post",), write=True, alpha=True, body=lambda w: _sample_body(w.sampler)),
    "retrieve_future": Route(("post",), write=False, alpha=True, body=lambda w: {"request_id": w.done}),
    "cancel_future": Route(("post",), write=True, alpha=True, body=lambda w: {"request_id": w.sample}),
    "copy_weights": Route(("post",), write=True, alpha=True,
                          body=lambda w: {"source_path": f"tinker://{w.saved}/weights/w",
                                          "destination_project_id": "tinker"}),
    "training_runs/<str:model_id>/checkpoints/<str:kind>/<str:name>/publish": Route(
        ("post", "delete"), write=True, alpha=True, kwargs=_model_kw, owner={"post": 204, "delete": 204}),
    "training_runs": Route(("get",), write=False, alpha=False),
    "training_runs/<str:model_id>": Route(("get",), write=False, alpha=True,
                                          kwargs=lambda w: {"model_id": w.saved}),
    "training_runs/<str:model_id>/checkpoints": Route(("get",), write=False, alpha=True,
                                                      kwargs=lambda w: {"model_id": w.saved}),
    "save_weights_external": Route(("post",), write=True, alpha=True,
                                   body=lambda w: {"model_id": w.model, "seq_id": 1, "path": "again"}),
    "training_runs/<str:model_id>/checkpoints/<str:kind>/<str:name>/external_weights_urls": Route(
        ("get",), write=False, alpha=True, kwargs=lambda w: _model_kw(w, "external_weights", "final")),
    "training_runs/<str:model_id>/checkpoints/<str:kind>/<str:name>/ttl": Route(
        ("put",), write=True, alpha=True, kwargs=_model_kw, body=lambda w: {"ttl_seconds": 3600},
        owner={"put": 204}),
    "checkpoints": Route(("get",), write=False, alpha=False),
    "weights_info": Route(("post",), write=False, alpha=True,
                          body=lambda w: {"tinker_path": f"tinker://{w.saved}/weights/w"}),
    "training_runs/<str:model_id>/checkpoints/<path:checkpoint_id>": Route(
        ("delete",), write=True, alpha=True, kwargs=lambda w: {"model_id": w.saved, "checkpoint_id": "weights/w"},
        owner={"delete": 204}),
}  # fmt: skip
# Routes that touch no team (the SDK's calls artweb does not offer, and signed export downloads):
# the same answer for every caller, checked below.
NOT_OFFERED_KWARGS = {"session_id": "x", "rest": "usage"}


def _fill(route: str, kwargs: dict[str, str]) -> str:
    import re

    def value(match: re.Match) -> str:
        return kwargs[match.group(1)]

    return "/" + re.sub(r"<(?:\w+:)?(\w+)>", value, route)


def _send(method: str, url: str, key: str | None, route: Route, world: World) -> Any:
    extra = {"HTTP_X_API_KEY": key} if key else {}
    body = route.body(world)
    if method == "get":
        return Client().get(url, **extra)
    data = body if route.protobuf else json.dumps(body)
    content_type = "application/x-protobuf" if route.protobuf else "application/json"
    return getattr(Client(), method)(url, data, content_type=content_type, **extra)


def _alpha_rows(team: Any) -> list[Any]:
    """Every Tinker-related row of alpha, as values: what no outsider or read-only call may change."""
    rows: list[Any] = []
    for model in (TinkerSession, TinkerModel, TinkerSampler, TinkerFuture, Project, Run, Checkpoint):
        rows.append(sorted(map(repr, scoped(model, team).values())))
    return rows


def test_every_tinker_route_is_in_the_walk():
    missing = [
        route
        for route, entry in tinker_routes()
        if route.startswith(API)
        and entry.callback is not rest.not_offered
        and route.removeprefix(API) not in ROUTES
    ]
    assert not missing, "Tinker routes the walk does not know (add them to ROUTES):\n" + "\n".join(missing)
    assert len(ROUTES) >= 30


def test_tinker_outsiders_get_404_read_only_keys_403_and_the_owner_succeeds(tinker, cast, tmp_path, settings):
    settings.TINKER_POLL_S = 0
    settings.TINKER_MAX_PENDING_SAMPLES_PER_TEAM = 1000  # a world per route, each with a queued sample
    from tests.factories import ProjectFactory

    ProjectFactory(team=cast.alpha, name="math")
    owner, reader, outsider = (f"tml-{tinker[name]}" for name in ("alpha", "reader", "beta"))
    problems: list[str] = []
    walked = 0
    for full, entry in tinker_routes():
        route_name = full.removeprefix(API)
        if not full.startswith(API) or entry.callback is rest.not_offered:
            continue
        route = ROUTES[route_name]
        world = _world(tinker["alpha"], tmp_path / f"w{walked}")
        walked += 1
        url = _fill(full, route.kwargs(world))
        before = _alpha_rows(cast.alpha)
        for method in METHODS:
            if method not in route.methods:
                status = _send(method, url, owner, route, world).status_code
                if status != 405:
                    problems.append(f"owner {method.upper()} {url} → {status}, not 405")
                continue
            if route_name == "healthz":
                continue  # no key, no team: the load balancer's probe
            status = _send(method, url, None, route, world).status_code
            if status != 401:
                problems.append(f"no key {method.upper()} {url} → {status}, not 401")
            reply = _send(method, url, outsider, route, world)
            if route.alpha and reply.status_code != 404:
                problems.append(f"outsider {method.upper()} {url} → {reply.status_code}, not 404")
            elif not route.alpha and (
                world.model in reply.content.decode() or world.session in reply.content.decode()
            ):
                problems.append(f"outsider {method.upper()} {url}: alpha's ids in the answer")
            status = _send(method, url, reader, route, world).status_code
            expected = 403 if route.write else route.owner.get(method, 200)
            if status != expected:
                problems.append(f"read-only key {method.upper()} {url} → {status}, not {expected}")
        if _alpha_rows(cast.alpha) != before:
            problems.append(f"{full}: an outsider's or a read-only key's call changed alpha's rows")
        for method in route.methods:
            reply = _send(method, url, owner, route, world)
            if reply.status_code != route.owner.get(method, 200) or (
                reply.status_code == 200 and "error" in reply.json()
            ):
                problems.append(f"owner {method.upper()} {url} → {reply.status_code} {reply.content[:200]!r}")
    assert not problems, "\n".join(problems)
    assert walked >= 30, "the walk reached too few routes to mean anything"


def test_tinker_routes_that_touch_no_team_answer_every_caller_alike(tinker):
    """The SDK's routes artweb does not offer (a 400 the SDK does not retry) and signed export
    downloads (the signature is the permission; an unsigned token is a 403 whoever sends it)."""
    keys = [None, *(f"tml-{tinker[name]}" for name in ("alpha", "reader", "beta"))]
    problems, walked = [], 0
    for full, entry in tinker_routes():
        if full.startswith(API) and entry.callback is not rest.not_offered:
            continue
        walked += 1
        expected = 400 if entry.callback is rest.not_offered else 403
        url = _fill(full, {**NOT_OFFERED_KWARGS, "token": "not-signed"})
        for key in keys:
            for method in ("get", "post"):
                client = Client()
                extra = {"HTTP_X_API_KEY": key} if key else {}
                status = getattr(client, method)(url, **extra).status_code
                if status != expected and not (expected == 403 and method == "post" and status == 405):
                    problems.append(f"{key and key[:12]} {method.upper()} {url} → {status}, not {expected}")
    assert not problems, "\n".join(problems)
    assert walked >= 10


def test_asample_without_a_sampler_never_takes_another_teams_session(tinker, tmp_path):
    """``asample`` without a ``sampling_session_id`` samples in the caller's latest session: a team
    with none gets a 400, never a sampler in another team's session."""
    _world(tinker["alpha"], tmp_path)
    before = TinkerSampler.objects.count()
    body = {**_sample_body(""), "sampling_session_id": None, "base_model": BASE}
    status, reply = call("asample", body, key=f"tml-{tinker['beta']}")
    assert status == 400 and reply.json()["error"]["param"] == "sampling_session_id", reply.content
    assert TinkerSampler.objects.count() == before
    assert call("asample", body, key=f"tml-{tinker['alpha']}")[0] == 200  # the owner's own session


def test_a_platform_checkpoint_path_of_another_team_is_404(tinker, alpha_setup, tmp_path):
    """``tinker://<project>.<model>/step/<N>`` names a checkpoint of the caller's team only."""
    from tests.factories import CheckpointFactory

    CheckpointFactory(model=alpha_setup.model, step=0, path=str(tmp_path))
    body = {"tinker_path": "tinker://math.agent/step/0"}
    status, reply = call("weights_info", body, key=f"tml-{tinker['alpha']}")
    assert status == 200, reply.content
    status, reply = call("weights_info", body, key=f"tml-{tinker['beta']}")
    assert status == 404 and reply.json()["error"]["param"] == "tinker_path", reply.content


def test_tinker_views_never_filter_by_team_by_hand():
    """Every team-owned read goes through ``selectors.scoped`` (the model's ``TEAM_PATH``): a query
    in projects/tinker that names a team in ``filter``/``get``/``exclude`` is the hand-written
    scoping the house style rules out (one forgotten filter is a cross-team read)."""
    import ast
    from pathlib import Path

    import projects.tinker

    found = []
    for path in Path(projects.tinker.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in {"filter", "get", "exclude", "first"}
                and any(keyword.arg and "team" in keyword.arg for keyword in node.keywords)
            ):
                found.append(f"{path.name}:{node.lineno}")
    assert not found, "filter by team by hand (use projects.selectors.scoped): " + ", ".join(found)


def test_copy_weights_into_another_teams_project_reads_as_a_missing_project(tinker, cast, tmp_path):
    """A published checkpoint may be copied by any team, but only into a project of its own: alpha's
    project named by beta is the same 404 as a project that does not exist."""
    from tests.factories import ProjectFactory

    ProjectFactory(team=cast.alpha, name="math")
    world = _world(tinker["alpha"], tmp_path)
    publish = f"training_runs/{world.saved}/checkpoints/weights/w/publish"
    assert call(publish, key=f"tml-{tinker['alpha']}")[0] == 204
    source = f"tinker://{world.saved}/weights/w"
    for project in ("math", "nope"):
        status, reply = call("copy_weights", {"source_path": source, "destination_project_id": project},
                             key=f"tml-{tinker['beta']}")  # fmt: skip
        assert status == 404 and reply.json()["error"]["param"] == "destination_project_id", reply.content
    assert not Project.objects.filter(team=cast.beta).exists()
    status, reply = call("copy_weights", {"source_path": source, "destination_project_id": "math"},
                         key=f"tml-{tinker['alpha']}")  # fmt: skip
    assert status == 200, reply.content
