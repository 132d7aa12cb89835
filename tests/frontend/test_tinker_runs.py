"""A Tinker SDK training client in the dashboard: a run of kind tinker whose optim_steps are its
steps (loss charted), with its device seconds on the cost line and no cancel button (its client
drives it)."""

from __future__ import annotations

import pytest
from django.test import Client

from projects import services

pytestmark = pytest.mark.django_db


def test_a_tinker_client_shows_as_a_run_with_steps_and_cost(cast):
    services.base_model_register(name="tiny", source="/nowhere")
    session = services.tinker_session_create(team=cast.alpha, project=None, tags=[], user_metadata=None,
                                             sdk_version="0.38.0")  # fmt: skip
    tinker = services.tinker_model_create(session=session, model_seq_id=0, base_model="tiny",
                                          lora_config={"rank": 4})  # fmt: skip
    for step, loss in ((1, 2.5), (2, 1.5)):
        services.tinker_loss_add(model=tinker, loss=loss)
        services.tinker_step_record(model=tinker, step=step, metrics={"grad_norm": 0.5, "learning_rate": 1e-3},
                                    seconds=1800.0)  # fmt: skip
    page = Client()
    page.force_login(cast.bob)  # a viewer of the team
    listing = page.get(f"/projects/{session.project.pk}/").content.decode()
    assert f"/runs/{tinker.run.pk}/" in listing and ">tinker<" in listing
    detail = page.get(f"/runs/{tinker.run.pk}/").content.decode()
    assert "tinker run" in detail and "Cancel run" not in detail
    start = detail.index('class="cost-line"')
    assert "Cost</strong> 1 device-hours" in " ".join(detail[start : detail.index("</p>", start)].split())
    metrics = page.get(f"/runs/{tinker.run.pk}/metrics.json").json()
    assert metrics["steps"] == [1, 2] and metrics["series"]["loss"]["values"] == [2.5, 1.5]
    outsider = Client()
    outsider.force_login(cast.charlie)
    assert outsider.get(f"/runs/{tinker.run.pk}/").status_code == 404
