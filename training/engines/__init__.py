"""Inference engines (see `base.py` for the interface) and the choice between them.

`TransformersEngine` runs anywhere; `VLLMEngine` needs CUDA and the `gpu` extra. Neither is
imported here, so importing this package never pulls in torch or vLLM.
"""

from __future__ import annotations

import importlib.util
from typing import Literal

EngineKind = Literal["vllm", "transformers"]
ENGINE_KINDS: tuple[str, ...] = ("auto", "vllm", "transformers")


def vllm_installed() -> bool:
    """Whether vLLM can be imported (checked without importing it: that takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def select_engine_kind(device: str, setting: str = "auto") -> EngineKind:
    """The engine a worker on `device` should sample with.

    `setting` (a worker's is Django's TRAINING_ENGINE, from ARTWEB_ENGINE): "auto" picks vLLM when
    `device` is a CUDA device that exists and vLLM is installed, and transformers otherwise;
    "transformers" always picks transformers; "vllm" insists and fails here, with the reason, when
    vLLM cannot run, rather than at the first rollout.
    """
    choice = setting.strip().lower()
    if choice not in ENGINE_KINDS:
        raise ValueError(f"engine setting must be one of {', '.join(ENGINE_KINDS)}, got {choice!r}")
    if choice == "transformers":
        return "transformers"
    on_cuda = device.startswith("cuda") and cuda_available()
    if choice == "vllm":
        if not on_cuda:
            raise ValueError(f"the vLLM engine needs a CUDA device; this worker's device is {device!r}")
        if not vllm_installed():
            raise ValueError("the vLLM engine needs vLLM: pip install .[gpu]")
        return "vllm"
    return "vllm" if on_cuda and vllm_installed() else "transformers"
