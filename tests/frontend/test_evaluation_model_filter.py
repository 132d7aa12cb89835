"""The New evaluation form narrowed by model: ``?model=<id>`` offers only that model's checkpoints
(and its base model) as the model to evaluate, the reference stays any; another team's model is a
404; the select asks htmx for just the field."""

from __future__ import annotations

import pytest

from projects import services
from tests import factories
from tests.frontend.test_views import client_for

pytestmark = pytest.mark.django_db


def subject_values(response) -> set[str]:
    return {
        value for _, options in response.context["form"].fields["subject"].choices for value, _ in options
    }


def test_the_model_select_narrows_the_checkpoints_to_that_model(cast, alpha_setup):
    other_base = factories.BaseModelFactory(name="other-base")
    other = factories.TrainableModelFactory(project=alpha_setup.project, name="other", base_model=other_base)
    mine = [
        services.checkpoint_record(
            model=alpha_setup.model, run=None, step=step, path=f"/tmp/a{step}", metrics={}
        )
        for step in (1, 2)
    ]
    theirs = services.checkpoint_record(model=other, run=None, step=1, path="/tmp/o1", metrics={})
    client = client_for(cast.alice)
    everything = client.get("/evaluations/new")
    assert {f"checkpoint:{c.pk}" for c in (*mine, theirs)} <= subject_values(everything)
    page = client.get("/evaluations/new", {"model": alpha_setup.model.pk})
    assert subject_values(page) == {f"checkpoint:{c.pk}" for c in mine} | {f"base:{alpha_setup.base.pk}"}
    reference = {
        value for group in page.context["form"].fields["reference"].choices for value in _values(group)
    }
    assert f"checkpoint:{theirs.pk}" in reference  # compare against any model
    html = page.content.decode()
    assert 'hx-get="/evaluations/new"' in html and 'hx-select="#evaluation-subject"' in html
    assert f'<option value="{alpha_setup.model.pk}" selected>' in html
    assert 'id="evaluation-subject"' in html
    assert (
        client_for(cast.charlie).get("/evaluations/new", {"model": alpha_setup.model.pk}).status_code == 404
    )


def _values(group):
    value, label = group
    return [v for v, _ in label] if isinstance(label, list | tuple) else [value]
