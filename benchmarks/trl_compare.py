"""One GRPO update of the same batch on one device: artweb's ``grpo_train_step`` against TRL's
``GRPOTrainer`` step, in the same run, on a randomly initialised model of a real model's shape.

    python -m benchmarks.trl_compare                      # Qwen3-4B's shape, bf16, on the GPU
    python -m benchmarks.trl_compare --model qwen3-1.7b
    python -m benchmarks.trl_compare --tiny               # a few seconds on the CPU (the test's run)

The model is built here from a config dict (no download) and its tokenizer is a word-level one
with one word per token id (no download either): the ids are drawn at random, and nothing here
says anything about learning. Both sides get the same batch (``--prompts`` x ``--group``
completions, prompts of ``--prompt-tokens``, completions of ``--min-completion`` to
``--max-completion`` tokens), the same LoRA (peft, r16 / alpha 32 on every attention and MLP
projection, training.session.policy.peft_lora_config) and one optimizer step per step, micro-batches of
``--micro-sequences`` sequences' worth of tokens. TRL's rollouts are replaced by its own
``rollout_func`` hook returning the fixed batch, so its step time is scoring plus update, as
artweb's is. Printed per side: seconds per step (median after one warm-up step), training tokens/s
(every sequence's prompt + completion tokens: the batch, counted the same for both sides; artweb's
packing computes each group's prompt once, so its MFU is per batch token, not per FLOP done) and
MFU = 6 * N * tokens/s over the device's dense bf16 peak (N: the base model's parameters). Then
rollout tokens/s with artweb's transformers engine (``TrainingSession.sample``).

TRL is optional: without it the TRL half prints "TRL not installed: skipped". TRL's GRPO trainer
imports datasets, pandas and pyarrow at module level; pyarrow's wheel alone (55 MB) is over what
can be carried to a GPU host, so where those are missing they are replaced by stand-ins that hold
a list of rows (``install_stand_ins``): the update never touches them.
"""

from __future__ import annotations

import argparse
import gc
import importlib.machinery
import importlib.util
import os
import statistics
import sys
import tempfile
import time
import types
from typing import Any

import torch

# Published shapes (the models' config.json files); weights are random.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-4b": {
        "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True,
        "rope_theta": 1_000_000.0, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    },
    "qwen3-1.7b": {
        "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True,
        "rope_theta": 1_000_000.0, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    },
    "tiny": {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "tie_word_embeddings": True,
        "max_position_embeddings": 1024,
    },
}  # fmt: skip

# Dense bf16 peak (no sparsity), TFLOP/s, by a name fragment of torch.cuda.get_device_name().
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}

REFERENCE_LINE = "published reference: 6,229 training tokens/s at 21.7% MFU, Qwen3-4B LoRA r16 on one H100"

PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
FIRST_WORD_ID = 3  # ids below are the special tokens; prompts and completions draw from the rest


def build_tokenizer(vocabulary: int) -> Any:
    """A word-level tokenizer whose every id is one word ("w<id>"): any id decodes, no download."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": PAD_ID, "<eos>": EOS_ID, "<unk>": UNK_ID}
    words.update({f"w{i}": i for i in range(FIRST_WORD_ID, vocabulary)})
    backend = Tokenizer(WordLevel(words, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def build_model(shape: dict[str, Any], dtype: torch.dtype, device: str) -> Any:
    """Qwen3's architecture at ``shape``, random weights (seed 0), built on ``device`` in ``dtype``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**shape, bos_token_id=None, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.random.fork_rng(devices=[]), torch.device(device):
            torch.manual_seed(0)
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = PAD_ID
    return model.eval()


def parameter_count(model: Any) -> int:
    """Distinct parameters (tied input and output embeddings once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def make_batch(args: argparse.Namespace, vocabulary: int) -> list[tuple[list[int], list[list[int]]]]:
    """(prompt, its completions) per prompt: random ids, lengths drawn once (seed 0)."""
    generator = torch.Generator().manual_seed(0)
    batch = []
    for _ in range(args.prompts):
        prompt = torch.randint(FIRST_WORD_ID, vocabulary, (args.prompt_tokens,), generator=generator).tolist()
        completions = []
        for _ in range(args.group):
            length = int(
                torch.randint(args.min_completion, args.max_completion + 1, (1,), generator=generator)
            )
            completions.append(
                torch.randint(FIRST_WORD_ID, vocabulary, (length,), generator=generator).tolist()
            )
        batch.append((prompt, completions))
    return batch


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_flops(device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(0)
    return next((tflops * 1e12 for key, tflops in PEAK_BF16_TFLOPS.items() if key in name), None)


def lora_spec() -> Any:
    from training.config import LoraSpec

    return LoraSpec(rank=16, alpha=32)


# ---------------------------------------------------------------- artweb
def run_artweb(
    args: argparse.Namespace, shape: dict, dtype: torch.dtype, batch: list, tokenizer: Any
) -> dict:
    """grpo_train_step (grpo_step over the session's forward_backward / optim_step), then
    rollouts through the session's ``sample``."""
    from training.config import SINGLE_UPDATE_RECIPE, TrainConfig
    from training.engines.base import SamplingParams
    from training.recipes.grpo_update import grpo_train_step
    from training.rollouts.trajectory import TrainGroup, TrainSample
    from training.session.local import TrainingSession
    from training.session.policy import Policy

    device = args.device
    model = build_model(shape, dtype, device)
    parameters = parameter_count(model)
    config = TrainConfig(
        learning_rate=1e-5, groups_per_step=args.prompts, group_size=args.group, seed=0,
        micro_batch_tokens=args.micro_sequences * (args.prompt_tokens + args.max_completion),
        **SINGLE_UPDATE_RECIPE,
    )  # fmt: skip
    trainer = Policy(model, tokenizer, config, lora_spec(), device)
    groups = [
        TrainGroup(samples=[
            TrainSample(prompt_token_ids=prompt, completion_token_ids=completion,
                        completion_logprobs=[-2.0] * len(completion), reward=float(index % 3))
            for index, completion in enumerate(completions)
        ])
        for prompt, completions in batch
    ]  # fmt: skip
    step_s, losses = [], []
    for _ in range(1 + args.steps):  # the first is the warm-up
        synchronize(device)
        started = time.perf_counter()
        losses.append(grpo_train_step(trainer, groups)["loss"])
        synchronize(device)
        step_s.append(time.perf_counter() - started)
    if device.startswith("cuda"):
        update_peak = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()

    session = TrainingSession(trainer)
    prompts = [prompt for prompt, completions in batch for _ in completions]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.rollout_tokens, seed=0)
    session.sample(prompts[:2], SamplingParams(temperature=1.0, max_new_tokens=2, seed=0))  # warm-up
    synchronize(device)
    started = time.perf_counter()
    choices = session.sample(prompts, sampling)
    synchronize(device)
    rollout_s = time.perf_counter() - started
    result = {
        "parameters": parameters, "step_s": step_s, "losses": losses, "rollout_s": rollout_s,
        "rollout_tokens": sum(len(choice.token_ids) for choice in choices), "rollout_rows": len(prompts),
    }  # fmt: skip
    if device.startswith("cuda"):
        result["update_peak_gib"] = update_peak
        result["rollout_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del session, trainer, model
    gc.collect()  # peft's wrappers hold reference cycles: free the weights before TRL builds its copy
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return result


# ---------------------------------------------------------------- TRL
class _StandInModule(types.ModuleType):
    """A module whose every unknown attribute is an empty class: enough for the names TRL imports
    and the annotations it evaluates."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        placeholder = type(name, (), {"__module__": self.__name__})
        setattr(self, name, placeholder)
        return placeholder


class _RowsDataset(torch.utils.data.Dataset):
    """datasets.Dataset's stand-in: a list of rows, indexed by position."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        self.cache_files: list[dict[str, str]] = []  # in memory, as Dataset.from_dict's

    @classmethod
    def from_list(cls, rows: list[dict[str, Any]]) -> _RowsDataset:
        return cls(list(rows))

    @classmethod
    def from_dict(cls, columns: dict[str, list[Any]]) -> _RowsDataset:
        names = list(columns)
        return cls([dict(zip(names, values, strict=True)) for values in zip(*columns.values(), strict=True)])

    @property
    def column_names(self) -> list[str]:
        return list(self.rows[0]) if self.rows else []

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.rows[index]


def install_stand_ins() -> list[str]:
    """Stand-ins for datasets, pandas and pyarrow where they are not installed; their names."""
    missing = [name for name in ("datasets", "pandas", "pyarrow") if importlib.util.find_spec(name) is None]
    for name in missing:
        for full in (name, *((f"{name}.compute", f"{name}.types") if name == "pyarrow" else ())):
            module = _StandInModule(full)
            # transformers' availability checks call importlib.util.find_spec, which needs a spec.
            module.__spec__ = importlib.machinery.ModuleSpec(full, None)
            sys.modules[full] = module
            if "." in full:
                setattr(sys.modules[name], full.rsplit(".", 1)[1], module)
        if name == "datasets":
            sys.modules[name].Dataset = _RowsDataset  # type: ignore[attr-defined]
    return missing


def run_trl(
    args: argparse.Namespace, shape: dict, dtype: torch.dtype, batch: list, tokenizer: Any
) -> dict | None:
    """TRL's GRPOTrainer for 1 + ``steps`` steps on the same batch; None without TRL."""
    if importlib.util.find_spec("trl") is None:
        return None
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")  # TRL pings the Hub when a trainer starts
    stand_ins = install_stand_ins()
    import trl
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from training.session.policy import peft_lora_config

    device = args.device
    by_prompt = {f"w{index + FIRST_WORD_ID}": (prompt, completions) for index, (prompt, completions) in
                 enumerate(batch)}  # fmt: skip

    def rollout_func(prompts: list[str], trainer: Any) -> dict[str, list]:
        # TRL's generation batch holds each prompt group-size times in a row: hand back the fixed
        # completions of that prompt in order.
        seen: dict[str, int] = {}
        out: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for text in prompts:
            prompt, completions = by_prompt[text]
            completion = completions[seen.get(text, 0) % len(completions)]
            seen[text] = seen.get(text, 0) + 1
            out["prompt_ids"].append(prompt)
            out["completion_ids"].append(completion)
            out["logprobs"].append([-2.0] * len(completion))
        return out

    def reward(completions: list, completion_ids: list, **_: Any) -> list[float]:
        return [float(index % 3) for index in range(len(completion_ids))]

    step_s: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            synchronize(device)
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            synchronize(device)
            step_s.append(time.perf_counter() - self.started)

    on_cuda = device.startswith("cuda")
    model = build_model(shape, dtype, device)
    with tempfile.TemporaryDirectory() as output_dir:
        config = GRPOConfig(
            output_dir=output_dir, use_cpu=not on_cuda, bf16=on_cuda and dtype == torch.bfloat16, fp16=False,
            gradient_checkpointing=False, max_steps=1 + args.steps,
            per_device_train_batch_size=args.micro_sequences,
            gradient_accumulation_steps=args.prompts * args.group // args.micro_sequences,
            num_generations=args.group, num_iterations=1, max_completion_length=args.max_completion,
            learning_rate=1e-5, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
            weight_decay=0.0, beta=0.0, loss_type="grpo", scale_rewards="group", shuffle_dataset=False,
            seed=0, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
            dataloader_pin_memory=False, log_completions=False,
        )  # fmt: skip
        torch.manual_seed(0)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[reward],
            args=config,
            train_dataset=Dataset.from_list([{"prompt": text} for text in by_prompt]),
            processing_class=tokenizer,
            peft_config=peft_lora_config(lora_spec()),
            callbacks=[StepTimer()],
            rollout_func=rollout_func,
        )
        trainer.remove_callback(PrinterCallback)
        trainer.train()
        losses = [float(entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]
        # TRL's running count of the prompt + completion tokens it trained on: the batch's per step.
        seen = [float(entry["num_tokens"]) for entry in trainer.state.log_history if "num_tokens" in entry]
    result: dict[str, Any] = {"version": trl.__version__, "step_s": step_s, "losses": losses,
                              "tokens_per_step": seen[-1] / len(seen) if seen else None,
                              "stand_ins": stand_ins}  # fmt: skip
    if on_cuda:
        result["update_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del trainer, model
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()
    return result


# ---------------------------------------------------------------- report
def speed_line(name: str, step_s: list[float], tokens: int, parameters: int, peak: float | None) -> str:
    step = statistics.median(step_s[1:] or step_s)
    speed = tokens / step
    mfu = (
        f"{100 * 6 * parameters * speed / peak:.1f}%" if peak else "n/a (no bf16 peak known for this device)"
    )
    return f"{name}: {step:.3f} s/step, {speed:,.0f} training tokens/s, MFU {mfu}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="qwen3-4b")
    parser.add_argument("--tiny", action="store_true", help="the tiny shape, small batch, fp32 on the CPU")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on cuda")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--min-completion", type=int, default=256)
    parser.add_argument("--max-completion", type=int, default=512)
    parser.add_argument("--micro-sequences", type=int, default=8, help="sequences per forward pass (TRL)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per side, after one warm-up")
    parser.add_argument("--rollout-tokens", type=int, default=128, help="new tokens per rollout row")
    parser.add_argument("--skip-trl", action="store_true")
    args = parser.parse_args(argv)
    if args.tiny:
        args.model = "tiny"
        args.prompts, args.group, args.prompt_tokens = 2, 4, 16
        args.min_completion, args.max_completion, args.micro_sequences = 8, 16, 4
        args.steps, args.rollout_tokens = 1, 8
        args.device = args.device or "cpu"
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.dtype is None:
        args.dtype = "bf16" if args.device.startswith("cuda") else "fp32"
    if (args.prompts * args.group) % args.micro_sequences:
        parser.error("--prompts x --group must be a multiple of --micro-sequences")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    shape = SHAPES[args.model]

    device_name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    print(f"device {device_name}; torch {torch.__version__}; model {args.model} shape, random weights, "
          f"{args.dtype}; LoRA r16/alpha 32 on all projections", flush=True)  # fmt: skip
    tokenizer = build_tokenizer(shape["vocab_size"])
    batch = make_batch(args, shape["vocab_size"])
    tokens = sum(len(prompt) + len(c) for prompt, completions in batch for c in completions)
    completion_tokens = sum(len(c) for _, completions in batch for c in completions)
    print(f"batch: {args.prompts} prompts x {args.group} completions, prompt {args.prompt_tokens} tokens, "
          f"completions {args.min_completion}-{args.max_completion}: {tokens} training tokens per step "
          f"({completion_tokens} completion tokens); {args.steps} timed steps after 1 warm-up", flush=True)  # fmt: skip
    peak = peak_flops(args.device)

    ours = run_artweb(args, shape, dtype, batch, tokenizer)
    print(f"parameters N = {ours['parameters'] / 1e6:,.1f} M; peak bf16 "
          f"{f'{peak / 1e12:.0f} TFLOP/s' if peak else 'unknown'}")  # fmt: skip
    print(speed_line("artweb grpo_train_step", ours["step_s"], tokens, ours["parameters"], peak))
    print(f"  step seconds {[round(s, 3) for s in ours['step_s']]}, losses {[round(x, 4) for x in ours['losses']]}"
          + (f", peak {ours['update_peak_gib']:.1f} GiB" if "update_peak_gib" in ours else ""))  # fmt: skip
    print(f"artweb rollouts (TransformersEngine via TrainingSession.sample): {ours['rollout_rows']} rows x "
          f"{args.rollout_tokens} new tokens: {ours['rollout_tokens']} tokens in {ours['rollout_s']:.3f} s, "
          f"{ours['rollout_tokens'] / ours['rollout_s']:,.0f} rollout tokens/s"
          + (f", peak {ours['rollout_peak_gib']:.1f} GiB" if "rollout_peak_gib" in ours else ""), flush=True)  # fmt: skip

    theirs = None if args.skip_trl else run_trl(args, shape, dtype, batch, tokenizer)
    if theirs is None:
        print("TRL not installed: skipped" if not args.skip_trl else "TRL: skipped (--skip-trl)")
    else:
        print(
            speed_line(
                f"TRL {theirs['version']} GRPOTrainer", theirs["step_s"], tokens, ours["parameters"], peak
            )
        )
        print(f"  TRL trained on {theirs['tokens_per_step']} tokens per step (the batch: {tokens})")
        print(f"  step seconds {[round(s, 3) for s in theirs['step_s']]}, losses "
              f"{[round(x, 4) for x in theirs['losses']]}"
              + (f", peak {theirs['update_peak_gib']:.1f} GiB" if "update_peak_gib" in theirs else "")
              + (f"; stand-ins for {', '.join(theirs['stand_ins'])}" if theirs["stand_ins"] else ""))  # fmt: skip
        ratio = statistics.median(theirs["step_s"][1:] or theirs["step_s"]) / statistics.median(
            ours["step_s"][1:] or ours["step_s"]
        )
        print(f"TRL s/step / artweb s/step: {ratio:.2f}")
    print(REFERENCE_LINE)


if __name__ == "__main__":
    main()
