"""A LoRA adapter trained elsewhere imported as a model's step 0 (training.session.adapter_import checks it).

The model must have no checkpoint yet (its step 0 would otherwise be a different adapter than the
one its later steps trained from): a 409 otherwise. The folder is written complete (scratch copy
renamed into place) with fresh optimizer and RNG state, so a run on the model resumes from it as
from any checkpoint, and the gateway serves it at once as ``<project>/<model>:0``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from django.conf import settings
from django.db import transaction

from projects.errors import Conflict, ValidationFailed
from projects.models import Checkpoint, TrainableModel
from projects.services.run_forks import model_checkpoint_root, write_fresh_resume_state
from training.session.adapter_import import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterImportError,
    check_adapter,
    read_archive,
)


def model_adapter_import(*, model: TrainableModel, archive: bytes) -> Checkpoint:
    """Check the archive's adapter against ``model``'s base model and record it as step 0; the
    model's LoRA settings become the adapter's."""
    from projects import storage
    from projects.services.steps import checkpoint_record
    from training.model_files import base_model_config
    from training.runs.steps import checkpoint_path
    from training.session.checkpoint_files import CHECKPOINT_FORMAT_VERSION

    if Checkpoint.objects.filter(model=model).exists():
        raise Conflict(
            f"model {model.name} already has checkpoints: import an adapter into a new model",
            field="model",
            code="model_has_checkpoints",
        )
    try:
        config, weights = read_archive(archive, max_bytes=settings.MAX_ADAPTER_BYTES)
        adapter = check_adapter(
            config, weights, base_model_config(model.base_model.source, settings.MODEL_CACHE_DIR)
        )
    except AdapterImportError as exc:
        raise ValidationFailed(
            exc.message, field=exc.field if exc.field == "file" else f"adapter_config.{exc.field}"
        ) from None
    root = model_checkpoint_root(model)
    root.mkdir(parents=True, exist_ok=True)
    target = checkpoint_path(root, 0)
    scratch = Path(tempfile.mkdtemp(prefix=".import-", dir=root))
    key = ""
    try:
        folder = scratch / "checkpoint"
        folder.mkdir()
        (folder / CONFIG_FILE).write_text(json.dumps(adapter.config, indent=2))
        (folder / WEIGHTS_FILE).write_bytes(adapter.weights)
        state = {"format_version": CHECKPOINT_FORMAT_VERSION, "step": 0, "config": {}, "lora": adapter.lora.to_dict(),
                 "metrics": {}, "imported": {"base_model_name_or_path": adapter.config.get("base_model_name_or_path")}}  # fmt: skip
        (folder / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
        write_fresh_resume_state(folder, config={})
        with transaction.atomic():
            locked = TrainableModel.objects.select_for_update().get(pk=model.pk)
            if Checkpoint.objects.filter(model=locked).exists():
                raise Conflict(
                    f"model {model.name} already has checkpoints", field="model", code="model_has_checkpoints"
                )
            if target.exists():  # left by an import that failed before recording it
                shutil.rmtree(target)
            folder.rename(target)
            key = storage.checkpoint_key(model_id=model.pk, step=0)
            stored = storage.checkpoint_store().put_dir(key, target)
            locked.lora = adapter.lora.to_dict()
            locked.save(update_fields=["lora"])
            model.lora = locked.lora
            return checkpoint_record(model=locked, run=None, step=0, path=str(target),
                                     metrics={"imported": True}, stored=stored)  # fmt: skip
    except BaseException:
        if key:
            storage.checkpoint_store().delete(key)
        if target.exists() and not Checkpoint.objects.filter(model=model, step=0).exists():
            shutil.rmtree(target, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
