"""The Tinker API's ``RestClient`` routes (and a training client's ``save_weights_external``):
training runs, checkpoint names across them, external-weights exports (projects.tinker.exports)
with their TTLs, weights info, and the SDK's routes artweb does not offer (a 400 saying so)."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt

from projects import selectors, services
from projects.access import TeamAccess
from projects.errors import Conflict, NotFound, ValidationFailed
from projects.models import Checkpoint, TinkerModel
from projects.selectors.tinker_paths import SCHEME, checkpoint_for_path, is_public, name_expiry
from projects.services.tinker import TINKER_PROJECT
from projects.tinker import exports
from projects.tinker.views import (
    _checked_name,
    _error,
    _json,
    _model,
    _session,
    _submit,
    _text,
    endpoint,
    no_access_tokens,
)
from training.rollouts.strict_json import parse_int

# ---------------------------------------------------------------------- checkpoints
_KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}


def _checkpoint_rows(model: TinkerModel) -> list[dict[str, Any]]:
    return [row for checkpoint in selectors.model_checkpoints(model=model.model)
            for row in _rows_of(model.pk, checkpoint)]  # fmt: skip


def _rows_of(model_id: str, checkpoint: Checkpoint) -> list[dict[str, Any]]:
    """The SDK's checkpoint rows of one checkpoint: one per name it was saved under."""
    rows, now = [], timezone.now()
    for label in sorted(checkpoint.metrics.get("tinker_names", {})):
        expiry = name_expiry(checkpoint, label)
        if expiry is not None and expiry <= now:  # gone for the client; the sweep drops the name
            continue
        rows.append({
            "checkpoint_id": label, "checkpoint_type": _KINDS.get(label.partition("/")[0], "sampler"),
            "time": checkpoint.created_at.isoformat(), "tinker_path": f"tinker://{model_id}/{label}",
            "size_bytes": checkpoint.size_bytes or None, "public": is_public(checkpoint, label),
            "expires_at": expiry.isoformat() if expiry else None,
        })  # fmt: skip
    return rows


@endpoint("POST", write=True)
def save_weights_external(request: HttpRequest, access: TeamAccess) -> dict[str, Any]:
    return _submit(access, "save_weights_external", exports.checked_export(_checked_name(_json(request))))


@endpoint("GET")
def external_weights_urls(
    request: HttpRequest, access: TeamAccess, model_id: str, kind: str, name: str
) -> dict[str, Any]:
    return exports.signed_urls(request, access.team, _model(access, model_id).pk, f"{kind}/{name}")


@endpoint("PUT", write=True)
def checkpoint_ttl(
    request: HttpRequest, access: TeamAccess, model_id: str, kind: str, name: str
) -> HttpResponse:
    """``set_checkpoint_ttl_from_tinker_path``: a saved name's expiry from now (null: never)."""
    checkpoint_id = f"{kind}/{name}"
    ttl = _json(request).get("ttl_seconds")
    exports.check_ttl(ttl)
    path = f"tinker://{_model(access, model_id).pk}/{checkpoint_id}"
    checkpoint = checkpoint_for_path(access.team, path, param="checkpoint_id")
    services.tinker_export_ttl(checkpoint=checkpoint, name=checkpoint_id, ttl_seconds=ttl)
    return HttpResponse(status=204)


@endpoint("GET")
def training_run_checkpoints(request: HttpRequest, access: TeamAccess, model_id: str) -> dict[str, Any]:
    return {"checkpoints": _checkpoint_rows(_model(access, model_id)), "cursor": None}


@endpoint("DELETE", write=True)
def training_run_checkpoint_delete(
    request: HttpRequest, access: TeamAccess, model_id: str, checkpoint_id: str
) -> HttpResponse:
    """``RestClient.delete_checkpoint``: the name goes; the checkpoint itself once no name is left
    (a 400 saying what still uses it: the model's latest step, an evaluation, an export)."""
    model = _model(access, model_id)
    checkpoint = checkpoint_for_path(
        access.team, f"tinker://{model.pk}/{checkpoint_id}", param="checkpoint_id"
    )
    try:
        services.tinker_checkpoint_forget(checkpoint=checkpoint, name=checkpoint_id)
    except Conflict as exc:  # a 400: the SDK retries a 409 for minutes, as if it could clear up
        return _error(400, str(exc), "checkpoint_id")
    return HttpResponse(status=204)


@endpoint("GET")
def training_run_detail(request: HttpRequest, access: TeamAccess, model_id: str) -> dict[str, Any]:
    return _run_row(access, _model(access, model_id))


def _run_row(access: TeamAccess, model: TinkerModel) -> dict[str, Any]:
    rows = _checkpoint_rows(model)
    training = [r for r in rows if r["checkpoint_type"] == "training"]
    sampler = [r for r in rows if r["checkpoint_type"] == "sampler"]
    return {
        "training_run_id": model.pk, "base_model": model.model.base_model.name, "model_owner": access.team.name,
        "is_lora": True, "corrupted": bool(model.lost), "lora_rank": model.model.lora.get("rank"),
        "last_request_time": (model.drained_at or model.created_at).isoformat(),
        "last_checkpoint": training[-1] if training else None, "last_sampler_checkpoint": sampler[-1] if sampler else None,
        "user_metadata": None,
    }  # fmt: skip


@endpoint("GET")
def user_checkpoints(request: HttpRequest, access: TeamAccess) -> dict[str, Any]:
    """``RestClient.list_user_checkpoints``: every checkpoint name of the team's training clients,
    newest first, ``limit`` / ``offset`` paged."""
    limit, offset = _int_param(request, "limit", 100, 1, 1000), _int_param(request, "offset", 0, 0, 10**9)
    checkpoints = selectors.tinker_client_checkpoints(team=access.team)
    rows = sorted((row for client, checkpoint in checkpoints for row in _rows_of(client, checkpoint)),
                  key=lambda r: r["time"], reverse=True)  # fmt: skip
    return {"checkpoints": rows[offset : offset + limit],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(rows)}}  # fmt: skip


def _int_param(request: HttpRequest, name: str, default: int, low: int, high: int) -> int:
    raw = request.GET.get(name)
    if raw is None or raw in ("", "None"):
        return default
    value = parse_int(raw, low=low, high=high)  # not int(raw): 5,000 digits or "²" are a 400 too
    if value is None:
        raise ValidationFailed(f"must be a whole number from {low} to {high}", field=name)
    return value


@endpoint("POST")
def weights_info(request: HttpRequest, access: TeamAccess) -> dict[str, Any]:
    """``RestClient.get_weights_info_by_tinker_path``: what loading the checkpoint needs."""
    path = _text(_json(request), "tinker_path")
    checkpoint = checkpoint_for_path(access.team, path, param="tinker_path", public=True)
    lora = checkpoint.model.lora or {}
    return {"base_model": checkpoint.model.base_model.name, "is_lora": True, "lora_rank": lora.get("rank"),
            "train_unembed": False, "train_mlp": True, "train_attn": True}  # fmt: skip


@endpoint("POST", "DELETE", write=True)
def checkpoint_publish(
    request: HttpRequest, access: TeamAccess, model_id: str, kind: str, name: str
) -> HttpResponse:
    """``publish_checkpoint_from_tinker_path`` (POST) and ``unpublish_…`` (DELETE): a public name is
    readable by every team of this artweb by its tinker path (``load_state``, a sampling client,
    ``copy_weights``, weights info); only its own team lists, deletes, exports or re-times it."""
    if kind not in ("weights", "sampler_weights"):
        raise ValidationFailed("only weights and sampler_weights are published (an export is shared by its "
                               "signed URLs)", field="checkpoint_id")  # fmt: skip
    label = f"{kind}/{name}"
    checkpoint = checkpoint_for_path(
        access.team, f"{SCHEME}{_model(access, model_id).pk}/{label}", param="checkpoint_id"
    )
    services.tinker_checkpoint_publish(checkpoint=checkpoint, name=label, public=request.method == "POST")
    return HttpResponse(status=204)


@endpoint("POST", write=True)
def copy_weights(request: HttpRequest, access: TeamAccess) -> dict[str, Any]:
    """``RestClient.copy_weights``: the checkpoint (the team's, or a published one) copied into a
    session's slot or a project of the team, as a training client that is not trained on."""
    body = _json(request)
    no_access_tokens(request, body)
    source_path = _text(body, "source_path")
    source = checkpoint_for_path(access.team, source_path, param="source_path", public=True)
    exports.check_ttl(body.get("ttl_seconds"))
    session, seq, project = None, body.get("model_seq_id"), body.get("destination_project_id")
    if body.get("session_id"):
        session = _session(access, body["session_id"])
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise ValidationFailed("must be an integer of 0 or more with a session_id", field="model_seq_id")
    elif not isinstance(project, str) or not project:
        raise ValidationFailed("name the project of your team that gets the copy (or a session_id and "
                               "model_seq_id)", field="destination_project_id")  # fmt: skip
    elif project != TINKER_PROJECT and not selectors.team_project_exists(team=access.team, name=project):
        raise NotFound(f"no project named {project!r} in your team", field="destination_project_id")
    path = services.tinker_weights_copy(
        team=access.team, source=source, source_path=source_path, session=session, model_seq_id=seq,
        project=project, ttl_seconds=body.get("ttl_seconds"),
        idempotency_key=request.headers.get("X-Idempotency-Key", "")[:200],
    )  # fmt: skip
    return {"tinker_path": path}


# What the SDK can call that artweb does not offer: a 400 the SDK raises at once (never a retry).
NOT_OFFERED = {
    "retrieve_futures": "the batched poll (the client config switches it off)",
    "join_sampling_session": "joining a sampling session (the client config switches it off)",
    "create_custom_loss": "server-side custom losses (the SDK runs forward_backward_custom itself)",
    "sessions": "listing and searching sessions (the dashboard lists every Tinker run)",
    "trace_export": "session traces",
    "project": "moving a session to another project",
    "audit": "audit logs",
    "billing": "billing (the run's cost line counts its device seconds)",
    "auth": "token exchange and whoami (artweb keys are team API keys)",
}


@csrf_exempt
def not_offered(request: HttpRequest, what: str, **_: Any) -> HttpResponse:
    response = _error(400, f"artweb's Tinker API does not offer {NOT_OFFERED[what]}")
    response["x-should-retry"] = "false"
    return response


@endpoint("GET")
def training_runs(request: HttpRequest, access: TeamAccess) -> dict[str, Any]:
    return {
        "training_runs": [_run_row(access, m) for m in selectors.tinker_models_recent(team=access.team)],
        "cursor": None,
    }
