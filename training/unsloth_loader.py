"""Optional: load the base model with unsloth's FastLanguageModel on CUDA.

Licence: unsloth's package is Apache-2.0 at the top, but many of its source files carry AGPL-3.0
headers, and unsloth-zoo, which it requires, is LGPL-3.0. So it is an optional extra
(`pip install .[gpu]`), imported only inside `load_with_unsloth`, never on CPU; a plain transformers
model with peft LoRA (`training.base_models.load_base_model` + `Policy`) is the default path.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

UNSLOTH_SETTINGS = ("auto", "on", "off")  # auto: on CUDA when installed | on: insist | off: never


def unsloth_available() -> bool:
    """Whether unsloth is installed (checked without importing it: the import patches transformers)."""
    return importlib.util.find_spec("unsloth") is not None


def use_unsloth(device: str | torch.device, setting: str = "auto") -> bool:
    """Whether to load the base model with unsloth on `device`.

    `setting` (a worker's is Django's TRAINING_UNSLOTH, from ARTWEB_UNSLOTH): "auto" uses it on an
    available CUDA device when it is installed; "off" never; "on" insists and raises, with the
    reason, where it cannot be used.
    """
    choice = setting.strip().lower()
    if choice not in UNSLOTH_SETTINGS:
        raise ValueError(f"unsloth setting must be one of {', '.join(UNSLOTH_SETTINGS)}, got {choice!r}")
    if choice == "off":
        return False
    on_cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
    if choice == "on":
        if not on_cuda:
            raise ValueError(f"unsloth needs a CUDA device; this worker's device is {str(device)!r}")
        if not unsloth_available():
            raise ValueError("unsloth is not installed: pip install .[gpu]")
        return True
    return on_cuda and unsloth_available()


def load_with_unsloth(source: str | Path, max_seq_length: int, dtype: torch.dtype | None) -> tuple[Any, Any]:
    """`(model, tokenizer)` from a local HF model directory via FastLanguageModel, in eval mode.

    Full-precision weights (no 4-bit): the sampler (vLLM) serves the unquantised base model, and the
    trainer's logprobs must be those of the same weights. `dtype=None` lets unsloth choose. The
    tokenizer gets a chat template and pad token as with `load_base_model`.
    """
    from training.base_models import ensure_chat_ready

    try:
        from unsloth import FastLanguageModel
    except ImportError as exc:
        raise ImportError("loading with unsloth needs unsloth: pip install .[gpu] (CUDA only)") from exc
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=str(source), max_seq_length=max_seq_length, dtype=dtype, load_in_4bit=False
    )
    ensure_chat_ready(tokenizer, model)
    model.eval()
    return model, tokenizer
