"""The compare page: 2 to 5 of the team's runs, their reward, loss, KL and validation reward as one
line per run on shared axes (the run page's series, unmeasured as gaps), and a config diff that
marks only the rows that differ; another team's run is a 404."""

from __future__ import annotations

import json

import pytest

from projects import services
from projects.models import Evaluation, Run, RunStatus, StepMetrics
from tests.frontend.test_views import client_for

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _no_enqueue(monkeypatch):
    monkeypatch.setattr(services.runs, "_enqueue_run", lambda run_id: None)


def make_run(setup, user, **config):
    """A finished run (a model has one active run at a time)."""
    run = services.run_create(
        model=setup.model, task_set=setup.task_set, environment=setup.environment, reward=setup.reward,
        config={"steps": 3, **config}, created_by=user,
    )  # fmt: skip
    Run.objects.filter(pk=run.pk).update(status=RunStatus.SUCCEEDED)
    run.refresh_from_db()
    return run


def record(run, step, reward_mean, **metrics):
    StepMetrics.objects.create(
        run=run, step=step, reward_mean=reward_mean, reward_std=0.1,
        metrics={"loss": 0.5, "kl": 0.01, "trainable_tokens": 10.0, **metrics},
    )  # fmt: skip


def compare(client, *ids, **extra):
    return client.get("/runs/compare", {"ids": ",".join(str(i) for i in ids), **extra})


def test_series_are_one_dataset_per_run_on_each_runs_steps(cast, alpha_setup):
    first = make_run(alpha_setup, cast.alice, kl_coef=0.1, learning_rate=1e-5)
    second = make_run(alpha_setup, cast.alice, kl_coef=0.0, learning_rate=2e-5)
    for step, reward in ((1, 0.2), (2, 0.4)):
        record(first, step, reward, loss=step / 10)
    record(second, 1, 0.9, loss=0.0, trainable_tokens=0.0)  # no update: loss not measured
    Evaluation.objects.create(
        project=alpha_setup.project, run=first, step=2, task_set=alpha_setup.task_set,
        environment=alpha_setup.environment, reward=alpha_setup.reward, status="succeeded",
        results={"n": 4, "reward_mean": 0.75},
    )  # fmt: skip
    page = compare(client_for(cast.alice), first.pk, second.pk)
    assert page.status_code == 200
    series = {chart["key"]: chart for chart in page.context["series"]}
    assert list(series) == ["reward", "loss", "kl", "validation"]
    reward = series["reward"]["datasets"]
    assert [d["run"] for d in reward] == [first.pk, second.pk]
    assert reward[0]["points"] == [{"x": 1, "y": 0.2}, {"x": 2, "y": 0.4}]
    assert reward[1]["points"] == [{"x": 1, "y": 0.9}]
    assert series["loss"]["datasets"][0]["points"] == [{"x": 1, "y": 0.1}, {"x": 2, "y": 0.2}]
    assert series["loss"]["datasets"][1]["points"] == [{"x": 1, "y": None}]
    # KL with kl_coef 0 is not measured: no values for that run, and the run page's note names it.
    kl = series["kl"]
    assert kl["datasets"][1]["measured"] is False and not kl["not_measured"]
    assert any("kl_coef is 0" in note for label, note in kl["notes"] if label.startswith(f"#{second.pk}"))
    assert series["validation"]["datasets"][0]["points"] == [{"x": 2, "y": 0.75}]
    assert series["validation"]["datasets"][1]["points"] == []
    html = page.content.decode()
    embedded = json.loads(html.split('id="compare-data" type="application/json">')[1].split("</script>")[0])
    assert [chart["key"] for chart in embedded] == ["reward", "loss", "kl", "validation"]
    for key in ("reward", "loss", "kl", "validation"):
        assert f'id="chart-{key}"' in html


def test_config_diff_marks_only_the_keys_that_differ(cast, alpha_setup):
    first = make_run(alpha_setup, cast.alice, learning_rate=1e-5, group_size=4)
    second = make_run(alpha_setup, cast.alice, learning_rate=3e-5, group_size=4)
    page = compare(client_for(cast.alice), first.pk, second.pk)
    rows = {row["key"]: row for row in page.context["rows"]}
    assert {key for key, row in rows.items() if row["differs"]} == {"learning_rate"}
    assert rows["learning_rate"]["values"] == ["1e-05", "3e-05"]
    assert rows["group_size"]["differs"] is False and rows["base model"]["values"] == ["tiny", "tiny"]
    assert rows["reward"]["values"] == [f"exact v{alpha_setup.reward.version}"] * 2
    html = page.content.decode()
    assert html.count('data-differs="1"') == 1
    assert 'data-key="learning_rate" class="differs"' in html


def test_another_teams_run_is_a_404_and_the_count_is_checked(cast, alpha_setup):
    from tests import factories

    mine = make_run(alpha_setup, cast.alice)
    other_project = factories.ProjectFactory(team=cast.beta, name="other")
    theirs = services.run_create(
        model=factories.TrainableModelFactory(project=other_project, name="m", base_model=alpha_setup.base),
        task_set=factories.TaskSetFactory(project=other_project, name="t"),
        environment=factories.EnvironmentFactory(project=other_project, name="e"),
        reward=factories.RewardDefinitionFactory(project=other_project, name="r"),
        config={"steps": 1}, created_by=cast.charlie,
    )  # fmt: skip
    alice = client_for(cast.alice)
    assert compare(alice, mine.pk, theirs.pk).status_code == 404
    assert compare(client_for(cast.charlie), mine.pk, theirs.pk).status_code == 404
    one = compare(alice, mine.pk)
    assert one.status_code == 400 and "Pick 2 to 5 runs to compare (1 run chosen)" in one.content.decode()
    six = [make_run(alpha_setup, cast.alice).pk for _ in range(5)] + [mine.pk]
    assert "(6 runs chosen)" in compare(alice, *six).content.decode()
    assert compare(alice, "x", mine.pk).status_code == 400
    # The runs list's checkboxes send ids repeated; the viewer reads the page too.
    second = make_run(alpha_setup, cast.alice)
    repeated = client_for(cast.bob).get("/runs/compare", {"ids": [mine.pk, second.pk]})
    assert repeated.status_code == 200 and [r.pk for r in repeated.context["runs"]] == [mine.pk, second.pk]


def test_runs_list_has_a_checkbox_per_run_and_a_compare_button(cast, alpha_setup):
    run = make_run(alpha_setup, cast.alice)
    html = client_for(cast.alice).get("/runs/").content.decode()
    assert 'id="compare-form"' in html and 'action="/runs/compare"' in html
    assert f'name="ids" value="{run.pk}" form="compare-form"' in html


def test_the_page_without_a_choice_says_what_to_do(cast):
    page = client_for(cast.alice).get("/runs/compare")
    assert page.status_code == 200 and "Pick 2 to 5 runs to compare (0 runs chosen)" in page.content.decode()
