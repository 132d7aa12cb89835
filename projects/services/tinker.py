"""The Tinker API's writes (projects.tinker): sessions, training clients, futures and samplers.

A training client is a TrainableModel with a run of kind ``tinker`` (the dashboard shows it like any
run); each ``optim_step`` is a step of that run; each saved checkpoint is a Checkpoint of the model,
served by the gateway at once. Concurrency: a model's requests are executed by one worker at a time
(``tinker_drain_claim`` under the TinkerModel row's lock), in ``seq_id`` order.

Why one module of this length: every write of the Tinker front (sessions, training clients, futures,
samplers, saves) takes the same row locks and follows one order of requests per model; split by
object, each part would import the others' locking rules.
"""

from __future__ import annotations

import secrets
from datetime import timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from projects.errors import Conflict, NotFound, RateLimited, ValidationFailed
from projects.models import (
    CLIENT_KINDS,
    BaseModel,
    Checkpoint,
    Project,
    Run,
    RunKind,
    RunStatus,
    Team,
    TinkerFuture,
    TinkerFutureStatus,
    TinkerModel,
    TinkerSampler,
    TinkerSession,
)
from projects.selectors.tinker_paths import SCHEME, name_expiry
from projects.services._common import check_devices, check_fsdp
from projects.services.projects import trainable_model_create
from projects.services.runs import run_event_add
from projects.services.steps import checkpoint_record
from training.config import DEFAULT_TARGET_MODULES
from training.cost import GPU, device_kind, device_usage
from training.rollouts.strict_json import parse_int

TINKER_PROJECT = "tinker"  # a session's project when create_session names none
DRAIN_LEASE_S = 120  # a drainer that stopped touching its model for this long lost it

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(8)}"


def tinker_request_id() -> str:
    return _new_id("req")


def tinker_session_create(
    *,
    team: Team,
    project: str | None,
    tags: list[str],
    user_metadata: dict[str, Any] | None,
    sdk_version: str,
) -> TinkerSession:
    """A session in ``project`` (an existing project of the team, by name) or the team's
    ``tinker`` project (created on first use, whether named or not)."""
    if project and project != TINKER_PROJECT:
        owner = Project.objects.filter(team=team, name=project).first()
        if owner is None:
            raise NotFound(f"no project named {project!r} in your team", field="project_id")
    else:
        owner, _ = Project.objects.get_or_create(team=team, name=TINKER_PROJECT)
    return TinkerSession.objects.create(
        id=_new_id("session"), team=team, project=owner, tags=[str(t) for t in tags][:32],
        user_metadata=user_metadata or {}, sdk_version=sdk_version[:64], heartbeat_at=timezone.now(),
    )  # fmt: skip


def tinker_session_heartbeat(*, session: TinkerSession) -> None:
    TinkerSession.objects.filter(pk=session.pk).update(heartbeat_at=timezone.now())


def tinker_session_finish(*, session: TinkerSession, reason: str, detail: str = "") -> None:
    """The client closed its session (the SDK's ``with`` block ended: ``success``, ``errored`` or
    ``interrupted``): each training client's run ends as succeeded, failed or cancelled; its
    checkpoints stay, served and loadable."""
    status = {"success": RunStatus.SUCCEEDED, "interrupted": RunStatus.CANCELLED}.get(
        reason, RunStatus.FAILED
    )
    from projects.services.run_control import client_run_end

    error = f"the Tinker client closed its session: {reason} {detail}".strip()[:2000]
    for run in Run.objects.filter(tinker_models__session=session, status=RunStatus.RUNNING):
        client_run_end(
            run_id=run.pk,
            to=status,
            message=f"Tinker session closed by its client ({reason})",
            updates={"error": error} if status == RunStatus.FAILED else None,
        )


def lora_of(config: dict[str, Any] | None) -> dict[str, Any]:
    """Tinker's LoraConfig (rank, train_attn, train_mlp, train_unembed, seed) as the model's LoRA."""
    config = config or {}
    rank = config.get("rank", 32)
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= 1024:
        raise ValidationFailed("must be an integer from 1 to 1024", field="lora_config.rank")
    modules = [
        *(_ATTENTION if config.get("train_attn", True) else ()),
        *(_MLP if config.get("train_mlp", True) else ()),
    ]
    if not modules:
        raise ValidationFailed("train_attn or train_mlp must be true: LoRA needs layers to adapt",
                               field="lora_config")  # fmt: skip
    assert set(modules) <= set(DEFAULT_TARGET_MODULES)
    return {"rank": rank, "alpha": 32, "dropout": 0.0, "target_modules": modules}


def devices_of(user_metadata: dict[str, Any] | None) -> int:
    """The devices a training client asks for: ``user_metadata={"devices": "2"}`` at
    ``create_lora_training_client`` (the SDK's metadata values are strings), 1 without it."""
    value = (user_metadata or {}).get("devices")
    if value is None:
        return 1
    text = str(value).strip()
    parsed = parse_int(text, low=0) if not isinstance(value, bool) else None  # "9"*5000: not int()
    number = parsed if parsed is not None else value
    check_devices(number, field="user_metadata.devices")
    return int(number)


def fsdp_of(user_metadata: dict[str, Any] | None, devices: int) -> bool:
    """Whether a training client asks for its base sharded across its devices (training.hosting.ranks
    .shard_base): ``user_metadata={"devices": "2", "fsdp": "true"}``; False without it."""
    value = (user_metadata or {}).get("fsdp")
    if value is None:
        return False
    text = str(value).strip().lower()
    if text not in ("true", "false"):
        raise ValidationFailed(f"must be true or false, got {str(value)[:40]!r}", field="user_metadata.fsdp")
    return check_fsdp(text == "true", devices, field="user_metadata.fsdp")


def tinker_model_create(
    *, session: TinkerSession, model_seq_id: int, base_model: str, lora_config: dict[str, Any] | None,
    user_metadata: dict[str, Any] | None = None, lora: dict[str, Any] | None = None,
) -> TinkerModel:  # fmt: skip
    """A training client: a new model of the session's project with step 0 and a run of kind
    ``tinker``. Its id is the SDK's own: ``"{session}:train:{model_seq_id}"``. ``lora``: the
    adapter's shape as stored (a checkpoint's, when the client is created from one)."""
    base = BaseModel.objects.filter(name=base_model).first()
    if base is None:
        names = ", ".join(BaseModel.objects.order_by("name").values_list("name", flat=True)) or "none"
        raise ValidationFailed(
            f"no base model named {base_model!r}; artweb offers: {names}", field="base_model"
        )
    devices = devices_of(user_metadata)
    fsdp = fsdp_of(user_metadata, devices)
    model_id = f"{session.id}:train:{model_seq_id}"
    with transaction.atomic():
        existing = TinkerModel.objects.filter(pk=model_id).first()
        if existing is not None:
            return existing
        model = trainable_model_create(
            project=session.project, name=f"{session.id}-train-{model_seq_id}", base_model=base,
            lora=lora if lora is not None else lora_of(lora_config),
        )  # fmt: skip
        now = timezone.now()
        run = Run.objects.create(
            kind=RunKind.TINKER, project=session.project, model=model,
            config={"lora_seed": (lora_config or {}).get("seed"), **({"devices": devices} if devices > 1 else {}),
                    **({"fsdp": True} if fsdp else {})},
            status=RunStatus.RUNNING, start_step=0, current_step=0, total_steps=0, started_at=now, heartbeat_at=now,
        )  # fmt: skip
        parallel = f", data-parallel on {devices} devices" if devices > 1 else ""
        parallel += ", the base sharded across them (fsdp: it does not sample)" if fsdp else ""
        run_event_add(run=run, message=f"Tinker training client {model_id} created on {base.name} "
                      f"(LoRA rank {model.lora['rank']}{parallel}): each optim_step is a step")  # fmt: skip
        checkpoint_record(model=model, run=run, step=0, path="", metrics={})
        return TinkerModel.objects.create(id=model_id, session=session, model=model, run=run)


def tinker_future_done(*, team: Team, kind: str, result: dict[str, Any]) -> TinkerFuture:
    """A future answered at once (``create_model``: the model exists when the reply leaves)."""
    return TinkerFuture.objects.create(
        id=tinker_request_id(), team=team, kind=kind, status=TinkerFutureStatus.DONE, result=result
    )


def tinker_future_submit(
    *, team: Team, kind: str, model: TinkerModel | None = None, seq_id: int | None = None,
    payload: dict[str, Any] | None = None, body: bytes | None = None,
) -> TinkerFuture:  # fmt: skip
    """The request's future, queued for execution. A training request is one per ``(model,
    seq_id)``: a retried submission gets the future of the first."""
    if model is not None:
        # seq 0 is the load that creates a client from a checkpoint; it runs before the client's 1.
        if seq_id is None or seq_id < 0:
            raise ValidationFailed("training requests need a seq_id of 1 or more", field="seq_id")
        if model.lost:
            raise ValidationFailed(model.lost, field="model_id")
        if model.run.config.get("copied_from"):
            raise ValidationFailed(
                f"{model.pk} is a copy of {model.run.config['copied_from']} (copy_weights) and is not trained: "
                "create a training client from its path", field="model_id",
            )  # fmt: skip
        existing = TinkerFuture.objects.filter(model=model, seq_id=seq_id).first()
        if existing is not None:
            return existing
        run = Run.objects.get(pk=model.run_id)
        if run.status != RunStatus.RUNNING:  # stopped by a user, closed, or idle (run_control)
            raise ValidationFailed(
                f"{model.pk}'s run #{run.pk} {run.status}: its training requests are refused; create a "
                "training client from its last saved checkpoint to go on",
                field="model_id",
            )
        _check_sole_writer(model)
    _check_team_share(team, training=model is not None)
    try:
        with transaction.atomic():
            future = TinkerFuture.objects.create(
                id=_new_id("req"), team=team, model=model, kind=kind, seq_id=seq_id, payload=payload or {}, body=body,
            )  # fmt: skip
    except IntegrityError:  # the same (model, seq_id) submitted twice at once
        return TinkerFuture.objects.get(model=model, seq_id=seq_id)
    from projects.jobs.tinker import enqueue

    transaction.on_commit(lambda: enqueue(future))
    return future


def _check_team_share(team: Team, *, training: bool) -> None:
    """A team's futures queued or running on the shared trainer, at most
    ``TINKER_MAX_PENDING_SAMPLES_PER_TEAM`` samples and ``TINKER_MAX_PENDING_TRAINING_PER_TEAM``
    training requests: one team cannot fill the worker's queue ahead of the others (issue 51).
    Over it: ``RateLimited`` (429 with ``Retry-After``). A count, not a lock: two requests at the
    same instant may both pass, by one each."""
    from django.conf import settings

    pending = TinkerFuture.objects.filter(team=team, status=TinkerFutureStatus.PENDING)
    if training:
        limit, name, what = settings.TINKER_MAX_PENDING_TRAINING_PER_TEAM, "TRAINING", "training requests"
        pending = pending.filter(model__isnull=False)
    else:
        limit, name, what = settings.TINKER_MAX_PENDING_SAMPLES_PER_TEAM, "SAMPLES", "samples"
        pending = pending.filter(kind="sample")
    if pending.count() >= limit:
        raise RateLimited(
            f"your team has {limit} {what} queued or running, the most it may have "
            f"(TINKER_MAX_PENDING_{name}_PER_TEAM): retry when one finishes",
            retry_after_s=settings.TINKER_RETRY_AFTER_S,
        )


def _check_sole_writer(model: TinkerModel) -> None:
    """One writer per model: a platform run may continue a Tinker client's model between its
    requests (runs.run_create waits for pending ones), but while that run is active, and after it
    has trained the model past the client's own steps, the client's resident state is not the
    model's any more: its training requests are refused (409) instead of writing over the run's."""
    from projects.services.runs import ACTIVE_STATUSES

    other = (
        Run.objects.filter(model=model.model, status__in=ACTIVE_STATUSES)
        .exclude(kind__in=CLIENT_KINDS)
        .first()
    )
    if other is not None:
        raise Conflict(
            f"run {other.pk} is training this model; one writer at a time: wait for it, then "
            "create a training client from its checkpoint",
            field="model_id",
            code="model_busy",
        )
    latest = (
        Checkpoint.objects.filter(model=model.model).order_by("-step").values_list("step", flat=True).first()
    )
    if latest is not None and latest > model.run.current_step:
        raise Conflict(
            f"another run trained this model to step {latest}, past this training client's step "
            f"{model.run.current_step}; create a training client from that checkpoint",
            field="model_id",
            code="model_busy",
        )


def tinker_future_finish(
    *, future: TinkerFuture, result: dict[str, Any] | None = None, blob: bytes | None = None,
    error: str = "", category: str = "user", seconds: float | None = None,
) -> None:  # fmt: skip
    """The future's outcome; a training request also moves its model's ``done_seq`` on. A sample
    its client cancelled meanwhile stays cancelled (its result is dropped)."""
    if future.model_id is None:
        TinkerFuture.objects.filter(pk=future.pk, status=TinkerFutureStatus.PENDING).update(
            status=TinkerFutureStatus.FAILED if error else TinkerFutureStatus.DONE, result=result, blob=blob,
            error=error[:4000], category=category if error else "", seconds=seconds, finished_at=timezone.now(),
        )  # fmt: skip
        return
    with transaction.atomic():
        future.status = TinkerFutureStatus.FAILED if error else TinkerFutureStatus.DONE
        future.result, future.blob, future.error = result, blob, error[:4000]
        future.category = category if error else ""
        future.seconds, future.finished_at = seconds, timezone.now()
        future.save(update_fields=["status", "result", "blob", "error", "category", "seconds", "finished_at"])
        if future.model_id is not None and future.seq_id is not None:
            TinkerModel.objects.filter(pk=future.model_id, done_seq__lt=future.seq_id).update(
                done_seq=future.seq_id, drained_at=timezone.now()
            )
            if seconds and future.kind != "optim_step":  # an optim_step's seconds are its step's own
                TinkerModel.objects.filter(pk=future.model_id).update(
                    pending_seconds=F("pending_seconds") + seconds
                )


CANCELLED_MESSAGE = "cancelled by its client (cancel_future)"


def tinker_future_cancel(*, future: TinkerFuture) -> bool:
    """``cancel_future``: a sample its client abandoned. Still queued, it never runs; running, it
    runs to its end and its result is dropped. A training request is never cancelled (a client's
    requests run in order, each on the state the one before left). True when it was pending."""
    if future.model_id is not None:
        raise ValidationFailed("only a sampling request can be cancelled: a training client's requests "
                               "run in order, each on the state the one before left", field="request_id")  # fmt: skip
    return bool(
        TinkerFuture.objects.filter(pk=future.pk, status=TinkerFutureStatus.PENDING).update(
            status=TinkerFutureStatus.CANCELLED,
            error=CANCELLED_MESSAGE,
            category="user",
            finished_at=timezone.now(),
        )  # fmt: skip
    )


def tinker_drain_claim(*, model: TinkerModel, holder: str) -> bool:
    """Make ``holder`` the one worker executing the model's queue; False while another holds it."""
    with transaction.atomic():
        locked = TinkerModel.objects.select_for_update().get(pk=model.pk)
        stale = locked.drained_at is None or locked.drained_at < timezone.now() - timedelta(
            seconds=DRAIN_LEASE_S
        )
        if locked.drainer and locked.drainer != holder and not stale:
            return False
        locked.drainer, locked.drained_at = holder, timezone.now()
        locked.save(update_fields=["drainer", "drained_at"])
        return True


def tinker_drain_release(*, model: TinkerModel, holder: str) -> None:
    TinkerModel.objects.filter(pk=model.pk, drainer=holder).update(drainer="")


def tinker_model_lost(*, model: TinkerModel, why: str) -> None:
    """The session's state is gone (its worker restarted): later requests fail with ``why``."""
    TinkerModel.objects.filter(pk=model.pk).update(lost=why)
    run_event_add(run=model.run, message=why, level="error")


def tinker_loss_add(*, model: TinkerModel, loss: float) -> None:
    """A ``forward_backward``'s loss, summed into the next step's."""
    TinkerModel.objects.filter(pk=model.pk).update(pending_loss=F("pending_loss") + loss)


def tinker_model_opened(*, model: TinkerModel) -> None:
    model.opened = True
    TinkerModel.objects.filter(pk=model.pk).update(opened=True)


def tinker_model_found(*, model: TinkerModel) -> None:
    """Loaded from a checkpoint: whatever was lost before is behind it."""
    TinkerModel.objects.filter(pk=model.pk).update(lost="")


def tinker_step_record(
    *, model: TinkerModel, step: int, metrics: dict[str, Any], seconds: float, device: str = "cpu"
) -> None:
    """An ``optim_step``: step ``step`` of the model's run, charted with the loss summed over the
    ``forward_backward`` calls since the step before, and the device seconds of every request since
    then (``seconds``: the step's own), which the run's cost line counts, with the tokens trained
    since the step before and those sampled from the model's checkpoints (``_tokens_since``)."""
    from projects.models import StepMetrics

    with transaction.atomic():
        locked = TinkerModel.objects.select_for_update().get(pk=model.pk)
        loss, spent = locked.pending_loss, locked.pending_seconds + seconds
        metrics = {**metrics, **_tokens_since(locked)}
        locked.pending_loss, locked.pending_seconds, locked.steps = 0.0, 0.0, step
        locked.save(update_fields=["pending_loss", "pending_seconds", "steps"])
        # A GPU per rank of a data-parallel session (its optim_step says how many); one CPU "device".
        count = int(metrics.get("update_devices", 1)) if device_kind(device) == GPU else 1
        metrics = {**metrics, "loss": loss, "step_seconds": spent, **device_usage(device, spent, count=count)}
        run = Run.objects.select_for_update().get(pk=model.run_id)
        StepMetrics.objects.get_or_create(run=run, step=step, defaults={"loss": loss, "metrics": metrics})
        run.current_step = max(run.current_step, step)
        run.total_steps = max(run.total_steps, step)
        run.heartbeat_at = timezone.now()
        run.save(update_fields=["current_step", "total_steps", "heartbeat_at"])


def _tokens_since(model: TinkerModel) -> dict[str, float]:
    """What the client did since its last optim_step (the one being recorded is still pending):
    ``trainable_tokens`` of its ``forward_backward`` requests and ``completion_tokens`` of samples
    from its model's checkpoints, as the requests' results keep them (projects.jobs.tinker)."""
    done = TinkerFuture.objects.filter(status=TinkerFutureStatus.DONE)
    last = done.filter(model=model, kind="optim_step").order_by("-seq_id").first()
    trained = done.filter(model=model, kind="forward_backward")
    sampled = done.filter(team_id=model.session.team_id, kind="sample", payload__sampler__in=list(
        TinkerSampler.objects.filter(checkpoint__model=model.model).values_list("id", flat=True)
    ))  # fmt: skip
    if last is not None:
        trained = trained.filter(seq_id__gt=last.seq_id)
        sampled = sampled.filter(finished_at__gt=last.finished_at)

    def total(rows: Any, key: str) -> float:
        return float(sum(int((row.result or {}).get(key) or 0) for row in rows.only("result")))

    # A count of 0 is left out: the charts read trainable_tokens 0 as "no update at this step"
    # (frontend.presentation), and an optim_step always updates.
    counts = {"trainable_tokens": total(trained, "trainable_tokens"),
              "completion_tokens": total(sampled, "completion_tokens")}  # fmt: skip
    return {key: value for key, value in counts.items() if value}


def export_record(*, recipients: list[str] | None, ttl_seconds: int | None) -> dict[str, Any]:
    """What a checkpoint keeps about one export (``metrics["tinker_exports"][label]``)."""
    expires = timezone.now() + timedelta(seconds=ttl_seconds) if ttl_seconds else None
    return {"recipients": list(recipients or []), "expires_at": expires.isoformat() if expires else None}


def tinker_checkpoint_record(
    *, model: TinkerModel, step: int, path: str, stored: Any, name: str, export: dict[str, Any] | None = None
) -> Checkpoint:
    """A saved state at ``step`` (adapter, optimizer, RNG: one folder serves ``weights``,
    ``sampler_weights`` and ``external_weights``), recorded as the model's checkpoint of that step;
    ``name`` (``weights/x``, ``sampler_weights/x``, ``external_weights/x``) finds it again, and an
    external export keeps ``export`` (projects.tinker.exports). ``stored`` None: the step's
    checkpoint is already saved, and only gets the name."""
    with transaction.atomic():
        checkpoint = Checkpoint.objects.select_for_update().filter(model=model.model, step=step).first()
        if stored is None and checkpoint is None:
            raise ValueError(f"no saved checkpoint of step {step} to name {name!r}")
        if (
            stored is not None
            and checkpoint is not None
            and not checkpoint.path
            and not checkpoint.storage_key
        ):
            checkpoint.path, checkpoint.storage_key = path, stored.key
            checkpoint.sha256, checkpoint.size_bytes = stored.sha256, stored.size_bytes
            checkpoint.save(update_fields=["path", "storage_key", "sha256", "size_bytes"])
        elif checkpoint is None:
            checkpoint = checkpoint_record(model=model.model, run=model.run, step=step, path=path, metrics={},
                                           stored=stored)  # fmt: skip
        names = dict(checkpoint.metrics.get("tinker_names", {}))
        names[name] = model.id
        exports = dict(checkpoint.metrics.get("tinker_exports", {}))
        if export is not None:
            exports[name] = export
        else:
            exports.pop(name, None)
        checkpoint.metrics = {**checkpoint.metrics, "tinker_names": names, "tinker_exports": exports}
        checkpoint.save(update_fields=["metrics"])
        return checkpoint


def tinker_export_ttl(*, checkpoint: Checkpoint, name: str, ttl_seconds: int | None) -> None:
    """Set (from now) or remove the expiry of the name ``name`` of ``checkpoint`` (an export's, or
    any other saved name's: kept alike under ``tinker_exports``)."""
    with transaction.atomic():
        checkpoint = Checkpoint.objects.select_for_update().get(pk=checkpoint.pk)
        exports = dict(checkpoint.metrics.get("tinker_exports", {}))
        recipients = exports.get(name, {}).get("recipients")
        exports[name] = export_record(recipients=recipients, ttl_seconds=ttl_seconds)
        checkpoint.metrics = {**checkpoint.metrics, "tinker_exports": exports}
        checkpoint.save(update_fields=["metrics"])


def tinker_checkpoint_forget(*, checkpoint: Checkpoint, name: str, expired: bool = False) -> bool:
    """Drop ``name`` (``weights/x``, ``sampler_weights/x``, ``external_weights/x``) from the
    checkpoint; delete the checkpoint when it was the last name and nothing uses it (else a 409 says
    what does). An export's name, or one whose TTL passed (``expired``), goes even then: the files
    stay for what uses them. True when the checkpoint was deleted."""
    from projects.services.checkpoints import checkpoint_delete

    names = dict(checkpoint.metrics.get("tinker_names", {}))
    if len(names) <= 1:
        try:
            checkpoint_delete(checkpoint=checkpoint)
            return True
        except Conflict:
            if not (expired or name.startswith("external_weights/")):
                raise
    names.pop(name, None)
    exports = {label: record for label, record in checkpoint.metrics.get("tinker_exports", {}).items()
               if label != name}  # fmt: skip
    public = [label for label in checkpoint.metrics.get("tinker_public", []) if label != name]
    checkpoint.metrics = {**checkpoint.metrics, "tinker_names": names, "tinker_exports": exports,
                          "tinker_public": public}  # fmt: skip
    checkpoint.save(update_fields=["metrics"])
    return False


def tinker_checkpoint_publish(*, checkpoint: Checkpoint, name: str, public: bool) -> None:
    """Make the name ``name`` of ``checkpoint`` public (every team of this artweb may read it by its
    tinker path: load it, sample it, copy it) or private again. Publishing a public name (or
    unpublishing a private one) is a 400: the SDK retries a 409 as if it could clear up."""
    with transaction.atomic():
        checkpoint = Checkpoint.objects.select_for_update().get(pk=checkpoint.pk)
        labels = list(checkpoint.metrics.get("tinker_public", []))
        if (name in labels) == public:
            raise ValidationFailed(f"{name} is already {'public' if public else 'private'}",
                                   field="checkpoint_id")  # fmt: skip
        labels = sorted({*labels, name}) if public else [label for label in labels if label != name]
        checkpoint.metrics = {**checkpoint.metrics, "tinker_public": labels}
        checkpoint.save(update_fields=["metrics"])


def tinker_weights_copy(
    *, team: Team, source: Checkpoint, source_path: str, session: TinkerSession | None, model_seq_id: int | None,
    project: str | None, ttl_seconds: int | None, idempotency_key: str = "",
) -> str:  # fmt: skip
    """``copy_weights``: a new training client in the caller's ``session`` (slot ``model_seq_id``) or
    ``project`` whose step 0 is a copy of ``source`` (its own object in the checkpoint store:
    deleting the source later leaves it whole), under the source's kind and name. A copy cannot be
    trained on (its client's training requests are refused); load it into a training client. The
    same ``idempotency_key`` (the SDK's ``X-Idempotency-Key``) gets the first copy's path again."""
    from projects.services.run_forks import checkpoint_fork

    if idempotency_key:
        earlier = (
            TinkerModel.objects.filter(session__team=team, run__config__copy_idempotency_key=idempotency_key)
            .select_related("run")
            .first()
        )
        if earlier is not None:
            return str(earlier.run.config["copy_path"])
    if session is None:
        session = tinker_session_create(team=team, project=project, tags=["copy_weights"], user_metadata=None,
                                        sdk_version="")  # fmt: skip
        model_seq_id = 0
    assert model_seq_id is not None
    model_id = f"{session.id}:train:{model_seq_id}"
    if TinkerModel.objects.filter(pk=model_id).exists():
        raise ValidationFailed(f"the session already has a training client in slot {model_seq_id}",
                               field="model_seq_id")  # fmt: skip
    _, kind, name = source_path[len(SCHEME) :].split("/", 2)
    label = f"{kind}/{name}" if kind in ("weights", "sampler_weights") else (
        f"weights/step-{name}" if kind == "step" else f"weights/{name}")  # fmt: skip
    copy_path = f"{SCHEME}{model_id}/{label}"

    def start(model: Any) -> Run:
        now = timezone.now()
        run = Run.objects.create(
            kind=RunKind.TINKER, project=session.project, model=model, status=RunStatus.SUCCEEDED,
            config={"copied_from": source_path, "copy_path": copy_path, "copy_idempotency_key": idempotency_key},
            start_step=0, current_step=0, total_steps=0, started_at=now, finished_at=now, heartbeat_at=now,
        )  # fmt: skip
        run_event_add(run=run, message=f"Copied from {source_path} (copy_weights) as {copy_path}; "
                      "a copy is not trained: load it into a training client")  # fmt: skip
        client = TinkerModel.objects.create(id=model_id, session=session, model=model, run=run)
        tinker_checkpoint_record(
            model=client, step=0, path="", stored=None, name=label,
            export=export_record(recipients=None, ttl_seconds=ttl_seconds) if ttl_seconds else None,
        )  # fmt: skip
        return run

    checkpoint_fork(source=source, project=session.project, name=f"{session.id}-train-{model_seq_id}",
                    config={}, start=start, field="source_path")  # fmt: skip
    return copy_path


def tinker_names_expire() -> int:
    """The sweep (a beat task): drop every Tinker checkpoint name whose TTL has passed, deleting a
    checkpoint left without one unless something uses it. How many names were dropped."""
    now, dropped = timezone.now(), 0
    for checkpoint in Checkpoint.objects.filter(metrics__has_key="tinker_exports").order_by("pk"):
        for label in sorted(checkpoint.metrics.get("tinker_exports", {})):
            expiry = name_expiry(checkpoint, label)
            if expiry is None or expiry > now:
                continue
            dropped += 1
            if tinker_checkpoint_forget(checkpoint=checkpoint, name=label, expired=True):
                break
    return dropped


def tinker_sampler_create(
    *, session: TinkerSession, sampler_id: str | None, base_model: BaseModel, checkpoint: Checkpoint | None,
    model_path: str = "",
) -> TinkerSampler:  # fmt: skip
    sampler, _ = TinkerSampler.objects.get_or_create(
        id=sampler_id or _new_id("sampler"),
        defaults={
            "session": session,
            "base_model": base_model,
            "checkpoint": checkpoint,
            "model_path": model_path,
        },
    )
    return sampler
