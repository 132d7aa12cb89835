"""Packed linears (training.engines.packed): inside the engine's inference scope the model's CPU
linears compute through prepacked oneDNN weights, siblings fused, with the same results as the
model's own forward; outside it nothing is changed."""

import pytest
import torch

from training.config import LoraSpec, TrainConfig
from training.engines.base import SamplingParams
from training.engines.packed import LinearPacks, _groups, packed_linears, packing_available
from training.engines.transformers_engine import TransformersEngine
from training.session.policy import Policy

PROMPT = [{"role": "user", "content": "Hello! How are you today?"}]


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def ids_for(engine: TransformersEngine, rows: int = 3) -> torch.Tensor:
    prompt = engine.render(PROMPT)
    return torch.tensor([prompt] * rows)


def linears(model) -> list[torch.nn.Linear]:
    return [m for n, m in model.named_modules() if type(m) is torch.nn.Linear and "lora_" not in n]


def test_the_cpu_build_can_pack():
    assert packing_available()  # the CPU lock's torch has oneDNN; without it decoding is ~2x slower


def test_packed_forward_matches_the_model_and_is_undone_after_the_scope(tiny_model):
    model, tokenizer = tiny_model
    model.eval()
    engine = TransformersEngine(model, tokenizer, pack_weights=False)
    ids = ids_for(engine)
    plain = logits_of(model, ids)
    packs = LinearPacks()
    with packed_linears(model, packs) as patched:
        assert patched == len(linears(model))  # every plain linear, the head included
        assert all("forward" in m.__dict__ for m in linears(model))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            packed = logits_of(model, ids)
    assert all("forward" not in m.__dict__ for m in linears(model))
    assert torch.allclose(packed, plain, atol=1e-4), (packed - plain).abs().max()
    ran = [event.key for event in profile.key_averages()]
    assert "mkldnn::_linear_pointwise" in ran and "aten::linear" not in ran
    # Siblings share one pack: per layer q/k/v and gate/up, plus o, down; then the head.
    layers = model.config.num_hidden_layers
    assert len(packs) == 4 * layers + 1
    assert [len(g) for g in _groups(model)][:4] == [3, 1, 2, 1]


def test_a_weight_changed_in_place_is_repacked(tiny_model):
    model, _ = tiny_model
    model.eval()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    packs = LinearPacks()
    with packed_linears(model, packs):
        logits_of(model, ids)
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(3.0)
        model.model.layers[0].mlp.down_proj.weight.mul_(-1.0)
    plain = logits_of(model, ids)
    with packed_linears(model, packs):
        packed = logits_of(model, ids)
    assert torch.allclose(packed, plain, atol=1e-4)


def test_gradients_inside_the_scope_use_the_module_forward(tiny_model):
    model, _ = tiny_model
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with packed_linears(model, LinearPacks()):
        loss = model(input_ids=ids).logits.sum()
        loss.backward()
    head = model.get_output_embeddings().weight
    assert head.grad is not None and head.grad.abs().sum() > 0


def test_a_sibling_called_with_another_input_computes_its_own(tiny_model):
    model, _ = tiny_model
    attention = model.model.layers[0].self_attn
    first, other = torch.randn(2, 1, model.config.hidden_size), torch.randn(2, 1, model.config.hidden_size)
    with torch.no_grad():
        expected_q, expected_k = attention.q_proj(first), attention.k_proj(other)
        with packed_linears(model, LinearPacks()):
            q = attention.q_proj(first)
            k = attention.k_proj(other)  # not the tensor q was computed from
            k_again = attention.k_proj(first)  # q's sibling slice for `first`
            v_twice = [
                attention.v_proj(first),
                attention.v_proj(first),
            ]  # the same input again: the same values
        expected_k_first = attention.k_proj(first)
        expected_v = attention.v_proj(first)
    assert torch.allclose(q, expected_q, atol=1e-5)
    assert torch.allclose(k, expected_k, atol=1e-5)
    assert torch.allclose(k_again, expected_k_first, atol=1e-5)
    for v in v_twice:
        assert torch.allclose(v, expected_v, atol=1e-5)


def test_a_lora_adapter_samples_the_same_with_packed_base_weights(tiny_model):
    model, tokenizer = tiny_model
    trainer = Policy(model, tokenizer, TrainConfig(), LoraSpec())
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in trainer.policy.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    packed_engine = TransformersEngine(trainer.policy, tokenizer)
    plain_engine = TransformersEngine(trainer.policy, tokenizer, pack_weights=False)
    assert packed_engine.linear_packs is not None and plain_engine.linear_packs is None
    sampling = SamplingParams(max_new_tokens=12, seed=3)
    prompt = packed_engine.render(PROMPT)
    packed = packed_engine.generate_from_tokens([prompt, prompt], sampling)
    plain = plain_engine.generate_from_tokens([prompt, prompt], sampling)
    assert [c.token_ids for c in packed] == [c.token_ids for c in plain]
    for a, b in zip(packed, plain, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    # The LoRA factors were not packed; a training step's change to them shows at once.
    with torch.no_grad():
        for name, parameter in trainer.policy.named_parameters():
            if "lora_B" in name:
                parameter.mul_(-1.0)
    changed = packed_engine.generate_from_tokens([prompt], sampling)[0]
    again = plain_engine.generate_from_tokens([prompt], sampling)[0]
    assert changed.token_ids == again.token_ids
    assert changed.logprobs == pytest.approx(again.logprobs, abs=1e-4)


def test_a_decode_loop_enters_the_inference_scope_once(tiny_model, monkeypatch):
    import training.engines.transformers_engine as module

    model, tokenizer = tiny_model
    engine = TransformersEngine(model.train(), tokenizer)
    entered = []
    real = module.packed_linears

    def counting(*args, **kwargs):
        entered.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "packed_linears", counting)
    choice = engine.generate_from_tokens([engine.render(PROMPT)], SamplingParams(max_new_tokens=6, seed=1))[0]
    assert len(choice.token_ids) == 6 or choice.finish_reason == "stop"
    assert entered == [1]  # not once per decode step
    assert model.training  # restored after
    assert all("forward" not in m.__dict__ for m in linears(model))


def test_a_nested_scope_keeps_the_outer_scopes_packed_forwards(tiny_model):
    model, tokenizer = tiny_model
    trainer = Policy(model, tokenizer, TrainConfig(), LoraSpec())
    engine = TransformersEngine(trainer.policy, tokenizer)
    base = linears(trainer.policy)
    with engine.inference(None):
        assert all("forward" in m.__dict__ for m in base)
        with engine.inference("default"):  # another adapter scope inside
            pass
        assert all("forward" in m.__dict__ for m in base)
    assert all("forward" not in m.__dict__ for m in base)
