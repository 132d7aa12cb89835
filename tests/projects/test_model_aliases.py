"""Model aliases and canaries (projects.services.aliases, projects.selectors.serving): an alias
names a checkpoint, a canary sends a share of conversations to a candidate (the same conversation
always to the same one), promotion and rollback are events with who and when and send webhooks,
an alias's checkpoints cannot be deleted under it, and the API is team-scoped. The gateway serving
through an alias is in tests/projects/gateway/test_gateway_live.py."""

from __future__ import annotations

import json

import pytest

from projects import services
from projects.errors import Conflict, ValidationFailed
from projects.models import AliasEvent, WebhookDelivery
from projects.selectors.serving import resolve_model
from projects.services import webhooks
from tests.conftest import error_of
from tests.factories import CheckpointFactory
from tests.projects.test_stored_completions import store

pytestmark = pytest.mark.django_db


@pytest.fixture
def steps(alpha_setup):
    return [CheckpointFactory(model=alpha_setup.model, step=step) for step in (1, 2, 3)]


@pytest.fixture(autouse=True)
def _no_enqueue(monkeypatch):
    monkeypatch.setattr(webhooks, "_enqueue", lambda delivery_id: None)


def test_a_canary_splits_conversations_by_its_share_and_each_stays_put(cast, alpha_setup, steps):
    alias = services.alias_set(model=alpha_setup.model, name="prod", step=1, by=cast.alice)
    assert resolve_model(team=cast.alpha, model_id="math/agent:prod").model_id == "math/agent:1"
    services.alias_canary(alias=alias, step=3, share=0.25, by=cast.alice)
    served = [resolve_model(team=cast.alpha, model_id="math/agent:prod", split_key=f"c-{i}").model_id
              for i in range(1000)]  # fmt: skip
    share = served.count("math/agent:3") / len(served)
    assert set(served) == {"math/agent:1", "math/agent:3"} and 0.21 <= share <= 0.29, share
    for i in range(20):  # sticky: a conversation is served by one checkpoint throughout
        again = {resolve_model(team=cast.alpha, model_id="math/agent:prod", split_key=f"c-{i}").model_id
                 for _ in range(5)}  # fmt: skip
        assert again == {served[i]}
    # Without a conversation (an evaluation, a run) the alias's own checkpoint; beta has no such alias.
    assert resolve_model(team=cast.alpha, model_id="math/agent:prod").model_id == "math/agent:1"
    with pytest.raises(Exception, match="does not exist"):
        resolve_model(team=cast.beta, model_id="math/agent:prod", split_key="c-1")


def test_promotion_and_rollback_are_events_and_send_webhooks(cast, alpha_setup, steps):
    webhooks.webhook_endpoint_create(team=cast.alpha, name="hook", url="http://127.0.0.1:9/hook",
                                     events=["model_alias.*"])  # fmt: skip
    alias = services.alias_set(model=alpha_setup.model, name="prod", step=1, by=cast.alice)
    with pytest.raises(Conflict):
        services.alias_promote(alias=alias)  # no candidate
    with pytest.raises(Conflict):
        services.alias_rollback(alias=alias)  # nothing before step 1
    services.alias_canary(alias=alias, step=2, share=0.5, by=cast.alice)
    alias = services.alias_promote(alias=alias, by=cast.alice)
    assert (alias.checkpoint.step, alias.candidate, alias.candidate_share) == (2, None, 0.0)
    services.alias_canary(alias=alias, step=3, share=0.1)
    alias = services.alias_rollback(alias=alias)  # drops the candidate
    assert (alias.checkpoint.step, alias.candidate) == (2, None)
    alias = services.alias_rollback(alias=alias)  # back to the checkpoint before the promotion
    assert alias.checkpoint.step == 1
    events = [(e.action, e.checkpoint_step, e.candidate_step, e.previous_step, e.created_by)
              for e in AliasEvent.objects.order_by("id")]  # fmt: skip
    assert events == [
        ("set", 1, None, None, cast.alice), ("canary", 1, 2, None, cast.alice), ("promote", 2, None, 1, cast.alice),
        ("canary", 2, 3, None, None), ("rollback", 2, None, 2, None), ("rollback", 1, None, 2, None),
    ]  # fmt: skip
    sent = [
        (d.event_type, d.payload["data"]["checkpoint_step"]) for d in WebhookDelivery.objects.order_by("id")
    ]
    assert sent == [
        ("model_alias.promoted", 2),
        ("model_alias.rolled_back", 2),
        ("model_alias.rolled_back", 1),
    ]


@pytest.mark.parametrize(
    "name, step, share, field",
    [("latest", 1, 0.5, "name"), ("Prod", 1, 0.5, "name"), ("7", 1, 0.5, "name"), ("prod", 9, 0.5, "checkpoint"),
     ("prod", 1, 0.0, "share"), ("prod", 1, 1.5, "share"), ("prod", 1, float("nan"), "share")],
)  # fmt: skip
def test_bad_aliases_and_canaries_are_refused_naming_the_field(
    cast, alpha_setup, steps, name, step, share, field
):
    with pytest.raises(ValidationFailed) as bad:
        alias = services.alias_set(model=alpha_setup.model, name=name, step=step)
        services.alias_canary(alias=alias, step=2, share=share)
    assert bad.value.field == field


def test_a_checkpoint_an_alias_serves_is_not_deleted(cast, alpha_setup, steps):
    alias = services.alias_set(model=alpha_setup.model, name="prod", step=1)
    services.alias_canary(alias=alias, step=2, share=0.5)
    for step in (1, 2):
        with pytest.raises(Conflict, match=":prod"):
            services.checkpoint_delete(checkpoint=steps[step - 1])
    services.alias_delete(alias=alias)
    services.checkpoint_delete(checkpoint=steps[0])


def test_the_api_creates_canaries_promotes_and_compares_the_arms(cast, alpha_setup, steps, key_client,
                                                                 read_only_client, charlie_client):  # fmt: skip
    reply = key_client.post("/api/v1/aliases", {"model": alpha_setup.model.pk, "name": "prod", "checkpoint": 1},
                            format="json")  # fmt: skip
    assert reply.status_code == 201, reply.content
    alias_id = reply.json()["id"]
    assert reply.json()["name"] == "math/agent:prod"
    reply = key_client.post(
        f"/api/v1/aliases/{alias_id}/canary", {"checkpoint": 2, "share": 0.3}, format="json"
    )
    assert reply.status_code == 200 and reply.json()["candidate"] == 2
    # Completions stored through the alias, and their feedback, per checkpoint.
    for i, (step, reward) in enumerate([(1, 1.0), (1, 0.0), (2, 1.0), (2, None)]):
        row = store(cast.alpha, f"chatcmpl-a{i}", model="math/agent:prod")
        row.served_by = f"math/agent:{step}"
        row.save(update_fields=["served_by"])
        if reward is not None:
            services.feedback_add(team=cast.alpha, value=reward, completion=row)
    arms = key_client.get(f"/api/v1/aliases/{alias_id}").json()["arms"]
    assert [(a["role"], a["step"], a["completions"], a["rated"], a["mean_reward"]) for a in arms] == [
        ("checkpoint", 1, 2, 2, 0.5), ("candidate", 2, 2, 1, 1.0),
    ]  # fmt: skip
    assert read_only_client.post(f"/api/v1/aliases/{alias_id}/promote").status_code == 403
    assert charlie_client.post(f"/api/v1/aliases/{alias_id}/promote").status_code == 404
    reply = key_client.post(f"/api/v1/aliases/{alias_id}/promote")
    assert reply.status_code == 200 and reply.json()["checkpoint"] == 2
    assert reply.json()["events"][0]["action"] == "promote" and reply.json()["events"][0]["by"] == "key ci"
    reply = key_client.post(f"/api/v1/aliases/{alias_id}/promote")
    assert reply.status_code == 409 and error_of(reply)["param"] == "candidate"
    reply = key_client.post(
        f"/api/v1/aliases/{alias_id}/canary", {"checkpoint": 2, "share": 0.3}, format="json"
    )
    assert reply.status_code == 400 and error_of(reply)["param"] == "checkpoint"  # already the checkpoint


def test_the_cli_sets_canaries_promotes_and_rolls_back(
    cast, alpha_setup, steps, alpha_key, monkeypatch, capsys
):
    """``artweb aliases …`` (artweb.cli), its requests answered by the API in-process."""
    from artweb import cli
    from tests.conftest import _client

    api = _client(key=alpha_key)

    def request(self, method: str, path: str, body=None, **query):
        url = f"/api/v1/{path}"
        reply = api.get(url) if method == "GET" else api.post(url, body or {}, format="json")
        assert reply.status_code < 400, reply.content
        return reply.json()

    monkeypatch.setattr(cli.Client, "request", request)
    monkeypatch.setattr(cli, "load_credentials", lambda: None)

    def artweb(*args: str) -> dict:
        assert cli.main(list(args)) == 0
        return json.loads(capsys.readouterr().out)

    alias = artweb(
        "aliases", "set", "--model", str(alpha_setup.model.pk), "--name", "prod", "--checkpoint", "1"
    )
    assert alias["name"] == "math/agent:prod" and alias["checkpoint"] == 1
    alias_id = str(alias["id"])
    assert artweb("aliases", "canary", alias_id, "--checkpoint", "3", "--share", "0.2")["candidate"] == 3
    assert artweb("aliases", "promote", alias_id)["checkpoint"] == 3
    assert artweb("aliases", "rollback", alias_id)["checkpoint"] == 1
    assert [a["name"] for a in artweb("aliases", "list")["data"]] == ["math/agent:prod"]
    assert [e["action"] for e in AliasEvent.objects.order_by("id").values()] == [
        "set", "canary", "promote", "rollback",
    ]  # fmt: skip
