"""The gateway's side of client-driven training: OpenPipe ART's checkpoint names resolve in the
caller's team only and are listed, a model's step 0 without files is served as the base model, the
latest alias is never remembered, and a logprobs request asks for (and returns) exact token ids."""

from __future__ import annotations

import json

import pytest
from django.http import HttpResponse

from projects import services
from projects.gateway import lookups, routing, token_ids
from projects.gateway.routing import ParsedChat, Route
from projects.gateway.services import inference_server_heartbeat
from projects.selectors.serving import ModelNotFound, Target, resolve_model
from training.serving.protocol import Limits, parse_chat_request

pytestmark = pytest.mark.django_db


@pytest.fixture
def client_model(cast, settings, tmp_path):
    services.base_model_register(name="tiny", source="/nowhere")
    model, run = services.client_model_register(
        team=cast.alpha, entity=None, project="games", name="agent", base_model="tiny"
    )
    services.checkpoint_record(model=model, run=run, step=1, path=str(tmp_path / "step-000001"))
    return model


def test_arts_names_are_aliases_of_the_teams_checkpoints(client_model, cast):
    latest = resolve_model(team=cast.alpha, model_id="wandb-artifact:///alpha/games/agent")
    assert (latest.model_id, latest.checkpoint.step) == ("games/agent:1", 1)
    first = resolve_model(team=cast.alpha, model_id="wandb-artifact:///alpha/games/agent:step0")
    # Step 0 has no files: the untrained adapter is the base model, served as such.
    assert (first.model_id, first.checkpoint.step, first.adapter_path) == ("games/agent:0", 0, None)
    assert latest.adapter_path.endswith("step-000001")


def test_a_name_that_is_no_slug_resolves_and_is_echoed_as_the_client_sent_it(client_model, cast, tmp_path):
    model, run = services.client_model_register(
        team=cast.alpha, entity=None, project="My Games", name="Run #2 (α)", base_model="tiny"
    )
    services.checkpoint_record(model=model, run=run, step=1, path=str(tmp_path / "odd-1"))
    target = resolve_model(team=cast.alpha, model_id="wandb-artifact:///alpha/My Games/Run #2 (α):step1")
    assert (target.model_id, target.checkpoint.model_id) == ("My Games/Run #2 (α):1", model.pk)
    latest = resolve_model(team=cast.alpha, model_id="wandb-artifact:///alpha/My Games/Run #2 (α)")
    assert latest.model_id == "My Games/Run #2 (α):1"
    with pytest.raises(ModelNotFound):
        resolve_model(team=cast.beta, model_id="wandb-artifact:///beta/My Games/Run #2 (α)")


@pytest.mark.parametrize(
    "name",
    [
        "wandb-artifact:///beta/games/agent",  # another team's entity, even for a model alpha has
        "wandb-artifact:///alpha/games/agent:step7",
        "wandb-artifact:///alpha/games/nothing",
        "wandb-artifact:///alpha/games/agent:stepx",
    ],
)
def test_other_teams_and_missing_steps_are_not_found(client_model, cast, name):
    with pytest.raises(ModelNotFound) as missing:
        resolve_model(team=cast.alpha, model_id=name)
    assert name in missing.value.message


def test_another_team_cannot_reach_the_checkpoint_under_its_own_name(client_model, cast):
    with pytest.raises(ModelNotFound):
        resolve_model(team=cast.beta, model_id="wandb-artifact:///beta/games/agent")


def test_v1_models_lists_arts_names_for_client_models(client_model, cast):
    ids = {item["id"] for item in routing.available_models(team=cast.alpha)}
    assert {"wandb-artifact:///alpha/games/agent", "wandb-artifact:///alpha/games/agent:step0",
            "wandb-artifact:///alpha/games/agent:step1", "games/agent:latest"} <= ids  # fmt: skip
    assert not any(
        i.startswith("wandb-artifact:") for i in (m["id"] for m in routing.available_models(team=cast.beta))
    )


def test_only_the_latest_alias_is_never_remembered():
    assert routing.names_latest("wandb-artifact:///alpha/games/agent")
    assert not routing.names_latest("wandb-artifact:///alpha/games/agent:step3")
    assert not routing.names_latest("games/agent:latest")  # the documented second of lag stays


def test_the_gateway_serves_a_new_latest_at_once_to_arts_name(client_model, cast, settings):
    from projects.gateway.views import _route

    settings.GATEWAY_LOOKUP_CACHE_S = 60
    inference_server_heartbeat(url="http://a:1", base_model_name="tiny")
    lookups.routes.clear()
    name = "wandb-artifact:///alpha/games/agent"
    assert _route(cast.alpha, name)[0].model_id == "games/agent:1"
    services.checkpoint_record(model=client_model, run=None, step=2, path="/nowhere/step-000002")
    assert _route(cast.alpha, name)[0].model_id == "games/agent:2"


def _chat(**body) -> ParsedChat:
    decoded = {"model": "games/agent:1", "messages": [{"role": "user", "content": "hi"}], **body}
    raw = json.dumps(decoded).encode()
    return token_ids.ask_for_token_ids(
        ParsedChat(raw, decoded, parse_chat_request(decoded, Limits.shape_only()))
    )


def test_a_logprobs_request_asks_the_server_for_token_ids_and_each_choice_gets_them(client_model):
    chat = _chat(logprobs=True)
    assert (
        chat.annotate and json.loads(chat.raw)["return_token_ids"] is True and chat.request.return_token_ids
    )
    assert not _chat().annotate and not _chat(logprobs=True, stream=True).annotate
    target = Target("games/agent:1", client_model.base_model, None)
    reply = {"choices": [{"index": 0, "token_ids": [5, 2]}], "prompt_token_ids": [1, 3]}
    answered = token_ids.annotated(HttpResponse(json.dumps(reply), content_type="application/json"),
                                   Route(None, target, [], chat))  # fmt: skip
    body = json.loads(answered.content)
    assert body["choices"][0] == {"index": 0, "token_ids": [5, 2], "prompt_token_ids": [1, 3],
                                  "artweb_model": "games/agent:1"}  # fmt: skip
    assert "prompt_token_ids" not in body  # the client did not ask for it
    asked = _chat(logprobs=True, return_token_ids=True)
    assert asked.annotate and asked.keep_prompt_token_ids
