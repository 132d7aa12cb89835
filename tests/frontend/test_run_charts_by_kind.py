"""A run page draws only the charts and notes of its kind: no SFT/DPO panels on a GRPO run, no
GRPO notes (early_ppo_epochs' extra optimizer steps) on ART or SFT runs, no validation chart on a
client run (it never evaluates), a Tinker run only what its optim_steps measure; and an SFT run's
held-out loss chart starts at its held-out figure before training."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from django.test import Client

from frontend.presentation import chart_data
from projects import services
from projects.models import Run, RunKind, StepMetrics

pytestmark = pytest.mark.django_db

GRPO_DEFAULTS = {"num_minibatches": 1, "ppo_epochs": 1, "early_ppo_epochs": 2, "early_ppo_epochs_steps": 1}
UPDATED = {"loss": 0.5, "grad_norm": 0.3, "clip_fraction": 0.0, "trainable_tokens": 40.0}


@pytest.fixture(autouse=True)
def _no_enqueue(monkeypatch):
    monkeypatch.setattr(services.runs, "_enqueue_run", lambda run_id: None)


def _rows(*steps: int, **extra: float) -> list[SimpleNamespace]:
    return [
        SimpleNamespace(step=s, metrics={**UPDATED, **extra}, reward_mean=0.5, reward_std=0.1) for s in steps
    ]


def _page(user) -> Client:
    page = Client()
    page.force_login(user)
    return page


def test_grpo_notes_are_for_grpo_runs_only():
    grpo = chart_data(_rows(1), config=GRPO_DEFAULTS, kind="platform")["series"]
    assert "2 optimizer steps per batch" in grpo["clip_fraction"]["note"]
    art = chart_data(_rows(1), config=GRPO_DEFAULTS, kind="client")["series"]
    assert "optimizer steps per batch" not in art["clip_fraction"]["note"]
    sft = chart_data(_rows(1), config=GRPO_DEFAULTS, kind="sft")["series"]
    assert "clip_fraction" not in sft and "kl" not in sft
    assert "optimizer steps per batch" not in " ".join(entry["note"] for entry in sft.values())


def test_a_grpo_run_page_has_no_sft_or_dpo_panels(cast, alpha_setup):
    run = services.run_create(model=alpha_setup.model, task_set=alpha_setup.task_set,
                              environment=alpha_setup.environment, reward=alpha_setup.reward,
                              config={"steps": 3})  # fmt: skip
    StepMetrics.objects.create(run=run, step=1, reward_mean=0.5, reward_std=0.1, metrics=UPDATED)
    page = _page(cast.alice)
    html = page.get(f"/runs/{run.pk}/").content.decode()
    assert 'id="chart-loss"' in html and 'id="chart-validation"' in html
    assert 'id="chart-heldout_loss"' not in html and 'id="chart-heldout_preference_accuracy"' not in html
    series = page.get(f"/runs/{run.pk}/metrics.json").json()["series"]
    assert "heldout_loss" not in series and "loss" in series


def test_a_tinker_run_page_shows_what_its_optim_steps_measure_and_no_validation(cast):
    services.base_model_register(name="tiny", source="/nowhere")
    session = services.tinker_session_create(team=cast.alpha, project=None, tags=[], user_metadata=None,
                                             sdk_version="0.38.0")  # fmt: skip
    tinker = services.tinker_model_create(session=session, model_seq_id=0, base_model="tiny", lora_config={})
    services.tinker_step_record(model=tinker, step=1, metrics={"grad_norm": 0.5, "learning_rate": 1e-3},
                                seconds=1.0)  # fmt: skip
    page = _page(cast.alice)
    html = page.get(f"/runs/{tinker.run.pk}/").content.decode()
    figures = {key for key in ("reward", "validation", "sub_rewards", "kl", "entropy", "clip_fraction",
                               "zero_variance_fraction", "heldout_loss", "loss", "grad_norm", "learning_rate")
               if f'id="chart-{key}"' in html}  # fmt: skip
    assert figures == {"loss", "grad_norm", "learning_rate"}
    series = page.get(f"/runs/{tinker.run.pk}/metrics.json").json()["series"]
    assert not [key for key, entry in series.items() if entry["note"].startswith("Not measured")]


def test_an_art_client_run_has_no_validation_chart(cast):
    services.base_model_register(name="tiny", source="/nowhere")
    _, run = services.client_model_register(
        team=cast.alpha, entity=None, project="math", name="agent", base_model="tiny"
    )
    html = _page(cast.alice).get(f"/runs/{run.pk}/").content.decode()
    assert 'id="chart-validation"' not in html and "evaluates its validation rows" not in html
    assert 'id="chart-reward"' in html


def test_the_sft_held_out_loss_chart_starts_before_training(cast, alpha_setup):
    run = services.run_create(model=alpha_setup.model, task_set=alpha_setup.task_set,
                              environment=alpha_setup.environment, reward=alpha_setup.reward,
                              config={"steps": 2})  # fmt: skip
    Run.objects.filter(pk=run.pk).update(kind=RunKind.SFT)
    services.run_event_add(run=run, message="Held-out before training: loss 2.5",
                           data={"step": 0, "heldout_loss": 2.5})  # fmt: skip
    StepMetrics.objects.create(run=run, step=1, metrics={"loss": 2.0, "trainable_tokens": 9.0})
    StepMetrics.objects.create(
        run=run, step=2, metrics={"loss": 1.5, "heldout_loss": 1.8, "trainable_tokens": 9.0}
    )
    data = _page(cast.alice).get(f"/runs/{run.pk}/metrics.json").json()
    assert data["steps"] == [0, 1, 2]
    assert data["series"]["heldout_loss"]["values"] == [2.5, None, 1.8]
    assert data["series"]["loss"]["values"] == [None, 2.0, 1.5]
    assert len(data["reward_mean"]) == 3
