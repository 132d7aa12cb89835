"""The rollout engine a run samples with and the adapter it holds (``PolicySampler``): the
trainer's live policy (transformers), the run's own vLLM server, or an inference server
(``rollouts_on``); and the evaluation of the policy a run starts from."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from training.runs.evaluation import evaluate_during_run, is_evaluation_step
from training.runs.spec import RunHooks, RunSpec
from training.runs.steps import checkpoint_path
from training.session.policy import load_policy_model


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
        # Detached (rollouts overlapping the update, training.runs.overlap): the sampler never shares
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

            live = trainer.session_engine(tokenizer)  # a session elsewhere samples itself
            if live is not None:
                self.engine = live
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
