"""Sinks in the control plane that request data or a stored row reaches, each tried with its
obvious abuse (issue 22's sink review; the table is in the review's report). Sinks already tried
elsewhere are cited there, not repeated here: tenancy (test_tenancy_walk.py), hostile JSON and
oversized bodies (api/test_hostile_input.py), outbound URLs (api/test_outbound_api.py), storage
keys (test_storage.py), the training core's own sinks (tests/training/test_sinks.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from django.core.exceptions import ValidationError

from projects import services
from projects.gateway.errors import GatewayError
from projects.gateway.views import _parse
from projects.gateway.vllm import request_body
from projects.models import Checkpoint, Project, RunEvent, Trajectory, WebhookDelivery
from projects.models.base import slug_validator
from projects.services import webhooks
from projects.storage import LocalCheckpointStore, StorageError
from projects.storage.base import folder_digest
from tests import factories
from tests.conftest import REWARD_SPEC

pytestmark = pytest.mark.django_db

# --- templates: a team's text is shown, never run --------------------------------------------------

SCRIPT = "<script>alert(22)</script>"
ESCAPED_SCRIPT = "&lt;script&gt;alert(22)&lt;/script&gt;"
ATTRIBUTE = '"><img src=x onerror=alert(23)>'
HOSTILE = f"{SCRIPT} {ATTRIBUTE}"


@pytest.fixture
def _no_enqueue(monkeypatch):
    monkeypatch.setattr(services.runs, "_enqueue_run", lambda run_id: None)


def test_the_dashboard_escapes_every_users_text_it_shows(alice_client, cast, _no_enqueue):
    project = factories.ProjectFactory(team=cast.alpha, name="xss", description=HOSTILE)
    base = factories.BaseModelFactory(name="tiny-xss")
    model = factories.TrainableModelFactory(project=project, name="agent", base_model=base)
    task_set = factories.TaskSetFactory(
        project=project,
        name="rows",
        rows=[{"prompt": HOSTILE, "item": {"answer": HOSTILE}}],
        validation_fraction=0,
    )
    environment = factories.EnvironmentFactory(project=project, name="env", system_prompt=HOSTILE)
    reward = factories.RewardDefinitionFactory(
        project=project, name="exact", spec={**REWARD_SPEC, "reference": HOSTILE}
    )
    run = services.run_create(model=model, task_set=task_set, environment=environment, reward=reward,
                              config={"steps": 1}, created_by=cast.alice)  # fmt: skip
    RunEvent.objects.create(run=run, message=HOSTILE, data={})
    Trajectory.objects.create(
        run=run, step=1, group_index=0, sample_index=0, task_row_index=0, reward=0.0,
        messages=[
            {"role": "user", "content": HOSTILE},
            {"role": "assistant", "content": HOSTILE, "tool_calls": [
                {"id": "c0", "type": "function", "function": {"name": HOSTILE, "arguments": json.dumps({"q": HOSTILE})}}
            ]},
        ],
    )  # fmt: skip
    endpoint = webhooks.webhook_endpoint_create(
        team=cast.alpha, name="hook", url="http://127.0.0.1:9/h", events=["*"]
    ).endpoint
    WebhookDelivery.objects.create(endpoint=endpoint, event_id="evt_1", event_type="run.failed", payload={},
                                   status="failed", attempts=1, error=HOSTILE)  # fmt: skip
    pages = [
        f"/projects/{project.pk}/",
        f"/task-sets/{task_set.pk}/",
        f"/rewards/{reward.pk}/",
        f"/runs/{run.pk}/",
        f"/runs/{run.pk}/trajectories?step=1",
        f"/team/webhooks/{endpoint.pk}/",
    ]
    for page in pages:
        response = alice_client.get(page, HTTP_X_TEAM="alpha")
        assert response.status_code == 200, page
        html = response.content.decode()
        assert ESCAPED_SCRIPT in html, f"{page} does not show the text at all"
        assert SCRIPT not in html and "<img src=x" not in html, f"{page} renders a team's text as HTML"


OWN_SCRIPTS = sorted((Path(__file__).resolve().parents[2] / "frontend" / "static" / "frontend").glob("*.js"))
HTML_SINKS = (
    "innerHTML",
    "outerHTML",
    "insertAdjacentHTML",
    "document.write",
    "eval(",
    "new Function",
    "Function(",
)


def test_the_dashboards_scripts_build_no_html_from_strings():
    """Our scripts put JSON answers on the page as text (textContent), never parse them as HTML."""
    assert OWN_SCRIPTS, "no scripts found"
    found = [
        f"{path.name}: {sink}" for path in OWN_SCRIPTS for sink in HTML_SINKS if sink in path.read_text()
    ]
    assert found == []


def test_htmx_never_evaluates_or_runs_scripts_from_a_swapped_page(alice_client):
    html = alice_client.get("/projects/", HTTP_X_TEAM="alpha").content.decode()
    config = json.loads(html.split('name="htmx-config" content=\'', 1)[1].split("'", 1)[0])
    assert config["allowEval"] is False and config["allowScriptTags"] is False


# --- SQL: field names never come from a query string -------------------------------------------------


@pytest.mark.parametrize(
    ("path", "group_by"),
    [
        ("/api/v1/usage", "api_key__hash"),
        ("/api/v1/usage", "day,api_key__team__name"),
        ("/api/v1/usage", "id"),
        ("/api/v1/costs", "run__created_by__password"),
        ("/api/v1/costs", "model,cost_model_id"),
    ],
)
def test_group_by_never_names_a_column_outside_its_list(key_client, path, group_by):
    response = key_client.get(path, {"group_by": group_by})
    assert response.status_code == 400, response.content[:300]
    assert response.json()["error"]["param"] == "group_by"


def test_lists_ignore_ordering_parameters_naming_fields(key_client, cast):
    for name in ("bravo", "alpha", "charlie"):
        factories.ProjectFactory(team=cast.alpha, name=name)
    plain = [p["id"] for p in key_client.get("/api/v1/projects/").json()["data"]]
    for query in (
        {"ordering": "-name"},
        {"order_by": "-id"},
        {"ordering": "team__apikeys__hash"},
        {"sort": "-name"},
    ):
        response = key_client.get("/api/v1/projects/", query)
        assert response.status_code == 200, (query, response.content[:300])
        assert [p["id"] for p in response.json()["data"]] == plain, query


# --- paths: a checkpoint row never makes us delete outside the checkpoint folder -----------------------


@pytest.fixture
def checkpoint_root(settings, tmp_path) -> Path:
    root = tmp_path / "checkpoints"
    root.mkdir()
    settings.CHECKPOINT_DIR = root
    settings.STORAGE_BACKEND = "local"
    return root


def _folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_model.safetensors").write_bytes(b"weights")
    return path


def test_a_legacy_checkpoint_path_outside_the_checkpoint_folder_is_never_deleted(
    key_client, alpha_setup, checkpoint_root, tmp_path, django_capture_on_commit_callbacks
):
    outside = tmp_path / "elsewhere"
    (checkpoint_root / "model-990").symlink_to(_folder(outside / "linked").parent, target_is_directory=True)
    victims = {
        "absolute": _folder(outside / "absolute"),
        "dotdot": _folder(outside / "dotdot"),
        "symlinked parent": outside / "linked",
    }
    paths = {
        "absolute": str(victims["absolute"]),
        "dotdot": f"{checkpoint_root}/model-1/../../elsewhere/dotdot",
        "symlinked parent": str(checkpoint_root / "model-990" / "linked"),
        "inside": str(_folder(checkpoint_root / f"model-{alpha_setup.model.pk}" / "step-000004")),
    }
    rows = {
        what: factories.CheckpointFactory(model=alpha_setup.model, step=step, path=path)
        for step, (what, path) in enumerate(paths.items(), start=1)
    }
    factories.CheckpointFactory(model=alpha_setup.model, step=9, path="")  # the latest stays
    for what, row in rows.items():
        with django_capture_on_commit_callbacks(execute=True):
            response = key_client.delete(f"/api/v1/checkpoints/{row.pk}/")
        assert response.status_code == 204, (what, response.content[:300])
        assert not Checkpoint.objects.filter(pk=row.pk).exists()
    for what, victim in victims.items():
        assert (victim / "adapter_model.safetensors").is_file(), f"{what}: a folder outside was deleted"
    assert not Path(paths["inside"]).exists()  # the control: a path inside is deleted


def test_a_symlink_in_a_checkpoint_folder_is_never_stored_or_served(tmp_path):
    """A link would smuggle a file from elsewhere into a stored (and downloadable) checkpoint."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("SECRET_KEY=hunter2")
    linked_file = _folder(tmp_path / "file-link")
    (linked_file / "adapter_config.json").symlink_to(outside / "secret.txt")
    linked_folder = _folder(tmp_path / "folder-link")
    (linked_folder / "nested").symlink_to(outside, target_is_directory=True)
    store = LocalCheckpointStore(tmp_path / "store")
    for key, folder in (("model-1/step-000001", linked_file), ("model-1/step-000002", linked_folder)):
        # The digest the folder would have if its links were followed (the secret copied in).
        followed = shutil.copytree(folder, tmp_path / f"followed-{key.replace('/', '-')}", symlinks=False)
        with pytest.raises(StorageError, match="only plain files"):
            folder_digest(folder)
        with pytest.raises(StorageError, match="only plain files"):
            store.put_dir(key, folder)
        with pytest.raises(StorageError):
            store.fetch_dir(key, sha256=folder_digest(followed).sha256)


# --- what reaches vLLM: only the parameters the gateway validated ----------------------------------------


@pytest.mark.parametrize("name", ["chat_template", "logits_processors", "guided_json"])
def test_the_gateway_refuses_engine_parameters_before_any_upstream(name):
    raw = json.dumps({"model": "p/m:1", "messages": [{"role": "user", "content": "hi"}], name: "{{ 7*7 }}"})
    with pytest.raises(GatewayError) as caught:
        _parse(raw.encode())
    assert (caught.value.status, caught.value.code, caught.value.param) == (400, "unknown_parameter", name)


def test_the_body_forwarded_to_vllm_holds_only_validated_parameters():
    parsed = _parse(json.dumps({"model": "p/m:1", "messages": [{"role": "user", "content": "hi"}],
                                "stream": True, "metadata": {"a": "b"}}).encode())  # fmt: skip
    forwarded = json.loads(request_body(parsed.decoded, model="model-1-step-1"))
    assert forwarded["model"] == "model-1-step-1"
    assert set(forwarded) <= {"model", "messages", "stream", "stream_options", "metadata", "return_token_ids"}


# --- redirects: a login never sends the browser off the site --------------------------------------------


@pytest.mark.parametrize(
    "target", ["https://evil.example/", "//evil.example/", "/\\evil.example", "javascript:alert(1)"]
)
def test_login_never_redirects_off_the_site(client, cast, target):
    response = client.post(f"/login/?next={target}", {"username": "alice", "password": "pw-alice-123"})
    assert response.status_code == 302
    assert response["Location"] == "/projects/"


# --- deserialisers: the broker carries JSON only ---------------------------------------------------------


def test_the_task_queue_accepts_json_messages_only():
    from artweb.celery import app

    assert app.conf.accept_content == ["json"] and app.conf.task_serializer == "json"
    assert app.conf.result_accept_content in (None, ["json"])
    assert app.conf.event_serializer == "json"


# --- JSON a stored row holds that json.loads cannot read -------------------------------------------------


# Past the recursion limit, past int()'s 4,300-digit limit: json.loads raises, and not JSONDecodeError.
@pytest.mark.parametrize("arguments", ["[" * 5000, "1" * 5000])
def test_a_stored_tool_call_the_json_reader_cannot_hold_still_shows_in_the_viewer(
    alice_client, alpha_setup, _no_enqueue, arguments
):
    s = alpha_setup
    run = services.run_create(model=s.model, task_set=s.task_set, environment=s.environment, reward=s.reward)
    Trajectory.objects.create(run=run, step=1, group_index=0, sample_index=0, reward=0.0, messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]}])  # fmt: skip
    response = alice_client.get(f"/runs/{run.pk}/trajectories?step=1", HTTP_X_TEAM="alpha")
    assert response.status_code == 200
    assert arguments[:50] in response.content.decode()  # shown as the text it is


# --- names: "$" matches before a final newline ------------------------------------------------------------


def test_a_slug_name_cannot_end_in_a_newline(key_client, alpha_setup):
    with pytest.raises(ValidationError):
        slug_validator("math\n")
    response = key_client.post(
        "/v1/preview/models", {"project": "math\n", "name": "agent2", "base_model": "tiny"}, format="json"
    )
    assert response.status_code == 400, response.content[:300]
    assert response.json()["error"]["param"] == "project"
    assert not Project.objects.filter(name="math\n").exists()
