"""The serving tests' engine: the tiny model under the transformers engine, one per test module
(a module may load adapters into it)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from training.base_models import load_base_model
    from training.engines.transformers_engine import TransformersEngine

    model, tokenizer = load_base_model(str(tiny_model_dir), tiny_model_dir.parent)
    return TransformersEngine(model, tokenizer)
