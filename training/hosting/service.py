"""The trainer service: a long-lived process per worker host (beside the inference server) that keeps
training sessions resident (training.hosting.pool: many adapters on one copy of each base model)
and offers their primitives over HTTP, so a worker's job, an ART training job or a Tinker API call
uses a session without loading anything.

Every session is *claimed* by a holder (a worker's job, an API request's owner) for a lease that
the holder renews with heartbeats; a primitive from anyone else is refused (409) while the lease
lives. When it lapses the session stays resident and may be claimed by the next holder. The service
runs one primitive at a time per process (one lock: the sessions share a model), except that a sample
decodes ``sample_slice_steps`` tokens per hold of the lock: the lock is fair (first come, first
served), so another team's forward_backward waits for one slice, not for the whole sample. A
session's own primitives still run one after another (a lock per session). Heartbeats, claims and
/stats answer at once: requests run on ``request_threads`` threads, enough that those waiting for
the lock never leave none free. A lease that lapsed while its holder's next call waited is still the
holder's if nobody claimed the session since (``_claimed``). A sample's ``max_new_tokens`` is
capped (``max_new_tokens``) and each prompt plus it must fit the model's context; token ids outside
the vocabulary are a 400 (training.session).

Routes (JSON; every route but /health needs the service token as a bearer token):
    POST   /sessions                       open: {session_id, base_model, config, lora, state?, tag?, holder, lease_s,
                                            closable?: its holder reopens it; unclaimed, it may be
                                            closed for another data-parallel session's ranks}
    POST   /sessions/{id}/claim            {holder, lease_s, tag?, config?, take?}: 404 unknown, 409 held (unless
                                            take: the caller holds the work elsewhere, e.g. a run's claim
                                            in the database), 412 another tag
    POST   /sessions/{id}/heartbeat        {holder, lease_s}
    POST   /sessions/{id}/forward          {holder, data, reference?: "base" | a checkpoint folder}
    POST   /sessions/{id}/forward_backward {holder, data, loss_fn, loss_fn_config}
    POST   /sessions/{id}/sample           {holder, prompts: [[token ids]], sampling: {temperature, max_new_tokens, stop,
                                            seed, top_logprobs, ...}}: choices (token_ids, logprobs, text,
                                            finish_reason, top_logprobs) and the policy's stop_token_ids
    POST   /sessions/{id}/optim_step       {holder, learning_rate, beta1, beta2, eps, weight_decay, max_grad_norm}
    POST   /sessions/{id}/save_state       {holder, path, step, metrics, tag?}: the live adapter's fingerprint
    POST   /sessions/{id}/save_weights_for_sampler {holder, path}
    POST   /sessions/{id}/tag              {holder, tag}: what the session holds, as its holder says
    POST   /sessions/{id}/release          {holder}: the lease ends, the session stays resident
    DELETE /sessions/{id}                  {holder}: closed and freed
    GET    /stats

Paths (``state``, ``path``) must lie under the service's ``root``: a request never names a file the
service would read or write elsewhere.

Why one module of this length: the routes, the leases and the fair lock share one state (which
session is claimed by whom, which request holds the model); split, the lease rules would be read
apart from the routes they guard.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.config import ConfigError, LoraSpec, TrainConfig
from training.engines.token_wire import TokenRequestError, choice_body, parse_prompts, parse_sampling
from training.hosting.pool import SessionPool, SessionPoolError
from training.serving.asgi import json_response, read_body
from training.serving.protocol import RequestError
from training.session.contract import BASE_MODEL, Datum
from training.session.losses import LossInputError

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024
PRIMITIVES = (
    "forward",
    "forward_backward",
    "optim_step",
    "sample",
    "save_state",
    "save_weights_for_sampler",
    "reset_optimizer",
)
OPTIM_FIELDS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "max_grad_norm")


class ServiceError(Exception):
    def __init__(self, status: int, message: str, *, code: str = "invalid_value", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


CLOSING = "(the trainer service, closing it)"  # the holder of a session being closed


@dataclass
class Lease:
    holder: str = ""
    expires_at: float = 0.0

    def held_by_other(self, holder: str, now: float) -> bool:
        return bool(self.holder) and self.holder != holder and self.expires_at > now


@dataclass
class ServiceConfig:
    root: Path  # the only folder requests may name (checkpoints, states)
    token: str = ""
    default_lease_s: float = 60.0
    max_lease_s: float = 3600.0
    max_new_tokens: int = 4096  # the most new tokens a sample may ask for (the inference server's cap)
    # Decode steps a sample runs per hold of the lock (others' primitives go in between); 0: the whole
    # sample in one hold (the behaviour before issue 51, kept for benchmarks/trainer_fairness.py).
    sample_slice_steps: int = 8
    # Threads that run requests. A request waiting for the lock (a primitive behind another team's
    # sample) holds one the whole time; asyncio's default pool has os.cpu_count() + 4 (6 on a 2-core
    # host), so a few waiting samples used to queue every heartbeat and claim behind them until
    # leases lapsed. Waiting threads cost no CPU.
    request_threads: int = 64


class FairLock:
    """A lock granted in the order it was asked for (a ticket lock): a thread that releases it
    and asks again queues behind those already waiting, which ``threading.Lock`` does not promise."""

    def __init__(self) -> None:
        self._turn = threading.Condition()
        self._next_ticket = 0
        self._serving = 0

    def __enter__(self) -> FairLock:
        with self._turn:
            ticket = self._next_ticket
            self._next_ticket += 1
            while self._serving != ticket:
                self._turn.wait()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._turn:
            self._serving += 1
            self._turn.notify_all()

    def waiting(self) -> int:
        """Threads queued or holding it."""
        with self._turn:
            return self._next_ticket - self._serving


@dataclass
class TrainerService:
    pool: SessionPool
    config: ServiceConfig
    clock: Callable[[], float] = time.monotonic
    leases: dict[str, Lease] = field(default_factory=dict)
    # Sessions their holder can open again from a recorded checkpoint (client jobs' kept sessions):
    # one that holds data-parallel ranks, unclaimed, gives them up to another that needs them.
    closable: set[str] = field(default_factory=set)
    _lock: FairLock = field(default_factory=FairLock)  # one primitive (or sample slice) at a time
    _session_locks: dict[str, threading.Lock] = field(default_factory=dict)  # a session's calls in order
    _leases_lock: threading.Lock = field(default_factory=threading.Lock)
    primitives_run: int = 0
    _requests: ThreadPoolExecutor = field(init=False)  # runs requests; its threads start as needed

    def __post_init__(self) -> None:
        self._requests = ThreadPoolExecutor(self.config.request_threads, thread_name_prefix="request")

    # ------------------------------------------------------------------ requests (plain, testable)
    def handle(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        parts = [part for part in path.split("/") if part]
        if parts == ["stats"] and method == "GET":
            return 200, self.stats()
        if parts == ["sessions"] and method == "POST":
            return 200, self._open(body)
        if len(parts) == 2 and parts[0] == "sessions" and method == "DELETE":
            self._claimed(parts[1], body)
            self._close(parts[1])
            return 200, {"session_id": parts[1], "deleted": True}
        if len(parts) == 3 and parts[0] == "sessions" and method == "POST":
            session_id, action = parts[1], parts[2]
            if action == "claim":
                return 200, self._claim(session_id, body)
            if action == "heartbeat":
                self._claimed(session_id, body)
                return 200, self._lease(session_id, body)
            if action == "tag":  # what the session holds, as its holder says (a recorded checkpoint)
                self._claimed(session_id, body)
                self.pool.set_tag(session_id, body.get("tag"))
                return 200, {"session_id": session_id, "tag": body.get("tag")}
            if action == "release":
                self._claimed(session_id, body)
                with self._leases_lock:
                    self.leases[session_id] = Lease()
                return 200, {"session_id": session_id, "released": True}
            if action in PRIMITIVES:
                self._claimed(session_id, body)
                return 200, self._primitive(session_id, action, body)
        raise ServiceError(404, f"no route {method} {path}", code="not_found")

    def stats(self) -> dict[str, Any]:
        now = self.clock()
        with self._leases_lock:
            held = {sid: lease.holder for sid, lease in self.leases.items() if lease.expires_at > now}
        return {**self.pool.stats(), "held": held, "primitives_run": self.primitives_run}

    # ------------------------------------------------------------------ internals
    def _open(self, body: dict[str, Any]) -> dict[str, Any]:
        session_id = _text(body, "session_id")
        holder = _text(body, "holder")
        try:
            config = TrainConfig.from_dict(body.get("config") or {})
            lora = LoraSpec.from_dict(body.get("lora") or {})
        except ConfigError as exc:
            raise ServiceError(
                400, str(exc), param=f"config.{exc.field}" if getattr(exc, "field", None) else "config"
            ) from exc
        state = self._under_root(body["state"], "state") if body.get("state") else None
        with self._leases_lock:
            if session_id in self.pool:
                raise ServiceError(409, f"session {session_id!r} is open already: claim it", code="conflict")
            self.leases[session_id] = Lease(holder, self.clock() + self._lease_s(body))
        try:
            if config.devices > 1:
                self._free_ranks()
            with self._lock:
                self.pool.open(
                    session_id, _text(body, "base_model"), config, lora, state=state, tag=body.get("tag")
                )
        except BaseException:
            with self._leases_lock:
                self.leases.pop(session_id, None)
            raise
        if body.get("closable") is True:
            self.closable.add(session_id)
        return {"session_id": session_id, "tag": body.get("tag"), **self._lease(session_id, body)}

    def _free_ranks(self) -> None:
        """Close the data-parallel sessions that are closable and claimed by nobody: the process
        trains one at a time (training.hosting.pool), and their holders reopen them when needed."""
        idle = []
        with self._leases_lock:  # held by this service from here on: a claim now is refused (409)
            now = self.clock()
            for sid in self.pool.data_parallel_sessions():
                if sid in self.closable and not self.leases.get(sid, Lease()).held_by_other("", now):
                    self.leases[sid] = Lease(CLOSING, now + self.config.max_lease_s)
                    idle.append(sid)
        for session_id in idle:
            log.info("closing data-parallel session %s (unclaimed, reopened by its holder): another needs the ranks",
                     session_id)  # fmt: skip
            self._close(session_id)

    def _close(self, session_id: str) -> None:
        with self._lock:
            self.pool.close(session_id)
        with self._leases_lock:
            self.leases.pop(session_id, None)
            self._session_locks.pop(session_id, None)
        self.closable.discard(session_id)

    def _claim(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        holder = _text(body, "holder")
        with self._leases_lock:
            if session_id not in self.pool:
                raise ServiceError(404, f"no session {session_id!r} on this trainer", code="not_found")
            lease = self.leases.setdefault(session_id, Lease())
            if lease.held_by_other(holder, self.clock()) and body.get("take") is not True:
                raise ServiceError(409, f"session {session_id!r} is held by another holder", code="conflict")
            if "tag" in body and self.pool.tag(session_id) != body["tag"]:
                raise ServiceError(412, f"session {session_id!r} holds another state than the one asked for",
                                   code="precondition_failed")  # fmt: skip
            self.leases[session_id] = Lease(holder, self.clock() + self._lease_s(body))
        if body.get("config") is not None:  # the claimer's settings from now on (training.hosting.pool)
            with self._lock:
                self.pool.configure(session_id, self._config(body))
        return {"session_id": session_id, "tag": self.pool.tag(session_id), **self._lease(session_id, body)}

    def _config(self, body: dict[str, Any]) -> TrainConfig:
        try:
            return TrainConfig.from_dict(body.get("config") or {})
        except ConfigError as exc:
            raise ServiceError(400, str(exc), param=f"config.{exc.field}") from exc

    def _claimed(self, session_id: str, body: dict[str, Any]) -> None:
        """The caller holds the session. A lease that lapsed is still its holder's while nobody else
        has claimed the session since (a claim by another holder, a release or a close replaces
        it): the holder's next call renews it. A request can reach this check long after its
        holder's last call, queued behind other teams' work on a busy service (a Tinker client's
        ``forward_backward`` after its sampler answered), and its session is then exactly as the
        holder left it."""
        holder = _text(body, "holder")
        with self._leases_lock:
            lease = self.leases.get(session_id)
            if lease is None or session_id not in self.pool:
                raise ServiceError(404, f"no session {session_id!r} on this trainer", code="not_found")
            if lease.holder != holder:
                raise ServiceError(409, f"session {session_id!r} is not claimed by {holder!r} (lease lost or "
                                   "never held): claim it again", code="lease_lost")  # fmt: skip
            now = self.clock()
            if lease.expires_at <= now:
                log.info(
                    "session %s: %s's lease had lapsed and nobody claimed it since; renewed",
                    session_id,
                    holder,
                )
                lease.expires_at = now + self.config.default_lease_s

    def _lease(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        lease_s = self._lease_s(body)
        with self._leases_lock:
            lease = self.leases[session_id]
            lease.expires_at = self.clock() + lease_s
        return {"holder": lease.holder, "lease_s": lease_s}

    def _lease_s(self, body: dict[str, Any]) -> float:
        value = body.get("lease_s", self.config.default_lease_s)
        if not isinstance(value, int | float) or not 0 < value <= self.config.max_lease_s:
            raise ServiceError(400, f"lease_s must be a number of seconds in (0, {self.config.max_lease_s:g}]",
                               param="lease_s")  # fmt: skip
        return float(value)

    def _session_lock(self, session_id: str) -> threading.Lock:
        with self._leases_lock:
            return self._session_locks.setdefault(session_id, threading.Lock())

    def _primitive(self, session_id: str, action: str, body: dict[str, Any]) -> dict[str, Any]:
        with self._session_lock(session_id):
            if action == "sample":
                return self._sample(session_id, body)
            return self._locked_primitive(session_id, action, body)

    def _sample(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """Decode ``sample_slice_steps`` tokens per hold of the lock (see the module doc); the
        session is made live again (adapter, RNG) for every slice and kept resident in between."""
        prompts, sampling = _prompts(body), _sampling(body)
        if sampling.max_new_tokens > self.config.max_new_tokens:
            raise ServiceError(400, f"max_new_tokens may be at most {self.config.max_new_tokens} on this trainer",
                               param="sampling.max_new_tokens")  # fmt: skip
        steps = self.config.sample_slice_steps or None
        with self._lock:
            self.primitives_run += 1
            with self.pool.use(session_id) as session:
                running = session.start_sample(prompts, sampling)
                stop_token_ids = sorted(session.stop_token_ids())
                done = running.advance(steps)
            if not done:
                self.pool.hold(session_id, True)
        if not done:
            try:
                while not done:
                    with self._lock, self.pool.use(session_id):
                        done = running.advance(steps)
            finally:
                with self._lock:
                    if session_id in self.pool:
                        self.pool.hold(session_id, False)
        return {"choices": [choice_body(c) for c in running.choices()], "stop_token_ids": stop_token_ids}

    def _locked_primitive(self, session_id: str, action: str, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self.primitives_run += 1
            with self.pool.use(session_id) as session:
                if action == "forward":
                    reference = body.get("reference")
                    if reference is not None and reference != BASE_MODEL:
                        reference = self._under_root(reference, "reference")
                    return {"logprobs": session.forward(_data(body), reference=reference)}
                if action == "forward_backward":
                    loss_fn = _text(body, "loss_fn")
                    result = session.forward_backward(_data(body), loss_fn, body.get("loss_fn_config") or {},
                                                      forward_only=bool(body.get("forward_only")))  # fmt: skip
                    return {"loss": result.loss, "metrics": result.metrics, "logprobs": result.logprobs}
                if action == "reset_optimizer":
                    session.reset_optimizer()
                    return {}
                if action == "optim_step":
                    params = {name: body[name] for name in OPTIM_FIELDS if body.get(name) is not None}
                    if "learning_rate" not in params:
                        raise ServiceError(400, "optim_step needs learning_rate", param="learning_rate")
                    return {"metrics": session.optim_step(**params)}
                target = self._under_root(_text(body, "path"), "path")
                if action == "save_state":
                    step = int(body.get("step", session.trainer.step))
                    session.trainer.step = step
                    session.save_state(target, step=step, metrics=body.get("metrics") or {})
                    if "tag" in body:
                        self.pool.set_tag(session_id, body["tag"])
                    # What the session holds now, for the holder to check against the saved files.
                    return {"path": str(target), "fingerprint": session.live_fingerprint()}
                else:
                    session.save_weights_for_sampler(target)
                return {"path": str(target)}

    def _under_root(self, value: Any, param: str) -> Path:
        if not isinstance(value, str) or not value:
            raise ServiceError(400, f"{param} must be a path", param=param)
        root = self.config.root.resolve()
        path = (root / value).resolve()
        if path != root and root not in path.parents:
            raise ServiceError(400, f"{param} must lie under the trainer's folder", param=param)
        return path

    # ------------------------------------------------------------------ ASGI
    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
        try:
            if (scope["method"], scope["path"]) == ("GET", "/health"):  # the one open route: liveness
                status, body = 200, {"status": "ok"}
            elif not self._authorized(headers):
                raise ServiceError(401, "a valid trainer service token is required", code="invalid_api_key")
            else:
                raw = await read_body(receive, MAX_BODY_BYTES)
                try:
                    request = json.loads(raw) if raw else {}
                except json.JSONDecodeError as exc:
                    raise ServiceError(400, f"the body is not JSON: {exc}") from exc
                if not isinstance(request, dict):
                    raise ServiceError(400, "the body must be a JSON object")
                status, body = await asyncio.get_running_loop().run_in_executor(
                    self._requests, self.handle, scope["method"], scope["path"], request
                )
        except ServiceError as exc:
            status, body = exc.status, exc.body()
        except RequestError as exc:  # the body: too large, or the client left
            status, body = exc.status, ServiceError(exc.status, exc.message, code=exc.code).body()
        except (LossInputError, ConfigError, ValueError) as exc:
            status, body = 400, ServiceError(400, str(exc)).body()
        except SessionPoolError as exc:
            status, body = 404, ServiceError(404, str(exc), code="not_found").body()
        await json_response(send, status, body)

    def _authorized(self, headers: dict[str, str]) -> bool:
        if not self.config.token:  # served on loopback only (training.serving.binding)
            return True
        given = headers.get("authorization", "").removeprefix("Bearer ").strip()
        return hmac.compare_digest(given.encode(), self.config.token.encode())


def _text(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise ServiceError(400, f"{name} is required (a non-empty string)", param=name)
    return value


def _prompts(body: dict[str, Any]) -> list[list[int]]:
    try:
        return parse_prompts(body.get("prompts"))
    except TokenRequestError as exc:
        raise ServiceError(400, exc.message, param=exc.param) from None


def _sampling(body: dict[str, Any]) -> Any:
    try:
        return parse_sampling(body.get("sampling"))
    except TokenRequestError as exc:
        raise ServiceError(400, exc.message, param=exc.param) from None


def _data(body: dict[str, Any]) -> list[Datum]:
    data = body.get("data")
    if not isinstance(data, list) or not data:
        raise ServiceError(400, "data must be a non-empty list of datums", param="data")
    out = []
    for index, item in enumerate(data):
        if not isinstance(item, dict) or not isinstance(item.get("model_input"), list):
            raise ServiceError(
                400, f"data[{index}] needs model_input (a list of token ids)", param=f"data[{index}]"
            )
        try:
            out.append(Datum(model_input=[int(t) for t in item["model_input"]],
                             loss_fn_inputs={k: list(v) for k, v in (item.get("loss_fn_inputs") or {}).items()}))  # fmt: skip
        except (TypeError, ValueError) as exc:
            raise ServiceError(400, f"data[{index}]: {exc}", param=f"data[{index}]") from exc
    return out


def main(argv: list[str] | None = None) -> None:
    """``python -m training.hosting.service --root DIR``: the service of one host. The token comes
    from ``TRAINER_SERVICE_TOKEN`` in the environment, never from the command line; without one it
    refuses to start, unless ``--dev-no-token`` on a loopback ``--host``."""
    import argparse
    import os

    from training.serving.binding import add_dev_no_token_argument, check_bind_or_exit
    from training.serving.server import advertised_url, bind, serve
    from training.session.policy import load_policy_model

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--root", type=Path, required=True, help="the folder requests' paths must lie under")
    parser.add_argument("--model-cache-dir", type=Path, default=None, help="default: ROOT/models")
    parser.add_argument(
        "--spill-dir", type=Path, default=None, help="evicted sessions' states (ROOT/.trainer-spill)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8200, help="0 picks a free port")
    parser.add_argument("--memory-budget-mb", type=int, default=0, help="resident sessions' budget; 0: none")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-new-tokens", type=int, default=4096, help="a sample's largest max_new_tokens")
    parser.add_argument("--unsloth", default="auto")
    parser.add_argument(
        "--fd", type=int, default=None,
        help="serve on this inherited listening socket, bound to --host/--port by the parent (manage.py up)",
    )  # fmt: skip
    add_dev_no_token_argument(parser, token_variable="TRAINER_SERVICE_TOKEN")
    args = parser.parse_args(argv)
    token = os.environ.get("TRAINER_SERVICE_TOKEN", "")
    check_bind_or_exit(
        parser, args, token=token, token_variable="TRAINER_SERVICE_TOKEN", what="the trainer service"
    )
    cache = args.model_cache_dir or args.root / "models"
    threads = int(os.environ.get("TORCH_THREADS") or 0)  # `manage.py up` splits the cores
    if threads:
        import torch

        torch.set_num_threads(threads)

    def load(source: str) -> tuple[Any, Any]:
        model, tokenizer, _ = load_policy_model(source, cache, device=args.device, unsloth=args.unsloth)
        return model, tokenizer

    pool = SessionPool(load, spill_dir=args.spill_dir or args.root / ".trainer-spill", device=args.device,
                       budget_bytes=args.memory_budget_mb * 2**20 or None, model_cache_dir=cache,
                       unsloth=args.unsloth)  # fmt: skip
    service = TrainerService(
        pool,
        ServiceConfig(root=args.root, token=token, max_new_tokens=args.max_new_tokens),
    )
    sock = socket.socket(fileno=args.fd) if args.fd is not None else bind(args.host, args.port)
    url = advertised_url(args.host, sock.getsockname()[1])
    print(f"trainer service on {url}", flush=True)
    serve(service, sock=sock, url=url, token=token)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
