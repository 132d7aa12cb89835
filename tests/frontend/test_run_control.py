"""The run page's Pause, Resume and Fork buttons and the new-run form's start: members see and use
them, a viewer gets 403 and sees none, an outsider 404; a refused action comes back as the page's
message; the form's "base" and checkpoint id reach ``start_from``."""

from __future__ import annotations

import json

import pytest

from projects import services
from projects.models import Checkpoint, Run, RunStatus, TrainableModel
from tests import factories
from tests.frontend.test_views import _run_form, client_for

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _no_enqueue(monkeypatch):
    monkeypatch.setattr(services.runs, "_enqueue_run", lambda run_id: None)


@pytest.fixture
def run(alpha_setup, cast, settings, tmp_path) -> Run:
    """A running run whose model has a complete step 0 on disk."""
    settings.CHECKPOINT_DIR = tmp_path / "checkpoints"
    created = services.run_create(
        model=alpha_setup.model, task_set=alpha_setup.task_set, environment=alpha_setup.environment,
        reward=alpha_setup.reward, config={"steps": 2}, created_by=cast.alice,
    )  # fmt: skip
    folder = settings.CHECKPOINT_DIR / f"model-{alpha_setup.model.pk}" / "step-000000"
    folder.mkdir(parents=True)
    for name in ("adapter_model.safetensors", "optimizer.pt", "rng_state.pt"):
        (folder / name).write_bytes(b"x")
    (folder / "state.json").write_text(json.dumps({"step": 0}))
    services.checkpoint_record(model=alpha_setup.model, run=created, step=0, path=str(folder))
    claimed = services.run_claim(run_id=created.pk, worker="w1")
    assert claimed is not None
    return claimed


def page_messages(response) -> list[str]:
    return [str(m) for m in response.context["messages"]]


ACTIONS = [("pause", {}), ("resume", {}), ("fork", {"from_step": "0", "name": "copy"})]


@pytest.mark.parametrize(("action", "data"), ACTIONS)
def test_a_viewer_gets_403_and_an_outsider_404(cast, run, action, data):
    assert client_for(cast.bob).post(f"/runs/{run.pk}/{action}", data).status_code == 403
    assert client_for(cast.charlie).post(f"/runs/{run.pk}/{action}", data).status_code == 404
    unchanged = Run.objects.get(pk=run.pk)
    assert unchanged.status == RunStatus.RUNNING and not unchanged.pause_requested
    assert not TrainableModel.objects.filter(name="copy").exists()


def test_a_viewer_sees_no_buttons_and_a_member_sees_pause_and_fork(cast, run):
    viewer = client_for(cast.bob).get(f"/runs/{run.pk}/").content.decode()
    assert f"/runs/{run.pk}/pause" not in viewer and f"/runs/{run.pk}/fork" not in viewer
    member = client_for(cast.alice).get(f"/runs/{run.pk}/").content.decode()
    assert f'action="/runs/{run.pk}/pause"' in member and f'action="/runs/{run.pk}/fork"' in member
    assert f'action="/runs/{run.pk}/resume"' not in member


def test_pause_then_resume_from_the_run_page(cast, run):
    alice = client_for(cast.alice)
    response = alice.post(f"/runs/{run.pk}/pause", follow=True)
    assert "Pause requested: the run pauses after its current step." in page_messages(response)
    html = response.content.decode()
    assert "pausing after this step" in html and f'action="/runs/{run.pk}/pause"' not in html
    services.run_pause_finish(run_id=run.pk, worker="w1")
    html = alice.get(f"/runs/{run.pk}/").content.decode()
    assert f'action="/runs/{run.pk}/resume"' in html and f'action="/runs/{run.pk}/pause"' not in html
    response = alice.post(f"/runs/{run.pk}/resume", follow=True)
    assert "Run resumed: queued again." in page_messages(response)
    assert Run.objects.get(pk=run.pk).status == RunStatus.QUEUED


def test_a_refused_pause_is_the_pages_message(cast, run):
    Run.objects.filter(pk=run.pk).update(status=RunStatus.SUCCEEDED)
    response = client_for(cast.alice).post(f"/runs/{run.pk}/pause", follow=True)
    assert "a succeeded run cannot be paused" in page_messages(response)


def test_fork_from_the_run_page_opens_the_new_run(cast, run):
    response = client_for(cast.alice).post(
        f"/runs/{run.pk}/fork", {"from_step": "0", "name": "copy"}, follow=True
    )
    fork = Run.objects.get(model__name="copy")
    assert response.redirect_chain[-1][0] == f"/runs/{fork.pk}/"
    assert f"Forked as model copy: run {fork.pk} queued." in page_messages(response)
    assert "Starts from step 0, a copy of agent:0 (forked)" in response.content.decode()
    assert fork.forked_from == Checkpoint.objects.get(model=run.model, step=0)


@pytest.mark.parametrize(
    ("data", "text"),
    [
        ({"from_step": "7", "name": "copy"}, "from_step:"),
        ({"from_step": "0", "name": "agent"}, "already exists"),
        ({"from_step": "0", "name": ""}, "name:"),
    ],
)
def test_a_bad_fork_is_the_pages_message_and_makes_nothing(cast, run, data, text):
    response = client_for(cast.alice).post(f"/runs/{run.pk}/fork", data, follow=True)
    assert response.redirect_chain[-1][0] == f"/runs/{run.pk}/"
    (message,) = page_messages(response)
    assert message.startswith("Fork not made:") and text in message
    assert TrainableModel.objects.filter(project=run.project).count() == 1


def test_the_new_run_form_passes_start_from(cast, alpha_setup):
    alice = client_for(cast.alice)
    url = f"/projects/{alpha_setup.project.pk}/runs/new"
    done = Run.objects.create(
        project=alpha_setup.project, model=alpha_setup.model, task_set=alpha_setup.task_set,
        environment=alpha_setup.environment, reward=alpha_setup.reward, config={}, status="succeeded",
    )  # fmt: skip
    old = factories.CheckpointFactory(model=alpha_setup.model, run=done, step=0)
    latest = factories.CheckpointFactory(model=alpha_setup.model, run=done, step=2)

    refused = alice.post(url, _run_form(alpha_setup, start_from="base"))
    assert refused.status_code == 200
    assert any("has trained to checkpoint step 2" in e for e in refused.context["form"].errors["start_from"])
    refused = alice.post(url, _run_form(alpha_setup, start_checkpoint=str(old.pk)))
    assert any("whose latest is step 2" in e for e in refused.context["form"].errors["start_from"])
    assert not Run.objects.exclude(pk=done.pk).exists()

    created = alice.post(url, _run_form(alpha_setup, start_checkpoint=str(latest.pk)))
    assert created.status_code == 302
    run = Run.objects.exclude(pk=done.pk).get()
    assert run.start_step == 2
    assert "Will continue from checkpoint step 2" in alice.get(f"/runs/{run.pk}/").content.decode()
