"""The run page's chart data (nothing unmeasured drawn as 0) and the trajectory viewer's
explanations (reference item, advantages, group mean/std, zero-variance badge, filter, keys)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from django.test import Client

from frontend.presentation import chart_data
from projects import services
from projects.models import Evaluation, Run, RunStatus, StepMetrics, TaskRow, Trajectory

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _no_enqueue(monkeypatch):
    monkeypatch.setattr(services.runs, "_enqueue_run", lambda run_id: None)


def client_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def make_run(setup, user, **config):
    return services.run_create(
        model=setup.model, task_set=setup.task_set, environment=setup.environment, reward=setup.reward,
        config={"steps": 3, **config}, created_by=user,
    )  # fmt: skip


UPDATED = {"loss": -2.4e-7, "grad_norm": 0.31, "clip_fraction": 0.0, "kl": 0.0, "trainable_tokens": 40.0}
NO_UPDATE = {
    "loss": 0.0,
    "grad_norm": 0.0,
    "entropy": 0.0,
    "clip_fraction": 0.0,
    "kl": 0.0,
    "trainable_tokens": 0.0,
}


def trajectory(run, step, group, sample, reward, *, row=0, tokens=10, sub_rewards=None):
    return Trajectory.objects.create(
        run=run, step=step, group_index=group, sample_index=sample, task_row_index=row,
        messages=[{"role": "user", "content": "Say a"}, {"role": "assistant", "content": f"answer {sample}"}],
        reward=reward, sub_rewards=sub_rewards or {}, completion_tokens=tokens,
    )  # fmt: skip


def test_chart_data_leaves_out_what_was_not_measured(cast, alpha_setup):
    run = make_run(alpha_setup, cast.alice, kl_coef=0.0, num_minibatches=1)
    StepMetrics.objects.create(
        run=run, step=1, reward_mean=0.5, reward_std=0.5, metrics={**UPDATED, "entropy": 1.2}
    )
    StepMetrics.objects.create(run=run, step=2, reward_mean=0.0, reward_std=0.0, metrics=NO_UPDATE)
    StepMetrics.objects.create(
        run=run, step=3, reward_mean=1.0, reward_std=0.0, metrics=UPDATED
    )  # no entropy
    data = client_for(cast.alice).get(f"/runs/{run.pk}/metrics.json").json()
    series = data["series"]
    assert data["steps"] == [1, 2, 3]
    # KL is not computed with kl_coef 0: no values at all, and the chart says why.
    assert series["kl"]["values"] == [None, None, None]
    assert series["kl"]["note"].startswith("Not measured") and "kl_coef" in series["kl"]["note"]
    # A step without an update measured no loss or grad norm: a gap, not a 0.
    assert series["loss"]["values"] == [-2.4e-7, None, -2.4e-7]
    assert series["grad_norm"]["values"] == [0.31, None, 0.31]
    assert "No update at step 2" in series["loss"]["note"]
    # Entropy missing from a step is missing from the chart.
    assert series["entropy"]["values"] == [1.2, None, None]
    # Clip fraction says why it stays at 0, and where the defaults' extra pass is (step 1).
    assert "One policy update per batch" in series["clip_fraction"]["note"]
    assert "Step 1 makes 2 optimizer steps per batch (early_ppo_epochs)" in series["clip_fraction"]["note"]


def test_the_clip_fraction_note_counts_the_updates_and_where_the_extra_passes_stop(cast, alpha_setup):
    run = make_run(alpha_setup, cast.alice, num_minibatches=2, early_ppo_epochs=3, early_ppo_epochs_steps=2)
    StepMetrics.objects.create(run=run, step=1, reward_mean=0.5, reward_std=0.5, metrics=UPDATED)
    note = (
        client_for(cast.alice).get(f"/runs/{run.pk}/metrics.json").json()["series"]["clip_fraction"]["note"]
    )
    assert "2 optimizer steps per batch" in note
    assert "The first 2 steps make 6 optimizer steps per batch (early_ppo_epochs)" in note


def test_a_run_continuing_a_trained_model_has_no_extra_pass_note():
    """Steps count from the base model: a run from step 12 on made no extra passes."""
    rows = [SimpleNamespace(step=step, metrics=UPDATED, reward_mean=0.5, reward_std=0.1) for step in (13, 14)]
    config = {"num_minibatches": 1, "ppo_epochs": 1, "early_ppo_epochs": 2, "early_ppo_epochs_steps": 1}
    note = chart_data(rows, config=config)["series"]["clip_fraction"]["note"]
    assert "One policy update per batch" in note and "early_ppo_epochs" not in note
    first = chart_data(
        [SimpleNamespace(step=1, metrics=UPDATED, reward_mean=0.5, reward_std=0.1)], config=config
    )
    assert "Step 1 makes 2 optimizer steps" in first["series"]["clip_fraction"]["note"]


def test_chart_data_has_completion_length_sub_rewards_and_validation(cast, alpha_setup):
    run = make_run(alpha_setup, cast.alice, kl_coef=0.1)
    StepMetrics.objects.create(
        run=run, step=1, reward_mean=0.5, reward_std=0.5, metrics={**UPDATED, "kl": 0.02}
    )
    trajectory(run, 1, 0, 0, 1.0, tokens=10, sub_rewards={"exact": 1.0, "brevity": 0.5})
    trajectory(run, 1, 0, 1, 0.0, tokens=30, sub_rewards={"exact": 0.0, "brevity": 0.25})
    for step, reward_mean in ((0, 0.2), (1, 0.6)):
        Evaluation.objects.create(
            project=alpha_setup.project, run=run, step=step, task_set=alpha_setup.task_set,
            environment=alpha_setup.environment, reward=alpha_setup.reward, status="succeeded",
            results={"n": 4, "reward_mean": reward_mean},
        )  # fmt: skip
    data = client_for(cast.alice).get(f"/runs/{run.pk}/metrics.json").json()
    assert data["series"]["kl"]["values"] == [0.02] and data["series"]["kl"]["note"] == ""
    assert data["series"]["completion_tokens"]["values"] == [20.0]
    assert data["sub_rewards"] == {"brevity": [0.375], "exact": [0.5]}
    assert data["validation"]["steps"] == [0, 1] and data["validation"]["reward_mean"] == [0.2, 0.6]
    evaluated = {"task_set": alpha_setup.task_set.pk, "split": "validation", "rows": None, "n": 4}
    assert data["validation"]["evaluated"] == [evaluated, evaluated]


def test_chart_data_draws_the_staleness_of_an_overlapped_runs_samples(cast, alpha_setup):
    overlapped = make_run(alpha_setup, cast.alice, max_off_policy_steps=1)
    for step, behind in ((1, 0.0), (2, 1.0), (3, 1.0)):
        StepMetrics.objects.create(run=overlapped, step=step, reward_mean=0.5, reward_std=0.5,
                                   metrics={**UPDATED, "off_policy_steps": behind})  # fmt: skip
    series = client_for(cast.alice).get(f"/runs/{overlapped.pk}/metrics.json").json()["series"]
    assert series["off_policy_steps"]["values"] == [0.0, 1.0, 1.0]
    assert series["off_policy_steps"]["note"] == ""
    overlapped.status = RunStatus.SUCCEEDED
    overlapped.save(update_fields=["status"])
    synchronous = make_run(alpha_setup, cast.alice)
    StepMetrics.objects.create(run=synchronous, step=1, reward_mean=0.5, reward_std=0.5,
                               metrics={**UPDATED, "off_policy_steps": 0.0})  # fmt: skip
    series = client_for(cast.alice).get(f"/runs/{synchronous.pk}/metrics.json").json()["series"]
    assert series["off_policy_steps"]["values"] == [0.0]
    assert "Synchronous run" in series["off_policy_steps"]["note"]
    # A run without the option whose steps were sampled ahead (an ART client's PipelineTrainer).
    StepMetrics.objects.create(run=synchronous, step=2, reward_mean=0.5, reward_std=0.5,
                               metrics={**UPDATED, "off_policy_steps": 1.5})  # fmt: skip
    series = client_for(cast.alice).get(f"/runs/{synchronous.pk}/metrics.json").json()["series"]
    assert series["off_policy_steps"]["values"] == [0.0, 1.5] and series["off_policy_steps"]["note"] == ""


def test_run_page_has_a_figure_per_series_and_the_smoothing_toggle(cast, alpha_setup):
    run = make_run(alpha_setup, cast.alice)
    html = client_for(cast.alice).get(f"/runs/{run.pk}/").content.decode()
    for key in ("reward", "validation", "sub_rewards", "loss", "grad_norm", "completion_tokens", "kl"):
        assert f'id="chart-{key}"' in html, key
    assert 'id="chart-smoothing"' in html


def test_checkpoint_metrics_are_shown_by_magnitude(cast, alpha_setup):
    run = make_run(alpha_setup, cast.alice)
    checkpoint = services.checkpoint_record(
        model=alpha_setup.model, run=run, step=1, path="/tmp/none",
        metrics={"completion_tokens": 347.0, "loss": -1.3e-9, "reward_mean": 0.625},
    )  # fmt: skip
    html = client_for(cast.alice).get(f"/checkpoints/{checkpoint.pk}/").content.decode()
    assert "<dd>347</dd>" in html and "<dd>-1.3e-9</dd>" in html and "<dd>0.625</dd>" in html
    assert "347.0000" not in html and "-0.0000" not in html


def test_viewer_shows_the_reference_item_advantages_and_group_statistics(cast, alpha_setup):
    run = make_run(alpha_setup, cast.alice, scale_rewards=True)
    row = TaskRow.objects.filter(task_set=alpha_setup.task_set).order_by("index").first()
    for sample, reward in enumerate((1.0, 0.0, 0.0, 1.0)):
        trajectory(run, 1, 0, sample, reward, row=row.index)
    response = client_for(cast.alice).get(f"/runs/{run.pk}/trajectories?step=1&group=0")
    summary = response.context["summary"]
    assert (summary.mean, summary.std, summary.zero_variance) == (0.5, 0.5, False)
    # reward − mean, divided by (std + 1e-6): ±1 up to the epsilon.
    assert [round(c.advantage, 4) for c in response.context["columns"]] == [1.0, 1.0, -1.0, -1.0]
    html = response.content.decode()
    assert row.data["item"]["answer"] in html and "Reference <code>item</code>" in html
    assert "advantage +1" in html and "advantage -1" in html and "zero variance" not in html

    Run.objects.filter(pk=run.pk).update(status=RunStatus.SUCCEEDED)  # one active run per model
    unscaled = make_run(alpha_setup, cast.alice, scale_rewards=False)
    for sample, reward in enumerate((1.0, 0.0, 0.0, 0.0)):
        trajectory(unscaled, 1, 0, sample, reward)
    columns = client_for(cast.alice).get(f"/runs/{unscaled.pk}/trajectories").context["columns"]
    assert [c.advantage for c in columns] == [0.75, -0.25, -0.25, -0.25]


def test_viewer_marks_zero_variance_groups_and_filters_them_out(cast, alpha_setup):
    run = make_run(alpha_setup, cast.alice)
    for sample in range(3):
        trajectory(run, 1, 0, sample, 0.5)  # group 0: zero variance
        trajectory(run, 1, 1, sample, float(sample))  # group 1: rewards differ
        trajectory(run, 2, 0, sample, 0.0)  # step 2: nothing to learn from
    client = client_for(cast.alice)
    response = client.get(f"/runs/{run.pk}/trajectories?step=1&group=0")
    assert response.context["summary"].zero_variance
    assert all(c.advantage == 0.0 for c in response.context["columns"])
    assert "zero variance" in response.content.decode()
    filtered = client.get(f"/runs/{run.pk}/trajectories?step=1&group=0&variance=1")
    assert response.context["groups"] == [(0, True), (1, False)]  # the group menu marks flat groups
    assert "0 · zero variance</option>" in response.content.decode()
    assert filtered.context["groups"] == [(1, False)] and filtered.context["group"] == 1
    assert "zero variance" not in filtered.content.decode()
    empty = client.get(f"/runs/{run.pk}/trajectories?step=2&variance=1")
    assert empty.context["group"] is None and "taught the model nothing" in empty.content.decode()


def test_viewer_links_neighbouring_groups_and_steps_with_their_keys(cast, alpha_setup):
    run = make_run(alpha_setup, cast.alice)
    for step in (1, 2, 3):
        for group in (0, 1):
            trajectory(run, step, group, 0, 1.0)
            trajectory(run, step, group, 1, 0.0)
    response = client_for(cast.alice).get(f"/runs/{run.pk}/trajectories?step=2&group=0&variance=1")
    assert response.context["nav"] == {
        "previous_group": None,
        "next_group": "?step=2&group=1&variance=1",
        "previous_step": "?step=1&group=0&variance=1",
        "next_step": "?step=3&group=0&variance=1",
    }
    html = response.content.decode()
    assert 'data-hotkey="j"' in html and 'data-hotkey="]"' in html and 'data-hotkey="["' in html
    assert (
        "<kbd>j</kbd>" in html and "<kbd>k</kbd>" in html
    )  # the hints show even where a key has nowhere to go


def test_viewer_of_another_team_is_404(cast, alpha_setup):
    run = make_run(alpha_setup, cast.alice)
    assert client_for(cast.charlie).get(f"/runs/{run.pk}/trajectories").status_code == 404
    assert client_for(cast.charlie).get(f"/runs/{run.pk}/metrics.json").status_code == 404


def test_reward_band_range_is_the_observed_rewards_without_a_declared_one(cast, alpha_setup):
    run = make_run(alpha_setup, cast.alice)
    StepMetrics.objects.create(run=run, step=1, reward_mean=0.25, reward_std=0.43, metrics=UPDATED)
    for sample, reward in enumerate([0.0, 0.0, 0.0, 1.0]):
        trajectory(run, 1, 0, sample, reward)
    data = client_for(cast.alice).get(f"/runs/{run.pk}/metrics.json").json()
    assert data["reward_range"] == {"low": 0.0, "high": 1.0, "source": "observed"}


def test_reward_band_range_is_the_graders_declared_range(cast, alpha_setup):
    python = services.reward_definition_create(
        project=alpha_setup.project,
        name="scaled",
        spec={"type": "python", "source": "def grade(sample, item):\n    return 2.0\n", "range": [0, 10]},
    )
    run = services.run_create(
        model=alpha_setup.model, task_set=alpha_setup.task_set, environment=alpha_setup.environment,
        reward=python, config={"steps": 3}, created_by=cast.alice,
    )  # fmt: skip
    StepMetrics.objects.create(run=run, step=1, reward_mean=2.0, reward_std=0.0, metrics=UPDATED)
    trajectory(run, 1, 0, 0, 2.0)
    data = client_for(cast.alice).get(f"/runs/{run.pk}/metrics.json").json()
    assert data["reward_range"] == {"low": 0.0, "high": 10.0, "source": "declared"}


def test_reward_band_range_is_unknown_before_any_sample(cast, alpha_setup):
    run = make_run(alpha_setup, cast.alice)
    assert client_for(cast.alice).get(f"/runs/{run.pk}/metrics.json").json()["reward_range"] is None
