"""The stored completions' review pages: the list and its filters, one completion as a transcript
with its feedback, thumbs and a score from the page, a selection made into a task set; viewers
read but cannot rate; another team's completion is a 404."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from projects import services
from projects.models import CompletionFeedback, StoredCompletion, TaskRow, TaskSet
from tests.factories import ProjectFactory
from tests.frontend.test_views import client_for
from tests.projects.test_stored_completions import store

pytestmark = pytest.mark.django_db


def test_the_list_filters_by_model_metadata_reward_and_date(cast):
    lyon = store(
        cast.alpha, "chatcmpl-lyon", metadata={"channel": "app"}, model="math/agent:1", content="Lyon"
    )
    paris = store(cast.alpha, "chatcmpl-paris", metadata={"channel": "web"}, content="Paris")
    store(cast.beta, "chatcmpl-beta", content="Berlin")
    services.feedback_add(team=cast.alpha, value=1.0, completion=paris)
    StoredCompletion.objects.filter(pk=lyon.pk).update(created_at=timezone.now() - timedelta(days=3))
    client = client_for(cast.bob)  # a viewer reads

    def shown(query: str = "") -> list[str]:
        page = client.get(f"/completions/{query}")
        assert page.status_code == 200
        return [row.completion_id for row, _prompt, _reply in page.context["rows"]]

    assert shown() == ["chatcmpl-paris", "chatcmpl-lyon"]  # newest first, alpha's only
    assert shown("?meta=channel%3Dapp") == ["chatcmpl-lyon"]
    assert shown("?model=math/agent:1") == ["chatcmpl-lyon"]
    assert shown("?reward_min=0.5") == ["chatcmpl-paris"] and shown("?rated=no") == ["chatcmpl-lyon"]
    today = timezone.localdate().isoformat()
    assert shown(f"?since={today}") == ["chatcmpl-paris"] and shown(f"?until={today}") == shown()
    assert shown("?reward_min=abc") == shown()  # a value that does not parse filters nothing
    html = client.get("/completions/").content.decode()
    assert (
        "Paris" in html and "Berlin" not in html and 'name="completion"' not in html
    )  # viewers: no selection


def test_a_member_rates_from_the_page_and_a_viewer_cannot(cast):
    row = store(cast.alpha, "chatcmpl-rate", metadata={"conversation_id": "c"}, content="Paris")
    alice, bob, charlie = (client_for(user) for user in (cast.alice, cast.bob, cast.charlie))
    page = alice.get("/completions/chatcmpl-rate/")
    html = page.content.decode()
    assert page.status_code == 200 and "Paris" in html and "Be brief." in html and "Thumbs up" in html
    assert alice.post("/completions/chatcmpl-rate/", {"value": "1"}).status_code == 302
    assert alice.post("/completions/chatcmpl-rate/", {"value": "0.25", "label": "partial",
                                                      "comment": "right city, long"}).status_code == 302  # fmt: skip
    assert alice.post("/completions/chatcmpl-rate/", {"value": "lots"}).status_code == 302  # refused, said
    assert [(f.value, f.label, f.source, f.created_by) for f in CompletionFeedback.objects.order_by("id")] == [
        (1.0, "", "dashboard", cast.alice), (0.25, "partial", "dashboard", cast.alice),
    ]  # fmt: skip
    row.refresh_from_db()
    assert row.reward == 0.25
    html = alice.get("/completions/chatcmpl-rate/").content.decode()
    assert "right city, long" in html and "alice" in html
    assert bob.post("/completions/chatcmpl-rate/", {"value": "1"}).status_code == 403
    assert "Thumbs up" not in bob.get("/completions/chatcmpl-rate/").content.decode()
    assert charlie.get("/completions/chatcmpl-rate/").status_code == 404
    assert charlie.post("/completions/chatcmpl-rate/", {"value": "1"}).status_code == 404
    assert CompletionFeedback.objects.count() == 2


def test_a_selection_becomes_a_task_set_with_prompts_items_and_replies(cast, alpha_setup):
    rows = [
        store(cast.alpha, f"chatcmpl-t{i}", metadata={"answer": str(i)}, content=f"reply {i}")
        for i in range(3)
    ]
    services.feedback_add(team=cast.alpha, value=1.0, completion=rows[0])
    beta_row = store(cast.beta, "chatcmpl-beta")
    alice = client_for(cast.alice)
    reply = alice.post("/completions/task-set", {
        "project": alpha_setup.project.pk, "name": "from-traffic",
        "completion": ["chatcmpl-t0", "chatcmpl-t2", beta_row.completion_id],  # beta's is not alpha's: left out
    })  # fmt: skip
    task_set = TaskSet.objects.get(name="from-traffic")
    assert reply.status_code == 302 and reply["Location"] == f"/task-sets/{task_set.pk}/"
    data = [row.data for row in TaskRow.objects.filter(task_set=task_set).order_by("index")]
    assert [d["item"]["completion_id"] for d in data] == ["chatcmpl-t0", "chatcmpl-t2"]
    assert data[0]["messages"][-1] == {"role": "user", "content": "q"} and data[0]["completion"] == "reply 0"
    assert data[0]["item"]["answer"] == "0" and data[0]["item"]["reward"] == 1.0
    assert task_set.source["completion_ids"] == ["chatcmpl-t0", "chatcmpl-t2"]
    assert client_for(cast.bob).post("/completions/task-set", {"project": alpha_setup.project.pk,
                                                               "name": "x", "completion": ["chatcmpl-t1"]}).status_code == 403  # fmt: skip
    other = ProjectFactory(team=cast.beta, name="theirs")
    reply = alice.post(
        "/completions/task-set", {"project": other.pk, "name": "y", "completion": ["chatcmpl-t1"]}
    )
    assert reply.status_code == 404 and not TaskSet.objects.filter(name="y").exists()
    reply = alice.post("/completions/task-set", {"project": alpha_setup.project.pk, "name": "z"}, follow=True)
    assert "select at least one stored completion" in reply.content.decode()


def test_the_model_page_compares_an_aliases_arms_and_promotes(cast, alpha_setup):
    from projects.models import AliasEvent
    from tests.factories import CheckpointFactory

    for step in (1, 2):
        CheckpointFactory(model=alpha_setup.model, step=step)
    model_url = f"/models/{alpha_setup.model.pk}/"
    alice, bob, charlie = (client_for(user) for user in (cast.alice, cast.bob, cast.charlie))
    assert alice.post(f"{model_url}aliases", {"name": "prod", "step": "1"}).status_code == 302
    alias = alpha_setup.model.aliases.get()
    action = f"{model_url}aliases/{alias.pk}/"
    assert alice.post(action + "canary", {"step": "2", "share": "0.4"}).status_code == 302
    for i, step in enumerate((1, 2, 2)):
        row = store(cast.alpha, f"chatcmpl-m{i}", model="math/agent:prod")
        row.served_by = f"math/agent:{step}"
        row.save(update_fields=["served_by"])
    services.feedback_add(
        team=cast.alpha, value=0.5, completion=StoredCompletion.objects.get(completion_id="chatcmpl-m1")
    )
    page = alice.get(model_url)
    [(shown, arms, _events)] = page.context["aliases"]
    assert [(a["role"], a["step"], a["completions"], a["rated"]) for a in arms] == [
        ("checkpoint", 1, 1, 0), ("candidate", 2, 2, 1),
    ]  # fmt: skip
    html = page.content.decode()
    assert "Promote step 2" in html and html.count("Aliases and canaries") == 1
    assert "<title>agent · artweb</title>" in html  # the title is the model's name, nothing more
    assert (
        bob.post(action + "promote").status_code == 403
        and charlie.post(action + "promote").status_code == 404
    )
    assert alice.post(action + "promote").status_code == 302
    alias.refresh_from_db()
    assert alias.checkpoint.step == 2 and alias.candidate is None
    assert alice.post(action + "canary", {"step": "2", "share": "0.4"}, follow=True).status_code == 200
    assert [e.action for e in AliasEvent.objects.order_by("id")] == ["set", "canary", "promote"]
    assert "Promote" not in bob.get(model_url).content.decode()


def test_rated_replies_to_one_prompt_become_a_preference_pair_for_dpo(cast, alpha_setup):
    rows = [store(cast.alpha, f"chatcmpl-p{i}", content=text, metadata={"answer": "Paris"})
            for i, text in enumerate(["Paris", "Lyon", "Nice"])]  # fmt: skip
    for row, reward in zip(rows, (1.0, 0.0, 0.5), strict=True):
        services.feedback_add(team=cast.alpha, value=reward, completion=row)
    alice = client_for(cast.alice)
    reply = alice.post("/completions/task-set", {"project": alpha_setup.project.pk, "name": "pairs", "rows": "pairs",
                                                 "completion": [r.completion_id for r in rows]})  # fmt: skip
    assert reply.status_code == 302, reply.content
    (pair,) = [row.data for row in TaskRow.objects.filter(task_set__name="pairs")]
    assert (pair["chosen"], pair["rejected"]) == ("Paris", "Lyon")
    assert pair["item"]["chosen_id"] == "chatcmpl-p0" and pair["item"]["rejected_id"] == "chatcmpl-p1"
    reply = alice.post("/completions/task-set", {"project": alpha_setup.project.pk, "name": "none", "rows": "pairs",
                                                 "completion": ["chatcmpl-p0"]}, follow=True)  # fmt: skip
    assert "no prompt has two rated completions" in reply.content.decode()


def test_a_conversations_turns_and_their_join_show_on_each_turn_and_it_is_rated_whole(cast):
    from tests.projects.test_conversations import turn

    ask = [{"role": "user", "content": "2+2?"}]
    turn(cast.alpha, "chatcmpl-c1", ask, "4", [1, 2], [3, 4], conversation="talk")
    again = [*ask, {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"}]
    turn(cast.alpha, "chatcmpl-c2", again, "6", [1, 2, 3, 4, 9], [5], conversation="talk")
    alice = client_for(cast.alice)
    page = alice.get("/completions/chatcmpl-c2/")
    turns = page.context["conversation"]["turns"]
    assert [(t["id"], t["sample"], t["start"], t["end"]) for t in turns] == [
        ("chatcmpl-c1", 0, 2, 4), ("chatcmpl-c2", 0, 5, 6)
    ]  # fmt: skip
    html = page.content.decode()
    assert (
        'href="/completions/chatcmpl-c1/"' in html
        and "1 sample:" in html
        and "Conversation thumbs up" in html
    )
    assert alice.post("/completions/chatcmpl-c2/", {"value": "0", "scope": "conversation"}).status_code == 302
    (feedback,) = CompletionFeedback.objects.all()
    assert feedback.completion is None and feedback.conversation_id == "talk" and feedback.value == 0.0
    assert set(StoredCompletion.objects.values_list("reward", flat=True)) == {0.0}  # both turns


def test_each_checkpoint_that_served_is_compared_on_the_model_page_and_the_api(cast, alpha_setup):
    from tests.conftest import _client

    for i, (step, reward) in enumerate([(1, 1.0), (1, 0.0), (2, 1.0), (2, 0.75), (2, None)]):
        row = store(cast.alpha, f"chatcmpl-s{i}", model=f"math/agent:{step}")
        if reward is not None:
            services.feedback_add(team=cast.alpha, value=reward, completion=row)
    store(cast.alpha, "chatcmpl-base", model="tiny")  # the base model: not a checkpoint of the model
    store(cast.beta, "chatcmpl-theirs", model="math/agent:2")  # another team's
    key = services.api_key_create(team=cast.alpha, name="k").plaintext
    body = _client(key=key).get(f"/api/v1/models/{alpha_setup.model.pk}/checkpoint-feedback").json()
    rows = [(r["step"], r["completions"], r["rated"], r["mean_reward"], r["positive"], r["feedback"])
            for r in body["data"]]  # fmt: skip
    assert rows == [(2, 3, 2, 0.875, 2, 2), (1, 2, 2, 0.5, 1, 2)]
    theirs = services.api_key_create(team=cast.beta, name="b").plaintext
    assert (
        _client(key=theirs).get(f"/api/v1/models/{alpha_setup.model.pk}/checkpoint-feedback").status_code
        == 404
    )
    page = client_for(cast.bob).get(f"/models/{alpha_setup.model.pk}/")
    assert [r["step"] for r in page.context["served"]] == [2, 1]
    assert "Checkpoints in production" in page.content.decode() and "0.875" in page.content.decode()


def test_the_conversations_page_lists_the_most_recently_continued_first(cast):
    from tests.projects.test_conversations import turn

    ask = [{"role": "user", "content": "q"}]
    turn(cast.alpha, "chatcmpl-a1", ask, "first", [1], [2], conversation="older")
    turn(cast.alpha, "chatcmpl-b1", ask, "b", [1], [2], conversation="newer")
    turn(cast.alpha, "chatcmpl-a2", ask, "second", [1], [2], conversation="older", reward=0.5)
    turn(cast.beta, "chatcmpl-x", ask, "theirs", [1], [2], conversation="theirs")
    page = client_for(cast.bob).get("/completions/conversations/")
    shown = [
        (c["conversation_id"], c["turns"], newest.completion_id) for c, newest, _ in page.context["rows"]
    ]
    assert shown == [("older", 2, "chatcmpl-a2"), ("newer", 1, "chatcmpl-b1")]
    html = page.content.decode()
    assert 'href="/completions/chatcmpl-a2/"' in html and "second" in html and "theirs" not in html
    assert "0.50" in html


def test_an_owner_sets_the_teams_storage_from_the_list_page(cast):
    alice, bob = client_for(cast.alice), client_for(cast.bob)
    assert "Storage settings" in alice.get("/completions/").content.decode()
    assert "Storage settings" not in bob.get("/completions/").content.decode()  # a viewer
    settings = {"storage": "all", "retention_days": "30", "conversation_key": "thread"}
    saved = alice.post("/completions/storage", settings, follow=True)
    assert [m.level_tag for m in saved.context["messages"]] == ["success"]
    cast.alpha.refresh_from_db()
    assert (cast.alpha.completion_storage, cast.alpha.completion_retention_days, cast.alpha.conversation_key) == (
        "all", 30, "thread"
    )  # fmt: skip
    for bad in ({"storage": "sometimes"}, {"storage": "off", "retention_days": "soon"}):
        follow = alice.post("/completions/storage", bad, follow=True)
        assert [m.level_tag for m in follow.context["messages"]] == ["error"], bad
    cast.alpha.refresh_from_db()
    assert cast.alpha.completion_storage == "all"  # a refused form changes nothing
    alice.post("/completions/storage", {"storage": "requested", "retention_days": ""})
    cast.alpha.refresh_from_db()
    assert (cast.alpha.completion_storage, cast.alpha.completion_retention_days) == ("requested", None)
    assert bob.post("/completions/storage", {"storage": "off"}).status_code == 403
    cast.alpha.refresh_from_db()
    assert cast.alpha.completion_storage == "requested"
