"""Checkpoints as managed assets over REST: read and delete one, prune a model's checkpoints by a
retention policy, download an adapter, and export merged weights (a job, shaped like OpenAI's jobs:
a status to poll, then the content).

- ``GET|DELETE /api/v1/checkpoints/{id}``: 409 ``checkpoint_in_use`` naming what uses it.
- ``POST /api/v1/models/{id}/checkpoints/prune`` ``{keep_last: N, keep_best: {metric, n, mode},
  dry_run}``: deletes what the policy does not keep, never one in use (listed in ``in_use``).
  A model's own policy (``PATCH /api/v1/models/{id}`` ``{retention: {...}}``) runs after every step.
- ``GET /api/v1/checkpoints/{id}/adapter``: a tar.gz a ``PeftModel.from_pretrained`` loads once
  unpacked (adapter weights, adapter_config.json, README.md model card).
- ``GET|POST /api/v1/checkpoints/{id}/exports`` ``{format: "merged"}``, ``GET /api/v1/exports/{id}``
  and ``GET /api/v1/exports/{id}/content`` (a tar.gz of the Hugging Face folder).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from django.http import FileResponse
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import mixins, serializers, status
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from projects import selectors, services, storage
from projects.api import serializers as s
from projects.api.base import TeamViewSet
from projects.api.views import _user, _valid
from projects.errors import Conflict, ValidationFailed
from projects.models import Checkpoint, Export, ExportFormat, ExportStatus, TrainableModel
from training.export import ADAPTER_FILES, write_archive

ARCHIVE_MEMORY_BYTES = 64 * 1024 * 1024  # archives larger than this spill to a temporary file

# --- serializers ------------------------------------------------------------------------------


class PruneIn(s.InputSerializer):
    keep_last = serializers.JSONField(required=False, help_text="keep the newest N checkpoints")
    keep_best = serializers.JSONField(
        required=False, help_text='{"metric": "eval.mean_reward", "n": K, "mode": "max"}: keep the best K'
    )
    dry_run = serializers.BooleanField(required=False, default=False)  # type: ignore[assignment]


class InUseOut(serializers.Serializer):
    step = serializers.IntegerField()
    reason = serializers.CharField()


class PruneOut(serializers.Serializer):
    object = serializers.CharField(default="checkpoint.prune")
    dry_run = serializers.BooleanField()  # type: ignore[assignment]
    deleted_steps = serializers.ListField(child=serializers.IntegerField(), source="deleted")
    kept_steps = serializers.ListField(child=serializers.IntegerField(), source="kept")
    in_use = serializers.SerializerMethodField()
    freed_bytes = serializers.IntegerField()

    def get_in_use(self, result: services.PruneResult) -> list[dict[str, Any]]:
        return [{"step": step, "reason": reason} for step, reason in sorted(result.in_use.items())]


class ExportIn(s.InputSerializer):
    format = serializers.ChoiceField(
        choices=ExportFormat.choices, required=False, default=ExportFormat.MERGED
    )


class ExportOut(serializers.ModelSerializer):
    object = serializers.SerializerMethodField()
    model_id = serializers.SerializerMethodField()
    step = serializers.IntegerField(source="checkpoint.step", read_only=True)

    class Meta:
        model = Export
        fields = [
            "id", "object", "checkpoint", "model_id", "step", "format", "status", "error", "size_bytes",
            "seconds", "attempts", "created_at", "started_at", "finished_at",
        ]  # fmt: skip

    def get_object(self, obj: Export) -> str:
        return "export"

    def get_model_id(self, obj: Export) -> str:
        model = obj.checkpoint.model
        return f"{model.project.name}/{model.name}:{obj.checkpoint.step}"


# --- views ------------------------------------------------------------------------------------


def _archive_response(folder: Path | None, filename: str, **kwargs: Any) -> FileResponse:
    """A tar.gz of ``folder`` streamed from a spooled temporary file (memory, then disk)."""
    # Not a context manager: FileResponse closes it once the body is sent.
    spool = tempfile.SpooledTemporaryFile(max_size=ARCHIVE_MEMORY_BYTES)  # noqa: SIM115
    write_archive(spool, folder, **kwargs)  # type: ignore[arg-type]
    spool.seek(0)
    return FileResponse(spool, as_attachment=True, filename=filename, content_type="application/gzip")


def _slug(checkpoint: Checkpoint) -> str:
    return f"{checkpoint.model.project.name}-{checkpoint.model.name}-step{checkpoint.step}"


class CheckpointViewSet(TeamViewSet, mixins.RetrieveModelMixin):
    model = Checkpoint
    serializer_class = s.CheckpointOut

    def base_queryset(self) -> Any:
        return Checkpoint.objects.select_related("model__project", "model__base_model", "run")

    @extend_schema(request=None, responses={204: None})
    def destroy(self, request: Request, pk: str) -> Response:
        services.checkpoint_delete(checkpoint=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(responses={(200, "application/gzip"): OpenApiResponse(description="tar.gz")})
    @action(detail=True, methods=["get"])
    def adapter(self, request: Request, pk: str) -> FileResponse:
        """The adapter as a tar.gz: ``adapter_model.safetensors``, ``adapter_config.json`` and a
        ``README.md`` model card (base model, step, run config, evaluation figures)."""
        checkpoint = self.get_object()
        folder = storage.checkpoint_local_dir(checkpoint)
        if folder is None or not (folder / ADAPTER_FILES[0]).is_file():
            raise Conflict(
                f"checkpoint step {checkpoint.step} has no adapter files (the untrained step 0 of a "
                "client model is the base model itself)",
                field="checkpoint",
                code="nothing_to_export",
            )
        card = selectors.checkpoint_card(checkpoint=checkpoint, kind="adapter")
        return _archive_response(
            folder, f"{_slug(checkpoint)}-adapter.tar.gz", names=ADAPTER_FILES, extra={"README.md": card}
        )

    @extend_schema(methods=["GET"], responses=ExportOut(many=True))
    @extend_schema(methods=["POST"], request=ExportIn, responses={201: ExportOut, 200: ExportOut})
    @action(detail=True, methods=["get", "post"])
    def exports(self, request: Request, pk: str) -> Response:
        """POST queues an export (``{format: "merged"}``; an unfinished or finished export of the
        same format is returned, 200); GET lists the checkpoint's exports, newest first."""
        checkpoint = self.get_object()
        if request.method == "GET":
            queryset = Export.objects.filter(checkpoint=checkpoint).select_related(
                "checkpoint__model__project"
            )
            return self.paginated(queryset.order_by("-id"), ExportOut)
        data = _valid(ExportIn, request.data)
        export, created = services.export_create(
            checkpoint=checkpoint, format=data["format"], created_by=_user(request)
        )
        return Response(
            ExportOut(export).data, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK
        )


class ModelCheckpointsPruneView(TeamViewSet):
    """``POST /api/v1/models/{id}/checkpoints/prune``: see the module docstring."""

    model = TrainableModel
    lookup_url_kwarg = "model_id"
    serializer_class = PruneIn  # what OPTIONS describes

    @extend_schema(request=PruneIn, responses=PruneOut)
    def create(self, request: Request, model_id: int) -> Response:
        model = self.get_object()
        if not isinstance(request.data, dict):
            raise ValidationFailed("must be a JSON object {keep_last, keep_best, dry_run}", field="body")
        data = _valid(PruneIn, request.data)
        policy = {key: value for key, value in request.data.items() if key != "dry_run"}
        result = services.checkpoints_prune(model=model, policy=policy, dry_run=data["dry_run"])
        return Response(PruneOut(result).data)


class ExportViewSet(TeamViewSet, mixins.RetrieveModelMixin):
    model = Export
    serializer_class = ExportOut

    def base_queryset(self) -> Any:
        return Export.objects.select_related("checkpoint__model__project")

    @extend_schema(responses={(200, "application/gzip"): OpenApiResponse(description="tar.gz")})
    @action(detail=True, methods=["get"])
    def content(self, request: Request, pk: str) -> FileResponse:
        """The merged model as a tar.gz of its Hugging Face folder (409 until it succeeded)."""
        export = self.get_object()
        if export.status != ExportStatus.SUCCEEDED or not export.key:
            raise Conflict(
                f"export {export.pk} is {export.status}; poll it until succeeded", code="not_ready"
            )
        store = selectors.checkpoint_store()
        stored = store.stat(export.key)
        if stored is None:
            raise Conflict(f"export {export.pk}'s files are gone from storage", code="export_missing")
        folder = store.fetch_dir(export.key, sha256=stored.sha256)
        return _archive_response(folder, f"{_slug(export.checkpoint)}-merged.tar.gz")
