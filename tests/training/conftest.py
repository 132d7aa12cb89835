"""Fixtures for the training core: a fresh tiny model per test (built once per session by the
root conftest's ``tiny_model_dir``), no hub."""

import os

# Before anything imports huggingface_hub: these tests must never reach the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from training.base_models import load_base_model  # noqa: E402


@pytest.fixture
def tiny_model(tiny_model_dir: Path):
    """A fresh (model, tokenizer) per test: the trainer modifies its base model in place."""
    return load_base_model(str(tiny_model_dir), cache_dir=tiny_model_dir.parent)


@pytest.fixture
def one_thread():
    """Torch in this process on one thread, as a trainer service started by the tests runs: sums of
    floats depend on how they are split between threads, so a bit-for-bit comparison between the
    two sides needs the same split (restored afterwards)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
