"""Checkpoints as a managed asset: deleting them (one, a list, or a prune by a retention policy),
a model's retention policy applied after every step, optimizer/RNG state kept only where a resume
can need it, and removing the files of deleted checkpoints, models and projects.

Invariants:
- Checkpoints are deleted only under the model row's lock (FOR NO KEY UPDATE), then the locks of its active
  runs (lock order model -> run, the order ``run_create`` and ``training_job_create`` use): a prune
  waits for a step being recorded (its writer holds the run's lock) and then sees that step, so
  "the latest" is never a stale answer. The retention hook runs inside the step's own transaction.
- Never deleted: the model's latest checkpoint, the start (and resume) step of an active run, one
  that a queued or running evaluation or export reads. A single delete says who uses it (409);
  a prune keeps it and says so.
- Files go after the transaction commits (``transaction.on_commit``), through the checkpoint store:
  a rolled-back delete leaves every file in place; a crash between commit and removal leaves
  orphan files, never a row without files.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction

from projects import selectors
from projects.errors import Conflict, ValidationFailed
from projects.models import Checkpoint, Export, Run, TrainableModel
from projects.services.runs import ACTIVE_STATUSES

logger = logging.getLogger(__name__)

# What Policy.save_checkpoint writes besides the adapter, needed only to resume training from it
# (training.session.policy.Policy.resume): a checkpoint that no resume can start from keeps its adapter.
RESUME_STATE_FILES = ["optimizer.pt", "rng_state.pt"]
RETENTION_KEYS = ("keep_last", "keep_best")
KEEP_BEST_KEYS = ("metric", "n", "mode")
MAX_KEEP = 100_000


# ----------------------------------------------------------------------------- the policy


def retention_check(policy: Any, *, field: str = "retention") -> dict[str, Any]:
    """The policy ``{keep_last: N, keep_best: {metric, n, mode}}`` normalised, or a 400 naming the
    field (below ``field``; "" for a request body holding the policy itself) and the reason.
    ``{}`` (or None) is "keep everything"; ``mode`` is ``max`` (default) or ``min``; ``metric`` is
    ``eval.<result>`` (the checkpoint's newest evaluation, e.g. ``eval.mean_reward``) or a step
    metric (``reward_mean``, ``loss``)."""

    def at(name: str) -> str:
        return f"{field}.{name}" if field else name

    if policy is None:
        return {}
    if not isinstance(policy, dict):
        raise ValidationFailed("must be an object {keep_last, keep_best}", field=field or None)
    for key in policy:
        if key not in RETENTION_KEYS:
            raise ValidationFailed(f"unknown key; use {', '.join(RETENTION_KEYS)}", field=at(key))
    result: dict[str, Any] = {}
    if policy.get("keep_last") is not None:
        result["keep_last"] = _count(policy["keep_last"], field=at("keep_last"), minimum=0)
    best = policy.get("keep_best")
    if best is not None:
        if not isinstance(best, dict):
            raise ValidationFailed("must be an object {metric, n}", field=at("keep_best"))
        for key in best:
            if key not in KEEP_BEST_KEYS:
                raise ValidationFailed(
                    f"unknown key; use {', '.join(KEEP_BEST_KEYS)}", field=at(f"keep_best.{key}")
                )
        metric = best.get("metric")
        if not isinstance(metric, str) or not metric.strip() or len(metric) > 200 or metric == "eval.":
            raise ValidationFailed(
                "must name a metric, e.g. eval.mean_reward or reward_mean", field=at("keep_best.metric")
            )
        mode = best.get("mode", "max")
        if mode not in ("max", "min"):
            raise ValidationFailed("must be max or min", field=at("keep_best.mode"))
        n = _count(best.get("n"), field=at("keep_best.n"), minimum=1)
        result["keep_best"] = {"metric": metric, "n": n, "mode": mode}
    if policy and not result:
        raise ValidationFailed("give keep_last or keep_best", field=at("keep_last"))
    return result


def _count(value: Any, *, field: str, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValidationFailed("must be an integer", field=field)
    if not minimum <= value <= MAX_KEEP:
        raise ValidationFailed(f"must be between {minimum} and {MAX_KEEP}", field=field)
    return value


@dataclass
class PruneResult:
    """What a prune deleted (or, with ``dry_run``, would delete) and what it kept and why."""

    deleted: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    in_use: dict[int, str] = field(default_factory=dict)  # kept steps the policy would delete
    freed_bytes: int = 0
    dry_run: bool = False


def _steps_to_keep(checkpoints: list[Checkpoint], policy: dict[str, Any]) -> set[int]:
    """The steps ``policy`` keeps (besides the ones in use): the latest, the last N, the best K."""
    steps = sorted(c.step for c in checkpoints)
    keep = set(steps[-1:])
    if "keep_last" in policy and policy["keep_last"] > 0:
        keep.update(steps[-policy["keep_last"] :])
    if best := policy.get("keep_best"):
        values = selectors.checkpoint_metric_values(checkpoints=checkpoints, metric=best["metric"])
        ranked = sorted(values.items(), key=lambda item: (item[1], item[0]), reverse=best["mode"] == "max")
        keep.update(step for step, _ in ranked[: best["n"]])
    return keep


# ----------------------------------------------------------------------------- deleting


def _lock(model: TrainableModel) -> None:
    """The model row, then its active runs (module invariant: lock order model -> run).

    ``FOR NO KEY UPDATE``, not ``FOR UPDATE``: a step's writer, holding its run's lock, inserts a
    checkpoint row whose foreign key takes ``FOR KEY SHARE`` on the model row. A full lock here
    would make it wait for us while we wait for its run: a deadlock (the race test found it)."""
    TrainableModel.objects.select_for_update(no_key=True).get(pk=model.pk)
    runs = Run.objects.select_for_update(no_key=True).filter(model=model, status__in=ACTIVE_STATUSES)
    list(runs.order_by("pk").values_list("pk", flat=True))


def checkpoint_delete(*, checkpoint: Checkpoint) -> None:
    """Delete one checkpoint (row now, files after commit); 409 naming what uses it."""
    with transaction.atomic():
        _lock(checkpoint.model)
        locked = Checkpoint.objects.filter(pk=checkpoint.pk).first()
        if locked is None:
            return  # deleted meanwhile: the caller wanted it gone
        users = selectors.checkpoint_users(model=checkpoint.model, checkpoints=[locked])
        if locked.step in users:
            raise Conflict(
                f"checkpoint step {locked.step} cannot be deleted: {users[locked.step]}",
                field="checkpoint",
                code="checkpoint_in_use",
            )
        _delete_rows([locked])


def checkpoints_delete(*, model: TrainableModel, steps: Any) -> tuple[int, list[int]]:
    """Delete the model's checkpoints ``steps`` (rows, then their files): (deleted count, steps not
    found). 409 naming the first one in use (the latest, one an evaluation or export reads, an
    active run's start). The preview API's ``DELETE .../checkpoints`` (OpenPipe ART)."""
    if not isinstance(steps, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
        raise ValidationFailed("must be a list of integer steps", field="steps")
    with transaction.atomic():
        _lock(model)
        checkpoints = list(Checkpoint.objects.filter(model=model, step__in=steps))
        users = selectors.checkpoint_users(model=model, checkpoints=checkpoints)
        for checkpoint in checkpoints:
            if checkpoint.step in users:
                raise Conflict(
                    f"step {checkpoint.step} cannot be deleted: {users[checkpoint.step]}",
                    field="steps",
                    code="checkpoint_in_use",
                )
        _delete_rows(checkpoints)
    found = {c.step for c in checkpoints}
    return len(checkpoints), sorted({s for s in steps if s not in found})


def checkpoints_prune(
    *, model: TrainableModel, policy: Any, dry_run: bool = False, field: str = ""
) -> PruneResult:
    """Delete every checkpoint of ``model`` that ``policy`` does not keep, except those in use
    (kept and listed in ``in_use``). With ``dry_run`` nothing changes: the answer says what would."""
    checked = retention_check(policy, field=field)
    if not checked:
        raise ValidationFailed(
            "give keep_last or keep_best", field=f"{field}.keep_last" if field else "keep_last"
        )
    with transaction.atomic():
        _lock(model)
        result = _prune_locked(model, checked, exclude_step=None)
        result.dry_run = dry_run
        if dry_run:
            transaction.set_rollback(True)
    return result


def _prune_locked(model: TrainableModel, policy: dict[str, Any], *, exclude_step: int | None) -> PruneResult:
    checkpoints = list(Checkpoint.objects.filter(model=model).order_by("step"))
    keep = _steps_to_keep(checkpoints, policy)
    candidates = [c for c in checkpoints if c.step not in keep and c.step != exclude_step]
    users = selectors.checkpoint_users(model=model, checkpoints=candidates)
    doomed = [c for c in candidates if c.step not in users]
    result = PruneResult(
        deleted=[c.step for c in doomed],
        kept=sorted(c.step for c in checkpoints if c not in doomed),
        in_use={step: reason for step, reason in users.items()},
        freed_bytes=sum(selectors.checkpoint_storage_bytes(checkpoint=c) for c in doomed),
    )
    _delete_rows(doomed)
    return result


def _delete_rows(checkpoints: list[Checkpoint]) -> None:
    """Delete the rows now and their folders (and their exports' folders) once this commits."""
    if not checkpoints:
        return
    keys = [key for c in checkpoints if (key := selectors.checkpoint_key(c))]
    keys += [e.key for e in Export.objects.filter(checkpoint__in=checkpoints).exclude(key="")]
    Checkpoint.objects.filter(pk__in=[c.pk for c in checkpoints]).delete()
    transaction.on_commit(lambda: _delete_keys(keys))


# ----------------------------------------------------------------------------- after every step


def retention_after_step(*, run: Run, step: int) -> None:
    """Called where a step's rows are written (services.steps.step_rows_write, inside the
    transaction that holds the run's lock): the run's previous checkpoint loses its optimizer/RNG
    state (no resume starts there any more: a run resumes from its latest), and the model's
    retention policy, if any, deletes what it does not keep (never this new step)."""
    previous = Checkpoint.objects.filter(run=run, step__lt=step).exclude(path="").order_by("-step").first()
    if previous is not None and (key := selectors.checkpoint_key(previous)):
        transaction.on_commit(lambda: _drop_resume_state(previous.pk, key))
    policy = TrainableModel.objects.filter(pk=run.model_id).values_list("retention", flat=True).first()
    if policy:
        _prune_locked(run.model, retention_check(policy), exclude_step=step)


def run_checkpoints_settle(*, run: Run) -> int:
    """What a worker that takes a run over does first: the run's checkpoints older than the one it
    resumes from lose their resume state, and each row gets the digest and size of what is stored.
    Dropping the state after a step changes the stored folder and then its row; a worker killed
    between the two left a row whose digest names files that are gone (serving that checkpoint
    would fail its check). Idempotent; returns how many checkpoints it looked at."""
    older = list(
        Checkpoint.objects.filter(run=run, step__lt=run.current_step).exclude(path="").order_by("step")
    )
    for checkpoint in older:
        if key := selectors.checkpoint_key(checkpoint):
            _drop_resume_state(checkpoint.pk, key)
    return len(older)


def _drop_resume_state(checkpoint_id: int, key: str) -> None:
    try:
        stored = selectors.checkpoint_store().remove_files(key, RESUME_STATE_FILES)
    except Exception:  # a missing folder (deleted meanwhile) or a store error: the files stay
        logger.warning("could not drop resume state of %s", key, exc_info=True)
        return
    _stored_update(checkpoint_id, stored)


def _stored_update(checkpoint_id: int, stored: Any) -> None:
    """The row's digest and size follow its folder (a row recorded without a key keeps none)."""
    Checkpoint.objects.filter(pk=checkpoint_id).exclude(storage_key="").update(sha256=stored.sha256)
    Checkpoint.objects.filter(pk=checkpoint_id).update(size_bytes=stored.size_bytes)


# ----------------------------------------------------------------------------- files


def model_files_remove_on_commit(*, model_ids: list[int]) -> None:
    """Once the transaction commits, remove every stored folder of these (deleted) models."""
    prefixes = [selectors.model_prefix(pk) for pk in model_ids]

    def remove() -> None:
        store = selectors.checkpoint_store()
        for prefix in prefixes:
            _delete_keys(store.list_keys(prefix))
            # The folder the trainer writes into on this host (the store's own copy when local).
            shutil.rmtree(Path(settings.CHECKPOINT_DIR) / prefix, ignore_errors=True)

    transaction.on_commit(remove)


def _delete_keys(keys: list[str]) -> None:
    store = selectors.checkpoint_store()
    for key in keys:
        try:
            store.delete(key)
        except Exception:
            logger.warning("could not delete stored folder %s", key, exc_info=True)
