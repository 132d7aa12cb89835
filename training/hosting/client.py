"""A session held by the trainer service (training.hosting.service), with the primitives of a local
``training.session.local.TrainingSession``: the caller's code is the same whichever it holds.

The holder claims the session for a lease and keeps it with ``heartbeat`` (``keep_alive`` runs a
thread for that while a job trains). A primitive after the lease was lost raises ``LeaseLost``: the
session may be someone else's by then, and the caller's work must stop, as a worker's does when its
claim on a job is lost.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from training.config import LoraSpec, TrainConfig
from training.engines.base import Choice, SamplingParams
from training.engines.token_wire import choices_of, sampling_body
from training.session.contract import Datum, ForwardBackwardResult


class TrainerServiceError(RuntimeError):
    def __init__(self, status: int, message: str, code: str = "") -> None:
        super().__init__(f"trainer service: {message} (HTTP {status})")
        self.status, self.message, self.code = status, message, code


class LeaseLost(TrainerServiceError):
    """Another holder has the session, or the lease lapsed."""


class TrainerServiceRefused(TrainerServiceError, ValueError):
    """The service refused the request's content (HTTP 400: a token outside the vocabulary, a prompt
    too long for the context, ...): the caller's mistake, told to its client as such."""


class TrainerServiceClient:
    def __init__(self, url: str, *, token: str = "", timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = json.dumps(body or {}).encode() if method != "GET" else None
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("content-type", "application/json")
        if self.token:
            request.add_header("authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:  # noqa: S310 (our own URL)
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            try:
                error = json.loads(exc.read())["error"]
            except (ValueError, KeyError, TypeError):
                error = {"message": exc.reason, "code": ""}
            kind = {409: LeaseLost, 400: TrainerServiceRefused}.get(exc.code, TrainerServiceError)
            raise kind(exc.code, error.get("message", ""), error.get("code") or "") from None

    def stats(self) -> dict[str, Any]:
        return self.call("GET", "/stats")

    def open(
        self,
        session_id: str,
        *,
        holder: str,
        base_model: str,
        config: TrainConfig,
        lora: LoraSpec,
        state: str | None = None,
        tag: Any = None,
        lease_s: float = 60.0,
        closable: bool = False,
    ) -> RemoteSession:
        """A new session on the service; ``closable``: the holder opens it again from a recorded
        checkpoint when it is gone, so the service may close it while it is unclaimed (a session
        with data-parallel ranks, when another needs them)."""
        self.call("POST", "/sessions", {
            "session_id": session_id, "holder": holder, "base_model": base_model, "config": config.to_dict(),
            "lora": lora.to_dict(), "state": state, "tag": tag, "lease_s": lease_s, "closable": closable,
        })  # fmt: skip
        return RemoteSession(self, session_id, holder, lease_s)

    def claim(
        self,
        session_id: str,
        *,
        holder: str,
        tag: Any = ...,
        config: TrainConfig | None = None,
        lease_s: float = 60.0,
        take: bool = False,
    ) -> RemoteSession:
        """The resident session, claimed (``tag``: only if it holds that state; 412 otherwise),
        with ``config`` as its settings from now on. ``take``: even from a holder whose lease still
        runs (the caller holds the work the session is for, e.g. a run's claim in the database)."""
        body: dict[str, Any] = {"holder": holder, "lease_s": lease_s, "take": take}
        if config is not None:
            body["config"] = config.to_dict()
        if tag is not ...:
            body["tag"] = tag
        self.call("POST", f"/sessions/{session_id}/claim", body)
        return RemoteSession(self, session_id, holder, lease_s)


class RemoteSession:
    def __init__(self, client: TrainerServiceClient, session_id: str, holder: str, lease_s: float) -> None:
        self.client, self.session_id, self.holder, self.lease_s = client, session_id, holder, lease_s

    def _call(self, action: str, **body: Any) -> dict[str, Any]:
        return self.client.call(
            "POST", f"/sessions/{self.session_id}/{action}", {"holder": self.holder, **body}
        )

    # ------------------------------------------------------------------ primitives
    def forward(self, data: Sequence[Datum], *, reference: Path | str | None = None) -> list[list[float]]:
        ref = None if reference is None else str(reference)
        return self._call("forward", data=[asdict(d) for d in data], reference=ref)["logprobs"]

    def forward_backward(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: dict[str, Any] | None = None,
        *, forward_only: bool = False,
    ) -> ForwardBackwardResult:  # fmt: skip
        out = self._call("forward_backward", data=[asdict(d) for d in data], loss_fn=loss_fn,
                         loss_fn_config=loss_fn_config or {}, forward_only=forward_only)  # fmt: skip
        return ForwardBackwardResult(loss=out["loss"], metrics=out["metrics"], logprobs=out["logprobs"])

    def sample(
        self, prompts: Sequence[list[int]], sampling: SamplingParams | dict[str, Any] | None = None
    ) -> list[Choice]:
        """Completions by the session's current policy, as a local session's ``sample`` answers them
        (``Choice``: token ids, their logprobs, finish reason). ``sampling``: SamplingParams, or
        the service's own ``sampling`` object as is."""
        wire = sampling_body(sampling) if isinstance(sampling, SamplingParams) else (sampling or {})
        prompts = [list(p) for p in prompts]
        return choices_of(prompts, self._call("sample", prompts=prompts, sampling=wire)["choices"])

    def optim_step(self, *, learning_rate: float, **params: float | None) -> dict[str, float]:
        return self._call("optim_step", learning_rate=learning_rate, **params)["metrics"]

    def reset_optimizer(self) -> None:
        self._call("reset_optimizer")

    def save_state(
        self, path: Path | str, *, step: int, metrics: dict[str, Any], tag: Any = ...
    ) -> dict[str, Any]:
        """Saved under ``path``; the answer holds the live adapter's ``fingerprint``."""
        extra = {} if tag is ... else {"tag": tag}
        return self._call("save_state", path=str(path), step=step, metrics=metrics, **extra)

    def save_weights_for_sampler(self, path: Path | str) -> None:
        self._call("save_weights_for_sampler", path=str(path))

    # ------------------------------------------------------------------ the claim
    def heartbeat(self) -> None:
        self._call("heartbeat", lease_s=self.lease_s)

    def set_tag(self, tag: Any) -> None:
        self._call("tag", tag=tag)

    def release(self) -> None:
        """End the lease; the session stays resident for the next holder."""
        self._call("release")

    def close(self) -> None:
        """Close the session on the service (its adapter and optimizer freed)."""
        self.client.call("DELETE", f"/sessions/{self.session_id}", {"holder": self.holder})

    @contextmanager
    def keep_alive(self, every_s: float | None = None) -> Iterator[threading.Event]:
        """Heartbeat from a thread while the block runs; the event is set if the lease was lost."""
        lost, stop = threading.Event(), threading.Event()
        interval = every_s if every_s is not None else self.lease_s / 3

        def beat() -> None:
            while not stop.wait(interval):
                try:
                    self.heartbeat()
                except LeaseLost:
                    lost.set()
                    return
                except (TrainerServiceError, OSError):
                    continue  # a hiccup: the next beat retries within the lease

        thread = threading.Thread(target=beat, name=f"lease-{self.session_id}", daemon=True)
        thread.start()
        try:
            yield lost
        finally:
            stop.set()
            thread.join(timeout=5)
