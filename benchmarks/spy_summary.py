"""Summarise a py-spy raw profile (`py-spy record --format raw`) of our training step by phase.

    .venv-bench/bin/py-spy record --rate 50 --format raw -o /tmp/ours.txt -- \\
        .venv-bench/bin/python -m benchmarks.grpo_cpu --skip-trl --skip-throughput --skip-eval --steps 3
    .venv-bench/bin/python -m benchmarks.spy_summary /tmp/ours.txt

Percentages are of the samples inside OurRun.step (the timed step). Frame names are those of the
pinned transformers/peft versions (benchmarks/requirements.txt).
"""

from __future__ import annotations

import argparse
import importlib.util
from collections import Counter
from pathlib import Path

STEP = "OurRun.step"


def _lora_base_layer_lines() -> set[str]:
    """`layer.py:N)` of the lines where peft's LoRA layers call their frozen base layer; samples
    in any other line of that file are the adapter's own work (lora_A, lora_B, scaling, the add)."""
    spec = importlib.util.find_spec("peft")
    if spec is None or not spec.submodule_search_locations:
        return set()
    source = Path(list(spec.submodule_search_locations)[0]) / "tuners" / "lora" / "layer.py"
    lines = source.read_text().splitlines()
    return {
        f"lora/layer.py:{number})"
        for number, line in enumerate(lines[:-1], start=1)
        if "result = self.base_layer(x, *args, **kwargs)" in line and "torch_result_dtype" in lines[number]
    }


def classify(frames: list[str], lora_base_lines: set[str]) -> str:
    """The phase one sampled stack (outermost frame first) belongs to."""
    stack = ";".join(frames)
    if "grade_trajectories" in stack:
        return "grading"
    if "grpo_train_step" in stack:
        if "backward" in stack:
            return "update: backward"
        if "_completion_logprobs" in stack:
            return "update: forward (logprobs, entropy)"
        if "torch/optim" in stack or "clip_grad" in stack:
            return "update: clip + AdamW"
        return "update: other"
    if "TransformersEngine.render" in stack:
        return "generation: prompt rendering"
    if "DecodeBatch.step" not in stack:  # the one decode core (training/engines/decode.py)
        return "other"
    if "sample_tokens" in stack or "DecodeBatch._sample" in stack:
        return "generation: sampling (training/engines/sampling.py)"
    if "LlamaForCausalLM.forward" in stack and "LlamaModel.forward" not in stack:
        return "generation: lm_head (vocabulary logits)"
    lora_frames = [frame for frame in frames if "peft/tuners/lora/layer.py" in frame]
    if lora_frames and lora_base_lines and not lora_frames[-1].endswith(tuple(lora_base_lines)):
        return "generation: LoRA adapter (A, B, scale, add)"
    if "sdpa_attention" in stack:
        return "generation: attention (sdpa)"
    if "cache_utils.py" in stack:
        return "generation: KV cache update"
    if "torch/nn/modules/linear.py" in stack or "engines/packed.py" in stack:
        return "generation: base linear layers"
    if "transformers/" in stack or "peft/" in stack:
        return "generation: other model code (norms, rotary, masks, module calls)"
    return "generation: engine loop (Python)"


def summarise(lines: list[str]) -> tuple[Counter[str], int]:
    lora_base_lines = _lora_base_layer_lines()
    counts: Counter[str] = Counter()
    total = 0
    for line in lines:
        stack, _, number = line.rstrip().rpartition(" ")
        if not number.isdigit() or STEP not in stack:
            continue
        total += int(number)
        counts[classify(stack.split(";"), lora_base_lines)] += int(number)
    return counts, total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("raw_profile", type=Path)
    args = parser.parse_args(argv)
    counts, total = summarise(args.raw_profile.read_text().splitlines())
    if not total:
        raise SystemExit(f"no samples inside {STEP} in {args.raw_profile}")
    print(f"{total} samples inside {STEP}")
    for name, samples in sorted(counts.items()):
        print(f"{samples / total:6.1%}  {name}")


if __name__ == "__main__":
    main()
