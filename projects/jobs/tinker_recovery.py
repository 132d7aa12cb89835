"""Rebuilding a Tinker training client's session after the process that held it restarted.

A session lives in its keeper's memory (this worker's pool or the host's trainer service); a
restart loses it. Everything that made it is on record, though: every training request is a
future whose request body is kept, and every save is a checkpoint with the adapter, AdamW's state
and the RNG. So the session is rebuilt exactly: from the newest state on record before the loss
(the last ``load_weights`` or save whose checkpoint still holds its optimizer state, else the
fresh adapter, which ``config.seed`` makes the same again), the ``forward_backward`` /
``forward`` / ``optim_step`` requests done since are run again in order, without recording
anything. Each replayed request must give what its client was sent, number for number (a
``forward_backward`` its logprobs and metrics, an ``optim_step`` its metrics); a difference (or
more requests to replay than ``TINKER_REPLAY_MAX``) leaves the model lost, as before, and the
client resumes from its last saved state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.conf import settings
from tinker.proto import tinker_public_pb2 as pb

from projects import services
from projects.models import Checkpoint, TinkerFuture, TinkerFutureStatus, TinkerModel
from projects.selectors.tinker_paths import checkpoint_for_path
from projects.services.run_forks import OPTIMIZER_STATE  # dropped from checkpoints no resume needs
from projects.storage import checkpoint_local_dir
from training.wire.tinker import forward_backward_output, parse_forward_backward

if TYPE_CHECKING:
    from collections.abc import Callable
    from contextlib import AbstractContextManager
    from pathlib import Path

SAVES = ("save_weights", "save_weights_for_sampler", "save_weights_external")
REPLAYED = ("forward_backward", "optim_step")


@dataclass
class Origin:
    """Where the rebuilt session starts: from ``state``, then the requests after ``seq`` run again
    (0: all). After a save, that is from the last optimizer step (or load) before it: a save keeps
    no gradients, so the ``forward_backward`` calls accumulated when it was taken run again too."""

    seq: int
    state: Path | None
    reset_optimizer: bool = False
    what: str = "a fresh adapter"


def recover(
    model: TinkerModel,
    open_session: Callable[..., AbstractContextManager[Any]],
    still_ours: Callable[[], bool],
) -> str | None:
    """Rebuild the model's lost session through ``open_session(model, state=, fresh=True)`` and
    ``open_session(model)`` (projects.jobs.tinker.session_of); None when it is the session it was,
    else why not (the session is then in no known state, and the caller marks the model lost).
    ``still_ours()`` renews this worker's hold on the model's queue after each request run again
    (a long replay must not look like a dead worker) and says whether it still holds it."""
    started = time.monotonic()
    done = list(
        TinkerFuture.objects.filter(
            model=model, status=TinkerFutureStatus.DONE, seq_id__gt=0, seq_id__lte=model.done_seq
        ).order_by("seq_id")  # fmt: skip
    )
    origin = _origin(model, done)
    if isinstance(origin, str):
        return origin
    replay = [f for f in done if _seq(f) > origin.seq and f.kind in REPLAYED]
    limit = settings.TINKER_REPLAY_MAX
    if len(replay) > limit:
        return f"{len(replay)} requests since {origin.what} would have to run again (more than {limit})"
    with open_session(model, state=origin.state, fresh=True):
        pass
    with open_session(model) as session:
        if origin.reset_optimizer:
            session.reset_optimizer()
        for future in replay:
            why = _run_again(session, future)
            if why:
                return why
            if not still_ours():
                return "another worker took the training client over while it was being rebuilt"
    steps = sum(1 for f in replay if f.kind == "optim_step")
    services.run_event_add(
        run=model.run,
        level="warn",
        message=(
            f"The trainer process holding this training client restarted: its session was rebuilt "
            f"from {origin.what} by running {len(replay)} request{'s' if len(replay) != 1 else ''} again "
            f"({steps} optimizer step{'s' if steps != 1 else ''}) in {time.monotonic() - started:.1f} s; "
            "each gave what its client was sent"
        ),
    )
    return None


def _origin(model: TinkerModel, done: list[TinkerFuture]) -> Origin | str:
    """The newest state on record: a load, or a save whose checkpoint holds the optimizer state."""
    for future in reversed(done):
        if future.kind == "load_weights":
            checkpoint = checkpoint_for_path(
                model.session.team, future.payload.get("path") or "", param="path"
            )
            folder = checkpoint_local_dir(checkpoint)
            if folder is None:
                return f"the checkpoint it loaded ({future.payload.get('path')}) is gone"
            return Origin(_seq(future), folder, reset_optimizer=not future.payload.get("optimizer", True),
                          what=f"the state it loaded ({future.payload.get('path')})")  # fmt: skip
        if future.kind in SAVES:
            before = [f for f in done if _seq(f) < _seq(future)]
            step = sum(1 for f in before if f.kind == "optim_step")  # the model's step at the save
            saved = Checkpoint.objects.filter(model=model.model, step=step).first()
            folder = checkpoint_local_dir(saved) if saved is not None else None
            if folder is not None and (folder / OPTIMIZER_STATE).is_file():
                since = max((_seq(f) for f in before if f.kind in ("optim_step", "load_weights")), default=0)
                return Origin(since, folder, what=f"its checkpoint of step {step}")
    return Origin(0, None)


def _seq(future: TinkerFuture) -> int:
    return future.seq_id or 0  # training requests always have one (projects.tinker.views._submit)


def _run_again(session: Any, future: TinkerFuture) -> str | None:
    from projects.jobs.tinker import optim_arguments, optim_result

    if future.kind == "forward_backward":
        call = parse_forward_backward(bytes(future.body or b""))
        result = session.forward_backward(call.data, call.loss_fn, call.loss_fn_config,
                                          forward_only=call.forward_only)  # fmt: skip
        # Logprobs and metrics as its client was sent them (compared parsed: map order is free).
        if pb.ForwardBackwardOutput.FromString(
            forward_backward_output(result)
        ) != pb.ForwardBackwardOutput.FromString(bytes(future.blob or b"")):
            return f"running request {future.seq_id} (forward_backward) again gave other logprobs or metrics"
        return None
    metrics = session.optim_step(**optim_arguments(future.payload))
    sent = (future.result or {}).get("metrics") or {}
    again = optim_result(metrics)["metrics"]
    if again != sent:
        return (f"running request {future.seq_id} (optim_step) again gave other metrics than its client "
                f"was sent ({_first_difference(sent, again)})")  # fmt: skip
    return None


def _first_difference(sent: dict[str, Any], again: dict[str, Any]) -> str:
    for name in sorted({*sent, *again}):
        if sent.get(name) != again.get(name):
            return f"{name}: {sent.get(name)} then, {again.get(name)} now"
    return "none"
