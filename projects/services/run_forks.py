"""Forks: a new model whose step 0 is a copy of a run's checkpoint (adapter, optimizer and RNG
state, through the checkpoint store), and a queued run on it with the run's inputs. The copy is
complete before its row exists; a checkpoint that retention left with only its adapter gets fresh
optimizer state."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction

from projects.errors import Conflict, ValidationFailed
from projects.models import Checkpoint, Project, Run, TrainableModel
from projects.services.runs import _refuse_client_run, run_create, run_event_add, run_platform_inputs
from training.config import TrainConfig


def model_checkpoint_root(model: TrainableModel) -> Path:
    """The folder of a model's checkpoints: one ``step-NNNNNN`` folder per step (training.runs.loop)."""
    return Path(settings.CHECKPOINT_DIR) / f"model-{model.pk}"


def run_fork(
    *,
    run: Run,
    from_step: int,
    name: str,
    config: dict[str, Any] | None = None,
    created_by: User | None = None,
) -> Run:
    """A new model in the run's project whose step 0 is a copy of checkpoint ``from_step`` of the
    run's model (adapter, optimizer and RNG state: it trains on as a resume would; a checkpoint
    that retention left with only its adapter gets fresh optimizer state), and a new run
    on it with the run's task set, environment, reward and config, ``config`` overriding any
    hyperparameters. The copy is the fork's own object in the checkpoint store: pruning or
    deleting the source later leaves it whole."""

    _refuse_client_run(run, "fork")
    task_set, environment, reward = run_platform_inputs(run=run)
    source = Checkpoint.objects.filter(model=run.model, step=from_step).first()
    if source is None:
        steps = list(Checkpoint.objects.filter(model=run.model).values_list("step", flat=True))
        raise ValidationFailed(
            f"model {run.model.name} has no checkpoint at step {from_step}"
            + (f" (it has steps {', '.join(map(str, steps))})" if steps else ""),
            field="from_step",
        )
    merged = {**run.config, **(config or {})}

    def start(model: TrainableModel) -> Run:
        forked = run_create(
            model=model,
            task_set=task_set,
            environment=environment,
            reward=reward,
            config=merged,
            created_by=created_by,
            forked_from=source,
        )
        run_event_add(
            run=run,
            message=f"Forked from checkpoint step {from_step} as model {model.name} (run #{forked.pk})",
            data={"fork_run": forked.pk, "fork_model": model.pk, "step": from_step},
        )
        return forked

    return checkpoint_fork(
        source=source, project=run.project, name=name, config=merged, start=start, field="from_step"
    )


def checkpoint_fork(
    *,
    source: Checkpoint,
    project: Project,
    name: str,
    config: dict[str, Any],
    start: Callable[[TrainableModel], Run],
    field: str,
) -> Run:
    """A new model ``name`` in ``project`` whose step 0 is a copy of ``source`` (the fork's own
    object in the checkpoint store), and the run ``start`` makes on it, in one transaction: a
    fork that did not happen leaves nothing behind, not its folder, not its stored copy. A fork
    of a run (``run_fork``) and a fine-tuning job continuing a checkpoint both come here."""
    from projects import storage

    try:
        folder = storage.checkpoint_local_dir(source)  # None: a client model's untrained step 0
    except storage.StorageError as exc:
        raise Conflict(
            f"the files of checkpoint step {source.step} cannot be read: {exc}",
            field=field,
            code="checkpoint_files_missing",
        ) from exc
    if folder is not None:
        _check_forkable(folder, step=source.step, field=field)
    written: Path | None = None
    key = ""
    try:
        with transaction.atomic():
            # Imported here: both modules import this one.
            from projects.services.projects import trainable_model_create
            from projects.services.steps import checkpoint_record

            model = trainable_model_create(
                project=project, name=name, base_model=source.model.base_model, lora=source.model.lora
            )
            if folder is not None:
                written = model_checkpoint_root(model)
                step_zero = _copy_checkpoint(folder, written, source=source, config=config)
                key = storage.checkpoint_key(model_id=model.pk, step=0)
                stored = storage.checkpoint_store().put_dir(key, step_zero)
                checkpoint_record(
                    model=model, run=None, step=0, path=str(step_zero), metrics={}, stored=stored
                )
            return start(model)
    except BaseException:
        if written is not None:
            shutil.rmtree(written, ignore_errors=True)
        if key:
            storage.checkpoint_store().delete(key)
        raise


# What Policy.save_checkpoint writes besides the adapter, for a resume (training.session.policy); retention
# drops them from checkpoints no resume needs (services.checkpoints.RESUME_STATE_FILES).
OPTIMIZER_STATE, RNG_STATE = "optimizer.pt", "rng_state.pt"


def _check_forkable(folder: Path, *, step: int, field: str) -> None:
    missing = [name for name in ("adapter_model.safetensors", "state.json") if not (folder / name).is_file()]
    if missing:
        raise Conflict(
            f"the files of checkpoint step {step} are incomplete (missing {', '.join(missing)})",
            field=field,
            code="checkpoint_files_missing",
        )


def write_fresh_resume_state(folder: Path, *, config: dict[str, Any]) -> None:
    """Optimizer and RNG state for a fork of a checkpoint that kept only its adapter: AdamW with no
    moments yet (what a new Policy starts with) and generators seeded from the fork's config, in
    the files Policy.resume reads. The optimizer's state dict is a real AdamW's, over one
    placeholder per adapter tensor (plain LoRA: the adapter's tensors are the trainable ones)."""
    import random

    import torch
    from safetensors import safe_open

    train_config = TrainConfig.from_dict(config)
    with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as weights:
        count = len(list(weights.keys()))
    placeholders = [torch.nn.Parameter(torch.zeros(1)) for _ in range(count)]
    # The rate in the state is a placeholder: Policy.resume sets the run's own.
    rate = train_config.learning_rate if train_config.learning_rate is not None else 0.0
    optimizer = torch.optim.AdamW(placeholders, lr=rate, weight_decay=train_config.weight_decay)
    torch.save(optimizer.state_dict(), folder / OPTIMIZER_STATE)
    generator = torch.Generator().manual_seed(train_config.seed)
    rng = {"torch": generator.get_state(), "python": random.Random(train_config.seed).getstate()}
    torch.save(rng, folder / RNG_STATE)


def _copy_checkpoint(folder: Path, root: Path, *, source: Checkpoint, config: dict[str, Any]) -> Path:
    """Copy checkpoint ``folder`` whole as ``root/step-000000`` (complete before it appears: a
    scratch copy renamed into place), its ``state.json`` saying step 0 and where it came from. A
    source that kept only its adapter gets fresh optimizer and RNG state (``fresh_state`` in
    ``forked_from``): the fork then starts from its weights with new optimizer moments."""
    from training.runs.steps import checkpoint_path

    target = checkpoint_path(root, 0)
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".fork-", dir=root))
    try:
        copy = scratch / "checkpoint"
        shutil.copytree(folder, copy)
        state_file = copy / "state.json"
        state = json.loads(state_file.read_text())
        fresh = not (copy / OPTIMIZER_STATE).is_file() or not (copy / RNG_STATE).is_file()
        if fresh:
            write_fresh_resume_state(copy, config=config)
        state["forked_from"] = {
            "model": source.model_id,
            "step": source.step,
            "checkpoint": source.pk,
            "fresh_state": fresh,
        }
        state["step"] = 0
        state_file.write_text(json.dumps(state, indent=2, sort_keys=True))
        copy.rename(target)
    except OSError as exc:
        raise Conflict(
            f"could not copy checkpoint step {source.step}: {exc}",
            field="from_step",
            code="checkpoint_files_missing",
        ) from exc
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target
