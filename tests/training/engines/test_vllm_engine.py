"""VLLMEngine: the conversions to and from vLLM's types, the adapter registry, and the error without
vLLM. The stand-ins below have the shape of vLLM's RequestOutput / CompletionOutput / Logprob: they
feed our conversion code, they do not imitate vLLM. The last test runs the real engine where vLLM
and a GPU are present."""

import sys
from dataclasses import dataclass, field

import pytest
import torch

from training.engines.base import SamplingParams
from training.engines.transformers_engine import TransformersEngine
from training.engines.vllm_engine import (
    LoraRegistry,
    VLLMEngine,
    VLLMUnavailableError,
    check_logprob_convention,
    choice_from_output,
    generation_eos,
    max_lora_rank_for,
    render_prompt,
    request_seed,
    sampled_logprobs,
    stop_token_ids_for,
    vllm_sampling_kwargs,
)


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    index: int = 0
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    request_id: str = "0"
    prompt: str | None = None
    finished: bool = True
    extra: dict = field(default_factory=dict)


def test_sampling_params_map_to_vllm_names():
    sampling = SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=12, stop=["</answer>"], seed=5)
    kwargs = vllm_sampling_kwargs(sampling, index=0)
    assert kwargs["temperature"] == 0.7
    assert kwargs["top_p"] == 1.0
    assert kwargs["max_tokens"] == 12
    assert kwargs["stop"] == ["</answer>"]
    assert kwargs["logprobs"] == 0  # only the sampled token's logprob
    assert kwargs["n"] == 1
    assert kwargs["include_stop_str_in_output"] is False
    assert kwargs["seed"] == request_seed(5, 0)
    assert kwargs["stop_token_ids"] == []
    assert vllm_sampling_kwargs(sampling, 1, stop_token_ids={7, 2})["stop_token_ids"] == [2, 7]


def test_each_request_of_a_batch_gets_its_own_reproducible_seed():
    # A GRPO group is N copies of one prompt: one shared seed would give N identical samples.
    seeds = [request_seed(7, index) for index in range(64)]
    assert len(set(seeds)) == 64
    assert seeds == [request_seed(7, index) for index in range(64)]
    assert request_seed(8, 0) != request_seed(7, 0)
    assert all(0 <= seed < 2**31 for seed in seeds)
    assert request_seed(None, 3) is None
    assert vllm_sampling_kwargs(SamplingParams(seed=None), index=3)["seed"] is None


def test_top_p_truncation_with_sampling_is_refused():
    with pytest.raises(ValueError, match="top_p=1"):
        check_logprob_convention(SamplingParams(temperature=1.0, top_p=0.9))
    with pytest.raises(ValueError, match="top_p=1"):
        vllm_sampling_kwargs(SamplingParams(temperature=0.5, top_p=0.5))
    check_logprob_convention(SamplingParams(temperature=0.0, top_p=0.9))  # greedy: top-p is moot
    check_logprob_convention(SamplingParams(temperature=0.3, top_p=1.0))


def test_output_becomes_a_choice_with_the_sampled_tokens_logprobs():
    output = RequestOutput(
        prompt_token_ids=[1, 2, 3],
        outputs=[
            CompletionOutput(
                text="yes",
                token_ids=[10, 11, 2],
                # With logprobs=0 vLLM lists the sampled token; with more it adds the top ones.
                logprobs=[
                    {10: Logprob(-0.5, rank=1)},
                    {11: Logprob(-2.25, rank=3), 12: Logprob(-0.1, rank=1)},
                    {2: Logprob(-0.75, rank=1)},
                ],
                finish_reason="stop",
            )
        ],
    )
    choice = choice_from_output(output)
    assert choice.text == "yes"
    assert choice.prompt_token_ids == [1, 2, 3]
    assert choice.token_ids == [10, 11, 2]
    assert choice.logprobs == [-0.5, -2.25, -0.75]
    assert choice.finish_reason == "stop"


def test_length_finish_is_kept_and_abort_is_an_error():
    completion = CompletionOutput(
        text="a", token_ids=[4], logprobs=[{4: Logprob(-1.0)}], finish_reason="length"
    )
    assert choice_from_output(RequestOutput([1], [completion])).finish_reason == "length"
    completion.finish_reason = "abort"
    with pytest.raises(RuntimeError, match="abort"):
        choice_from_output(RequestOutput([1], [completion]))


def test_missing_or_misaligned_logprobs_are_errors():
    with pytest.raises(RuntimeError, match="logprobs=0"):
        sampled_logprobs([1, 2], None)
    with pytest.raises(RuntimeError, match="2 tokens"):
        sampled_logprobs([1, 2], [{1: Logprob(-1.0)}])
    with pytest.raises(RuntimeError, match="sampled token 2"):
        sampled_logprobs([1, 2], [{1: Logprob(-1.0)}, {3: Logprob(-1.0)}])


def test_registry_ids_start_at_one_and_are_never_reused(tmp_path):
    registry = LoraRegistry()
    assert registry.register("step-1", tmp_path / "a") == 1
    assert registry.register("step-2", tmp_path / "b") == 2
    assert registry.lookup("step-1") == (1, tmp_path / "a")
    assert registry.forget("step-1") == 1
    # Same name, even same path: a new id, or vLLM would serve its cached copy of the old files.
    assert registry.register("step-1", tmp_path / "a") == 3
    assert registry.names() == ["step-2", "step-1"]
    with pytest.raises(ValueError, match="already loaded"):
        registry.register("step-2", tmp_path / "c")
    with pytest.raises(ValueError, match="not loaded"):
        registry.forget("step-9")
    with pytest.raises(ValueError, match="not loaded"):
        registry.lookup("step-9")


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


def test_stop_tokens_are_those_the_transformers_engine_stops_on(tiny_model, tiny_model_dir, tmp_path):
    model, tokenizer = tiny_model
    expected = TransformersEngine(model, tokenizer).stop_token_ids
    assert stop_token_ids_for(tokenizer, generation_eos(tiny_model_dir)) == expected
    assert stop_token_ids_for(tokenizer, [5, 6]) == {tokenizer.eos_token_id, 5, 6}
    assert generation_eos(tmp_path) is None  # no generation_config.json


def test_without_vllm_the_engine_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(VLLMUnavailableError, match=r"pip install \.\[gpu\]"):
        VLLMEngine(tmp_path)


@pytest.mark.gpu  # deselected by `make test` (no GPU there); run on a GPU host with `make test-gpu`
def test_vllm_samples_the_newest_adapter_on_gpu(tmp_path):
    """On a GPU worker: train one step, load the checkpoint into vLLM, check it with verify_sampler."""
    from training.adapter_check import verify_sampler
    from training.agent import rollout_groups
    from training.base_models import BUNDLED_MODEL, base_model_dir, load_base_model
    from training.config import LoraSpec, TrainConfig
    from training.environments import EnvironmentSpec
    from training.trainer import Trainer
    from training.trajectory import to_train_group

    cache = tmp_path / "models"
    model, tokenizer = load_base_model(BUNDLED_MODEL, cache, dtype=torch.float32, device="cuda")
    config = TrainConfig(group_size=4, max_new_tokens=8, learning_rate=1e-3)
    trainer = Trainer(model, tokenizer, config, LoraSpec(rank=8, alpha=16), device="cuda")
    engine = VLLMEngine(
        base_model_dir(BUNDLED_MODEL, cache), tokenizer=tokenizer, dtype="float32", max_model_len=512
    )
    trainer.save_checkpoint(tmp_path / "step-0", step=0, metrics={})
    engine.load_adapter("step-0", tmp_path / "step-0")
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=1)
    groups = rollout_groups(
        engine, [{"prompt": "Say hello."}], EnvironmentSpec(), sampling, 4, adapter="step-0"
    )
    for group in groups:
        for index, trajectory in enumerate(group):
            trajectory.reward = float(index)
    trainer.train_step([to_train_group(group) for group in groups])
    trainer.save_checkpoint(tmp_path / "step-1", step=1, metrics={})
    engine.load_adapter("step-1", tmp_path / "step-1")
    engine.unload_adapter("step-0")
    probes = [[{"role": "user", "content": "What is the answer?"}]]
    verify_sampler(engine, trainer, tokenizer, tmp_path / "step-1", probes, adapter="step-1", tolerance=2e-3)
