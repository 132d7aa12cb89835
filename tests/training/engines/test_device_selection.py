"""What a worker picks for its device: engine, weight dtype, unsloth or plain peft. What the machine
has (CUDA, bf16 units, vLLM, unsloth) is set per test; unsloth and vLLM themselves are not run."""

import sys

import pytest
import torch

import training.engines as engines
import training.unsloth_loader as unsloth_loader
from training.base_models import load_base_model, resolve_dtype
from training.engines import select_engine_kind
from training.unsloth_loader import load_with_unsloth, use_unsloth


@pytest.fixture
def machine(monkeypatch):
    """Declare what this worker has: machine(cuda=..., bf16=..., vllm=..., unsloth=...)."""

    def declare(cuda=False, bf16=False, vllm=False, unsloth=False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16)
        monkeypatch.setattr(engines, "vllm_installed", lambda vllm_python="": vllm)
        monkeypatch.setattr(unsloth_loader, "unsloth_available", lambda: unsloth)

    return declare


def test_vllm_on_a_gpu_that_has_it(machine):
    machine(cuda=True, vllm=True)
    assert select_engine_kind("cuda") == "vllm"
    assert select_engine_kind("cuda:1") == "vllm"


@pytest.mark.parametrize(
    ("device", "cuda", "vllm"),
    [("cpu", False, False), ("cpu", True, True), ("cuda", True, False), ("cuda", False, True)],
)
def test_transformers_everywhere_else(machine, device, cuda, vllm):
    machine(cuda=cuda, vllm=vllm)
    assert select_engine_kind(device) == "transformers"


def test_transformers_can_be_forced_by_argument(machine, monkeypatch):
    # The core reads no environment: ARTWEB_ENGINE reaches it through Django's TRAINING_ENGINE
    # and the run spec (tests/platform/test_settings.py, tests/projects/jobs).
    machine(cuda=True, vllm=True)
    assert select_engine_kind("cuda", "transformers") == "transformers"
    monkeypatch.setenv("ARTWEB_ENGINE", "transformers")
    assert select_engine_kind("cuda") == "vllm"
    assert select_engine_kind("cuda", "auto") == "vllm"


def test_vllm_on_a_cpu_only_when_asked_for(machine, tmp_path):
    """Its CPU build samples on a CPU when a run insists ("auto" keeps the engine in the worker);
    where vLLM is comes from the python of its own virtualenv (VLLM_PYTHON) when this one lacks it."""
    machine(cuda=False, vllm=True)
    assert select_engine_kind("cpu", "vllm") == "vllm"
    assert select_engine_kind("cpu", "auto") == "transformers"


def test_vllm_is_found_in_a_virtualenv_of_its_own(monkeypatch, tmp_path):
    from training.serving import vllm as serving_vllm

    monkeypatch.setattr(serving_vllm.importlib.util, "find_spec", lambda name: None)  # not importable here
    python = tmp_path / "bin" / "python"
    assert serving_vllm.vllm_executable(str(python)) is None  # no such file
    python.parent.mkdir()
    python.write_text("#!/bin/sh\n")
    assert serving_vllm.vllm_executable(str(python)) is None  # not executable
    python.chmod(0o755)
    assert serving_vllm.vllm_executable(str(python)) == [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
    ]
    assert engines.vllm_installed(str(python)) and not engines.vllm_installed("")


def test_insisting_on_vllm_fails_early_with_the_reason(machine):
    machine(cuda=True, vllm=False)
    with pytest.raises(ValueError, match=r"make install-vllm"):
        select_engine_kind("cuda", "vllm")
    machine(cuda=False, vllm=True)
    with pytest.raises(ValueError, match="CUDA is not available"):
        select_engine_kind("cuda", "vllm")
    with pytest.raises(ValueError, match="must be one of"):
        select_engine_kind("cpu", "tensorrt")


def test_auto_dtype_is_fp32_on_cpu_even_with_bf16(machine):
    machine(cuda=True, bf16=True)
    assert resolve_dtype("auto", "cpu") == torch.float32


def test_auto_dtype_on_cuda_is_bf16_where_supported_else_fp32(machine):
    machine(cuda=True, bf16=True)
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    machine(cuda=True, bf16=False)
    assert resolve_dtype("auto", "cuda") == torch.float32


def test_explicit_dtype_is_kept_and_nonsense_refused(machine):
    machine(cuda=True, bf16=True)
    assert resolve_dtype(torch.float16, "cuda") == torch.float16
    assert resolve_dtype(torch.bfloat16, "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="auto"):
        resolve_dtype("bf16", "cuda")


def test_load_base_model_takes_auto_or_a_torch_dtype(tiny_model_dir, tmp_path):
    model, _ = load_base_model(str(tiny_model_dir), tmp_path)
    assert model.dtype == torch.float32
    model, _ = load_base_model(str(tiny_model_dir), tmp_path, torch.bfloat16)
    assert model.dtype == torch.bfloat16


def test_unsloth_only_on_cuda_when_installed(machine):
    machine(cuda=True, unsloth=True)
    assert use_unsloth("cuda") is True
    assert use_unsloth("cpu") is False
    machine(cuda=True, unsloth=False)
    assert use_unsloth("cuda") is False
    machine(cuda=False, unsloth=True)
    assert use_unsloth("cuda") is False


def test_unsloth_can_be_switched_off_or_insisted_on(machine, monkeypatch):
    machine(cuda=True, unsloth=True)
    monkeypatch.setenv("ARTWEB_UNSLOTH", "off")  # read by Django's settings, not here
    assert use_unsloth("cuda") is True
    assert use_unsloth("cuda", "off") is False
    assert use_unsloth("cuda", "on") is True
    machine(cuda=True, unsloth=False)
    with pytest.raises(ValueError, match=r"pip install \.\[gpu\]"):
        use_unsloth("cuda", "on")
    with pytest.raises(ValueError, match="CUDA"):
        use_unsloth("cpu", "on")
    with pytest.raises(ValueError, match="must be one of"):
        use_unsloth("cuda", "maybe")


def test_loading_with_unsloth_without_it_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "unsloth", None)
    with pytest.raises(ImportError, match=r"pip install \.\[gpu\]"):
        load_with_unsloth(tmp_path, max_seq_length=512, dtype=None)
