"""The base model's context, read without loading weights (run creation checks max_new_tokens and
prompts against it): config.json of a local directory or the bundled model's cache, else the
bundled GGUF file's metadata."""

from __future__ import annotations

from training.base_models import prompt_token_counts
from training.model_files import BUNDLED_MODEL, context_length


def test_context_of_a_local_model_comes_from_its_config(tiny_model_dir, tmp_path):
    assert context_length(str(tiny_model_dir), tiny_model_dir.parent) == 1024
    assert context_length(str(tmp_path / "missing"), tmp_path) is None
    [count] = prompt_token_counts(
        str(tiny_model_dir), tiny_model_dir.parent, [[{"role": "user", "content": "hi"}]]
    )
    assert 3 < count < 20


def test_bundled_model_context_comes_from_the_gguf_metadata_before_conversion(tmp_path):
    assert context_length(BUNDLED_MODEL, tmp_path / "empty-cache") == 8192
    assert prompt_token_counts(BUNDLED_MODEL, tmp_path / "empty-cache", [[]]) is None, "no tokenizer yet"
