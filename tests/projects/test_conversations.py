"""Storage per key and per model (projects.gateway.capture.storage_mode), and conversations:
stored completions joined by the team's conversation key into one multi-turn trajectory on the
sampler's exact ids (projects.services.conversations, training.runs.art_tokens.join_turns) and
served at ``/api/v1/conversations``."""

from __future__ import annotations

import math

import pytest
from django.utils import timezone

from projects import services
from projects.gateway import capture
from projects.gateway.errors import GatewayError
from projects.models import StoredCompletion
from projects.services import conversations
from tests.conftest import _client, error_of
from training.runs.art_tokens import Placement, join_turns

pytestmark = pytest.mark.django_db


def test_a_keys_setting_wins_over_the_models_which_wins_over_the_teams(cast, alpha_setup):
    team = cast.alpha
    key = services.api_key_create(team=team, name="prod").api_key
    team.completion_storage = "off"
    team.completion_storage_models = {"math/agent": "all"}
    sent_nothing = capture.StoreFields(None, {})
    # The model's setting covers its checkpoints and aliases; another model follows the team.
    for model_id, stored in [("math/agent:3", True), ("math/agent:prod", True), ("math/other:1", False)]:
        got = capture.capture_for(team, sent_nothing, {"model": model_id, "messages": []}, key)
        assert (got is not None) == stored, model_id
    key.completion_storage = "off"  # the key's own setting wins over the model's
    assert capture.capture_for(team, sent_nothing, {"model": "math/agent:3"}, key) is None
    with pytest.raises(GatewayError) as refused:
        capture.capture_for(team, capture.StoreFields(True, {}), {"model": "math/agent:3"}, key)
    assert refused.value.param == "store" and f"API key {key.prefix}" in refused.value.message
    key.completion_storage = "requested"
    assert capture.capture_for(team, sent_nothing, {"model": "math/other:1"}, key) is None
    assert capture.capture_for(team, capture.StoreFields(True, {}), {"model": "math/other:1"}, key)
    assert capture.storage_mode(team, "math/other:1", None) == ("off", "team")


def test_an_owner_sets_storage_per_model_and_per_key(cast, alpha_setup, key_client, alice_client):
    reply = alice_client.patch(
        "/api/v1/team",
        {"completion_storage_models": {"math/agent": "all", "tiny": "requested"}},
        format="json",
    )
    assert reply.status_code == 200, reply.content
    assert reply.json()["completion_storage_models"] == {"math/agent": "all", "tiny": "requested"}
    for bad, field in [({"math/nope": "all"}, "completion_storage_models"),
                       ({"math/agent": "often"}, "completion_storage_models")]:  # fmt: skip
        reply = alice_client.patch("/api/v1/team", {"completion_storage_models": bad}, format="json")
        assert reply.status_code == 400 and error_of(reply)["param"].startswith(field), reply.content
    assert (
        key_client.patch("/api/v1/team", {"completion_storage_models": {}}, format="json").status_code == 403
    )
    # Per key: at creation and after; another team's key is a 404, a bad value a 400.
    reply = alice_client.post(
        "/api/v1/api-keys", {"name": "prod", "completion_storage": "all"}, format="json"
    )
    assert reply.status_code == 201 and reply.json()["completion_storage"] == "all"
    key_id = reply.json()["id"]
    reply = alice_client.patch(f"/api/v1/api-keys/{key_id}", {"completion_storage": ""}, format="json")
    assert reply.status_code == 200 and reply.json()["completion_storage"] == ""
    reply = alice_client.patch(f"/api/v1/api-keys/{key_id}", {"completion_storage": "maybe"}, format="json")
    assert reply.status_code == 400 and error_of(reply)["param"] == "completion_storage"
    assert key_client.patch(f"/api/v1/api-keys/{key_id}", {"completion_storage": "all"},
                            format="json").status_code == 403  # fmt: skip
    theirs = services.api_key_create(team=cast.beta, name="theirs").api_key
    reply = alice_client.patch(f"/api/v1/api-keys/{theirs.pk}", {"completion_storage": "all"}, format="json")
    assert reply.status_code == 404


def test_turns_join_where_each_prompt_continues_the_ids_so_far():
    # Turn 2's prompt continues turn 1's prompt and sample (then 7, 8: the end of turn, the next
    # user message); turn 3's does not (a template wrote turn 2 back differently): a new sample.
    turns = [([1, 2], [3, 4], [-0.1, -0.2]), ([1, 2, 3, 4, 7, 8], [5], [-0.3]), ([1, 2, 9], [6], None)]
    samples, placements = join_turns(turns)
    assert placements == [Placement(0, 2, 4), Placement(0, 6, 7), Placement(1, 3, 4)]
    assert samples[0].prompt == [1, 2] and samples[0].completion == [3, 4, 7, 8, 5]
    assert samples[0].mask == [1, 1, 0, 0, 1] and samples[0].logprobs[:2] == [-0.1, -0.2]
    assert samples[1].tokens == [1, 2, 9, 6] and math.isnan(samples[1].logprobs[0])
    assert join_turns([]) == ([], [])


def turn(team, completion_id, messages, reply, prompt_ids, ids, *, conversation="c-1", reward=None):
    row = services.stored_completion_create(
        team_id=team.pk, completion_id=completion_id, api_key_id=None, model="math/agent:prod",
        served_by="math/agent:2", checkpoint_id=None, stream=False, metadata={"conversation_id": conversation},
        conversation_id=conversation, request={"messages": messages},
        response={"choices": [{"index": 0, "message": {"role": "assistant", "content": reply},
                               "finish_reason": "stop", "logprobs": None}]},
        prompt_token_ids=prompt_ids, token_ids=[ids], logprobs=[[-0.5] * len(ids)], latency_ms=3,
    )  # fmt: skip
    assert row is not None
    if reward is not None:
        services.feedback_add(team=team, value=reward, completion=row)
    return StoredCompletion.objects.get(pk=row.pk)


def test_a_conversation_is_one_trajectory_and_its_exact_join(cast, key_client):
    system, question = {"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}
    first = turn(cast.alpha, "chatcmpl-t1", [system, question], "4", [1, 2], [3, 4])
    # The client sends the reply back with fields of its own (the openai client's refusal: None).
    follow = [system, question, {"role": "assistant", "content": "4", "refusal": None},
              {"role": "user", "content": "and 3+3?"}]  # fmt: skip
    second = turn(cast.alpha, "chatcmpl-t2", follow, "6", [1, 2, 3, 4, 9], [5, 4])
    rewritten = [system, {"role": "user", "content": "start over"}]
    third = turn(cast.alpha, "chatcmpl-t3", rewritten, "ok", [1, 7], [8], reward=1.0)
    turn(cast.beta, "chatcmpl-b1", [question], "4", [1], [2])  # another team's conversation "c-1"

    trajectory = conversations.conversation_trajectory([first, second, third], 1.0)
    items = trajectory["messages_and_choices"]
    assert [item.get("role") or "choice" for item in items] == ["system", "user", "choice", "user", "choice"]
    assert items[2]["token_ids"] == [3, 4] and items[4]["prompt_token_ids"] == [1, 2, 3, 4, 9]
    assert items[4]["artweb_model"] == "math/agent:2" and trajectory["reward"] == 1.0
    (rest,) = trajectory["additional_histories"]  # the rewritten turn: a history of its own
    assert rest["messages_and_choices"][1] == {"role": "user", "content": "start over"}
    assert trajectory["metadata"]["completion_ids"] == "chatcmpl-t1,chatcmpl-t2,chatcmpl-t3"

    body = key_client.get("/api/v1/conversations/c-1").json()
    assert [t["id"] for t in body["turns"]] == ["chatcmpl-t1", "chatcmpl-t2", "chatcmpl-t3"]
    assert [(t["sample"], t["start"], t["end"]) for t in body["turns"]] == [(0, 2, 4), (0, 5, 7), (1, 2, 3)]
    assert body["samples"] == [{"tokens": 7, "trained_tokens": 4}, {"tokens": 3, "trained_tokens": 1}]
    assert body["reward"] == 1.0
    listed = key_client.get("/api/v1/conversations").json()
    assert listed["object"] == "list" and [c["id"] for c in listed["data"]] == ["c-1"]
    assert listed["data"][0]["turns"] == 3
    assert key_client.get("/api/v1/conversations/nope").status_code == 404
    beta_key = services.api_key_create(team=cast.beta, name="b").plaintext
    theirs = _client(key=beta_key).get("/api/v1/conversations/c-1").json()
    assert [t["id"] for t in theirs["turns"]] == ["chatcmpl-b1"]  # each team sees its own turns only
    turn(cast.alpha, "chatcmpl-t4", [question], "4", [1], [2], conversation="c-alpha")
    assert key_client.get("/api/v1/conversations/c-alpha").status_code == 200
    assert _client(key=beta_key).get("/api/v1/conversations/c-alpha").status_code == 404


def test_conversations_list_newest_first_and_pages(cast, key_client):
    for n in range(3):
        turn(cast.alpha, f"chatcmpl-p{n}", [{"role": "user", "content": "q"}], "a", [1], [2],
             conversation=f"conv-{n}")  # fmt: skip
    turn(cast.beta, "chatcmpl-pb", [{"role": "user", "content": "q"}], "a", [1], [2], conversation="conv-b")
    turn(cast.alpha, "chatcmpl-p0b", [{"role": "user", "content": "q"}], "a", [1], [2], conversation="conv-0")
    page = key_client.get("/api/v1/conversations?limit=2").json()
    assert [c["id"] for c in page["data"]] == ["conv-0", "conv-2"] and page["has_more"] is True
    rest = key_client.get("/api/v1/conversations?limit=2&after=conv-2").json()
    assert [c["id"] for c in rest["data"]] == ["conv-1"] and rest["has_more"] is False
    reply = key_client.get("/api/v1/conversations?after=conv-9")
    assert reply.status_code == 400 and error_of(reply)["param"] == "after"
    assert timezone.now().timestamp() >= page["data"][0]["last_at"] >= page["data"][0]["first_at"]
