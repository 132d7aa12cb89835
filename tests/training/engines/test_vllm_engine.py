"""vLLM's rules that every vLLM sampler follows (training.engines.vllm_engine): request seeds, the
logprob convention, LoRA ranks, prompts and stop tokens as the trainer's. The samplers themselves
run against the real vLLM (its CPU build) in tests/vllm/."""

import pytest

from training.engines.base import SamplingParams
from training.engines.transformers_engine import TransformersEngine
from training.engines.vllm_engine import (
    check_logprob_convention,
    generation_eos,
    max_lora_rank_for,
    render_prompt,
    request_seed,
)


def test_each_request_of_a_batch_gets_its_own_reproducible_seed():
    # A GRPO group is N copies of one prompt: one shared seed would give N identical samples.
    seeds = [request_seed(7, index) for index in range(64)]
    assert len(set(seeds)) == 64
    assert seeds == [request_seed(7, index) for index in range(64)]
    assert request_seed(8, 0) != request_seed(7, 0)
    assert all(0 <= seed < 2**31 for seed in seeds)
    assert request_seed(None, 3) is None


def test_top_p_truncation_with_sampling_is_refused():
    with pytest.raises(ValueError, match="top_p=1"):
        check_logprob_convention(SamplingParams(temperature=1.0, top_p=0.9))
    with pytest.raises(ValueError, match="top_p=1"):
        check_logprob_convention(SamplingParams(temperature=0.5, top_k=5))
    check_logprob_convention(SamplingParams(temperature=0.0, top_p=0.9))  # greedy: top-p is moot
    check_logprob_convention(SamplingParams(temperature=0.3, top_p=1.0))


def test_max_lora_rank_rounds_up_to_a_rank_vllm_supports():
    assert max_lora_rank_for(1) == 8
    assert max_lora_rank_for(8) == 8
    assert max_lora_rank_for(9) == 16
    assert max_lora_rank_for(300) == 320
    with pytest.raises(ValueError):
        max_lora_rank_for(1024)


def test_prompts_render_as_the_transformers_engine_renders_them(tiny_model):
    model, tokenizer = tiny_model
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    assert render_prompt(tokenizer, messages) == TransformersEngine(model, tokenizer).render(messages)


def test_the_generation_configs_eos_is_read_and_a_folder_without_one_has_none(tiny_model_dir, tmp_path):
    assert generation_eos(tiny_model_dir) is not None
    assert generation_eos(tmp_path) is None  # no generation_config.json
