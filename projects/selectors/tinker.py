"""Reads for the Tinker API (projects.tinker): a team's sessions, training clients, samplers and
futures by the ids the SDK sends, and the rows its answers list. Every id lookup goes through
``scoped`` (the model's ``TEAM_PATH``), so another team's id reads as absent (the views' 404);
functions taking a row take one already read through the caller's team. The base-model catalogue
is shared by every team, and a download's team comes from its signed URL (projects.tinker.exports).
"""

from __future__ import annotations

from typing import Any

from projects.models import (
    BaseModel,
    Checkpoint,
    Project,
    Team,
    TinkerFuture,
    TinkerModel,
    TinkerSampler,
    TinkerSession,
)
from projects.selectors._scoping import scoped


def tinker_session_get(*, team: Team, session_id: Any) -> TinkerSession | None:
    return scoped(TinkerSession, team).filter(pk=str(session_id)).select_related("project").first()


def tinker_session_latest(*, team: Team) -> TinkerSession | None:
    """The team's newest session (``asample`` without a sampling session samples in it)."""
    return scoped(TinkerSession, team).order_by("-created_at").first()


def tinker_session_training_run_ids(*, session: TinkerSession) -> list[str]:
    return list(session.models.order_by("created_at").values_list("id", flat=True))


def tinker_session_sampler_ids(*, session: TinkerSession) -> list[str]:
    return list(session.samplers.order_by("created_at").values_list("id", flat=True))


def tinker_model_get(*, team: Team, model_id: Any) -> TinkerModel | None:
    return (
        scoped(TinkerModel, team)
        .filter(pk=str(model_id))
        .select_related("model__base_model", "session", "run")
        .first()
    )


def tinker_models_recent(*, team: Team, limit: int = 100) -> list[TinkerModel]:
    """The team's newest ``limit`` training clients (``RestClient.list_training_runs``)."""
    models = scoped(TinkerModel, team).select_related("model__base_model")
    return list(models.order_by("-created_at")[:limit])


def tinker_client_checkpoints(*, team: Team) -> list[tuple[str, Checkpoint]]:
    """Every checkpoint of the team's training clients with its client's id, in two queries
    whatever the number of clients: their ids by model, then the checkpoints."""
    clients = dict(scoped(TinkerModel, team).values_list("model_id", "id"))
    return [(clients[checkpoint.model_id], checkpoint)
            for checkpoint in Checkpoint.objects.filter(model_id__in=clients)]  # fmt: skip


def tinker_sampler_get(*, team: Team, sampler_id: Any) -> TinkerSampler | None:
    return scoped(TinkerSampler, team).filter(pk=str(sampler_id)).select_related("base_model").first()


def tinker_future_get(*, team: Team, request_id: Any) -> TinkerFuture | None:
    return scoped(TinkerFuture, team).filter(pk=str(request_id)).first()


def tinker_future_refresh(*, future: TinkerFuture) -> None:
    """Re-read what a worker writes when it answers (``retrieve_future`` polls it in place)."""
    future.refresh_from_db(fields=["status", "result", "blob", "error", "category"])


def team_project_exists(*, team: Team, name: str) -> bool:
    return scoped(Project, team).filter(name=name).exists()


def base_models_by_name() -> list[BaseModel]:
    """The base-model catalogue (every team's), by name."""
    return list(BaseModel.objects.order_by("name"))


def base_model_named(name: str) -> BaseModel | None:
    return BaseModel.objects.filter(name=name).first()


def team_of_signed_url(team_id: Any) -> Team | None:
    """The team a signed download URL names: the signature is the permission, so this is the one
    read here not tied to a caller's team (projects.tinker.exports.download)."""
    return Team.objects.filter(pk=team_id).first()
