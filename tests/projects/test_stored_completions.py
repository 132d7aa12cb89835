"""Stored completions without servers: the gateway's capture rules (projects.gateway.capture),
a stream joined as it passes, the row's bound, the API's errors and paging
(projects.api.completions), the team's settings and retention. The live path, with the ``openai``
client, a gateway and an inference server, is in tests/projects/gateway/test_gateway_live.py."""

from __future__ import annotations

import json
from datetime import timedelta
from types import SimpleNamespace

import pytest
from django.utils import timezone

from projects import services
from projects.gateway import capture
from projects.gateway.errors import GatewayError
from projects.models import StoredCompletion
from tests.conftest import error_of

pytestmark = pytest.mark.django_db


def store(team, completion_id: str, *, metadata=None, model="math/agent:0", content="hi") -> StoredCompletion:
    row = services.stored_completion_create(
        team_id=team.pk, completion_id=completion_id, api_key_id=None, model=model, served_by=model,
        checkpoint_id=None, stream=False, metadata=metadata or {}, conversation_id="",
        request={"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"}]},
        response={"choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                               "finish_reason": "stop", "logprobs": None}]},
        prompt_token_ids=[1, 2, 3], token_ids=[[4, 5]], logprobs=[[-0.1, -0.2]], latency_ms=7,
    )  # fmt: skip
    assert row is not None
    return row


def test_storage_follows_the_teams_setting_and_the_request(cast):
    team = cast.alpha
    off = capture.StoreFields(True, {})
    with pytest.raises(GatewayError) as refused:
        capture.capture_for(team, off, {})
    assert refused.value.status == 400 and refused.value.param == "store"
    for storage, sent, stored in [
        ("requested", True, True), ("requested", None, False), ("requested", False, False),
        ("all", None, True), ("all", False, False), ("all", True, True), ("off", None, False),
    ]:  # fmt: skip
        team.completion_storage = storage
        fields = capture.StoreFields(sent, {"conversation_id": "c-9"})
        got = capture.capture_for(team, fields, {"model": "m", "messages": [], "store": sent})
        assert (got is not None) == stored, (storage, sent)
        if got is not None:
            assert got.conversation_id == "c-9" and "store" not in got.client_request


@pytest.mark.parametrize(
    "metadata, reason",
    [({f"k{i}": "v" for i in range(17)}, "at most 16"), ({"k" * 65: "v"}, "1 to 64"), ({"k": 1}, "string"),
     ({"k": "v" * 513}, "512"), ("text", "object")],
)  # fmt: skip
def test_a_stored_completions_metadata_follows_openais_rules(cast, metadata, reason):
    cast.alpha.completion_storage = "requested"
    fields = capture.store_fields({"metadata": metadata, "store": True})
    with pytest.raises(GatewayError) as bad:
        capture.capture_for(cast.alpha, fields, {"metadata": metadata})
    assert bad.value.param == "metadata" and reason in bad.value.message
    # Not stored: served whatever metadata it carries (as vLLM serves it).
    assert capture.capture_for(cast.alpha, capture.store_fields({"metadata": metadata}), {}) is None
    fine = capture.store_fields({"metadata": {"k": "v" * 512}, "store": True})
    assert capture.capture_for(cast.alpha, fine, {}).metadata == {"k": "v" * 512}
    assert (
        capture.conversation_of(capture.store_fields({"metadata": {"conversation_id": 7}}), "conversation_id")
        is None
    )


def events(*chunks: dict) -> bytes:
    return (
        b"".join(b"data: " + json.dumps(chunk).encode() + b"\n\n" for chunk in chunks) + b"data: [DONE]\n\n"
    )


def test_a_stream_is_joined_as_it_passes_and_the_client_sees_only_what_it_asked():
    asked = capture.Capture(team_id=1, metadata={}, conversation_id="", client_logprobs=False,
                            client_token_ids=False, client_request={})  # fmt: skip
    head = {"id": "chatcmpl-s", "object": "chat.completion.chunk", "created": 5, "model": "m"}
    lp = lambda token, value: {"token": token, "logprob": value, "top_logprobs": []}  # noqa: E731
    raw = events(
        {**head, "prompt_token_ids": [7, 8], "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {**head, "choices": [{"index": 0, "delta": {"content": "Hel"}, "token_ids": [11],
                              "logprobs": {"content": [lp("Hel", -0.5)]}}]},
        {**head, "choices": [{"index": 0, "delta": {"content": "lo"}, "token_ids": [12],
                              "logprobs": {"content": [lp("lo", -0.25)]}}]},
        {**head, "choices": [{"index": 1, "delta": {"tool_calls": [
            {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_", "arguments": '{"ci'}}]},
            "token_ids": [13, 14]}]},
        {**head, "choices": [{"index": 1, "delta": {"tool_calls": [
            {"index": 0, "function": {"name": "weather", "arguments": 'ty": "Paris"}'}}]}, "token_ids": [15],
            "finish_reason": "tool_calls"}]},
        {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "token_ids": [2]}]},
    )  # fmt: skip
    join = capture.StreamJoin(asked)
    passed = b"".join(join.feed(raw[i : i + 37]) for i in range(0, len(raw), 37)) + join.rest()
    assert passed.endswith(b"data: [DONE]\n\n")
    client_chunks = [json.loads(e[6:]) for e in passed.split(b"\n\n") if e.startswith(b"data: {")]
    assert len(client_chunks) == 6
    assert not any("prompt_token_ids" in c for c in client_chunks)
    for chunk in client_chunks:
        for item in chunk["choices"]:
            assert item.get("logprobs") is None and "token_ids" not in item, item

    joined = join.completion()
    assert joined["id"] == "chatcmpl-s" and joined["prompt_token_ids"] == [7, 8]
    first, second = joined["choices"]
    assert first["message"] == {"role": "assistant", "content": "Hello"} and first["finish_reason"] == "stop"
    assert first["token_ids"] == [11, 12, 2] and [e["logprob"] for e in first["logprobs"]["content"]] == [
        -0.5,
        -0.25,
    ]
    assert second["message"]["tool_calls"] == [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ]
    assert second["finish_reason"] == "tool_calls" and second["token_ids"] == [13, 14, 15]


def test_a_row_over_the_bound_loses_its_logprobs_then_is_not_stored(settings):
    asked = capture.Capture(team_id=1, metadata={}, conversation_id="", client_logprobs=True,
                            client_token_ids=False, client_request={"messages": [{"role": "user", "content": "q"}]})  # fmt: skip
    route = SimpleNamespace(target=SimpleNamespace(model_id="m", checkpoint=None), api_key=None,
                            chat=SimpleNamespace(request=SimpleNamespace(model="m")))  # fmt: skip
    entries = [{"token": "x", "logprob": -1.0, "top_logprobs": []}] * 100
    full = {"id": "chatcmpl-b", "prompt_token_ids": [1, 2], "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "x" * 100}, "finish_reason": "stop",
         "token_ids": list(range(100)), "logprobs": {"content": entries}}]}  # fmt: skip
    settings.STORED_COMPLETION_MAX_BYTES = 100_000
    record = capture.record_of(full, capture.client_view(full, asked), asked, route=route, stream=False)
    assert record is not None and not record.bounded and record.logprobs == [[-1.0] * 100]
    settings.STORED_COMPLETION_MAX_BYTES = 2_000
    record = capture.record_of(full, capture.client_view(full, asked), asked, route=route, stream=False)
    assert record is not None and record.bounded and record.logprobs is None
    assert record.response["choices"][0]["logprobs"] is None and record.token_ids == [list(range(100))]
    settings.STORED_COMPLETION_MAX_BYTES = 300
    assert capture.record_of(full, capture.client_view(full, asked), asked, route=route, stream=False) is None


def test_the_list_pages_filters_and_refuses_bad_parameters(cast, key_client):
    rows = [store(cast.alpha, f"chatcmpl-{i}", metadata={"n": str(i % 2)}) for i in range(5)]
    store(cast.beta, "chatcmpl-beta")

    def ids(query: str) -> list[str]:
        reply = key_client.get(f"/v1/chat/completions{query}")
        assert reply.status_code == 200, reply.content
        return [row["id"] for row in reply.json()["data"]]

    assert ids("") == [row.completion_id for row in rows]
    assert ids("?limit=2&after=chatcmpl-1") == ["chatcmpl-2", "chatcmpl-3"]
    assert ids("?order=desc&limit=2&after=chatcmpl-3") == ["chatcmpl-2", "chatcmpl-1"]
    assert ids("?metadata[n]=1") == ["chatcmpl-1", "chatcmpl-3"]
    assert ids("?metadata[n]=1&metadata[m]=x") == []
    assert ids("?model=math/agent:0&limit=1") == ["chatcmpl-0"]
    page = key_client.get("/v1/chat/completions?limit=2").json()
    assert page["has_more"] and page["first_id"] == "chatcmpl-0" and page["last_id"] == "chatcmpl-1"
    for query, field in [("?limit=0", "limit"), ("?limit=101", "limit"), ("?order=sideways", "order"),
                         ("?after=chatcmpl-beta", "after"), ("?metadata=x", "metadata")]:  # fmt: skip
        reply = key_client.get(f"/v1/chat/completions{query}")
        assert reply.status_code == 400 and error_of(reply)["param"] == field, (query, reply.content)


def test_retrieve_update_messages_and_delete(cast, key_client):
    row = store(cast.alpha, "chatcmpl-r", metadata={"conversation_id": "a"}, content="Paris")
    body = key_client.get("/v1/chat/completions/chatcmpl-r").json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "Paris"
    assert body["prompt_token_ids"] == [1, 2, 3] and body["choices"][0]["token_ids"] == [4, 5]
    assert body["choices"][0]["sampled_logprobs"] == [-0.1, -0.2] and body["metadata"] == {
        "conversation_id": "a"
    }

    for bad in [{"metadata": {"k": "v" * 513}}, {"metadata": {"k": "v"}, "other": 1}, {"metadata": "x"}]:
        reply = key_client.post("/v1/chat/completions/chatcmpl-r", bad, format="json")
        assert reply.status_code == 400 and error_of(reply)["param"] == "metadata", reply.content
    reply = key_client.post(
        "/v1/chat/completions/chatcmpl-r", {"metadata": {"conversation_id": "b"}}, format="json"
    )
    assert reply.status_code == 200 and reply.json()["metadata"] == {"conversation_id": "b"}
    row.refresh_from_db()
    assert row.conversation_id == "b"  # the conversation follows the team's key

    messages = key_client.get("/v1/chat/completions/chatcmpl-r/messages").json()
    assert [(m["id"], m["role"]) for m in messages["data"]] == [
        ("chatcmpl-r-0", "system"),
        ("chatcmpl-r-1", "user"),
    ]
    later = key_client.get("/v1/chat/completions/chatcmpl-r/messages?after=chatcmpl-r-0").json()
    assert [m["id"] for m in later["data"]] == ["chatcmpl-r-1"]

    reply = key_client.delete("/v1/chat/completions/chatcmpl-r")
    assert reply.json() == {"object": "chat.completion.deleted", "id": "chatcmpl-r", "deleted": True}
    reply = key_client.get("/v1/chat/completions/chatcmpl-r")
    assert reply.status_code == 404 and error_of(reply)["code"] == "not_found"


def test_only_an_owner_changes_the_teams_storage(cast, key_client, alice_client, bob_client):
    assert key_client.get("/api/v1/team").json() == {
        "name": "alpha", "completion_storage": "off", "completion_retention_days": None,
        "conversation_key": "conversation_id", "completion_storage_models": {},
    }  # fmt: skip
    for caller in (key_client, bob_client):  # a key acts as a member; bob is a viewer
        assert caller.patch("/api/v1/team", {"completion_storage": "all"}, format="json").status_code == 403
    for bad, field in [({"completion_storage": "sometimes"}, "completion_storage"),
                       ({"completion_retention_days": 0}, "completion_retention_days"),
                       ({"conversation_key": ""}, "conversation_key"), ({"name": "x"}, "name")]:  # fmt: skip
        reply = alice_client.patch("/api/v1/team", bad, format="json")
        assert reply.status_code == 400 and error_of(reply)["param"] == field, reply.content
    reply = alice_client.patch(
        "/api/v1/team", {"completion_storage": "requested", "completion_retention_days": 30}, format="json"
    )
    assert reply.status_code == 200 and reply.json()["completion_storage"] == "requested"
    cast.alpha.refresh_from_db()
    assert cast.alpha.completion_storage == "requested" and cast.alpha.completion_retention_days == 30
    reply = alice_client.patch("/api/v1/team", {"completion_retention_days": None}, format="json")
    assert (
        reply.json()["completion_retention_days"] is None
        and reply.json()["completion_storage"] == "requested"
    )


def test_retention_deletes_only_what_is_older_than_the_teams_days(cast):
    services.completion_storage_set(team=cast.alpha, retention_days=7)
    old, new = store(cast.alpha, "chatcmpl-old"), store(cast.alpha, "chatcmpl-new")
    beta_old = store(cast.beta, "chatcmpl-beta-old")  # beta keeps everything
    StoredCompletion.objects.filter(pk__in=[old.pk, beta_old.pk]).update(
        created_at=timezone.now() - timedelta(days=8)
    )
    assert services.stored_completions_expire() == 1
    assert set(StoredCompletion.objects.values_list("completion_id", flat=True)) == {
        "chatcmpl-new", "chatcmpl-beta-old",
    }  # fmt: skip
    assert new.pk


# ---------------------------------------------------------------- feedback


def test_feedback_by_completion_or_conversation_becomes_the_reward(cast, key_client, alpha_key):
    one = store(cast.alpha, "chatcmpl-f1", metadata={"conversation_id": "conv"})
    two = store(cast.alpha, "chatcmpl-f2", metadata={"conversation_id": "conv"})
    StoredCompletion.objects.filter(pk__in=[one.pk, two.pk]).update(conversation_id="conv")
    other = store(cast.beta, "chatcmpl-beta")

    reply = key_client.post("/api/v1/feedback", {"completion_id": "chatcmpl-f1", "value": 0.0, "label": "wrong",
                                                 "comment": "answered Lyon"}, format="json")  # fmt: skip
    assert reply.status_code == 201, reply.content
    body = reply.json()
    assert body["completion_id"] == "chatcmpl-f1" and body["value"] == 0.0 and body["source"] == "api"
    reply = key_client.post("/api/v1/feedback", {"conversation_id": "conv", "value": 1}, format="json")
    assert reply.status_code == 201 and reply.json()["conversation_id"] == "conv"
    one.refresh_from_db(), two.refresh_from_db(), other.refresh_from_db()
    assert (one.reward, one.feedback_count, two.reward, two.feedback_count) == (1.0, 2, 1.0, 1)
    assert other.reward is None  # another team's completion is never touched

    for bad, field in [
        ({"value": 1}, "completion_id"),
        ({"completion_id": "chatcmpl-f1", "conversation_id": "conv", "value": 1}, "completion_id"),
        ({"completion_id": "chatcmpl-beta", "value": 1}, "completion_id"),  # beta's: not found here
        ({"conversation_id": "nobody", "value": 1}, "conversation_id"),
        ({"completion_id": "chatcmpl-f1", "value": "NaN"}, "value"),
        ({"completion_id": "chatcmpl-f1", "value": 1, "label": "x" * 65}, "label"),
        ({"completion_id": "chatcmpl-f1", "value": 1, "stars": 5}, "stars"),
    ]:
        reply = key_client.post("/api/v1/feedback", bad, format="json")
        assert reply.status_code == 400 and error_of(reply)["param"] == field, (bad, reply.content)

    listed = key_client.get("/api/v1/feedback?completion_id=chatcmpl-f1").json()
    assert [row["label"] for row in listed["data"]] == ["wrong"] and listed["object"] == "list"
    assert len(key_client.get("/api/v1/feedback").json()["data"]) == 2
    from projects import selectors

    assert [r.completion_id for r in selectors.stored_completions(team=cast.alpha, reward_min=0.5)] == [
        "chatcmpl-f1", "chatcmpl-f2",
    ]  # fmt: skip
    assert [r.completion_id for r in selectors.stored_completions(team=cast.alpha, rated=False)] == []


def test_export_as_jsonl_and_purge_by_metadata_or_key(cast, key_client, alice_client):
    key = services.api_key_create(team=cast.alpha, name="app").api_key
    rows = [store(cast.alpha, f"chatcmpl-x{i}", metadata={"user": "u1" if i < 2 else "u2"}) for i in range(4)]
    StoredCompletion.objects.filter(pk=rows[3].pk).update(api_key=key)
    store(cast.beta, "chatcmpl-beta", metadata={"user": "u1"})

    reply = key_client.get("/api/v1/stored-completions/export?metadata[user]=u1")
    assert reply.status_code == 200 and reply["Content-Type"] == "application/jsonl"
    lines = [json.loads(line) for line in b"".join(reply.streaming_content).decode().splitlines()]
    assert [line["id"] for line in lines] == ["chatcmpl-x0", "chatcmpl-x1"]
    assert lines[0]["request"]["messages"][-1]["content"] == "q" and lines[0]["prompt_token_ids"] == [1, 2, 3]

    assert (
        key_client.post(
            "/api/v1/stored-completions/purge", {"metadata": {"user": "u1"}}, format="json"
        ).status_code
        == 403
    )  # fmt: skip  (owners only)
    reply = alice_client.post("/api/v1/stored-completions/purge", {}, format="json", HTTP_X_TEAM="alpha")
    assert reply.status_code == 400 and error_of(reply)["param"] == "metadata"
    reply = alice_client.post("/api/v1/stored-completions/purge", {"metadata": {"user": "u1"}}, format="json",
                              HTTP_X_TEAM="alpha")  # fmt: skip
    assert reply.json() == {"object": "stored_completions.purge", "deleted": 2}
    reply = alice_client.post("/api/v1/stored-completions/purge", {"api_key": key.pk}, format="json",
                              HTTP_X_TEAM="alpha")  # fmt: skip
    assert reply.json()["deleted"] == 1
    assert set(StoredCompletion.objects.values_list("completion_id", flat=True)) == {
        "chatcmpl-x2",
        "chatcmpl-beta",
    }


def test_a_reward_definition_grades_stored_completions_in_the_background(cast, alpha_setup, key_client):
    from projects.jobs import completions as completion_jobs
    from projects.models import CompletionGrading
    from tests.factories import RewardDefinitionFactory

    reward = RewardDefinitionFactory(
        project=alpha_setup.project, name="says-paris",
        spec={"type": "string_check", "name": "paris", "operation": "ilike", "input": "{{ sample.output_text }}",
              "reference": "{{ item.answer }}"},
    )  # fmt: skip
    for i, (content, answer) in enumerate([("Paris.", "paris"), ("Lyon", "paris"), ("Berlin", "berlin")]):
        store(cast.alpha, f"chatcmpl-g{i}", metadata={"answer": answer, "channel": "web"}, content=content)
    store(cast.alpha, "chatcmpl-other", metadata={"answer": "x", "channel": "app"})
    store(cast.beta, "chatcmpl-beta", metadata={"answer": "hi", "channel": "web"}, content="hi")

    reply = key_client.post("/api/v1/completion-gradings", {"reward": reward.pk, "filters": {
        "metadata": {"channel": "web"}}}, format="json")  # fmt: skip
    assert reply.status_code == 201, reply.content
    body = reply.json()
    assert body["status"] == "queued" and body["total"] == 3
    assert completion_jobs.grade(body["id"]) == "succeeded"
    assert completion_jobs.grade(body["id"]) == "skipped"  # delivered twice: graded once
    done = key_client.get(f"/api/v1/completion-gradings/{body['id']}").json()
    assert (done["status"], done["graded"], done["errors"]) == ("succeeded", 3, 0)
    assert done["mean_reward"] == pytest.approx(2 / 3)
    rewards = dict(StoredCompletion.objects.values_list("completion_id", "reward"))
    assert rewards == {"chatcmpl-g0": 1.0, "chatcmpl-g1": 0.0, "chatcmpl-g2": 1.0, "chatcmpl-other": None,
                       "chatcmpl-beta": None}  # fmt: skip
    from projects.models import CompletionFeedback

    assert set(CompletionFeedback.objects.values_list("source", flat=True)) == {"grader:says-paris v1"}
    for bad, field in [({"reward": reward.pk, "filters": {"metadata": {"channel": "none"}}}, "filters"),
                       ({"reward": reward.pk, "filters": {"when": "today"}}, "filters"),
                       ({"reward": reward.pk, "limit": 0}, "limit"),
                       ({"reward": 999999}, "reward")]:  # fmt: skip
        reply = key_client.post("/api/v1/completion-gradings", bad, format="json")
        assert reply.status_code == 400 and error_of(reply)["param"] == field, (bad, reply.content)
    assert CompletionGrading.objects.count() == 1


def test_training_on_stored_completions_refuses_what_it_cannot_use(
    cast, alpha_setup, key_client, read_only_client
):
    store(cast.alpha, "chatcmpl-u1")
    store(cast.beta, "chatcmpl-beta")
    other_model = services.trainable_model_create(project=services.project_create(team=cast.beta, name="theirs"),
                                                  name="m", base_model=alpha_setup.base)  # fmt: skip
    url = "/api/v1/stored-completions/train"
    for bad, field in [
        ({"model": alpha_setup.model.pk}, "completion_ids"),
        ({"model": alpha_setup.model.pk, "completion_ids": ["chatcmpl-u1"], "filters": {}}, "completion_ids"),
        ({"model": alpha_setup.model.pk, "completion_ids": ["chatcmpl-beta"]}, "completion_ids"),
        ({"model": other_model.pk, "completion_ids": ["chatcmpl-u1"]}, "model"),
        ({"model": alpha_setup.model.pk, "completion_ids": ["chatcmpl-u1"]}, "completions"),  # unrated, alone
        ({"model": alpha_setup.model.pk, "filters": {"metadata": "x"}}, "filters"),
    ]:
        reply = key_client.post(url, bad, format="json")
        assert reply.status_code == 400 and error_of(reply)["param"] == field, (bad, reply.content)
    reply = key_client.post(
        url, {"model": alpha_setup.model.pk, "completion_ids": ["chatcmpl-u1"]}, format="json"
    )
    assert "1 unrated" in error_of(reply)["message"]
    assert (
        read_only_client.post(url, {"model": alpha_setup.model.pk, "filters": {}}, format="json").status_code
        == 403
    )
