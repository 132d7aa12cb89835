"""Sampling with vLLM on a GPU: many LoRA adapters over one base model, swapped between steps.

vLLM is imported inside `VLLMEngine` only, so this module imports anywhere; the conversions between
our types and vLLM's are plain functions, tested without vLLM. Needs vLLM >= 0.10.1 (`logprobs_mode`).

Invariants:
- vLLM caches an adapter by its integer id and never rereads the files of an id it has seen, so
  every `load_adapter` takes a fresh id, never reused, even for a name or path loaded before.
  Reusing ids is how a sampler keeps serving an old adapter while training goes on.
- Logprobs follow `engines/base.py`: the engine runs with logprobs_mode="processed_logprobs", the
  log-softmax after temperature (untempered for greedy decoding) and after top-p truncation. The
  two agree only when top_p == 1, so `generate` refuses top_p < 1 with temperature > 0 rather than
  hand the trainer logprobs whose importance ratios silently do not start at 1.
- Sleep mode (trainer and sampler on one GPU): `sleep()` before the policy update frees vLLM's
  weights (level 1: backed up in CPU memory) and KV cache for the trainer; `wake_up()` before the
  next rollouts. Level 1, not 2: the base weights never change under LoRA training, and level 2's
  weight reload broke with LoRA enabled (vLLM #39934). Adapters are loaded after waking, never
  carried across a sleep. Unverified on a GPU so far (benchmarks/gpu_smoke.sh checks it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from training.engines.base import (
    Choice,
    Engine,
    FinishReason,
    OnFinished,
    OnToken,
    SamplingParams,
    render_chat,
    report_after,
    report_finished_after,
)

# LoRA ranks vLLM's kernels are built for; max_lora_rank must be one of them (vllm LoRAConfig).
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
LOGPROBS_MODE = "processed_logprobs"
# Without sleep mode, vLLM's fixed share of the GPU; the trainer's update must fit in the rest.
SHARED_GPU_MEMORY_UTILIZATION = 0.4
SLEEP_LEVEL = 1  # see the module docstring
# With sleep mode, what vLLM leaves free at start for the trainer's work while vLLM is awake (the
# probe forward pass of adapter_check, allocator slack): a fraction of the GPU, at least 1 GiB.
SLEEP_MODE_TRAINER_RESERVE = 0.1
SLEEP_MODE_MIN_RESERVE_BYTES = 1 << 30


class VLLMUnavailableError(ImportError):
    """vLLM is not installed (it needs CUDA; `pip install .[gpu]`)."""


class LoraRegistry:
    """Adapter names → (vLLM integer id, path). Ids start at 1 (0 means "no adapter" in vLLM) and
    are never reused; see the module docstring."""

    def __init__(self) -> None:
        self._next_id = 1
        self._loaded: dict[str, tuple[int, Path]] = {}

    def register(self, name: str, path: Path) -> int:
        if not name:
            raise ValueError("an adapter needs a name")
        if name in self._loaded:
            raise ValueError(f"adapter {name!r} is already loaded")
        lora_id = self._next_id
        self._next_id += 1
        self._loaded[name] = (lora_id, Path(path))
        return lora_id

    def forget(self, name: str) -> int:
        """Drop `name`; returns the id it had, for removing it from the engine."""
        if name not in self._loaded:
            raise ValueError(f"adapter {name!r} was not loaded by this engine")
        lora_id, _ = self._loaded.pop(name)
        return lora_id

    def lookup(self, name: str) -> tuple[int, Path]:
        if name not in self._loaded:
            raise ValueError(f"adapter {name!r} is not loaded")
        return self._loaded[name]

    def names(self) -> list[str]:
        return list(self._loaded)


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


def vllm_sampling_kwargs(
    sampling: SamplingParams, index: int = 0, stop_token_ids: Iterable[int] = ()
) -> dict[str, Any]:
    """Keyword arguments of `vllm.SamplingParams` for request `index` of a batch.

    `stop_token_ids` end a completion; the token stays in `token_ids`, as an eos does.
    """
    check_logprob_convention(sampling)
    return {
        "n": 1,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": sampling.max_new_tokens,
        "stop": list(sampling.stop),
        "stop_token_ids": sorted(stop_token_ids),
        "include_stop_str_in_output": False,  # the text is cut before a stop string, as OpenAI does
        "skip_special_tokens": True,
        "seed": request_seed(sampling.seed, index),
        # 0 = only the sampled token's logprob; k adds the k most likely (under the same mode)
        "logprobs": sampling.top_logprobs,
    }


def sampled_logprobs(token_ids: Sequence[int], logprobs: Any) -> list[float]:
    """The logprob of each sampled token from vLLM's per-position `{token_id: Logprob}` entries."""
    if logprobs is None:
        raise RuntimeError("vLLM returned no logprobs: the request must set logprobs=0")
    if len(logprobs) != len(token_ids):
        raise RuntimeError(f"vLLM returned {len(logprobs)} logprob entries for {len(token_ids)} tokens")
    values = []
    for position, token in enumerate(token_ids):
        entry = logprobs[position]
        if token not in entry:
            raise RuntimeError(f"vLLM's logprobs at position {position} lack the sampled token {token}")
        values.append(float(entry[token].logprob))
    return values


def top_alternatives(logprobs: Any, k: int) -> list[list[tuple[int, float]]]:
    """The k most likely (token id, logprob) pairs per position from vLLM's per-position
    `{token_id: Logprob}` entries (requested with logprobs=k), most likely first."""
    return [
        sorted(
            ((int(token), float(entry.logprob)) for token, entry in position.items()),
            key=lambda pair: -pair[1],
        )[:k]  # fmt: skip
        for position in logprobs
    ]


def choice_from_output(output: Any, top_logprobs: int = 0) -> Choice:
    """Our Choice from one vLLM RequestOutput (generated with n=1 and logprobs=top_logprobs)."""
    if len(output.outputs) != 1:
        raise RuntimeError(f"expected one completion per request, got {len(output.outputs)}")
    completion = output.outputs[0]
    finish_reason: FinishReason
    if completion.finish_reason == "stop":
        finish_reason = "stop"
    elif completion.finish_reason == "length":
        finish_reason = "length"
    else:  # "abort" or unfinished: there is no complete sample to train on
        raise RuntimeError(f"vLLM did not finish a request (finish_reason={completion.finish_reason!r})")
    token_ids = [int(token) for token in completion.token_ids]
    return Choice(
        text=completion.text,
        prompt_token_ids=[int(token) for token in output.prompt_token_ids],
        token_ids=token_ids,
        logprobs=sampled_logprobs(token_ids, completion.logprobs),
        finish_reason=finish_reason,
        top_logprobs=top_alternatives(completion.logprobs, top_logprobs) if top_logprobs else None,
    )


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


def stop_token_ids_for(tokenizer: Any, generation_eos: int | list[int] | None) -> frozenset[int]:
    """The ids that end a completion: the tokenizer's eos and the generation config's (the ones
    TransformersEngine stops on)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if isinstance(generation_eos, int):
        ids.add(generation_eos)
    elif isinstance(generation_eos, list):
        ids.update(int(token) for token in generation_eos)
    return frozenset(ids)


def render_prompt(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Prompt token ids of a chat request, ending with the assistant header: `Engine.render`'s,
    which VLLMEngine uses too, so vLLM samples from the prompt ids the trainer scores."""
    return render_chat(tokenizer, messages)


class VLLMEngine(Engine):
    """Engine over a vLLM `LLM` with LoRA enabled. `adapter=None` samples the base model.

    Give it the trainer's tokenizer (from `load_base_model`), so that prompts are rendered exactly as
    the trainer sees them; without one it uses vLLM's. `max_lora_rank` is rounded up to a rank vLLM
    supports. When the trainer shares the GPU, pass `sleep_mode=True` and call `sleep()` before each
    update and `wake_up()` after it; without sleep mode, `gpu_memory_utilization` (default 0.4)
    must leave the update its memory. `None` picks the default for the mode.
    """

    def __init__(
        self,
        model: str | Path,
        *,
        tokenizer: Any = None,
        max_lora_rank: int = 8,
        max_loras: int = 2,
        dtype: str = "auto",
        gpu_memory_utilization: float | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
        sleep_mode: bool = False,
        **llm_kwargs: Any,
    ) -> None:
        try:
            import vllm
            from vllm.lora.request import LoRARequest
        except ImportError as exc:
            raise VLLMUnavailableError(
                "the vLLM engine needs vLLM, which is not installed here: pip install .[gpu] "
                "(CUDA machines only; use the transformers engine elsewhere)"
            ) from exc
        self._vllm = vllm
        self._lora_request_type = LoRARequest
        if gpu_memory_utilization is None:
            gpu_memory_utilization = default_memory_utilization(sleep_mode)
        if sleep_mode:
            llm_kwargs["enable_sleep_mode"] = True
        self.sleep_mode = sleep_mode
        self.asleep = False
        self._llm = vllm.LLM(
            model=str(model),
            enable_lora=True,
            max_lora_rank=max_lora_rank_for(max_lora_rank),
            max_loras=max_loras,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            seed=seed,
            logprobs_mode=LOGPROBS_MODE,
            **llm_kwargs,
        )
        if tokenizer is None:
            tokenizer = self._llm.get_tokenizer()
            if not getattr(tokenizer, "chat_template", None):
                from training.base_models import CHATML_TEMPLATE

                tokenizer.chat_template = CHATML_TEMPLATE
        self.tokenizer = tokenizer
        self.stop_token_ids = stop_token_ids_for(tokenizer, generation_eos(Path(model)))
        self._registry = LoraRegistry()

    def generate_from_tokens(
        self,
        prompt_token_ids: list[list[int]],
        sampling: SamplingParams,
        adapter: str | None = None,
        *,
        on_token: OnToken | None = None,
        grammars: Sequence[str | None] | None = None,
        on_finished: OnFinished | None = None,
    ) -> list[Choice]:
        """One Choice per prompt given as token ids; vLLM does not re-tokenise them (or add a bos).
        The offline `LLM.generate` does not stream: `on_token` hears every token at the end.
        Constrained decoding is vLLM's own server's (`response_format` passes through the gateway
        to it); this in-process engine refuses grammars (`check_grammar`)."""
        if grammars is not None and any(grammar is not None for grammar in grammars):
            raise ValueError("VLLMEngine does not constrain decoding; serve through vLLM's server")
        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep (the policy update runs): wake_up() first")
        if not prompt_token_ids:
            return []
        if not all(prompt_token_ids):
            raise ValueError("every prompt needs at least one token")
        check_logprob_convention(sampling)
        lora = None
        if adapter is not None:
            lora_id, path = self._registry.lookup(adapter)
            lora = self._lora_request_type(adapter, lora_id, str(path))
        prompts = [{"prompt_token_ids": [int(token) for token in prompt]} for prompt in prompt_token_ids]
        params = [
            self._vllm.SamplingParams(**vllm_sampling_kwargs(sampling, index, self.stop_token_ids))
            for index in range(len(prompts))
        ]
        outputs = self._llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        choices = [choice_from_output(output, sampling.top_logprobs) for output in outputs]
        return report_finished_after(report_after(choices, on_token), on_finished)

    def sleep(self) -> None:
        """Free vLLM's GPU memory for the policy update (weights to CPU memory, KV cache dropped).
        Only with sleep_mode; a second call while asleep does nothing."""
        if not self.sleep_mode:
            raise RuntimeError("this vLLM engine was started without sleep_mode")
        if not self.asleep:
            self._llm.sleep(level=SLEEP_LEVEL)
            self.asleep = True

    def wake_up(self) -> None:
        """Take the GPU memory back before sampling again; does nothing when awake."""
        if self.asleep:
            self._llm.wake_up()
            self.asleep = False

    def load_adapter(self, name: str, path: Path) -> None:
        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep: wake_up() before loading an adapter")
        path = Path(path)
        if not (path / "adapter_config.json").is_file():
            raise FileNotFoundError(f"no LoRA adapter in {path} (adapter_config.json missing)")
        lora_id = self._registry.register(name, path)
        try:
            # Load now rather than at the first generate, so that a bad adapter fails here, by name.
            self._llm.llm_engine.add_lora(self._lora_request_type(name, lora_id, str(path)))
        except Exception:
            self._registry.forget(name)
            raise

    def unload_adapter(self, name: str) -> None:
        lora_id = self._registry.forget(name)
        remove = getattr(self._llm.llm_engine, "remove_lora", None)
        if remove is not None:
            remove(lora_id)

    def adapter_path(self, name: str) -> Path:
        """Where the adapter loaded as `name` was read from."""
        return self._registry.lookup(name)[1]

    def loaded_adapters(self) -> list[str]:
        return self._registry.names()


def generation_eos(model_dir: Path) -> int | list[int] | None:
    """The eos id(s) in a model directory's generation_config.json, if it has one."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_dir, local_files_only=True).eos_token_id
    except OSError:
        return None
