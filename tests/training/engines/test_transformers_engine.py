import pytest
import torch

from training.config import LoraSpec, TrainConfig
from training.engines.base import SamplingParams
from training.engines.transformers_engine import TransformersEngine
from training.session.policy import Policy

REQUESTS = [
    [{"role": "user", "content": "Hello! How are you today?"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 1 + 2?"},
    ],
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Please think step by step and then answer the question."}],
]


def teacher_forced_logprobs(model, choice, temperature=1.0):
    """Logprobs of the sampled tokens from one unpadded, uncached forward pass."""
    ids = torch.tensor([choice.prompt_token_ids + choice.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    if temperature > 0:
        logits = logits / temperature
    logprobs = torch.log_softmax(logits, dim=-1)
    start = len(choice.prompt_token_ids) - 1
    positions = torch.arange(start, start + len(choice.token_ids))
    return logprobs[positions, torch.tensor(choice.token_ids)]


def test_batch_returns_one_choice_per_request_in_order(tiny_model):
    model, tokenizer = tiny_model
    engine = TransformersEngine(model, tokenizer)
    choices = engine.generate(REQUESTS, SamplingParams(max_new_tokens=8, seed=0))
    assert len(choices) == 4
    for request, choice in zip(REQUESTS, choices, strict=True):
        assert choice.prompt_token_ids == engine.render(request)
        assert 1 <= len(choice.token_ids) <= 8
        assert len(choice.logprobs) == len(choice.token_ids)
        assert choice.finish_reason in ("stop", "length")
    assert engine.render(REQUESTS[0])[-3:] == tokenizer("<|im_start|>assistant\n")["input_ids"][-3:]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_teacher_forcing(tiny_model, temperature):
    model, tokenizer = tiny_model
    engine = TransformersEngine(model, tokenizer)
    # Prompts of different lengths: left padding and position ids must not change the numbers.
    choices = engine.generate(REQUESTS, SamplingParams(max_new_tokens=12, temperature=temperature, seed=3))
    for choice in choices:
        expected = teacher_forced_logprobs(model, choice, temperature)
        assert torch.allclose(torch.tensor(choice.logprobs), expected, atol=1e-4)


def test_same_seed_same_tokens_other_seed_other_tokens(tiny_model):
    model, tokenizer = tiny_model
    engine = TransformersEngine(model, tokenizer)
    first = engine.generate(REQUESTS, SamplingParams(max_new_tokens=10, seed=7))
    again = engine.generate(REQUESTS, SamplingParams(max_new_tokens=10, seed=7))
    other = engine.generate(REQUESTS, SamplingParams(max_new_tokens=10, seed=8))
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert [c.logprobs for c in first] == [c.logprobs for c in again]
    assert [c.token_ids for c in first] != [c.token_ids for c in other]


def test_no_seed_draws_from_torch_global_rng(tiny_model):
    model, tokenizer = tiny_model
    engine = TransformersEngine(model, tokenizer)
    torch.manual_seed(123)
    first = engine.generate(REQUESTS, SamplingParams(max_new_tokens=6))
    torch.manual_seed(123)
    again = engine.generate(REQUESTS, SamplingParams(max_new_tokens=6))
    assert [c.token_ids for c in first] == [c.token_ids for c in again]


def test_max_new_tokens_ends_with_length(tiny_model):
    model, tokenizer = tiny_model
    engine = TransformersEngine(model, tokenizer)
    choices = engine.generate(REQUESTS, SamplingParams(max_new_tokens=3, seed=0))
    assert [c.finish_reason for c in choices] == ["length"] * 4
    assert [len(c.token_ids) for c in choices] == [3] * 4


def test_stop_string_cuts_text_and_keeps_sampled_tokens(tiny_model):
    model, tokenizer = tiny_model
    engine = TransformersEngine(model, tokenizer)
    request = [REQUESTS[0]]
    full = engine.generate(request, SamplingParams(max_new_tokens=24, seed=1))[0]
    stop = next(full.text[i : i + 2] for i in range(3, len(full.text)) if full.text[i : i + 2].isalpha())
    cut = engine.generate(request, SamplingParams(max_new_tokens=24, seed=1, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert stop not in cut.text
    # The tokens are a prefix of the uncut sample and include the one that completed the stop string.
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]
    assert stop in tokenizer.decode(cut.token_ids)
    assert stop not in tokenizer.decode(cut.token_ids[:-1])


def test_eos_stops_a_row_and_is_returned(tiny_model):
    model, tokenizer = tiny_model
    eos = tokenizer.eos_token_id
    engine = TransformersEngine(model, tokenizer)
    baseline = engine.generate(REQUESTS, SamplingParams(max_new_tokens=5, seed=0))

    def force_eos_on_second_token(module, inputs, output):
        # Only in decode steps (one position): the first generated token stays as sampled.
        if output.shape[1] == 1 and forced["calls"] >= 1:
            output = output.clone()
            output[..., eos] += 1000.0
        forced["calls"] += 1
        return output

    forced = {"calls": 0}
    handle = model.lm_head.register_forward_hook(force_eos_on_second_token)
    try:
        choices = engine.generate(REQUESTS, SamplingParams(max_new_tokens=5, seed=0))
    finally:
        handle.remove()
    for before, choice in zip(baseline, choices, strict=True):
        assert choice.finish_reason == "stop"
        assert choice.token_ids == [before.token_ids[0], eos]
        assert choice.logprobs[1] == pytest.approx(0.0, abs=1e-4)
        assert choice.text == tokenizer.decode([before.token_ids[0]], skip_special_tokens=True)


def test_greedy_decoding_is_deterministic_without_seed(tiny_model):
    model, tokenizer = tiny_model
    engine = TransformersEngine(model, tokenizer)
    first = engine.generate(REQUESTS[:2], SamplingParams(temperature=0, max_new_tokens=6))
    second = engine.generate(REQUESTS[:2], SamplingParams(temperature=0, max_new_tokens=6))
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    expected = teacher_forced_logprobs(model, first[0], temperature=0)
    assert torch.allclose(torch.tensor(first[0].logprobs), expected, atol=1e-4)


def _perturb_adapter(trainer: Policy, seed: int = 0) -> None:
    """Give the LoRA B matrices (zero at init) values, so the adapter changes the model."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in trainer.policy.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)


def test_engine_samples_from_the_live_peft_adapter_and_restores_train_mode(tiny_model):
    model, tokenizer = tiny_model
    trainer = Policy(model, tokenizer, TrainConfig(), LoraSpec())
    _perturb_adapter(trainer)
    engine = TransformersEngine(trainer.policy, tokenizer)
    trainable = {n for n, p in trainer.policy.named_parameters() if p.requires_grad}
    assert trainer.policy.training
    choices = engine.generate(REQUESTS, SamplingParams(max_new_tokens=8, seed=0))
    assert trainer.policy.training
    assert {n for n, p in trainer.policy.named_parameters() if p.requires_grad} == trainable
    for choice in choices:
        with_adapter = teacher_forced_logprobs(trainer.policy, choice)
        assert torch.allclose(torch.tensor(choice.logprobs), with_adapter, atol=1e-4)
        with trainer.policy.disable_adapter():
            without = teacher_forced_logprobs(trainer.policy, choice)
        assert not torch.allclose(with_adapter, without, atol=1e-3)


def test_load_and_unload_adapter_from_a_checkpoint(tiny_model_dir, tmp_path):
    from training.base_models import load_base_model

    policy_model, tokenizer = load_base_model(str(tiny_model_dir), tmp_path)
    trainer = Policy(policy_model, tokenizer, TrainConfig(), LoraSpec())
    _perturb_adapter(trainer)
    trainer.save_checkpoint(tmp_path / "ckpt", step=1, metrics={})
    sampling = SamplingParams(max_new_tokens=8, seed=5)
    from_policy = TransformersEngine(trainer.policy, tokenizer).generate(REQUESTS, sampling)

    base, tokenizer = load_base_model(str(tiny_model_dir), tmp_path)
    engine = TransformersEngine(base, tokenizer)
    from_base = engine.generate(REQUESTS, sampling)
    engine.load_adapter("proj/model:1", tmp_path / "ckpt")
    with_adapter = engine.generate(REQUESTS, sampling, adapter="proj/model:1")
    assert [c.token_ids for c in with_adapter] == [c.token_ids for c in from_policy]
    for a, b in zip(with_adapter, from_policy, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    # adapter=None on a plain model means the base weights, adapters loaded or not.
    assert [c.token_ids for c in engine.generate(REQUESTS, sampling)] == [c.token_ids for c in from_base]
    with pytest.raises(ValueError):
        engine.generate(REQUESTS, sampling, adapter="nope")
    engine.unload_adapter("proj/model:1")
    assert not hasattr(engine.model, "peft_config")
    assert [c.token_ids for c in engine.generate(REQUESTS, sampling)] == [c.token_ids for c in from_base]


def test_extra_adapter_on_the_trainers_policy_leaves_training_untouched(tiny_model, tiny_model_dir, tmp_path):
    from training.base_models import load_base_model

    other_model, tokenizer = load_base_model(str(tiny_model_dir), tmp_path)
    other = Policy(other_model, tokenizer, TrainConfig(), LoraSpec())
    _perturb_adapter(other, seed=1)
    other.save_checkpoint(tmp_path / "other", step=1, metrics={})
    other_choices = TransformersEngine(other.policy, tokenizer).generate(REQUESTS, SamplingParams(seed=2))

    model, tokenizer = tiny_model
    trainer = Policy(model, tokenizer, TrainConfig(), LoraSpec())
    engine = TransformersEngine(trainer.policy, tokenizer)
    flags = {n: p.requires_grad for n, p in trainer.policy.named_parameters()}
    engine.load_adapter("other", tmp_path / "other")
    choices = engine.generate(REQUESTS, SamplingParams(seed=2), adapter="other")
    assert [c.token_ids for c in choices] == [c.token_ids for c in other_choices]
    assert trainer.policy.active_adapter == "default"
    engine.unload_adapter("other")
    assert {n: p.requires_grad for n, p in trainer.policy.named_parameters()} == flags
    assert trainer.policy.active_adapter == "default"


def test_tiny_top_p_keeps_only_the_most_likely_token(tiny_model):
    model, tokenizer = tiny_model
    engine = TransformersEngine(model, tokenizer)
    greedy = engine.generate(REQUESTS, SamplingParams(temperature=0, max_new_tokens=6))
    nucleus = engine.generate(REQUESTS, SamplingParams(top_p=1e-6, max_new_tokens=6, seed=4))
    assert [c.token_ids for c in nucleus] == [c.token_ids for c in greedy]
    # The logprob stays the one under the full distribution, not the truncated one (which is 0).
    for choice in nucleus:
        expected = teacher_forced_logprobs(model, choice)
        assert torch.allclose(torch.tensor(choice.logprobs), expected, atol=1e-4)
        assert max(choice.logprobs) < -0.5
