"""A platform run whose training session lives in the host's trainer service (training.hosting.service).

With a service on the worker's host (``RunSpec.host`` is its SessionHost), a run holds no model in the
worker: its session (adapter, AdamW's state, RNG) lives in the service beside the other sessions on
the same base model (multi-tenant LoRA: ART jobs, Tinker clients, other runs), and the loop drives it
through the primitives: ``sample`` for rollouts and evaluations (``SessionEngine``), the GRPO update
of training.recipes.grpo_update (``forward`` / ``forward_backward`` / ``optim_step``), ``save_state`` for each
checkpoint. The worker loads the tokenizer only. The loop is otherwise the one every run takes, so a
run trains the same tensors wherever its session lives (tests/training/test_service_run.py).

SFT and DPO runs (training.recipes.supervised) are the same primitives and go there too. Trained in the worker
still (training.hosting.placement's rule, which ``service_refusal`` reads for a run): rollouts that
overlap the update, a data-parallel update (``devices`` > 1), and the vLLM sampler.

The session is leased: the worker heartbeats it while the run trains and closes it when the run ends,
however it ends. When the service loses it (a restart, a lease that lapsed), every later call raises
``SessionLost`` and the loop resumes the run from its last recorded checkpoint on a new session:
the checkpoint holds everything the next step needs, so the resumed run is the uninterrupted one.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from training.base_models import load_tokenizer
from training.engines.base import (
    Choice,
    Engine,
    OnFinished,
    OnToken,
    SamplingParams,
    report_after,
    report_finished_after,
)
from training.engines.vllm_engine import render_prompt
from training.hosting.client import LeaseLost, RemoteSession, TrainerServiceError
from training.hosting.placement import SERVICE, WORKER, place
from training.recipes.grpo_update import grpo_step
from training.rollouts.trajectory import TrainGroup
from training.runs.progress import phase
from training.runs.steps import checkpoint_path
from training.session.adapter_check import AdapterMismatchError, SamplerCheck, saved_adapter_fingerprint
from training.session.contract import Datum, Session


class HostUnavailable(OSError):
    """The trainer service did not answer when the run's session was opened on it."""


class SessionLost(RuntimeError):
    """The trainer service no longer holds the run's session (or does not answer)."""


def service_refusal(spec: Any) -> str | None:
    """Why ``spec``'s run trains in the worker rather than on its host's trainer service; None when
    it trains there (training.hosting.placement's rule over ``spec.host``, the SessionHost the
    worker's sessions open on)."""
    from training.engines import select_engine_kind

    if (
        getattr(spec.host, "kind", WORKER) != SERVICE
    ):  # the engine is chosen (and vLLM looked for) only where it matters
        return place("run", service=False).reason
    sampler = select_engine_kind(spec.device, spec.engine, spec.vllm_python)
    placement = place("run", service=True, config=spec.config, sampler=sampler)
    return None if placement.host == SERVICE else placement.reason


class _RunSession(RemoteSession):
    """A RemoteSession whose loss (the service restarted, the lease lapsed, no answer) is SessionLost."""

    def _call(self, action: str, **body: Any) -> dict[str, Any]:
        try:
            return super()._call(action, **body)
        except LeaseLost as exc:
            raise SessionLost(f"the trainer service gave the run's session to another holder: {exc}") from exc
        except TrainerServiceError as exc:
            if exc.status == 404:
                raise SessionLost(f"the trainer service no longer holds the run's session: {exc}") from exc
            raise
        except OSError as exc:
            raise SessionLost(f"the trainer service did not answer: {exc}") from exc

    def stop_token_ids(self) -> set[int]:
        """The ids that end the policy's completions (the service's engine says, with any sample;
        one greedy token on a private seed, so the session's RNG is not touched)."""
        out = self._call(
            "sample", prompts=[[0]], sampling={"max_new_tokens": 1, "temperature": 0.0, "seed": 0}
        )
        return {int(i) for i in out["stop_token_ids"]}


def open_session(client: Any, holder: str, session_id: str, spec: Any, state: Path | None, *,
                 lease_s: float) -> _RunSession:  # fmt: skip
    """The run's session, opened on the service from ``state`` (a checkpoint folder; None: a fresh
    adapter seeded by the config). One an earlier attempt left there is taken and closed first,
    even under a lease that still runs: this worker holds the run (its claim in the database), so
    the holder of that lease is a worker that lost the run."""
    try:
        client.claim(session_id, holder=holder, lease_s=lease_s, take=True).close()
    except TrainerServiceError as exc:
        if exc.status != 404:
            raise
    client.open(session_id, holder=holder, base_model=spec.base_model_source, config=spec.config,
                lora=spec.lora, state=str(state) if state is not None else None, lease_s=lease_s)  # fmt: skip
    return _RunSession(client, session_id, holder, lease_s)


def start_on_service(
    client: Any, holder: str, spec: Any, hooks: Any, *, lease_s: float
) -> tuple[Any, Any, Any, int]:
    """training.runs.loop.start_run with the run's session (``spec.session_id``) opened on the
    trainer service ``client`` talks to, held by ``holder`` (this worker): the worker loads the
    tokenizer only. The service host's ``start_run`` (training.hosting.resident.ServiceSessions)."""
    started = time.monotonic()
    phase(hooks, "loading", f"Opening the run's session on the trainer service ({spec.base_model_source})")
    current = spec.start_step if spec.resume_step is None else spec.resume_step
    state = None if spec.resume_step is None else checkpoint_path(spec.checkpoint_root, current)
    session = open_session(client, holder, spec.session_id, spec, state, lease_s=lease_s)
    try:  # the tokenizer after the session: the service converts the bundled model on first use
        tokenizer = load_tokenizer(spec.base_model_source, spec.model_cache_dir)
    except BaseException:
        with contextlib.suppress(Exception):
            session.close()
        raise
    run = ServiceRun(session, tokenizer, spec.config, spec.lora, step=0 if state is None else current)
    hooks.event(
        f"Opened session {spec.session_id} on the trainer service in {time.monotonic() - started:.1f}s"
    )
    if state is None:
        path = checkpoint_path(spec.checkpoint_root, current)
        if path.exists():  # left by a worker that died before recording it
            shutil.rmtree(path)
        try:
            run.save_checkpoint(path, step=current, metrics={})
        except BaseException:
            run.close()
            raise
        hooks.record_checkpoint(step=current, path=path, metrics={})
    elif current == spec.start_step:
        hooks.event(f"Loaded checkpoint step {current}: training continues from it")
    else:
        hooks.event(f"Resumed from checkpoint step {current}")
    dtype = torch.float32 if spec.device == "cpu" else torch.bfloat16
    return run, tokenizer, dtype, current


class ServiceRun:
    """A run whose session is in the service: the loop's calls (``train_step``, ``save_checkpoint``,
    ``run_session``, ...) as training.hosting.in_process.InProcessRun's, over that session."""

    def __init__(self, session: _RunSession, tokenizer: Any, config: Any, lora: Any, *, step: int) -> None:
        self.session = session
        self.tokenizer = tokenizer
        self.config = config
        self.lora = lora
        self.step = step  # updates so far, as Policy.step (the checkpoint's step on resume)
        self.fingerprint = ""  # of the adapter last saved, which the session held then
        self._alive = session.keep_alive()
        self._alive.__enter__()

    def train_step(self, groups: list[TrainGroup], *, learning_rate: float | None = None) -> dict[str, float]:
        """One GRPO step (``grpo_step``) over the service's session."""
        metrics = grpo_step(lambda _: self.session, groups, self.config, step=self.step + 1,
                            learning_rate=learning_rate)  # fmt: skip
        self.step += 1
        return metrics

    def save_checkpoint(self, path: Path, *, step: int, metrics: dict[str, Any]) -> None:
        """Saved by the service into ``path`` (the host's checkpoint folder, shared with it); the
        adapter in the files must be the one the session holds."""
        answer = self.session.save_state(path, step=step, metrics=metrics)
        saved = saved_adapter_fingerprint(path)
        if answer.get("fingerprint") != saved:
            raise AdapterMismatchError(
                f"the trainer service's live adapter is not the one it saved in {path}: fingerprints "
                f"{str(answer.get('fingerprint'))[:12]} vs {saved[:12]}"
            )
        self.fingerprint = saved

    def run_session(self, followers: Any = None) -> Session:
        """The session a run's recipe calls: the service's (a run on the service has no followers:
        service_refusal keeps data-parallel runs in the worker)."""
        if followers is not None:
            raise ValueError("a run on the trainer service has no data-parallel followers")
        return self.session

    def session_engine(self, tokenizer: Any) -> Engine | None:
        """Rollouts are sampled by the session's live policy on the service."""
        return SessionEngine(self.session, tokenizer)

    def check_sampler(
        self, engine: Engine, tokenizer: Any, path: Path, probes: list[list[dict]], *, adapter: str | None,
        tolerance: float,
    ) -> SamplerCheck:  # fmt: skip
        """The service's sampler check (``check_session_sampler``): the saved adapter is the live one."""
        if not isinstance(engine, SessionEngine):
            raise TypeError("a run on the trainer service samples through its SessionEngine")
        return check_session_sampler(engine, self, probes, tolerance=tolerance)

    def close(self) -> None:
        """End the heartbeats and free the session on the service (gone already: nothing to do)."""
        self._alive.__exit__(None, None, None)
        with contextlib.suppress(SessionLost, TrainerServiceError, OSError):
            self.session.close()


class SessionEngine(Engine):
    """Rollouts and evaluations sampled by the session's live policy on the service (the same
    TransformersEngine a worker-side run samples with, over the same weights). No constrained
    decoding, no adapters by name: the session is the policy."""

    def __init__(self, session: _RunSession, tokenizer: Any) -> None:
        self.session = session
        self.tokenizer = tokenizer
        self.stop_token_ids = frozenset(session.stop_token_ids())

    def generate_from_tokens(
        self,
        prompt_token_ids: list[list[int]],
        sampling: SamplingParams,
        adapter: str | None = None,
        *,
        on_token: OnToken | None = None,
        grammars: Any = None,
        on_finished: OnFinished | None = None,
    ) -> list[Choice]:
        if adapter is not None:
            raise ValueError("the trainer service's session samples its live policy, not an adapter by name")
        if grammars is not None and any(g is not None for g in grammars):
            raise NotImplementedError("constrained decoding is not offered by the trainer service")
        choices = self.session.sample(prompt_token_ids, sampling)
        return report_finished_after(report_after(choices, on_token), on_finished)

    def load_adapter(self, name: str, path: Path) -> None:
        raise NotImplementedError("the trainer service's session is the policy: it loads no adapter by name")

    def unload_adapter(self, name: str) -> None:
        raise NotImplementedError("the trainer service's session is the policy: it loads no adapter by name")


def check_session_sampler(
    engine: SessionEngine, run: ServiceRun, probe_messages: list[list[dict]], *, tolerance: float
) -> SamplerCheck:
    """The sampler check of training.session.adapter_check for a session in the service: the saved adapter
    is the live one (``ServiceRun.save_checkpoint`` checked the fingerprints) and the sampler's
    logprob of a probe's first token (at the run's temperature, seeded) equals the learner's
    teacher-forced one (``forward``) to ``tolerance``."""
    prompts = [render_prompt(engine.tokenizer, messages) for messages in probe_messages]
    choices = engine.generate_from_tokens(
        prompts, SamplingParams(temperature=run.config.temperature, max_new_tokens=1, seed=0)
    )
    data = [
        Datum(model_input=prompt, loss_fn_inputs={
            "target_tokens": [float(t) for t in prompt[1:]] + [float(choice.token_ids[0])],
            "weights": [0.0] * (len(prompt) - 1) + [1.0],
        })
        for prompt, choice in zip(prompts, choices, strict=True)
    ]  # fmt: skip
    largest = 0.0
    for choice, learner in zip(choices, run.session.forward(data), strict=True):
        gap = abs(choice.logprobs[0] - learner[-1])
        largest = max(largest, gap)
        if not gap <= tolerance:
            raise AdapterMismatchError(
                f"the trainer service samples token {choice.token_ids[0]} of a probe with logprob "
                f"{choice.logprobs[0]:.6f}, its learner scores it {learner[-1]:.6f} (gap {gap:.2e} > "
                f"{tolerance:.0e})"
            )
    return SamplerCheck(fingerprint=run.fingerprint, max_logprob_gap=largest)
