import json
import time

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
from training.session.checkpoint_files import CheckpointError, read_checkpoint_state
from training.session.policy import Policy

ROWS = [{"prompt": "Hello! How are you today?"}, {"prompt": "What is the answer?"}]


def e_share(text: str) -> float:
    """The reward the tiny model learns: the share of the letter 'e' in its answer."""
    return text.count("e") / max(len(text), 1)


def sample_groups(trainer: Policy, config: TrainConfig, rows=ROWS) -> list[TrainGroup]:
    engine = TransformersEngine(trainer.policy, trainer.tokenizer)
    sampling = SamplingParams(
        temperature=config.temperature, top_p=config.top_p, max_new_tokens=config.max_new_tokens
    )
    groups = rollout_groups(engine, rows, EnvironmentSpec(), sampling, config.group_size)
    for group in groups:
        for trajectory in group:
            trajectory.reward = e_share(trajectory.output_text)
    return [to_train_group(group) for group in groups]


def adapter_state(trainer: Policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if "lora_" in n}


def test_reward_climbs_on_a_tiny_model(tiny_model):
    model, tokenizer = tiny_model
    config = TrainConfig(steps=40, group_size=8, learning_rate=1e-2, max_new_tokens=16, seed=0)
    trainer = Policy(model, tokenizer, config, LoraSpec(rank=8, alpha=16))
    start = time.perf_counter()
    rewards = []
    for _ in range(config.steps):
        metrics = grpo_train_step(trainer, sample_groups(trainer, config))
        rewards.append(metrics["reward_mean"])
    elapsed = time.perf_counter() - start
    first, last = rewards[0], sum(rewards[-5:]) / 5
    print(f"reward first step {first:.3f}, mean of last 5 {last:.3f}, {elapsed:.1f} s")
    assert last > first + 0.1, rewards
    assert last > 2 * first, rewards


def test_first_update_sees_ratio_one_with_engine_logprobs(tiny_model):
    model, tokenizer = tiny_model
    # temperature != 1: engine and trainer must temper the same way for ratios to start at 1.
    # One update a step (the defaults make a second pass on step 1): each is on the sampler's policy.
    config = TrainConfig(
        group_size=4, temperature=0.7, max_new_tokens=12, learning_rate=1e-2, num_minibatches=1,
        early_ppo_epochs_steps=0,
    )  # fmt: skip
    trainer = Policy(model, tokenizer, config, LoraSpec())
    for _ in range(2):
        metrics = grpo_train_step(trainer, sample_groups(trainer, config))
        assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        assert metrics["clip_fraction"] == 0.0
        assert metrics["trainable_tokens"] > 0


def test_zero_variance_groups_do_not_update(tiny_model):
    model, tokenizer = tiny_model
    config = TrainConfig(group_size=2, learning_rate=1e-1)
    trainer = Policy(model, tokenizer, config, LoraSpec())
    before = adapter_state(trainer)
    sample = TrainSample([5, 6, 7], [8, 9], [-5.0, -5.0], reward=1.0)
    metrics = grpo_train_step(trainer, [TrainGroup([sample, sample]), TrainGroup([sample, sample])])
    assert metrics["loss"] == 0.0
    assert metrics["zero_variance_fraction"] == 1.0
    assert metrics["trainable_tokens"] == 0.0
    after = adapter_state(trainer)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert not trainer.optimizer.state  # no optimizer step was taken


def test_zero_variance_groups_are_skipped_not_trained(tiny_model):
    model, tokenizer = tiny_model
    config = TrainConfig(group_size=2, learning_rate=1e-2)
    trainer = Policy(model, tokenizer, config, LoraSpec())
    flat = TrainGroup(
        [TrainSample([5, 6], [7, 8, 9], [-6.0] * 3, 0.5), TrainSample([5, 6], [10], [-6.0], 0.5)]
    )
    useful = TrainGroup(
        [TrainSample([5, 6], [11, 12], [-6.0] * 2, 1.0), TrainSample([5, 6], [13], [-6.0], 0.0)]
    )
    metrics = grpo_train_step(trainer, [flat, useful])
    assert metrics["zero_variance_fraction"] == 0.5
    assert metrics["trainable_tokens"] == 3.0
    assert metrics["reward_mean"] == pytest.approx(0.5)
    # population std of [0.5, 0.5, 1, 0]: sqrt((0 + 0 + 0.25 + 0.25) / 4)
    assert metrics["reward_std"] == pytest.approx(0.125**0.5)
    assert metrics["grad_norm"] > 0


@pytest.mark.parametrize("normalization", ["sequence", "token", "constant"])
def test_micro_batching_gives_the_same_update(tiny_model_dir, tmp_path, normalization):
    config = TrainConfig(
        group_size=4, max_new_tokens=10, learning_rate=1e-2, normalization=normalization, num_minibatches=1
    )
    results = []
    groups = None
    for budget in (100_000, 1):  # everything in one pass vs one sample per pass
        model, tokenizer = load_base_model(str(tiny_model_dir), tmp_path)
        trainer = Policy(
            model,
            tokenizer,
            TrainConfig.from_dict({**config.to_dict(), "micro_batch_tokens": budget}),
            LoraSpec(),
        )
        if groups is None:
            groups = sample_groups(trainer, config)
        applied = gradients_at_optimizer_step(trainer)
        metrics = grpo_train_step(trainer, groups)
        results.append((metrics, applied, adapter_state(trainer)))
    (one, one_grads, one_params), (many, many_grads, many_params) = results
    assert one["loss"] == pytest.approx(many["loss"], abs=1e-6)
    assert one["grad_norm"] == pytest.approx(many["grad_norm"], rel=1e-4)
    assert one["entropy"] == pytest.approx(many["entropy"], rel=1e-5)
    assert one_grads.keys() == many_grads.keys() and one_grads
    for name in one_grads:
        torch.testing.assert_close(one_grads[name], many_grads[name], rtol=1e-4, atol=1e-7, msg=name)
    # AdamW's first step moves each weight by ~lr * sign(grad): a gradient entry near 1e-7 that
    # differs by float rounding moves its weight by up to ~1e-5, hence the looser bound here.
    for name in one_params:
        assert torch.allclose(one_params[name], many_params[name], atol=2e-5), name


def gradients_at_optimizer_step(trainer: Policy) -> dict[str, torch.Tensor]:
    """The gradients (after clipping) that the trainer's next optimizer step applies, filled in then."""
    applied: dict[str, torch.Tensor] = {}
    step = trainer.optimizer.step

    def recording_step(*args, **kwargs):
        applied.update(
            {n: p.grad.clone() for n, p in trainer.policy.named_parameters() if p.grad is not None}
        )
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    return applied


def test_forward_passes_respect_the_token_budget(tiny_model):
    model, tokenizer = tiny_model
    config = TrainConfig(group_size=8, learning_rate=1e-3, max_new_tokens=12, micro_batch_tokens=64)
    trainer = Policy(model, tokenizer, config, LoraSpec())
    groups = sample_groups(trainer, config)
    longest = max(len(s.prompt_token_ids) + len(s.completion_token_ids) for g in groups for s in g.samples)
    assert longest <= 64
    shapes = []
    handle = trainer.policy.get_base_model().model.embed_tokens.register_forward_hook(
        lambda module, inputs, output: shapes.append(tuple(inputs[0].shape))
    )
    try:
        grpo_train_step(trainer, groups)
    finally:
        handle.remove()
    assert len(shapes) > 1
    assert all(rows * width <= 64 for rows, width in shapes), shapes


def test_kl_to_the_base_model_starts_at_zero_and_grows(tiny_model):
    model, tokenizer = tiny_model
    config = TrainConfig(group_size=4, max_new_tokens=8, learning_rate=2e-2, kl_coef=0.1, num_minibatches=1,
                         early_ppo_epochs_steps=0)  # fmt: skip
    trainer = Policy(model, tokenizer, config, LoraSpec())
    kls = [grpo_train_step(trainer, sample_groups(trainer, config))["kl"] for _ in range(4)]
    assert kls[0] == pytest.approx(0.0, abs=1e-7)  # LoRA B starts at zero: policy == base
    assert kls[-1] > 1e-5


def test_resume_continues_exactly(tiny_model_dir, tmp_path):
    config = TrainConfig(group_size=4, max_new_tokens=8, learning_rate=1e-2, seed=3)
    lora = LoraSpec(rank=4, alpha=8)

    model, tokenizer = load_base_model(str(tiny_model_dir), tmp_path)
    straight = Policy(model, tokenizer, config, lora)
    grpo_train_step(straight, sample_groups(straight, config))
    after_one = adapter_state(straight)
    expected = grpo_train_step(straight, sample_groups(straight, config))
    expected_params = adapter_state(straight)
    assert any(not torch.equal(after_one[n], expected_params[n]) for n in after_one)

    model, tokenizer = load_base_model(str(tiny_model_dir), tmp_path)
    stopped = Policy(model, tokenizer, config, lora)
    first = grpo_train_step(stopped, sample_groups(stopped, config))
    stopped.save_checkpoint(tmp_path / "step-1", step=1, metrics=first)
    del stopped
    torch.manual_seed(999)  # whatever happens in between must not matter

    model, tokenizer = load_base_model(str(tiny_model_dir), tmp_path)
    resumed = Policy.resume(model, tokenizer, tmp_path / "step-1", config, lora)
    assert resumed.step == 1
    got = grpo_train_step(resumed, sample_groups(resumed, config))
    assert got["reward_mean"] == pytest.approx(expected["reward_mean"], abs=1e-9)
    assert got["loss"] == pytest.approx(expected["loss"], abs=1e-6)
    assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    got_params = adapter_state(resumed)
    for name in expected_params:
        assert torch.allclose(got_params[name], expected_params[name], atol=1e-6), name


def test_checkpoint_layout_and_atomic_replace(tiny_model, tmp_path):
    model, tokenizer = tiny_model
    config = TrainConfig(group_size=2, max_new_tokens=4)
    trainer = Policy(model, tokenizer, config, LoraSpec(rank=4, alpha=8))
    path = tmp_path / "checkpoints" / "0001"
    trainer.save_checkpoint(path, step=1, metrics={"loss": 0.5})
    files = {p.name for p in path.iterdir()}
    assert {
        "adapter_model.safetensors",
        "adapter_config.json",
        "optimizer.pt",
        "rng_state.pt",
        "state.json",
    } <= files
    state = read_checkpoint_state(path)
    assert state["format_version"] == 1
    assert state["step"] == 1
    assert state["metrics"] == {"loss": 0.5}
    # The config as the trainer took it: nothing re-derived (an empty learning rate stays empty;
    # resolving is TrainConfig.resolved's, where the work is created).
    assert TrainConfig.from_dict(state["config"]) == config == trainer.config
    assert LoraSpec.from_dict(state["lora"]) == LoraSpec(rank=4, alpha=8)
    assert json.loads((path / "adapter_config.json").read_text())["r"] == 4

    trainer.save_checkpoint(path, step=2, metrics={})  # saving over a checkpoint replaces it whole
    assert read_checkpoint_state(path)["step"] == 2
    assert [p.name for p in path.parent.iterdir()] == ["0001"]  # no temporary leftovers


def test_resume_rejects_other_lora_and_takes_the_new_learning_rate(tiny_model_dir, tmp_path):
    model, tokenizer = load_base_model(str(tiny_model_dir), tmp_path)
    Policy(model, tokenizer, TrainConfig(), LoraSpec(rank=4, alpha=8)).save_checkpoint(
        tmp_path / "ckpt", step=0, metrics={}
    )
    model, tokenizer = load_base_model(str(tiny_model_dir), tmp_path)
    with pytest.raises(CheckpointError):
        Policy.resume(model, tokenizer, tmp_path / "ckpt", TrainConfig(), LoraSpec(rank=8, alpha=8))
    model, tokenizer = load_base_model(str(tiny_model_dir), tmp_path)
    resumed = Policy.resume(
        model, tokenizer, tmp_path / "ckpt", TrainConfig(learning_rate=3e-3), LoraSpec(rank=4, alpha=8)
    )
    assert resumed.step == 0
    assert resumed.optimizer.param_groups[0]["lr"] == 3e-3


def test_read_checkpoint_state_of_a_non_checkpoint(tmp_path):
    with pytest.raises(CheckpointError):
        read_checkpoint_state(tmp_path)
