"""Inference engines (see `base.py` for the interface) and the choice between them.

`TransformersEngine` runs anywhere, in the worker. vLLM runs as a server process
(training.serving.vllm), from this interpreter when it imports vLLM (a GPU image with the `gpu`
extra) or from a virtualenv of its own (the CPU build; `vllm_python`), and is sampled through
`RemoteEngine`. Nothing is imported here, so importing this package never pulls in torch or vLLM.
"""

from __future__ import annotations

from typing import Literal

EngineKind = Literal["vllm", "transformers"]
ENGINE_KINDS: tuple[str, ...] = ("auto", "vllm", "transformers")


def vllm_installed(vllm_python: str = "") -> bool:
    """Whether vLLM can run here: importable by this interpreter (checked without importing it:
    that takes seconds) or by the python of its own virtualenv, `vllm_python`."""
    from training.serving.vllm import vllm_available

    return vllm_available(vllm_python)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def select_engine_kind(device: str, setting: str = "auto", vllm_python: str = "") -> EngineKind:
    """The engine a worker on `device` should sample with.

    `setting` (a worker's is Django's TRAINING_ENGINE, from ARTWEB_ENGINE): "auto" picks vLLM when
    `device` is a CUDA device that exists and vLLM is installed, and transformers otherwise (on a
    CPU the engine in the worker samples the live policy: no second copy of the model, no
    adapter to save and load each step; benchmarks/README.md, "Engines on CPU");
    "transformers" always picks transformers; "vllm" insists (its CPU build on a CPU) and fails
    here, with the reason, when vLLM cannot run, rather than at the first rollout.
    """
    choice = setting.strip().lower()
    if choice not in ENGINE_KINDS:
        raise ValueError(f"engine setting must be one of {', '.join(ENGINE_KINDS)}, got {choice!r}")
    if choice == "transformers":
        return "transformers"
    on_cuda = device.startswith("cuda") and cuda_available()
    if choice == "vllm":
        if device.startswith("cuda") and not on_cuda:
            raise ValueError(f"this worker's device is {device!r}, but CUDA is not available")
        if not vllm_installed(vllm_python):
            raise ValueError(
                "the vLLM engine needs vLLM: `make install-vllm` (its CPU build, VLLM_PYTHON) or pip install .[gpu]"
            )
        return "vllm"
    return "vllm" if on_cuda and vllm_installed(vllm_python) else "transformers"
