"""Fixtures for the training core: a tiny random-init model built once per session, no hub."""

import os

# Before anything imports huggingface_hub: these tests must never reach the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from training.base_models import build_tiny_model, load_base_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture
def tiny_model(tiny_model_dir: Path):
    """A fresh (model, tokenizer) per test: the trainer modifies its base model in place."""
    return load_base_model(str(tiny_model_dir), cache_dir=tiny_model_dir.parent)
