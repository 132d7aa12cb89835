"""Executing the Tinker API's requests (projects.tinker) on the session core.

A training client's requests (``forward_backward``, ``optim_step``, saves, loads) run in ``seq_id``
order, one worker at a time per model: a drain claims the model, executes its next request while
there is one (``done_seq + 1``), and releases it; a request arriving meanwhile starts another drain,
which either finds the model claimed (the running drain will reach it) or runs it. Sampling requests
have no order and run at once.

Each training client is one session of the host's keeper (training.hosting.resident: the trainer service
when ``TRAINER_SERVICE_URL`` is set, else this worker's own pool), with its adapter and AdamW state
kept resident between requests. A session gone from its keeper (the process restarted) is rebuilt
exactly from its last saved state and the requests since (projects.jobs.tinker_recovery, with an
event on the run); only when that cannot be done is the model marked lost, its requests failing
saying so, and the client resumes from its last saved state (``load_state``), as with Tinker's own
service.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from django.conf import settings

from projects import services
from projects.errors import DomainError
from projects.jobs.hosts import session_host
from projects.models import Checkpoint, TinkerFuture, TinkerFutureStatus, TinkerModel, TinkerSampler
from projects.selectors.serving import live_servers
from projects.selectors.tinker_paths import checkpoint_for_path
from projects.services.tinker import export_record
from projects.serving_names import secret_suffix
from projects.storage import checkpoint_local_dir, checkpoint_upload
from training.config import LoraSpec, TrainConfig
from training.engines.base import SamplingParams
from training.hosting.resident import SessionGone
from training.runs.steps import checkpoint_path
from training.session.contract import LossInputError, Session
from training.wire.tinker import (
    WireError,
    forward_backward_output,
    model_input_tokens,
    parse_forward_backward,
    prompt_logprobs,
    prompt_scoring,
    sample_response,
)


class RequestFailed(Exception):
    """What the client is told (``category``: ``user`` for its own mistakes)."""

    def __init__(self, message: str, category: str = "user") -> None:
        super().__init__(message)
        self.category = category


class SessionLost(RequestFailed):
    pass


def holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def enqueue(future: TinkerFuture) -> None:
    from projects.jobs.queues import base_model_queue
    from projects.jobs.tasks import tinker_drain, tinker_sample

    if future.model_id is None:
        sampler = (
            TinkerSampler.objects.filter(pk=future.payload.get("sampler"))
            .select_related("base_model")
            .first()
        )
        queue = base_model_queue(sampler.base_model if sampler else None)
        tinker_sample.apply_async(args=(future.pk,), queue=queue)
        return
    model = TinkerModel.objects.select_related("model__base_model").get(pk=future.model_id)
    tinker_drain.apply_async(args=(model.pk,), queue=base_model_queue(model.model.base_model))


# ---------------------------------------------------------------------- sessions
def _session_id(model: TinkerModel) -> str:
    return "tinker-" + model.pk.replace(":", "-")


def _config(model: TinkerModel) -> tuple[TrainConfig, LoraSpec]:
    seed = model.run.config.get("lora_seed")
    config = TrainConfig(seed=int(seed)) if isinstance(seed, int) else TrainConfig()
    # Data-parallel on that many devices (training.hosting.pool); a client created with it.
    config = dataclasses.replace(config, devices=int(model.run.config.get("devices") or 1),
                                 fsdp=model.run.config.get("fsdp") is True)  # fmt: skip
    return config, LoraSpec.from_dict(model.model.lora)


@contextmanager
def session_of(model: TinkerModel, *, state: Path | None = None, fresh: bool = False) -> Iterator[Session]:
    """The model's session, live for one request, on whichever host keeps this worker's sessions
    (training.hosting.resident). ``fresh``: open it (from ``state``, or a new adapter), replacing
    any it had; otherwise it must be resident (else it is rebuilt, or ``SessionLost``)."""
    host = session_host()
    session_id = _session_id(model)
    if fresh or not model.opened:  # the client's first request opens its session: a fresh adapter
        config, lora = _config(model)
        host.open(session_id, model.model.base_model.source, config, lora, state=state)
        services.tinker_model_opened(model=model)
    with contextlib.ExitStack() as stack:
        try:
            session = stack.enter_context(host.use(session_id))
        except SessionGone:
            _rebuild(model)
            session = stack.enter_context(host.use(session_id))
        yield session


def _rebuild(model: TinkerModel) -> None:
    """The session is gone (its keeper restarted): rebuilt exactly from what is on record
    (projects.jobs.tinker_recovery), else the model is lost and SessionLost says why."""
    from projects.jobs.tinker_recovery import recover

    try:
        because = recover(
            model, session_of, lambda: services.tinker_drain_claim(model=model, holder=holder())
        )
    except Exception as exc:  # noqa: BLE001 (whatever stopped it, the session is in no known state)
        because = f"rebuilding it failed ({type(exc).__name__}: {exc})"
    if because is None:
        return
    why = (f"the training session of {model.pk} is gone (the trainer process holding it restarted) and "
           f"could not be rebuilt: {because}; create a training client from your last saved state "
           "(load_state) to continue")  # fmt: skip
    services.tinker_model_lost(model=model, why=why)
    raise SessionLost(why)


# ---------------------------------------------------------------------- training requests
def drain(model_pk: str) -> int:
    """Execute the model's queued requests in order; returns how many ran."""
    me, ran = holder(), 0
    while True:
        model = TinkerModel.objects.select_related("model__base_model", "run", "session").get(pk=model_pk)
        if not services.tinker_drain_claim(model=model, holder=me):
            return ran
        try:
            while True:
                model.refresh_from_db(fields=["done_seq", "steps", "lost", "opened"])
                future = (
                    TinkerFuture.objects.filter(
                        model=model, seq_id__in=(0, model.done_seq + 1), status=TinkerFutureStatus.PENDING
                    )
                    .order_by("seq_id")
                    .first()
                )
                if future is None:
                    break
                execute(model, future)
                ran += 1
        finally:
            services.tinker_drain_release(model=model, holder=me)
        model.refresh_from_db(fields=["done_seq"])
        if not TinkerFuture.objects.filter(model=model, seq_id__in=(0, model.done_seq + 1),
                                           status=TinkerFutureStatus.PENDING).exists():  # fmt: skip
            return ran


def execute(model: TinkerModel, future: TinkerFuture) -> None:
    started = time.monotonic()
    try:
        if model.lost:
            raise SessionLost(model.lost)
        result, blob = _run(model, future, started)
    except RequestFailed as exc:
        services.tinker_future_finish(future=future, error=str(exc), category=exc.category)
    except (WireError, LossInputError, ValueError) as exc:
        services.tinker_future_finish(future=future, error=str(exc), category="user")
    except Exception as exc:  # noqa: BLE001 (the client must hear of it, not wait forever)
        services.tinker_future_finish(future=future, error=f"{type(exc).__name__}: {exc}", category="server")
    else:
        services.tinker_future_finish(future=future, result=result, blob=blob,
                                      seconds=time.monotonic() - started)  # fmt: skip


def _run(
    model: TinkerModel, future: TinkerFuture, started: float
) -> tuple[dict[str, Any] | None, bytes | None]:
    kind, payload = future.kind, future.payload
    if kind == "forward_backward":
        call = parse_forward_backward(bytes(future.body or b""))
        with session_of(model) as session:
            result = session.forward_backward(call.data, call.loss_fn, call.loss_fn_config,
                                              forward_only=call.forward_only)  # fmt: skip
        if not call.forward_only:
            services.tinker_loss_add(model=model, loss=result.loss)
            # Kept with the request (its client reads the blob): the next optim_step's cost counts it.
            return {"trainable_tokens": trained_tokens(call.data)}, forward_backward_output(result)
        return None, forward_backward_output(result)
    if kind == "optim_step":
        arguments = optim_arguments(payload)
        with session_of(model) as session:
            metrics = session.optim_step(**arguments)
        step = model.steps + 1
        services.tinker_step_record(model=model, step=step, metrics=metrics, seconds=time.monotonic() - started,
                                    device=settings.TRAINING_DEVICE)  # fmt: skip
        model.steps = step
        return optim_result(metrics), None
    if kind in ("save_weights", "save_weights_for_sampler", "save_weights_external"):
        return _save(model, future), None
    if kind == "load_weights":
        return _load(model, payload), None
    raise RequestFailed(f"unknown request kind {kind!r}", category="server")


def trained_tokens(data: Any) -> int:
    """The positions a ``forward_backward`` trained on: those with a non-zero ``weights`` value
    (cross_entropy), else a non-zero ``advantages`` value (the RL losses), else every position."""
    total = 0
    for datum in data:
        inputs = datum.loss_fn_inputs
        mask = inputs.get("weights", inputs.get("advantages"))
        total += len(datum.model_input) if mask is None else sum(1 for value in mask if value)
    return total


def optim_arguments(payload: dict[str, Any]) -> dict[str, float]:
    """An ``optim_step`` request's AdamW settings, as the session's ``optim_step`` takes them."""
    params = payload.get("adam_params") or payload.get("optim_params") or {}
    if "type" in params and params["type"] not in ("adam", "adamw"):
        raise RequestFailed(f"optimizer {params['type']!r} is not offered: artweb trains with AdamW")
    clip = float(params.get("grad_clip_norm", 0.0) or 0.0)
    return {
        "learning_rate": float(params.get("learning_rate", 1e-4)), "beta1": float(params.get("beta1", 0.9)),
        "beta2": float(params.get("beta2", 0.95)), "eps": float(params.get("eps", 1e-12)),
        "weight_decay": float(params.get("weight_decay", 0.0)), "max_grad_norm": clip if clip > 0 else float("inf"),
    }  # fmt: skip


def optim_result(metrics: dict[str, Any]) -> dict[str, Any]:
    """An ``optim_step``'s answer to its client (what a rebuild compares against)."""
    return {"type": "optim_step", "metrics": {f"{k}:mean": float(v) for k, v in metrics.items()}}


def _save(model: TinkerModel, future: TinkerFuture) -> dict[str, Any]:
    payload, kind = future.payload, future.kind
    step = model.steps
    existing = (
        Checkpoint.objects.filter(model=model.model, step=step).exclude(storage_key="", path="").first()
    )
    if existing is None:
        folder = checkpoint_path(settings.CHECKPOINT_DIR / f"model-{model.model.pk}", step)
        with session_of(model) as session:
            session.save_state(folder, step=step, metrics={"tinker": model.pk})
        stored = checkpoint_upload(model_id=model.model.pk, step=step, folder=folder)
        path = str(folder)
    else:
        stored, path = None, existing.path
    prefix = {"save_weights": "weights", "save_weights_external": "external_weights"}.get(
        kind, "sampler_weights"
    )
    name = payload.get("path")
    label = f"{prefix}/{name}" if name else f"{prefix}/step-{step:06d}"
    export = None
    # projects.tinker.exports: an export's adapter files go by signed URLs; any name may have a TTL.
    if kind == "save_weights_external" or payload.get("ttl_seconds"):
        export = export_record(recipients=payload.get("age_encryption_recipients"),
                               ttl_seconds=payload.get("ttl_seconds"))  # fmt: skip
    checkpoint = services.tinker_checkpoint_record(
        model=model, step=step, path=path, stored=stored, name=label, export=export
    )
    tinker_path = f"tinker://{model.pk}/{label}"
    if kind in ("save_weights", "save_weights_external"):
        return {"type": kind, "path": tinker_path}
    if name:
        return {"type": "save_weights_for_sampler", "path": tinker_path}
    seq = payload.get("sampling_session_seq_id")
    sampler = services.tinker_sampler_create(
        session=model.session, sampler_id=f"{model.session_id}:sample:{seq}" if seq is not None else None,
        base_model=model.model.base_model, checkpoint=checkpoint, model_path=tinker_path,
    )  # fmt: skip
    return {"type": "save_weights_for_sampler", "path": None, "sampling_session_id": sampler.pk}


def _load(model: TinkerModel, payload: dict[str, Any]) -> dict[str, Any]:
    try:
        checkpoint = checkpoint_for_path(
            model.session.team, payload.get("path") or "", param="path", public=True
        )
    except DomainError as exc:  # unpublished or deleted since the request was accepted
        raise RequestFailed(str(exc)) from None
    if checkpoint.model.base_model_id != model.model.base_model_id:
        raise RequestFailed(f"{payload.get('path')} is a checkpoint of {checkpoint.model.base_model.name}, "
                            f"not of {model.model.base_model.name}")  # fmt: skip
    if LoraSpec.from_dict(checkpoint.model.lora) != LoraSpec.from_dict(model.model.lora):
        raise RequestFailed("the checkpoint's LoRA shape (rank, layers) differs from this training client's")
    folder = checkpoint_local_dir(checkpoint)
    with session_of(model, state=folder, fresh=True):
        pass
    if not payload.get("optimizer", True):
        with session_of(model) as session:  # weights only: the optimizer's moments start afresh
            session.reset_optimizer()
    services.tinker_model_found(model=model)
    return {"type": "load_weights", "path": payload.get("path")}


# ---------------------------------------------------------------------- sampling
def sample(future_pk: str) -> None:
    future = TinkerFuture.objects.filter(pk=future_pk).first()
    if future is None or future.status != TinkerFutureStatus.PENDING:  # gone with its team, or cancelled
        return
    started = time.monotonic()
    try:
        blob, tokens = _sample(future)
    except (RequestFailed, WireError, ValueError) as exc:
        services.tinker_future_finish(
            future=future, error=str(exc), category=getattr(exc, "category", "user")
        )
    except Exception as exc:  # noqa: BLE001
        services.tinker_future_finish(future=future, error=f"{type(exc).__name__}: {exc}", category="server")
    else:
        services.tinker_future_finish(future=future, blob=blob, seconds=time.monotonic() - started,
                                      result={"completion_tokens": tokens})  # fmt: skip


def _sample(future: TinkerFuture) -> tuple[bytes, int]:
    """The response and the tokens sampled (kept with the request: the cost of the next optim_step
    of the training client whose checkpoint it sampled counts them)."""
    payload = future.payload
    sampler = TinkerSampler.objects.select_related("base_model", "checkpoint__model__project").get(
        pk=payload["sampler"]
    )
    if sampler.checkpoint is not None and sampler.checkpoint.model.project.team_id != future.team_id:
        try:  # another team's published checkpoint: still published?
            checkpoint_for_path(future.team, sampler.model_path, param="model_path", public=True)
        except DomainError as exc:
            raise RequestFailed(str(exc)) from None
    prompt = model_input_tokens(payload.get("prompt"), "prompt")
    params = payload.get("sampling_params") or {}
    stop = params.get("stop")
    stop_strings = [stop] if isinstance(stop, str) else [s for s in (stop or []) if isinstance(s, str)]
    stop_ids = (
        [s for s in (stop or []) if isinstance(s, int) and not isinstance(s, bool)]
        if not isinstance(stop, str)
        else []
    )
    num = int(payload.get("num_samples", 1))
    if not 1 <= num <= 64:
        raise RequestFailed("num_samples must be from 1 to 64")
    sampling = SamplingParams(
        temperature=float(params.get("temperature", 1.0)), top_p=float(params.get("top_p", 1.0)),
        top_k=max(0, int(params.get("top_k", -1))), max_new_tokens=int(params.get("max_tokens") or 64),
        seed=params.get("seed"), stop=stop_strings, stop_token_ids=stop_ids,
    )  # fmt: skip
    keeper = session_host()
    session_id = f"tinker-sampler-{sampler.checkpoint_id or 'base-' + str(sampler.base_model_id)}"
    source = sampler.base_model.source
    if sampler.checkpoint is not None:
        folder = checkpoint_local_dir(sampler.checkpoint)
        lora = LoraSpec.from_dict(sampler.checkpoint.model.lora)
    else:
        folder, lora = None, LoraSpec()
    prompts = [prompt] * num
    wanted = bool(payload.get("prompt_logprobs"))
    last_n = payload.get("prompt_logprobs_last_n")
    on_vllm = None if wanted else vllm_sampler(sampler, sampling)
    if on_vllm is not None:
        choices = sample_on_vllm(on_vllm, sampler, folder, prompts, sampling)
        return sample_response(choices), sum(len(choice.token_ids) for choice in choices)
    scoring = prompt_scoring(prompt, last_n) if wanted else None
    scored = None
    with contextlib.ExitStack() as stack:
        try:
            session = stack.enter_context(keeper.use(session_id))
        except SessionGone:  # a sampler's session is opened on its first request
            keeper.open(session_id, source, TrainConfig(), lora, state=folder)
            session = stack.enter_context(keeper.use(session_id))
        choices = session.sample(prompts, sampling)
        scored = session.forward([scoring])[0] if scoring is not None else None
    sampled = sum(len(choice.token_ids) for choice in choices)
    return sample_response(choices, prompt_logprobs(prompt, scored, last_n) if wanted else None), sampled


def vllm_sampler(sampler: TinkerSampler, sampling: SamplingParams) -> Any:
    """A live vLLM inference server of the sampler's base model (TINKER_SAMPLER=auto), or None:
    none serves it, or the request asks what vLLM cannot report the sampled tokens' logprobs under
    (top-k, top-p truncation: training.engines.vllm_engine.check_logprob_convention)."""
    if settings.TINKER_SAMPLER != "auto":
        return None
    from training.engines.vllm_engine import check_logprob_convention

    try:
        check_logprob_convention(sampling)
    except ValueError:
        return None
    affinity = f"tinker-{sampler.checkpoint_id or sampler.base_model.name}"
    return next(
        (s for s in live_servers(base_model=sampler.base_model, affinity=affinity) if s.engine == "vllm"),
        None,
    )


def sample_on_vllm(server: Any, sampler: TinkerSampler, folder: Path | None, prompts: list[list[int]],
                   sampling: SamplingParams) -> list[Any]:  # fmt: skip
    """Sample ``prompts`` on the vLLM server ``server`` (an InferenceServer row), the sampler's
    checkpoint loaded as an adapter of a name no one else can guess for the call and unloaded
    after it: the gateway keeps its own adapters' count on that server. vLLM stops at the model's
    eos itself; the client's stop tokens are added."""
    from training.engines.remote_engine import RemoteEngine, RolloutServer

    checkpoint = sampler.checkpoint
    located = (
        (checkpoint.storage_key, checkpoint.sha256)
        if checkpoint and checkpoint.storage_key and checkpoint.sha256
        else None
    )
    engine = RemoteEngine(
        RolloutServer(
            url=server.url, token=settings.INFERENCE_SERVER_TOKEN, locate=lambda _folder: located, engine="vllm",
            fetch_url=server.fetch_url, served_model=sampler.base_model.name,
            adapter_prefix=f"tinker-{sampler.pk}-{secret_suffix(f'tinker-{sampler.pk}')}-",
        ),
        tokenizer=None,
        stop_token_ids=frozenset(),
    )  # fmt: skip
    if folder is None:
        return engine.generate_from_tokens(prompts, sampling)
    name = f"step-{checkpoint.step if checkpoint else 0}"
    engine.load_adapter(name, folder)
    try:
        return engine.generate_from_tokens(prompts, sampling, adapter=name)
    finally:
        engine.unload_adapter(name)
