"""vLLM's side of sampling, shared by every place vLLM samples: the run's own vLLM server
(training.runs.loop.start_run_vllm over training.serving.vllm.LocalVLLM) and a shared one
(``rollouts_on: inference_servers``), both sampled through training.engines.remote_engine.

vLLM always runs as a server process, never as vLLM's offline `LLM` inside the worker: that one
starts its engine core with multiprocessing, which a Celery pool child (daemonic) may not do
("daemonic processes are not allowed to have children", under fork, spawn and forkserver alike);
and a server also runs from a virtualenv of vLLM's own (its CPU build pins a torch and
transformers of its own).

Invariants:
- Logprobs follow `engines/base.py`: vLLM runs with --logprobs-mode processed_logprobs, the
  log-softmax after temperature (untempered for greedy decoding) and after top-p truncation. The
  two agree only when top_p == 1, so sampling refuses top_p < 1 with temperature > 0 rather than
  hand the trainer logprobs whose importance ratios silently do not start at 1.
- vLLM seeds each request on its own: one seed for a group's copies of a prompt would sample them
  alike, so each request gets its own (`request_seed`).
- Sleep mode (trainer and sampler on one GPU): vLLM sleeps (level 1: weights backed up in CPU
  memory, KV cache dropped) through the policy update and wakes before the next checkpoint's
  adapter loads. Level 1, not 2: the base weights never change under LoRA training, and level 2's
  weight reload broke with LoRA enabled (vLLM #39934). Unverified on a GPU so far
  (benchmarks/gpu_check.sh).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from training.engines.base import (
    SamplingParams,
    render_chat,
)

# LoRA ranks vLLM's kernels are built for; max_lora_rank must be one of them (vllm LoRAConfig).
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
LOGPROBS_MODE = "processed_logprobs"
# Without sleep mode, vLLM's fixed share of the GPU; the trainer's update must fit in the rest.
SHARED_GPU_MEMORY_UTILIZATION = 0.4
# With sleep mode, what vLLM leaves free at start for the trainer's work while vLLM is awake (the
# probe forward pass of adapter_check, allocator slack): a fraction of the GPU, at least 1 GiB.
SLEEP_MODE_TRAINER_RESERVE = 0.1
SLEEP_MODE_MIN_RESERVE_BYTES = 1 << 30


def max_lora_rank_for(rank: int) -> int:
    """The smallest rank vLLM accepts as `max_lora_rank` that fits an adapter of `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest supported rank {VLLM_LORA_RANKS[-1]}")


def check_logprob_convention(sampling: SamplingParams) -> None:
    """Refuse sampling settings for which vLLM's logprobs differ from the trainer's."""
    if sampling.temperature > 0 and (sampling.top_p < 1 or sampling.top_k > 0 or sampling.min_p > 0):
        raise ValueError(
            "the vLLM engine cannot report logprobs without top-p, top-k or min-p truncation, which "
            "the trainer expects (engines/base.py): use top_p=1 (and no top_k or min_p) with it, or the transformers engine"
        )


def request_seed(seed: int | None, index: int) -> int | None:
    """A per-request seed. vLLM seeds each request on its own, so one seed for a batch of copies of
    the same prompt (a GRPO group) would give identical samples and zero-variance groups."""
    if seed is None:
        return None
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "big") >> 1  # 31 bits: fits every generator vLLM seeds


def sleep_mode_memory_utilization(free_bytes: int, total_bytes: int) -> float:
    """vLLM's `gpu_memory_utilization` with sleep mode: all the GPU memory free at start (after the
    trainer loaded its model) but a reserve. The update needs no share of its own: vLLM sleeps
    through it. vLLM refuses a fraction above what is free when it starts."""
    if total_bytes <= 0 or not 0 <= free_bytes <= total_bytes:
        raise ValueError(f"impossible GPU memory figures: {free_bytes} free of {total_bytes}")
    reserve = max(SLEEP_MODE_TRAINER_RESERVE * total_bytes, SLEEP_MODE_MIN_RESERVE_BYTES)
    fraction = (free_bytes - reserve) / total_bytes
    if fraction < 0.05:
        raise ValueError(
            f"only {free_bytes / 2**30:.1f} GiB of {total_bytes / 2**30:.1f} GiB GPU memory is free: "
            "too little for vLLM next to the trainer's model"
        )
    return round(fraction, 3)


def default_memory_utilization(sleep_mode: bool) -> float:
    """The fixed split without sleep mode; with it, the free memory measured now (CUDA only)."""
    if not sleep_mode:
        return SHARED_GPU_MEMORY_UTILIZATION
    import torch

    free_bytes, total_bytes = torch.cuda.mem_get_info()
    return sleep_mode_memory_utilization(free_bytes, total_bytes)


def render_prompt(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Prompt token ids of a chat request, ending with the assistant header: `Engine.render`'s,
    which every vLLM sampler sends as token ids, so vLLM samples from the prompt ids the trainer scores."""
    return render_chat(tokenizer, messages)


def generation_eos(model_dir: Path) -> int | list[int] | None:
    """The eos id(s) in a model directory's generation_config.json, if it has one."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_dir, local_files_only=True).eos_token_id
    except OSError:
        return None
