"""The packed update (training.session.packing): a group's prompt computed once, no padding, and the same
loss, gradients and logprobs as one left-padded row per completion."""

import pytest
import torch

from training.base_models import load_base_model
from training.config import LoraSpec, TrainConfig
from training.engines.base import SamplingParams
from training.engines.transformers_engine import TransformersEngine
from training.environments import EnvironmentSpec
from training.recipes.grpo_update import grpo_train_step
from training.rollouts.agent import rollout_groups
from training.rollouts.trajectory import TrainGroup, TrainSample, to_train_group
from training.session.packing import pack, plan_rows, plan_units
from training.session.policy import Policy


def random_groups(seed: int = 0) -> list[TrainGroup]:
    """Two groups of different prompt lengths; completions of 0 to 9 tokens, one multi-turn mask."""
    generator = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(5, 200, (n,), generator=generator).tolist()

    groups = []
    for prompt_length, lengths in ((7, (1, 4, 9, 3, 0)), (11, (6, 2, 8, 5, 5))):
        prompt = tokens(prompt_length)
        samples = []
        for i, n in enumerate(lengths):
            logprobs = (-torch.rand(n, generator=generator) * 6).tolist()
            mask = [1, 1, 0, 0, 1, 1, 0, 1, 1][:n] if n == 9 else None
            samples.append(
                TrainSample(prompt, tokens(n), logprobs, reward=float(i % 2) + 0.1 * i, completion_mask=mask)
            )
        groups.append(TrainGroup(samples))
    return groups


def one_update(tiny_model_dir, tmp_path, groups, *, packed: bool, **config):
    """One step's metrics and the gradients it applied (the optimizer step is skipped), from a
    LoRA whose B is random, so that A gets gradients too."""
    model, tokenizer = load_base_model(str(tiny_model_dir), tmp_path)
    trainer = Policy(
        model, tokenizer, TrainConfig(group_size=5, learning_rate=1e-3, **config), LoraSpec(rank=4, alpha=8)
    )
    assert trainer.packed  # the tiny model runs sdpa attention
    trainer.packed = packed
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in trainer.policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.05)
    trainer.optimizer.step = lambda: None
    trainer.optimizer.zero_grad = lambda set_to_none=True: None
    metrics = grpo_train_step(trainer, groups)
    grads = {n: p.grad.clone() for n, p in trainer.policy.named_parameters() if p.grad is not None}
    return metrics, grads


@pytest.mark.parametrize(
    "config",
    [
        {"normalization": "sequence"},
        {"normalization": "token", "kl_coef": 0.1},
        {"normalization": "constant", "loss_type": "cispo", "temperature": 0.7},
        {"normalization": "sequence", "importance_level": "sequence", "micro_batch_tokens": 20},
    ],
)
def test_packed_update_equals_the_padded_one(tiny_model_dir, tmp_path, config):
    groups = random_groups()
    packed, packed_grads = one_update(tiny_model_dir, tmp_path, groups, packed=True, **config)
    padded, padded_grads = one_update(tiny_model_dir, tmp_path, groups, packed=False, **config)
    for name in ("loss", "entropy", "kl", "ratio_mean", "clip_fraction", "trainable_tokens"):
        assert packed[name] == pytest.approx(padded[name], rel=1e-5, abs=1e-6), name
    assert packed["grad_norm"] == pytest.approx(padded["grad_norm"], rel=1e-5)
    assert packed_grads.keys() == padded_grads.keys()
    assert any("lora_A" in name for name in packed_grads) and packed["grad_norm"] > 0
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, padded_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    if config.get("kl_coef"):
        assert packed["kl"] > 0  # the reference pass ran packed too, with the adapter off


def test_a_groups_prompt_is_fed_once_and_nothing_is_padding(tiny_model_dir, tmp_path):
    groups = random_groups()
    model, tokenizer = load_base_model(str(tiny_model_dir), tmp_path)
    # One update (the defaults make two passes on a run's first step): one forward to measure.
    config = TrainConfig(group_size=5, learning_rate=1e-3, num_minibatches=1, early_ppo_epochs_steps=0)
    trainer = Policy(model, tokenizer, config, LoraSpec())
    widths = []
    handle = trainer.policy.get_base_model().model.embed_tokens.register_forward_hook(
        lambda module, inputs, output: widths.append(tuple(inputs[0].shape))
    )
    try:
        metrics = grpo_train_step(trainer, groups)
    finally:
        handle.remove()
    # Each prompt once, each completion without its last token (it predicts nothing).
    expected = sum(
        len(g.samples[0].prompt_token_ids) + sum(max(len(s.completion_token_ids) - 1, 0) for s in g.samples)
        for g in groups
    )
    assert widths == [(1, expected)]
    assert metrics["update_positions"] == expected
    assert metrics["padding_fraction"] == 0.0


def test_the_padded_fallback_reports_its_padding(tiny_model_dir, tmp_path):
    model, tokenizer = load_base_model(str(tiny_model_dir), tmp_path)
    config = TrainConfig(
        group_size=2, learning_rate=1e-3, num_minibatches=1, early_ppo_epochs_steps=0
    )  # one update
    trainer = Policy(model, tokenizer, config, LoraSpec())
    trainer.packed = False
    prompt = [5, 6, 7]
    group = TrainGroup(
        [TrainSample(prompt, [8], [-5.0], 1.0), TrainSample(prompt, [9, 10, 11], [-5.0] * 3, 0.0)]
    )
    metrics = grpo_train_step(trainer, [group])
    # Two rows of width 6 (3 + 3); the short one (3 + 1) has 2 padded positions.
    assert metrics["update_positions"] == 12
    assert metrics["padding_fraction"] == pytest.approx(2 / 12)


def test_a_sibling_completion_is_invisible(tiny_model_dir, tmp_path):
    """The tree mask: a completion's logprobs do not depend on the other completions in its row."""
    model, tokenizer = load_base_model(str(tiny_model_dir), tmp_path)
    trainer = Policy(model, tokenizer, TrainConfig(group_size=2, learning_rate=1e-3), LoraSpec())
    prompt, mine = [5, 6, 7, 8], [20, 21, 22, 23]

    def my_logprobs(sibling: list[int]) -> torch.Tensor:
        samples = [
            TrainSample(prompt, sibling, [-1.0] * len(sibling), 0.0),
            TrainSample(prompt, mine, [-1.0] * 4, 0.0),
        ]
        (row,) = pack(samples, [1.0, -1.0], budget=4096)
        batch = {
            name: getattr(row, name)
            for name in ("input_ids", "position_ids", "attention_mask", "keep", "logit_index", "targets")
        }
        with torch.no_grad():
            logprobs, _ = trainer._completion_logprobs(batch)
        return logprobs[row.members.index(1), :4]

    torch.testing.assert_close(
        my_logprobs([30, 31]), my_logprobs([40, 41, 42, 43, 44, 45]), rtol=0, atol=1e-6
    )


def test_teacher_forced_packed_logprobs_equal_the_sampled_ones(tiny_model_dir, tmp_path):
    model, tokenizer = load_base_model(str(tiny_model_dir), tmp_path)
    config = TrainConfig(group_size=6, learning_rate=1e-3, temperature=0.8, max_new_tokens=12)
    trainer = Policy(model, tokenizer, config, LoraSpec())
    engine = TransformersEngine(trainer.policy, tokenizer)
    sampling = SamplingParams(temperature=0.8, top_p=1.0, max_new_tokens=12)
    rows = [{"prompt": "Hello! How are you today?"}, {"prompt": "What is the answer?"}]
    groups = [to_train_group(g) for g in rollout_groups(engine, rows, EnvironmentSpec(), sampling, 6)]
    samples = [s for g in groups for s in g.samples]
    packed_rows = pack(samples, [0.0] * len(samples), budget=4096)
    assert len(packed_rows) == 1 and packed_rows[0].width < sum(
        len(s.prompt_token_ids) + len(s.completion_token_ids) for s in samples
    )
    for row in packed_rows:
        batch = {
            name: getattr(row, name)
            for name in ("input_ids", "position_ids", "attention_mask", "keep", "logit_index", "targets")
        }
        with torch.no_grad():
            logprobs, _ = trainer._completion_logprobs(batch)
        for r, member in enumerate(row.members):
            sampled = torch.tensor(samples[member].completion_logprobs)
            torch.testing.assert_close(logprobs[r, : len(sampled)], sampled, rtol=0, atol=1e-4)


def test_units_fit_the_budget_and_cover_every_sample_once():
    prompt_a, prompt_b = [1] * 10, [2] * 4
    samples = [TrainSample(prompt_a, [3] * n, [-1.0] * n, 0.0) for n in (5, 30, 7, 2)]
    samples += [TrainSample(prompt_b, [4] * n, [-1.0] * n, 0.0) for n in (3, 3)]
    units = plan_units(samples, budget=25)
    assert sorted(m for u in units for m in u.members) == list(range(len(samples)))
    for unit in units:
        assert unit.tokens <= 25 or len(unit.members) == 1
        assert all(tuple(samples[m].prompt_token_ids) == tuple(unit.prompt) for m in unit.members)
    # prompt_a's 4 completions need 3 units (10+4+... > 25), prompt_b's fit one
    assert [len(u.members) for u in units] == [1, 1, 2, 2]
    rows = plan_rows(units, row_tokens=25)
    assert sorted(id(u) for row in rows for u in row) == sorted(id(u) for u in units)
    assert all(sum(u.tokens for u in row) <= 25 or len(row) == 1 for row in rows)
