"""A model's checkpoints page: the disk each checkpoint takes and who uses it, delete one (one in
use is refused with the reason), and prune by a retention policy only after a preview that still
holds; problems are shown at the field the service names; viewers read only."""

from __future__ import annotations

import pytest

from projects.models import Checkpoint
from tests import factories
from tests.frontend.test_views import client_for

pytestmark = pytest.mark.django_db


def steps_of(model) -> list[int]:
    return sorted(Checkpoint.objects.filter(model=model).values_list("step", flat=True))


@pytest.fixture
def checkpoints(alpha_setup):
    """Steps 0..3 without files, each with a reward_mean and a recorded size."""
    for step in range(4):
        checkpoint = factories.CheckpointFactory(
            model=alpha_setup.model, step=step, metrics={"reward_mean": step / 10}
        )
        Checkpoint.objects.filter(pk=checkpoint.pk).update(size_bytes=1000 * (step + 1))
    return alpha_setup.model


def page_url(model) -> str:
    return f"/models/{model.pk}/checkpoints"


def test_the_page_lists_sizes_and_why_the_latest_stays(cast, checkpoints):
    response = client_for(cast.alice).get(page_url(checkpoints))
    rows = response.context["rows"]
    assert [(r["checkpoint"].step, r["bytes"]) for r in rows] == [(3, 4000), (2, 3000), (1, 2000), (0, 1000)]
    assert "latest checkpoint" in rows[0]["in_use"] and not rows[1]["in_use"]
    assert "reward_mean" in response.context["metric_names"]
    html = response.content.decode()
    assert html.count('class="danger small"') == 3  # no Delete button on the latest


def test_preview_deletes_nothing_and_prune_deletes_what_it_showed(cast, checkpoints):
    client = client_for(cast.alice)
    policy = {
        "keep_last": "1",
        "keep_best_metric": "reward_mean",
        "keep_best_n": "1",
        "keep_best_mode": "min",
    }
    preview = client.post(page_url(checkpoints), {**policy, "action": "preview"}).context["preview"]
    assert preview["deleted"] == [(1, 2000), (2, 3000)] and preview["freed_bytes"] == 5000
    assert steps_of(checkpoints) == [0, 1, 2, 3]
    pruned = client.post(
        page_url(checkpoints), {**policy, "action": "prune", "previewed": "1,2"}, follow=True
    )
    assert steps_of(checkpoints) == [0, 3]
    messages = [str(m) for m in pruned.context["messages"]]
    assert messages == ["Deleted steps 1, 2; 4.9\xa0KB freed."], messages


def test_a_prune_whose_preview_no_longer_holds_deletes_nothing(cast, checkpoints):
    client = client_for(cast.alice)
    # Previewed when only step 0 would go; a new step since then makes it steps 0 and 1.
    response = client.post(page_url(checkpoints), {"keep_last": "2", "action": "prune", "previewed": "0"})
    assert response.status_code == 200 and response.context["changed"]
    assert response.context["preview"]["previewed"] == "0,1"
    assert steps_of(checkpoints) == [0, 1, 2, 3]


def test_a_policy_problem_is_shown_at_its_field(cast, checkpoints):
    client = client_for(cast.alice)
    no_n = client.post(page_url(checkpoints), {"keep_best_metric": "reward_mean", "action": "preview"})
    assert no_n.context["form"].errors["keep_best_n"] == ["must be an integer"]
    nothing = client.post(page_url(checkpoints), {"action": "preview"})
    assert nothing.context["form"].errors["keep_last"] == ["give keep_last or keep_best"]
    negative = client.post(page_url(checkpoints), {"keep_last": "-1", "action": "preview"})
    assert "between 0 and" in negative.context["form"].errors["keep_last"][0]
    assert steps_of(checkpoints) == [0, 1, 2, 3]


def test_deleting_one_in_use_is_refused_with_the_reason(cast, checkpoints):
    client = client_for(cast.alice)
    latest = Checkpoint.objects.get(model=checkpoints, step=3)
    refused = client.post(f"/checkpoints/{latest.pk}/delete", follow=True)
    (message,) = [str(m) for m in refused.context["messages"]]
    assert "checkpoint step 3 cannot be deleted: it is the model's latest checkpoint" in message
    older = Checkpoint.objects.get(model=checkpoints, step=1)
    deleted = client.post(f"/checkpoints/{older.pk}/delete", follow=True)
    assert [str(m) for m in deleted.context["messages"]] == ["Deleted step 1; 2.0\xa0KB freed."]
    assert steps_of(checkpoints) == [0, 2, 3]


def test_viewers_read_but_cannot_prune_or_delete(cast, checkpoints):
    bob = client_for(cast.bob)  # alpha's viewer
    page = bob.get(page_url(checkpoints))
    assert page.status_code == 200 and "retention-form" not in page.content.decode()
    assert bob.post(page_url(checkpoints), {"keep_last": "1", "action": "preview"}).status_code == 403
    checkpoint = Checkpoint.objects.get(model=checkpoints, step=0)
    assert bob.post(f"/checkpoints/{checkpoint.pk}/delete").status_code == 403
    assert client_for(cast.charlie).get(page_url(checkpoints)).status_code == 404  # another team
    assert steps_of(checkpoints) == [0, 1, 2, 3]
