"""An export (POST /api/v1/checkpoints/{id}/exports) as claimed work: load the base model in fp32,
merge the checkpoint's adapter into it (peft merge_and_unload), write a Hugging Face folder with a
model card and store it (projects.storage) below the model's folder. A taken-over export restarts
from scratch; the stored folder appears in one put, so a half-written export is never served.
"""

from __future__ import annotations

import gc
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from django.conf import settings

from projects import selectors, services, storage
from projects.jobs.claimed import Claimed, Job, readable
from projects.models import Export
from training.base_models import load_base_model
from training.export import merge_adapter, save_merged


def _claim(export_id: int, worker: str) -> Export | None:
    return services.export_claim(export_id=export_id, worker=worker)


def _beat(export_id: int, worker: str) -> bool:
    return services.export_heartbeat(export_id=export_id, worker=worker)


def _fail(export_id: int, worker: str, exc: BaseException) -> None:
    services.export_fail(export_id=export_id, worker=worker, error=readable(exc))


def _export(claimed: Claimed[Export]) -> str:
    export = Export.objects.select_related("checkpoint__model__base_model", "checkpoint__model__project").get(
        pk=claimed.row.pk
    )
    checkpoint = export.checkpoint
    started = time.monotonic()
    adapter_dir = storage.checkpoint_local_dir(checkpoint)
    if adapter_dir is None:
        raise ValueError(f"checkpoint step {checkpoint.step} has no adapter files")
    # fp32 whatever the host: a merged export is the checkpoint's exact function, not a rounding.
    base, tokenizer = load_base_model(
        checkpoint.model.base_model.source, settings.MODEL_CACHE_DIR, dtype=torch.float32
    )
    merged: Any = merge_adapter(base, adapter_dir)
    root = Path(settings.CHECKPOINT_DIR)
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".export-{export.pk}-", dir=root))
    try:
        save_merged(
            merged, tokenizer, scratch, card=selectors.checkpoint_card(checkpoint=checkpoint, kind="merged")
        )
        del merged, base
        gc.collect()
        if claimed.heartbeat.lost:
            return "lost"
        stored = storage.checkpoint_store().put_dir(services.export_key(export), scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    finished = services.export_finish(
        export_id=export.pk,
        worker=claimed.worker,
        key=stored.key,
        size_bytes=stored.size_bytes,
        seconds=time.monotonic() - started,
    )
    return "succeeded" if finished else "lost"


EXPORT: Job[Export] = Job(kind="export", claim=_claim, beat=_beat, work=_export, fail=_fail)
