"""Every URL of the REST API and the dashboard is team-scoped, proven by walking the URL patterns.

A view added later that forgets the tenancy base (or that this walk cannot fill in) fails here:
each pattern must be a team view (``projects.api.base`` / ``frontend.access.team_view``) or be on
an explicit list below; an outsider (charlie, owner of beta) gets 404 on every method of every
alpha object; a viewer (bob) and a read-only key get 403 on every write; and alice, the owner,
reads every page, so the 404s are not an accident of a badly filled URL.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver, resolve, reverse

from frontend.access import TEAM_VIEWS
from projects import services
from projects.api.base import CatalogueViewSet, SignedInViewSet, TeamViewSet
from projects.models import Membership, TrainingJob
from tests.factories import ApiKeyFactory, CheckpointFactory, RunFactory

pytestmark = pytest.mark.django_db

# Reachable without a team: signing in and out, the API's schema and its docs page.
PUBLIC = {"schema", "docs", "frontend:login", "frontend:logout"}
# Rows every team shares (the operator's catalogue), and static descriptions of the platform.
CATALOGUE = {"base-model-list", "base-model-detail", "hyperparameters", "environment-kinds"}
# The one dashboard post a viewer may make: choosing which of their teams to work in.
VIEWER_MAY_POST = {"frontend:team-switch"}
# For a signed-in person before any team is theirs: accepting an invitation (the API's
# ``SignedInViewSet`` and the dashboard page it links to); tested in tests/projects/api/test_invitations.py
# and tests/frontend/test_views.py.
SIGNED_IN = {"invitation-accept", "frontend:invitation-accept"}
# Not a team_view: ``/`` redirects; the playground checks the session with the same resolver
# (``session_access``) and is tested below on its own.
DASHBOARD_OTHERS = {"frontend:root", "frontend:playground-chat"}


def _walk(patterns: list, prefix: str = "", namespace: str = "") -> list[tuple[str, URLPattern, str]]:
    found = []
    for entry in patterns:
        if isinstance(entry, URLResolver):
            inner = f"{namespace}{entry.namespace}:" if entry.namespace else namespace
            found += _walk(entry.url_patterns, prefix + str(entry.pattern), inner)
        elif entry.name:
            found.append((prefix + str(entry.pattern), entry, f"{namespace}{entry.name}"))
    return found


def api_patterns() -> list[tuple[str, URLPattern, str]]:
    return [
        (route, entry, name)
        for route, entry, name in _walk(get_resolver().url_patterns)
        if route.startswith("api/v1/") and "format" not in entry.pattern.regex.groupindex
    ]


def dashboard_patterns() -> list[tuple[str, URLPattern, str]]:
    return [
        (route, entry, name)
        for route, entry, name in _walk(get_resolver().url_patterns)
        if name.startswith("frontend:")
    ]


@pytest.fixture
def world(cast, alpha_setup, alice_client, settings, tmp_path):
    """One of every team-owned object, all in alpha (nothing is enqueued: the test's transaction
    never commits)."""
    from projects.services import judges

    run = RunFactory(
        model=alpha_setup.model,
        task_set=alpha_setup.task_set,
        environment=alpha_setup.environment,
        reward=alpha_setup.reward,
        created_by=cast.alice,
    )
    # Real files, so the owner can download the adapter and a finished export's content.
    settings.CHECKPOINT_DIR = tmp_path / "checkpoints"
    folder = settings.CHECKPOINT_DIR / f"model-{alpha_setup.model.pk}" / "step-000000"
    folder.mkdir(parents=True)
    (folder / "adapter_model.safetensors").write_bytes(b"weights")
    checkpoint = CheckpointFactory(model=alpha_setup.model, run=run, step=0, path=str(folder))
    from projects.models import Export

    export = Export.objects.create(
        checkpoint=checkpoint, status="succeeded", key=f"model-{alpha_setup.model.pk}/step-000000"
    )
    created = alice_client.post(
        "/api/v1/evaluations",
        {
            "model": "math/agent:0",
            "task_set": alpha_setup.task_set.id,
            "environment": alpha_setup.environment.id,
            "reward": alpha_setup.reward.id,
        },
        format="json",
    )
    assert created.status_code == 201, created.content
    from projects.models import Evaluation

    evaluation = Evaluation.objects.get(pk=created.json()["id"])
    judge = judges.judge_endpoint_create(team=cast.alpha, name="judge", base_url="http://127.0.0.1:9/v1")
    api_key = ApiKeyFactory(team=cast.alpha)
    from projects.services import webhooks

    webhook = webhooks.webhook_endpoint_create(
        team=cast.alpha, name="hook", url="http://127.0.0.1:9/hook", events=["*"]
    ).endpoint
    delivery = webhooks.webhook_test(endpoint=webhook)  # enqueued on commit: this test never commits
    invitation = services.invitation_create(team=cast.alpha, invitee="dora", role="member", by=cast.alice)
    from projects.models import ScenarioJob

    scenario_job = ScenarioJob.objects.create(
        project=alpha_setup.project, environment=alpha_setup.environment, endpoint=judge,
        name="generated", instruction="x", model="m", rows_total=1,
    )  # fmt: skip
    completion = services.stored_completion_create(
        team_id=cast.alpha.pk, completion_id="chatcmpl-walk", api_key_id=None, model="math/agent:0",
        served_by="math/agent:0", checkpoint_id=checkpoint.pk, stream=False, metadata={"conversation_id": "c"},
        conversation_id="c", request={"messages": [{"role": "user", "content": "hi"}]},
        response={"choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"},
                               "finish_reason": "stop", "logprobs": None}]},
        prompt_token_ids=[1], token_ids=[[2]], logprobs=[[-0.5]], latency_ms=3,
    )  # fmt: skip
    client_model, client_run = services.client_model_register(
        team=cast.alpha, entity=None, project="math", name="scheduled", base_model=alpha_setup.base.name
    )
    schedule = TrainingJob.objects.create(model=client_model, run=client_run)  # a one-step schedule
    TrainingJob.objects.filter(pk=schedule.pk).update(schedule=schedule)
    objects = {
        "project": alpha_setup.project,
        "model": alpha_setup.model,
        "task_set": alpha_setup.task_set,
        "environment": alpha_setup.environment,
        "reward": alpha_setup.reward,
        "run": run,
        "checkpoint": checkpoint,
        "evaluation": evaluation,
        "export": export,
        "judge": judge,
        "webhook": webhook,
        "delivery": delivery,
        "api_key": api_key,
        "invitation": invitation.invitation,
        "membership": Membership.objects.get(team=cast.alpha, user=cast.bob),
        "base_model": alpha_setup.base,
        "scenario_job": scenario_job,
        "stored_completion": completion,
        "feedback": services.feedback_add(team=cast.alpha, value=1.0, completion=completion),
        "alias": services.alias_set(model=alpha_setup.model, name="prod", step=0),
        "grading": services.completion_grading_create(team=cast.alpha, reward=alpha_setup.reward),
        "training_schedule": schedule,
    }
    return type("World", (), {**objects, "objects": objects, "setup": alpha_setup})


# URL keyword → the world's object that fills it.
KWARGS = {
    "alias_id": "alias",
    "completion_id": "stored_completion",  # a stored completion's own id (chatcmpl-…), not its pk
    "conversation_id": "stored_completion",  # its conversation's id (the metadata value)
    "run_id": "run",
    "checkpoint_id": "checkpoint",
    "project_id": "project",
    "task_set_id": "task_set",
    "evaluation_id": "evaluation",
    "model_id": "model",
    "reward_id": "reward",
    "membership_id": "membership",
    "key_id": "api_key",
    "invitation_id": "invitation",
    "webhook_id": "webhook",
    "endpoint_id": "judge",  # the judge-endpoints pages
    "delivery_id": "delivery",
    "job_id": "scenario_job",  # a scenario generation job's page
    "schedule_id": "training_schedule",  # a training schedule over stored completions: its first job
}
# A router's ``pk`` → the world's object, by the view's model.
PK_OF_MODEL = {
    "Project": "project",
    "TrainableModel": "model",
    "TaskSet": "task_set",
    "Environment": "environment",
    "RewardDefinition": "reward",
    "Run": "run",
    "Checkpoint": "checkpoint",
    "Evaluation": "evaluation",
    "Export": "export",
    "JudgeEndpoint": "judge",
    "WebhookEndpoint": "webhook",
    "ApiKey": "api_key",
    "Invitation": "invitation",
    "Membership": "membership",
    "BaseModel": "base_model",
    "StoredCompletion": "stored_completion",
    "CompletionFeedback": "feedback",
    "ModelAlias": "alias",
    "CompletionGrading": "grading",
}


def _key_value(row: Any, key: str) -> Any:
    """A URL keyword's value from its row: a stored completion is named by its own id (or its
    conversation's), every other row by its pk."""
    return getattr(row, key) if key in ("completion_id", "conversation_id") else row.pk


def _url(world: Any, entry: URLPattern, name: str, view_class: type | None) -> str:
    kwargs: dict[str, Any] = {}
    for key in entry.pattern.regex.groupindex:
        if key == "pk":
            assert view_class is not None and view_class.model is not None, f"{name}: pk of what?"
            kwargs[key] = world.objects[PK_OF_MODEL[view_class.model.__name__]].pk
        elif key == "verb":  # an alias's action on the model page
            kwargs[key] = "rollback"
        else:
            assert key in KWARGS, f"{name}: the walk does not know the URL keyword {key!r}; add it"
            row = world.objects[KWARGS[key]]
            kwargs[key] = _key_value(row, key)
    return reverse(name, kwargs=kwargs)


def _api_methods(entry: URLPattern) -> dict[str, str]:
    return dict(getattr(entry.callback, "actions", {}) or {})


def _not_openai_list(body: Any) -> bool:
    """A bare array, DRF's page shape, or an OpenAI list missing its cursor fields."""
    if isinstance(body, list) or (isinstance(body, dict) and "results" in body and "count" in body):
        return True
    return body.get("object") == "list" and not {"data", "has_more", "first_id", "last_id"} <= body.keys()


def _send(client: Any, method: str, url: str) -> Any:
    return getattr(client, method)(url, {}, format="json") if method != "get" else client.get(url)


def test_every_api_view_derives_from_the_tenancy_base():
    unscoped = []
    for route, entry, name in api_patterns():
        if name in PUBLIC:
            continue
        view_class = getattr(entry.callback, "cls", None)
        expected = (
            CatalogueViewSet if name in CATALOGUE else SignedInViewSet if name in SIGNED_IN else TeamViewSet
        )
        if view_class is None or not issubclass(view_class, expected):
            unscoped.append(f"{route} ({name}): {view_class}")
    assert not unscoped, "API views outside projects.api.base:\n" + "\n".join(unscoped)


def test_api_outsiders_get_404_viewers_403_and_the_owner_reads(
    world, alice_client, bob_client, charlie_client, read_only_client
):
    problems: list[str] = []
    checked_objects = 0
    for _route, entry, name in api_patterns():
        if name in PUBLIC | SIGNED_IN:
            continue
        view_class = entry.callback.cls
        url = _url(world, entry, name, view_class)
        methods = _api_methods(entry)
        for method in methods:
            if method in {"head", "options"}:
                continue
            if method == "get":
                response = alice_client.get(url)
                if response.status_code >= 400:
                    problems.append(f"owner GET {url} → {response.status_code}")
                elif response["Content-Type"] == "application/json" and _not_openai_list(response.json()):
                    problems.append(f"owner GET {url}: a list not in OpenAI's shape")
            elif name not in CATALOGUE:
                for who, client in (("viewer", bob_client), ("read-only key", read_only_client)):
                    status = _send(client, method, url).status_code
                    if status != 403:
                        problems.append(f"{who} {method.upper()} {url} → {status}, not 403")
            if entry.pattern.regex.groupindex and name not in CATALOGUE:
                checked_objects += 1
                status = _send(charlie_client, method, url).status_code
                if status != 404:
                    problems.append(f"outsider {method.upper()} {url} → {status}, not 404")
    assert not problems, "\n".join(problems)
    assert checked_objects >= 30, "the walk reached too few object routes to mean anything"


def _is_team_view(view: Any) -> bool:
    while view is not None:  # through outer decorators such as require_POST
        if view in TEAM_VIEWS:
            return True
        view = getattr(view, "__wrapped__", None)
    return False


def test_every_dashboard_view_is_a_team_view():
    unscoped = [
        f"{route} ({name})"
        for route, entry, name in dashboard_patterns()
        if name not in PUBLIC | DASHBOARD_OTHERS | SIGNED_IN and not _is_team_view(entry.callback)
    ]
    assert not unscoped, "dashboard views without team_view:\n" + "\n".join(unscoped)


def _page_client(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_dashboard_outsiders_get_404_viewers_403_and_the_owner_reads(world, cast):
    alice, bob, charlie = (_page_client(user) for user in (cast.alice, cast.bob, cast.charlie))
    problems: list[str] = []
    for _route, entry, name in dashboard_patterns():
        if name in PUBLIC | DASHBOARD_OTHERS | SIGNED_IN:
            continue
        url = _url(world, entry, name, None)
        owner_get = alice.get(url).status_code
        if owner_get not in (200, 302, 405):
            problems.append(f"owner GET {url} → {owner_get}")
        if entry.pattern.regex.groupindex:
            answers = {charlie.get(url).status_code, charlie.post(url, {}).status_code}
            if answers - {404, 405} or 404 not in answers:
                problems.append(f"outsider {url} → {sorted(answers)}, not 404")
        if name not in VIEWER_MAY_POST:
            status = bob.post(url, {}).status_code
            if status not in (403, 405):
                problems.append(f"viewer POST {url} → {status}, not 403")
    assert not problems, "\n".join(problems)


def test_playground_resolves_the_session_team_and_finds_no_other_teams_model(world, cast):
    charlie = _page_client(cast.charlie)
    charlie.cookies["csrftoken"] = "x" * 32
    response = charlie.post(
        reverse("frontend:playground-chat"),
        data={"model": "math/agent:0", "messages": [{"role": "user", "content": "hi"}]},
        content_type="application/json",
        HTTP_X_CSRFTOKEN="x" * 32,
    )
    assert response.status_code == 404, response.content
    assert response.json()["error"]["code"] == "model_not_found"


# --- OPTIONS on every route ---------------------------------------------------------------------

# URL keywords outside the team's objects: the router's format suffix and the admin's own (whose
# pages send anyone who is not staff to its sign-in page; none of the cast is staff).
OTHER_KWARGS = {"format": "json", "app_label": "projects", "object_id": "1", "content_type_id": "1",
                "id": "1", "url": "nowhere/",
                # the Tinker API's (projects.tinker): ids the SDK holds, none of them existing here
                "session_id": "session-0", "sampler_id": "session-0:sample:0", "model_id": "session-0:train:0",
                "kind": "external_weights", "name": "final", "token": "not-signed", "rest": "usage",
                # OpenAI's fine-tuning API (projects.api.fine_tuning): a file id no team has
                "file_id": "file-0", "verb": "rollback"}  # fmt: skip
_GROUP = re.compile(r"\(\?P<(\w+)>[^()]*\)")


def every_pattern(patterns: list, prefix: str = "") -> list[tuple[str, URLPattern]]:
    """Every URL pattern, named or not (the trailing-slash twins too), as (full regex, pattern)."""
    found = []
    for entry in patterns:
        regex = entry.pattern.regex.pattern.lstrip("^")
        if isinstance(entry, URLResolver):
            found += every_pattern(entry.url_patterns, prefix + regex)
        else:
            found.append((prefix + regex, entry))
    return found


def _path_of(world: Any, regex: str, entry: URLPattern) -> str:
    """The path that ``regex`` matches with each keyword filled by a real row's id: the view's
    own model for its lookup keyword (a preview ``job_id`` is a training job, the dashboard's a
    scenario job), else KWARGS; checked by resolving it back to the same view."""
    view_class = getattr(entry.callback, "cls", None)
    model = getattr(view_class, "model", None)

    def value(match: re.Match) -> str:
        key = match.group(1)
        if model is not None and key in {"pk", getattr(view_class, "lookup_url_kwarg", None)}:
            row = world.by_model[model.__name__]
            return str(getattr(row, getattr(view_class, "lookup_field", "pk")))
        if key in KWARGS:
            row = world.objects[KWARGS[key]]
            return str(_key_value(row, key))
        assert key in OTHER_KWARGS, f"{regex}: the walk does not know the URL keyword {key!r}; add it"
        return OTHER_KWARGS[key]

    path = "/" + _GROUP.sub(value, regex).removesuffix("$").removesuffix(r"\Z")
    path = path.replace("/?", "").replace("\\", "")
    assert resolve(path).func == entry.callback, f"{regex} filled as {path} resolves elsewhere"
    return path


def test_options_never_fails_on_any_route_for_any_caller(
    world, cast, alice_client, bob_client, key_client, read_only_client, anonymous_client
):
    """DRF answers OPTIONS with its metadata, which asks the view for a serializer: views without
    one (ART's preview protocol, the prune action) answered 500 to a caller allowed to write.
    Every route, as every kind of caller, must answer 200 or an error that is the caller's (4xx),
    or a redirect to sign in; never a server error."""
    model, run = services.client_model_register(
        team=cast.alpha, entity=None, project="math", name="client", base_model=world.setup.base.name
    )
    job = TrainingJob.objects.create(model=model, run=run)
    world.by_model = {
        **{world.objects[name]._meta.object_name: world.objects[name] for name in PK_OF_MODEL.values()},
        "TrainingJob": job,
        "ScenarioJob": world.scenario_job,
    }
    callers = {"owner session": alice_client, "viewer session": bob_client, "read-write key": key_client,
               "read-only key": read_only_client, "anonymous": anonymous_client}  # fmt: skip
    for client in callers.values():
        client.raise_request_exception = False  # a 500 is collected, not raised on the first one
    patterns = every_pattern(get_resolver().url_patterns)
    problems = []
    for regex, entry in patterns:
        path = _path_of(world, regex, entry)
        for who, client in callers.items():
            status = client.options(path).status_code
            if status >= 500:
                problems.append(f"{who} OPTIONS {path} → {status}")
    assert not problems, "\n".join(problems)
    assert len(patterns) > 250, "the walk reached too few routes to mean anything"
