"""The training loop of one run, top to bottom: roll out, grade, update, checkpoint, record.

No Django here: the caller passes a ``RunHooks`` object that records results and answers "should
I stop?". Invariants the loop keeps:
- checkpoint files are complete (atomic rename) before ``hooks.record_step`` is called;
- a step is a pure function of (seed, step, checkpoint before it), so a resumed run redoes an
  unrecorded step exactly as the dead worker would have, and never records one twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from training.config import LoraSpec, TrainConfig
from training.environments import Environment
from training.evaluation import evaluate_during_run, is_evaluation_step
from training.learning_signal import SignalWatch
from training.progress import phase, step_label
from training.run_steps import checkpoint_path, draw_step, record_step, update_step
from training.trajectory import Trajectory

logger = logging.getLogger(__name__)


@dataclass
class RunSpec:
    base_model_source: str  # BUNDLED_MODEL or a local model directory
    model_cache_dir: Path  # where converted base models are cached
    checkpoint_root: Path  # one folder per step: <root>/step-000003
    config: TrainConfig
    lora: LoraSpec
    environment: Environment  # from training.environments.build_environment; run_training closes it
    grader_spec: dict[str, Any]
    train_rows: list[dict[str, Any]]  # each {"index": int, "data": task row}
    start_step: int  # model step this run started from
    resume_step: int | None  # recorded checkpoint to resume from; None = fresh adapter (step 0)
    stop: list[str] = field(default_factory=list)
    max_grader_error_fraction: float = 0.5
    device: str = "cpu"
    engine: str = "auto"  # rollout engine: auto | vllm | transformers (training.engines.select_engine_kind)
    unsloth: str = "auto"  # base model loader: auto | on | off (training.unsloth_loader.use_unsloth)
    reward_name: str = ""  # how users know the reward definition, for error messages
    judge: Any = None  # training.rewards.JudgeClient for LLM-judge graders (the team's endpoint)
    sandbox: Any = None  # training.rewards.SandboxConfig: the operator's python-grader limits
    validation_rows: list[dict[str, Any]] = field(default_factory=list)  # evaluated (training.evaluation)
    objective: str = (
        "grpo"  # grpo (rollouts and rewards) | sft | dpo (training.supervised: rows carry targets)
    )
    # The host's trainer service (training.service_run.ServiceTarget): the run's session lives
    # there when it may (service_refusal); None: it trains in this process.
    trainer_service: Any = None
    # ``rollouts_on: inference_servers``: the inference server an overlapped run's rollouts are
    # sampled on (training.engines.remote_engine.RolloutServer); None: a sampler in this process.
    rollout_server: Any = None
    # vLLM when this interpreter does not import it: the python of its own virtualenv (the CPU
    # build's, or a GPU image's), and the CPU build's KV cache in GiB (training.serving.vllm).
    vllm_python: str = ""
    vllm_cpu_kv_cache_gib: float = 2.0

    def __post_init__(self) -> None:
        # An empty learning rate: the default for the base model's width and the run's objective
        # (a run created through the API has it filled in already: projects.services.runs).
        if self.config.learning_rate is None:
            from training.base_models import hidden_size

            width = hidden_size(self.base_model_source, Path(self.model_cache_dir))
            self.config = self.config.with_learning_rate(width, self.objective)


# A finished step's trajectories as ``hooks.record_step`` gets them: (group_index, task_row_index, trajectory).
StepTrajectories = list[tuple[int, int, Trajectory]]


class RunHooks(Protocol):
    def should_stop(self) -> str | None:
        """A reason to stop before the next step ("cancelled", "lost") or None."""

    def record_checkpoint(self, *, step: int, path: Path, metrics: dict[str, Any]) -> None: ...

    def record_step(
        self, *, step: int, metrics: dict[str, Any], trajectories: StepTrajectories, path: Path
    ) -> bool:
        """Persist a finished step (see StepTrajectories); False if this worker lost the run."""

    def event(self, message: str, *, level: str = "info", data: dict[str, Any] | None = None) -> None: ...

    def record_evaluation(self, *, step: int, results: dict[str, Any], samples: list[Any]) -> None:
        """Persist the validation evaluation of checkpoint ``step`` (training.evaluation.EvalSample list)."""

    def is_evaluated(self, *, step: int) -> bool:
        """Whether checkpoint ``step`` has its evaluation recorded (asked only when resuming)."""


def _load_policy_model(spec: RunSpec) -> tuple[Any, Any, Any]:
    return load_policy_model(spec.base_model_source, spec.model_cache_dir, device=spec.device,
                             unsloth=spec.unsloth, fsdp=spec.config.fsdp)  # fmt: skip


def load_policy_model(
    source: str, cache_dir: Path, *, device: str, unsloth: str, fsdp: bool = False
) -> tuple[Any, Any, Any]:
    """The base model for training, its tokenizer and dtype: unsloth's loader on CUDA when
    installed (``unsloth``: auto | on | off), else transformers, which leaves the weights in CPU
    memory for the Trainer to move. ``fsdp`` (a base to be sharded across ranks): transformers
    always, so that no rank ever holds the whole base on its device (the Trainer leaves it in CPU
    memory; training.distributed.shard_base puts each rank's shard on the device)."""
    from training.base_models import base_model_dir, load_base_model, resolve_dtype
    from training.unsloth_loader import load_with_unsloth, use_unsloth

    dtype = resolve_dtype("auto", device)
    if not fsdp and use_unsloth(device, unsloth):
        model, tokenizer = load_with_unsloth(
            base_model_dir(source, cache_dir), max_seq_length=4096, dtype=dtype
        )
    else:
        model, tokenizer = load_base_model(source, cache_dir, dtype=dtype, device=device)
    return model, tokenizer, dtype


def start_run_vllm(
    spec: RunSpec, trainer: Any, tokenizer: Any, dtype: Any, *, sleep_mode: bool
) -> tuple[Any, Any]:
    """The run's own vLLM server over its base model and the RemoteEngine that samples it: LoRA up
    to the run's rank, its dtype, sleep mode when it shares a GPU with the trainer (else a fixed
    share of the GPU), and its log beside the checkpoints."""
    from training.base_models import base_model_dir
    from training.engines.remote_engine import RemoteEngine, RolloutServer
    from training.engines.transformers_engine import stop_token_ids_of
    from training.engines.vllm_engine import default_memory_utilization, max_lora_rank_for
    from training.serving.vllm import LocalVLLM, VLLMServeOptions, vllm_executable

    executable = vllm_executable(spec.vllm_python)
    if executable is None:  # select_engine_kind checked; the virtualenv went away since
        raise ValueError(f"the vLLM engine needs vLLM, found neither here nor at {spec.vllm_python!r}")
    on_gpu = spec.device.startswith("cuda")
    sleep_mode = sleep_mode and on_gpu
    name = "policy-base"
    options = VLLMServeOptions(
        model_dir=base_model_dir(spec.base_model_source, spec.model_cache_dir),
        served_model_name=name,
        port=0,
        max_loras=2,  # the checkpoint sampled and the one replacing it
        max_cpu_loras=2,
        max_lora_rank=max_lora_rank_for(spec.lora.rank),
        dtype=str(dtype).removeprefix("torch."),
        gpu_memory_utilization=default_memory_utilization(sleep_mode) if on_gpu else 0.9,
        cpu_kv_cache_gib=None if on_gpu else spec.vllm_cpu_kv_cache_gib,
        max_model_len=getattr(trainer.model.config, "max_position_embeddings", None),
        seed=spec.config.seed,
        sleep_mode=sleep_mode,
    )
    spec.checkpoint_root.mkdir(parents=True, exist_ok=True)
    server = LocalVLLM(options, executable=executable, log_path=spec.checkpoint_root / "vllm.log")
    rollout_server = RolloutServer(url=server.url, token=server.token, engine="vllm", served_model=name)
    engine = RemoteEngine(
        rollout_server, tokenizer, stop_token_ids=stop_token_ids_of(trainer.model, tokenizer)
    )
    return server, engine


class PolicySampler:
    """The rollout engine and the adapter it samples with.

    The TransformersEngine samples from the trainer's live policy, so there is nothing to load.
    With vLLM, the run starts a vLLM server of its own (training.serving.vllm.LocalVLLM: a child
    process, so it starts inside a Celery pool child too) and samples it through RemoteEngine in
    vLLM's dialect, as rollouts on a shared vLLM do; every saved checkpoint is loaded as a new
    adapter by its folder and the previous one is unloaded. On a GPU vLLM shares it with the
    trainer through sleep mode: asleep during the update, woken before the adapter of the new
    checkpoint loads.
    """

    def __init__(
        self, spec: RunSpec, trainer: Any, tokenizer: Any, dtype: Any, step: int, *, detached: bool = False
    ) -> None:
        from training.engines import select_engine_kind

        self.kind: str = select_engine_kind(spec.device, spec.engine, spec.vllm_python)
        self.engine: Any
        self.vllm: Any = None  # the run's own vLLM server (kind "vllm")
        if detached and spec.rollout_server is not None:
            self.kind = "remote"
        if self.kind == "vllm" and spec.config.top_p < 1:
            # vLLM reports top-p-truncated logprobs, which the trainer cannot reproduce.
            self.kind = "transformers"
        # Detached (rollouts overlapping the update, training.overlap): the sampler never shares
        # weights with the trainer: a copy of the base model of its own (transformers), a vLLM
        # that stays awake, or an inference server (remote), each loading saved checkpoints as adapters.
        self.detached = detached
        self.adapter: str | None = None
        self.step: int | None = None  # the checkpoint it samples (None: the trainer's live policy)
        if self.kind == "remote":  # the base model's inference server samples (rollouts_on)
            from training.engines.remote_engine import RemoteEngine
            from training.engines.transformers_engine import stop_token_ids_of

            stops = stop_token_ids_of(trainer.model, tokenizer)
            self.engine = RemoteEngine(spec.rollout_server, tokenizer, stop_token_ids=stops)
        elif self.kind == "vllm":
            self.vllm, self.engine = start_run_vllm(spec, trainer, tokenizer, dtype, sleep_mode=not detached)
        else:
            from training.engines.transformers_engine import TransformersEngine
            from training.service_run import ServiceTrainer, SessionEngine

            if isinstance(trainer, ServiceTrainer):  # the session in the service samples itself
                self.engine = SessionEngine(trainer.session, tokenizer)
            elif detached:
                base, _, _ = load_policy_model(
                    spec.base_model_source, spec.model_cache_dir, device=spec.device, unsloth="off"
                )
                base.to(spec.device)  # loaded on the CPU; only the trainer moves its own copy
                self.engine = TransformersEngine(base, tokenizer, device=spec.device)
            else:
                self.engine = TransformersEngine(trainer.policy, tokenizer, device=spec.device)
        self.use_checkpoint(step, checkpoint_path(spec.checkpoint_root, step))

    def before_update(self) -> None:
        """Give the GPU memory vLLM holds to the policy update (not when detached: it samples on)."""
        if self.vllm is not None and self.vllm.options.sleep_mode:
            self.vllm.sleep()

    def release(self) -> None:
        """The run is over: a sampler on an inference server lets go of the checkpoint it holds
        (vLLM unloads it; the transformers server keeps its own LRU), and the run's own vLLM
        stops. Best effort."""
        if self.kind == "remote" and self.adapter is not None:
            with contextlib.suppress(Exception):
                self.engine.unload_adapter(self.adapter)
            self.adapter = None
        if self.vllm is not None:
            self.vllm.close()
            self.vllm = None

    def use_checkpoint(self, step: int, path: Path) -> None:
        """Sample from the checkpoint saved at ``path`` from now on (the live policy needs nothing)."""
        if self.kind != "vllm" and not self.detached:
            return
        if self.vllm is not None and self.vllm.asleep:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the update's cached blocks, which vLLM's wake-up needs
            self.vllm.wake_up()
        previous, name = self.adapter, f"step-{step}"
        self.engine.load_adapter(name, path)
        self.adapter, self.step = name, step
        if previous is not None:
            self.engine.unload_adapter(previous)


def run_training(spec: RunSpec, hooks: RunHooks) -> str:
    """Train ``spec.config.steps`` steps from ``spec.start_step``; returns "succeeded", "cancelled"
    or "lost" (another worker owns the run now). The environment is closed at the end (an MCP
    session and its server process live as long as the run)."""
    try:
        return _run_training(spec, hooks)
    finally:
        spec.environment.close()


def start_trainer(spec: RunSpec, hooks: RunHooks) -> tuple[Any, Any, Any, int]:
    """The run's trainer, its tokenizer and dtype, and the step it is at: a fresh adapter saved and
    recorded as the start step's checkpoint, or the checkpoint ``spec.resume_step`` restored. On
    the host's trainer service when the run may train there (training.service_run), else here."""
    import torch

    from training.service_run import service_refusal
    from training.trainer import Trainer

    if service_refusal(spec) is None:
        try:
            return start_service_trainer(spec, hooks)
        except OSError as exc:  # no answer: a run is not held up by a service that is down
            hooks.event(
                f"The trainer service did not answer ({exc}): this run trains in the worker", level="warn"
            )
    config = spec.config
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    started = time.monotonic()
    phase(hooks, "loading", f"Loading base model {spec.base_model_source}")
    base_model, tokenizer, dtype = _load_policy_model(spec)
    hooks.event(f"Loaded base model {spec.base_model_source} in {time.monotonic() - started:.1f}s")

    if spec.resume_step is None:
        trainer = Trainer(base_model, tokenizer, config, spec.lora, device=spec.device)
        current = spec.start_step
        path = checkpoint_path(spec.checkpoint_root, current)
        if path.exists():  # left by a worker that died before recording it
            shutil.rmtree(path)
        trainer.save_checkpoint(path, step=current, metrics={})
        hooks.record_checkpoint(step=current, path=path, metrics={})
    else:
        current = spec.resume_step
        trainer = Trainer.resume(
            base_model,
            tokenizer,
            checkpoint_path(spec.checkpoint_root, current),
            config,
            spec.lora,
            device=spec.device,
        )
        # The run's own first start continues the model; any later start picks the run up again.
        if current == spec.start_step:
            hooks.event(f"Loaded checkpoint step {current}: training continues from it")
        else:
            hooks.event(f"Resumed from checkpoint step {current}")
    return trainer, tokenizer, dtype, current


def start_service_trainer(spec: RunSpec, hooks: RunHooks) -> tuple[Any, Any, Any, int]:
    """``start_trainer`` with the run's session on the host's trainer service: the worker loads
    the tokenizer only."""
    import torch

    from training.base_models import load_tokenizer
    from training.service_run import ServiceTrainer, open_session

    target = spec.trainer_service
    started = time.monotonic()
    phase(hooks, "loading", f"Opening the run's session on the trainer service ({spec.base_model_source})")
    current = spec.start_step if spec.resume_step is None else spec.resume_step
    state = None if spec.resume_step is None else checkpoint_path(spec.checkpoint_root, current)
    session = open_session(target, spec, state)
    try:  # the tokenizer after the session: the service converts the bundled model on first use
        tokenizer = load_tokenizer(spec.base_model_source, spec.model_cache_dir)
    except BaseException:
        with contextlib.suppress(Exception):
            session.close()
        raise
    trainer = ServiceTrainer(session, tokenizer, spec.config, spec.lora, step=0 if state is None else current)
    hooks.event(
        f"Opened session {target.session_id} on the trainer service in {time.monotonic() - started:.1f}s"
    )
    if state is None:
        path = checkpoint_path(spec.checkpoint_root, current)
        if path.exists():  # left by a worker that died before recording it
            shutil.rmtree(path)
        try:
            trainer.save_checkpoint(path, step=current, metrics={})
        except BaseException:
            trainer.close()
            raise
        hooks.record_checkpoint(step=current, path=path, metrics={})
    elif current == spec.start_step:
        hooks.event(f"Loaded checkpoint step {current}: training continues from it")
    else:
        hooks.event(f"Resumed from checkpoint step {current}")
    dtype = torch.float32 if spec.device == "cpu" else torch.bfloat16
    return trainer, tokenizer, dtype, current


class _Recorded:
    """The run's hooks, noting the last step whose checkpoint was recorded (where a run whose
    session the trainer service lost continues)."""

    def __init__(self, hooks: RunHooks) -> None:
        self._hooks = hooks
        self.step: int | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._hooks, name)

    def record_checkpoint(self, *, step: int, path: Path, metrics: dict[str, Any]) -> None:
        self._hooks.record_checkpoint(step=step, path=path, metrics=metrics)
        self.step = step

    def record_step(
        self, *, step: int, metrics: dict[str, Any], trajectories: StepTrajectories, path: Path
    ) -> bool:
        recorded = self._hooks.record_step(step=step, metrics=metrics, trajectories=trajectories, path=path)
        if recorded:
            self.step = step
        return recorded


SESSION_REBUILDS = 3  # times one attempt of a run continues after the trainer service lost its session


def _run_training(spec: RunSpec, hooks: RunHooks) -> str:
    from training.service_run import ServiceTrainer, SessionLost
    from training.supervised import run_supervised

    spec.config.check_objective(spec.objective)
    recorded: Any = _Recorded(hooks)
    for rebuild in range(SESSION_REBUILDS + 1):
        trainer, tokenizer, dtype, current = start_trainer(spec, recorded)
        try:
            with data_parallel_ranks(spec, current, recorded) as followers:
                if spec.objective in ("sft", "dpo"):
                    return run_supervised(spec, recorded, trainer, tokenizer, dtype, current, followers)
                return _train(spec, recorded, trainer, tokenizer, dtype, current, followers)
        except SessionLost as exc:
            if rebuild == SESSION_REBUILDS:
                raise
            reason = hooks.should_stop()
            if reason:  # the run is no longer this worker's (or was cancelled): nothing to rebuild
                return reason
            resume = recorded.step if recorded.step is not None else current
            hooks.event(
                f"{exc}: the run continues from checkpoint step {resume} on a new session", level="warn"
            )
            spec = dataclasses.replace(spec, resume_step=resume)
        finally:
            if isinstance(trainer, ServiceTrainer):
                trainer.close()
    raise AssertionError("unreachable")


@contextlib.contextmanager
def data_parallel_ranks(spec: RunSpec, current: int, hooks: RunHooks) -> Iterator[Any]:
    """With ``devices`` > 1, the update's other ranks (training.distributed.Followers), started
    on the checkpoint at ``current`` and stopped when the run ends however it ends; else None."""
    if spec.config.devices <= 1:
        yield None
        return
    from training.distributed import Followers, FollowerSpec

    if spec.device.startswith("cuda"):
        import torch

        if torch.cuda.device_count() < spec.config.devices:
            raise ValueError(
                f"devices: {spec.config.devices} needs that many GPUs on the worker's host; it has "
                f"{torch.cuda.device_count()}"
            )
    follower_spec = FollowerSpec(
        base_model_source=spec.base_model_source, model_cache_dir=spec.model_cache_dir, device=spec.device,
        unsloth=spec.unsloth, config=spec.config, lora=spec.lora,
        checkpoint=checkpoint_path(spec.checkpoint_root, current),
    )  # fmt: skip
    followers = Followers(follower_spec, spec.config.devices, rendezvous_dir=spec.checkpoint_root)
    sharded = ", the base's weights sharded across them (FSDP2)" if spec.config.fsdp else ""
    hooks.event(
        f"Policy update data-parallel on {spec.config.devices} devices ({followers.backend}){sharded}"
    )
    try:
        yield followers
    finally:
        followers.close()


def _train(spec: RunSpec, hooks: RunHooks, trainer: Any, tokenizer: Any, dtype: Any, current: int,
           followers: Any) -> str:  # fmt: skip
    import torch

    from training.adapter_check import verify_sampler
    from training.service_run import ServiceTrainer, check_session_sampler

    config = spec.config
    # A fixed probe prompt: after every save, the sampler must score it exactly as the trainer does.
    probes = [spec.environment.start(spec.train_rows[0]["data"], seed=0).messages]
    if spec.environment.tools:  # an MCP server's tools are listed by now: say which the model gets
        hooks.event(f"Environment tools: {', '.join(tool.name for tool in spec.environment.tools)}")
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    watch = SignalWatch(
        patience=config.no_signal_patience,
        grader_name=str(spec.reward_name or spec.grader_spec.get("name") or spec.grader_spec.get("type")),
    )
    if config.max_off_policy_steps:
        from training.overlap import train_overlapped

        return train_overlapped(
            spec, hooks, trainer, tokenizer, dtype, current, followers, watch=watch, probes=probes, tolerance=tolerance
        )  # fmt: skip
    sampler = PolicySampler(spec, trainer, tokenizer, dtype, current)
    try:
        final_step = spec.start_step + config.steps
        evaluate_start(spec, hooks, sampler, current)
        for step in range(current + 1, final_step + 1):
            reason = hooks.should_stop()
            if reason:
                return reason
            step_started = time.monotonic()
            label = step_label(step, start_step=spec.start_step, final_step=final_step)
            drawn = draw_step(spec, sampler, hooks, step=step, label=label, policy_step=step - 1)
            if hooks.should_stop() == "cancelled":
                return "cancelled"
            phase(hooks, "updating", f"{label}: updating the policy", step=step)
            sampler.before_update()
            metrics, path = update_step(
                spec, trainer, followers, drawn, on_restart=lambda message: hooks.event(message, level="warn"),
                on_saving=lambda: phase(hooks, "saving", f"{label}: saving checkpoint", step=step),  # noqa: B023
            )  # fmt: skip
            loading = time.monotonic()  # sync: wake the sampler, load and check the adapter
            sampler.use_checkpoint(step, path)
            # Fail loudly if training did not reach the sampler (peers shipped exactly that bug).
            if isinstance(trainer, ServiceTrainer):
                check = check_session_sampler(sampler.engine, trainer, probes, tolerance=tolerance)
            else:
                check = verify_sampler(
                    sampler.engine,
                    trainer,
                    tokenizer,
                    path,
                    probes,
                    adapter=sampler.adapter,
                    tolerance=tolerance,
                )
            metrics["sync_seconds"] += time.monotonic() - loading
            step_seconds = time.monotonic() - step_started
            if not record_step(spec, hooks, watch, drawn, metrics, path, step_seconds=step_seconds,
                               sampler_logprob_gap=check.max_logprob_gap):  # fmt: skip
                return "lost"
            if is_evaluation_step(
                step, start_step=spec.start_step, final_step=final_step, interval=config.eval_interval
            ):
                evaluate_during_run(spec, sampler.engine, sampler.adapter, step, hooks)
            logger.info(
                "step %d done in %.1fs: reward %.3f", step, step_seconds, metrics.get("reward_mean", 0.0)
            )
        return "succeeded"
    finally:
        sampler.release()  # the run's own vLLM stops with it


def evaluate_start(spec: RunSpec, hooks: RunHooks, sampler: PolicySampler, current: int) -> None:
    """Evaluate the policy the run starts from: the baseline later evaluations are read against. A
    resumed run evaluates its resume step only if that was due and the dead worker recorded the
    step, not its evaluation."""
    config = spec.config
    final_step = spec.start_step + config.steps
    if spec.resume_step is None or (
        is_evaluation_step(
            current, start_step=spec.start_step, final_step=final_step, interval=config.eval_interval
        )
        and not hooks.is_evaluated(step=current)
    ):
        evaluate_during_run(spec, sampler.engine, sampler.adapter, current, hooks)
