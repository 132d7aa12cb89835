"""Tinker's external weights: a checkpoint's LoRA adapter in Hugging Face PEFT form
(``adapter_config.json``, ``adapter_model.safetensors``), saved by name with
``TrainingClient.save_weights_external`` and downloaded file by file from signed URLs
(``RestClient.get_external_weights_urls``; ``tinker_cookbook.weights.download`` does both).

- ``tinker://<training run>/external_weights/<name>`` names the export; it lists, deletes and takes
  a TTL (``set_checkpoint_ttl_from_tinker_path``) like any checkpoint name. An expired export is a
  404 and its name is dropped on the next read.
- ``age_encryption_recipients`` (at most 10 ``age1…`` keys): every file is served age-encrypted to
  them (with pyrage) under its name + ``.age``; the plain bytes never leave the server.
- A signed URL (valid ``URL_SECONDS``, 1 h) needs no key: it names one file of one export of one
  team's checkpoint, and stops working when it expires, the export is deleted or the TTL passes.
"""

from __future__ import annotations

import datetime
from typing import Any

from django.core import signing
from django.http import FileResponse, HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt

from projects import selectors
from projects.errors import NotFound, ValidationFailed
from projects.models import Checkpoint
from projects.selectors.tinker_paths import checkpoint_for_path, name_expiry
from training.wire.openai_errors import error_object

EXPORT_FILES = ("adapter_config.json", "adapter_model.safetensors")
AGE_SUFFIX = ".age"
URL_SECONDS = 3600
MAX_RECIPIENTS = 10
TTL_RANGE = (3600, 10 * 365 * 24 * 3600)  # the SDK's: 1 hour to 10 years
_SALT = "artweb.tinker.external-weights"

__all__ = [
    "AGE_SUFFIX",
    "EXPORT_FILES",
    "MAX_RECIPIENTS",
    "TTL_RANGE",
    "URL_SECONDS",
    "check_ttl",
    "checked_export",
    "download",
    "live_export",
    "signed_urls",
]


def checked_export(body: dict[str, Any]) -> dict[str, Any]:
    """``save_weights_external``'s body, checked: a 400 naming the field otherwise."""
    if not isinstance(body.get("path"), str) or not body["path"]:
        raise ValidationFailed("is required: the export's name", field="path")
    check_ttl(body.get("ttl_seconds"))
    recipients = body.get("age_encryption_recipients")
    if recipients is not None:
        if not isinstance(recipients, list) or not recipients or len(recipients) > MAX_RECIPIENTS:
            raise ValidationFailed(f"must be a list of 1 to {MAX_RECIPIENTS} age recipients",
                                   field="age_encryption_recipients")  # fmt: skip
        for index, recipient in enumerate(recipients):
            _recipient(recipient, f"age_encryption_recipients[{index}]")
    return body


def check_ttl(ttl: Any) -> None:
    low, high = TTL_RANGE
    if ttl is not None and (not isinstance(ttl, int) or isinstance(ttl, bool) or not low <= ttl <= high):
        raise ValidationFailed(f"must be whole seconds from {low} (1 hour) to {high} (10 years), or null",
                               field="ttl_seconds")  # fmt: skip


def _recipient(value: Any, field: str) -> Any:
    import pyrage

    if isinstance(value, str) and value.startswith("age1"):
        try:
            return pyrage.x25519.Recipient.from_str(value)
        except Exception:  # noqa: BLE001 (pyrage raises its own error types for a malformed key)
            pass
    raise ValidationFailed(
        "is not an age X25519 recipient (age1…); SSH keys are not accepted here", field=field
    )


def live_export(team: Any, model_id: str, checkpoint_id: str) -> tuple[Checkpoint, dict[str, Any]]:
    """The checkpoint and export record ``tinker://<model_id>/<checkpoint_id>`` names, if it is an
    unexpired external-weights export of the team's; a 404 otherwise (an expired name is one, until
    the sweep drops it: services.tinker_names_expire)."""
    if not checkpoint_id.startswith("external_weights/"):
        raise ValidationFailed("only external weights (external_weights/<name>) are downloadable; save "
                               "them with save_weights_external", field="checkpoint_id")  # fmt: skip
    checkpoint = checkpoint_for_path(team, f"tinker://{model_id}/{checkpoint_id}", param="checkpoint_id")
    return checkpoint, checkpoint.metrics.get("tinker_exports", {}).get(checkpoint_id, {})


def signed_urls(request: HttpRequest, team: Any, model_id: str, checkpoint_id: str) -> dict[str, Any]:
    """``ExternalWeightsUrlsResponse``: a signed URL per file, valid ``URL_SECONDS``."""
    checkpoint, record = live_export(team, model_id, checkpoint_id)
    suffix = AGE_SUFFIX if record.get("recipients") else ""
    urls = {}
    for name in EXPORT_FILES:
        token = signing.dumps([checkpoint.pk, team.pk, model_id, checkpoint_id, name], salt=_SALT)
        urls[name + suffix] = request.build_absolute_uri(f"/tinker/files/{token}")
    expires = timezone.now() + datetime.timedelta(seconds=URL_SECONDS)
    expiry = name_expiry(checkpoint, checkpoint_id)
    if expiry is not None:
        expires = min(expires, expiry)
    return {"urls": urls, "expires": expires.isoformat()}


def _refuse(status: int, message: str) -> JsonResponse:
    return JsonResponse(error_object(status, message), status=status)


@csrf_exempt
def download(request: HttpRequest, token: str) -> HttpResponse | FileResponse:
    """One file of an export, by a signed URL (no key: the signature is the permission)."""
    from projects.storage import checkpoint_local_dir

    if request.method != "GET":
        return _refuse(405, "use GET here")
    try:
        checkpoint_pk, team_pk, model_id, checkpoint_id, name = signing.loads(
            token, salt=_SALT, max_age=URL_SECONDS
        )
    except signing.SignatureExpired:
        return _refuse(403, "this download URL has expired: ask for new ones (get_external_weights_urls)")
    except signing.BadSignature:
        return _refuse(403, "not a valid download URL")
    team = selectors.team_of_signed_url(team_pk)
    try:
        checkpoint, record = live_export(team, model_id, checkpoint_id)
    except (NotFound, ValidationFailed) as exc:
        return _refuse(404, str(exc))
    if checkpoint.pk != checkpoint_pk or name not in EXPORT_FILES:
        return _refuse(404, "this export no longer holds that file")
    folder = checkpoint_local_dir(checkpoint)
    if folder is None or not (folder / name).is_file():
        return _refuse(404, "this export's files are missing")
    path = folder / name
    if not record.get("recipients"):
        return FileResponse(path.open("rb"), as_attachment=True, filename=name)
    import pyrage

    recipients = [_recipient(r, "recipient") for r in record["recipients"]]
    encrypted = pyrage.encrypt(path.read_bytes(), recipients)
    response = HttpResponse(encrypted, content_type="application/octet-stream")
    response["Content-Disposition"] = f'attachment; filename="{name}{AGE_SUFFIX}"'
    return response
