"""A client run's page (ART, Tinker) counts the steps its client made, never "0 / 0" (it plans no
step count), and a member can stop it from there while it runs (a viewer cannot)."""

from __future__ import annotations

import pytest
from django.test import Client

from projects import services
from projects.models import Run, RunStatus

pytestmark = pytest.mark.django_db


@pytest.fixture
def tinker_run(cast) -> Run:
    services.base_model_register(name="tiny", source="/nowhere")
    session = services.tinker_session_create(team=cast.alpha, project=None, tags=[], user_metadata=None,
                                             sdk_version="0.38.0")  # fmt: skip
    return services.tinker_model_create(
        session=session, model_seq_id=0, base_model="tiny", lora_config={}
    ).run


def _page(user) -> Client:
    page = Client()
    page.force_login(user)
    return page


def test_a_client_run_without_steps_never_shows_zero_of_zero(cast, tinker_run):
    page = _page(cast.alice)
    listing = page.get(f"/projects/{tinker_run.project_id}/").content.decode()
    assert "0 / 0" not in listing and "<td>0 steps</td>" in listing
    detail = page.get(f"/runs/{tinker_run.pk}/").content.decode()
    assert "Step 0/0" not in detail and "Step 0 (0 steps made by its client)" in detail
    assert 'aria-label="Steps done"' not in detail  # no progress bar towards a planned count


def test_a_member_stops_a_client_run_from_its_page_and_a_viewer_cannot(cast, tinker_run):
    viewer = _page(cast.bob)
    assert "Stop run" not in viewer.get(f"/runs/{tinker_run.pk}/").content.decode()
    assert viewer.post(f"/runs/{tinker_run.pk}/cancel").status_code == 403
    member = _page(cast.alice)
    detail = member.get(f"/runs/{tinker_run.pk}/").content.decode()
    assert "Stop run" in detail and "Cancel run" not in detail
    response = member.post(f"/runs/{tinker_run.pk}/cancel", follow=True)
    assert "Run stopped." in response.content.decode()
    assert Run.objects.get(pk=tinker_run.pk).status == RunStatus.CANCELLED
    assert "Stop run" not in member.get(f"/runs/{tinker_run.pk}/").content.decode()
