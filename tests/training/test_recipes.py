"""Recipe levers of a GRPO run (issue 27): learning-rate schedules, several optimizer steps per
batch (minibatches × PPO epochs), dynamic sampling, overlong filtering and the soft length penalty."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from tests.training.test_cost_loop import MeteredHooks
from tests.training.test_learning_signal import ROWS
from tests.training.test_trainer import adapter_state, sample_groups
from training.config import ConfigError, LoraSpec, TrainConfig
from training.environments import build_environment
from training.recipes.grpo import is_zero_variance
from training.recipes.grpo_update import grpo_train_step, passes
from training.recipes.minibatches import split_evenly
from training.recipes.schedules import default_learning_rate, learning_rate_at
from training.rollouts.trajectory import Trajectory, longest_turn, overlong_penalty, to_train_group
from training.runs.loop import run_training
from training.runs.spec import RunSpec
from training.session.policy import Policy


# ------------------------------------------------------------------ schedules
def schedule(kind: str, warmup: int = 0, floor: float = 0.0) -> SimpleNamespace:
    return SimpleNamespace(learning_rate=1e-3, lr_schedule=kind, warmup_steps=warmup, min_lr_ratio=floor)


def test_schedules_on_hand_computed_values():
    # warm-up 2 of 6 steps: 1/3, 2/3 of the peak, then the peak at step 3.
    assert [learning_rate_at(schedule("constant", 2), i, 6) for i in (1, 2, 3, 6)] == pytest.approx(
        [1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3]
    )
    # cosine to a floor of 0.1: step 3 the peak, step 6 the floor, step 4 a third of the way.
    cosine = [learning_rate_at(schedule("cosine", 2, 0.1), i, 6) for i in (3, 4, 6)]
    assert cosine == pytest.approx([1e-3, 1e-4 + 9e-4 * 0.5 * (1 + math.cos(math.pi / 3)), 1e-4])
    linear = [learning_rate_at(schedule("linear", 0, 0.0), i, 5) for i in range(1, 6)]
    assert linear == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4, 0.0])
    assert learning_rate_at(schedule("cosine"), 1, 1) == pytest.approx(1e-3)  # a one-step run: the peak
    with pytest.raises(ValueError, match="outside"):
        learning_rate_at(schedule("constant"), 7, 6)


def test_recipe_settings_are_validated_with_the_field_named():
    with pytest.raises(ConfigError) as caught:
        TrainConfig(lr_schedule="step")
    assert caught.value.field == "lr_schedule"
    with pytest.raises(ConfigError) as caught:
        TrainConfig(groups_per_step=1, group_size=2, num_minibatches=3)
    assert caught.value.field == "num_minibatches"
    with pytest.raises(ConfigError) as caught:
        TrainConfig(max_new_tokens=8, length_penalty_buffer=9)
    assert caught.value.field == "length_penalty_buffer"
    with pytest.raises(ConfigError) as caught:
        TrainConfig(max_resample_factor=0.5)
    assert caught.value.field == "max_resample_factor"


# ------------------------------------------------------------------ the default learning rate
def test_the_default_learning_rate_falls_with_the_base_models_width():
    # 1e-3 where it was measured (the bundled model, width 576); a wider model gets less, a
    # narrower one no more; an unknown width is taken for a 7-8B model's.
    assert default_learning_rate(576) == pytest.approx(1e-3)
    rates = [default_learning_rate(width) for width in (576, 896, 2048, 4096, 8192)]
    assert rates == sorted(rates, reverse=True) and len(set(rates)) == len(rates)
    assert default_learning_rate(4096) == pytest.approx(1e-3 * (576 / 4096) ** 0.78, rel=0.02)  # 2 digits
    assert default_learning_rate(64) == default_learning_rate(576)
    assert default_learning_rate(None) == default_learning_rate(4096)
    assert default_learning_rate(576, "sft") == pytest.approx(5e-4)
    assert (
        default_learning_rate(2048, "dpo") < default_learning_rate(2048, "sft") < default_learning_rate(2048)
    )
    with pytest.raises(KeyError):
        default_learning_rate(576, "ppo")


def test_the_defaults_are_the_measured_recipe_and_an_empty_rate_is_filled_in_once(tiny_model_dir, tmp_path):
    from training.base_models import load_base_model
    from training.config import ConfigError
    from training.model_files import BUNDLED_MODEL, hidden_size, resolve_config

    config = TrainConfig()
    assert (config.learning_rate, config.lr_schedule, config.warmup_steps, config.min_lr_ratio,
            config.num_minibatches) == (None, "cosine", 1, 0.1, 2)  # fmt: skip
    assert config.resolved(objective="grpo", width=2048).learning_rate == default_learning_rate(2048)
    assert config.resolved(objective="dpo", width=2048).learning_rate == default_learning_rate(2048, "dpo")
    set_rate = TrainConfig(learning_rate=3e-4)
    assert set_rate.resolved(objective="grpo", width=2048) is set_rate  # a set rate stays
    # Resolving checks the objective too: GRPO-only options in an SFT run are refused there.
    with pytest.raises(ConfigError, match="max_off_policy_steps"):
        TrainConfig(max_off_policy_steps=1).resolved(objective="sft", width=64)
    # The width, read without loading weights: config.json, or the bundled GGUF's metadata.
    assert hidden_size(str(tiny_model_dir), tiny_model_dir.parent) == 64
    assert hidden_size(str(tmp_path / "missing"), tmp_path) is None
    assert hidden_size(BUNDLED_MODEL, tmp_path / "empty-cache") == 576
    resolved = resolve_config(
        config, source=str(tiny_model_dir), cache_dir=tiny_model_dir.parent, objective="sft"
    )
    assert resolved.learning_rate == default_learning_rate(64, "sft")
    # Nothing downstream re-derives it: a trainer given an empty rate keeps it empty and its GRPO
    # update refuses to run; a run's spec refuses an unresolved config, and RunSpec.resolving
    # (a run built by hand) resolves it through the same function.
    model, tokenizer = load_base_model(str(tiny_model_dir), tiny_model_dir.parent)
    trainer = Policy(model, tokenizer, TrainConfig(), LoraSpec(rank=2, alpha=4))
    assert trainer.config.learning_rate is None
    with pytest.raises(RuntimeError, match="TrainConfig.resolved"):
        grpo_train_step(trainer, [])
    fields = dict(base_model_source=str(tiny_model_dir), model_cache_dir=tiny_model_dir.parent,
                  checkpoint_root=tmp_path / "run", config=TrainConfig(), lora=LoraSpec(),
                  environment=None, grader_spec={}, train_rows=[], start_step=0, resume_step=None,
                  objective="sft")  # fmt: skip
    with pytest.raises(ValueError, match="resolved config"):
        RunSpec(**fields)
    assert RunSpec.resolving(**fields).config == resolved


def test_split_evenly_keeps_order_and_balances():
    assert split_evenly(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_evenly([1, 2], 5) == [[1], [2]]
    assert split_evenly(list(range(4)), 1) == [[0, 1, 2, 3]]


# ------------------------------------------------------------------ several updates per batch
def test_minibatches_and_epochs_take_one_optimizer_step_each_and_the_first_is_on_policy(tiny_model):
    model, tokenizer = tiny_model
    config = TrainConfig(group_size=4, groups_per_step=2, max_new_tokens=10, learning_rate=5e-2,
                         epsilon=0.05, num_minibatches=2, ppo_epochs=2, seed=3)  # fmt: skip
    trainer = Policy(model, tokenizer, config, LoraSpec(rank=4, alpha=8))
    groups = sample_groups(trainer, config)
    metrics = grpo_train_step(trainer, groups)
    if metrics["trainable_tokens"] == 0:
        pytest.fail(
            f"the tiny model's rollouts carried no signal: {[[s.reward for s in g.samples] for g in groups]}"
        )
    assert metrics["optimizer_steps"] == 4.0
    assert trainer.optimizer.state[trainer.trainable_parameters[0]]["step"] == 4
    # The first minibatch of the first pass is scored by the policy that sampled it: ratio 1.
    assert metrics["first_update_ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    # Later updates see a moved policy: the ratio spreads and the clip range bites.
    assert metrics["ratio_std"] > 1e-3 and metrics["clip_fraction"] > 0
    assert metrics["learning_rate"] == 5e-2


def test_early_ppo_epochs_make_the_extra_passes_on_the_first_steps_only(tiny_model):
    model, tokenizer = tiny_model
    config = TrainConfig(group_size=4, groups_per_step=2, max_new_tokens=10, learning_rate=5e-2, num_minibatches=2,
                         early_ppo_epochs=3, early_ppo_epochs_steps=1, seed=3)  # fmt: skip
    trainer = Policy(model, tokenizer, config, LoraSpec(rank=4, alpha=8))
    groups = sample_groups(trainer, config)
    if all(is_zero_variance([s.reward for s in g.samples]) for g in groups):
        pytest.fail(
            f"the tiny model's rollouts carried no signal: {[[s.reward for s in g.samples] for g in groups]}"
        )
    first = grpo_train_step(trainer, groups)
    second = grpo_train_step(trainer, groups)
    # Step 1: three passes over two minibatches; step 2, past early_ppo_epochs_steps: ppo_epochs (1).
    assert (first["optimizer_steps"], second["optimizer_steps"]) == (6.0, 2.0)
    assert trainer.optimizer.state[trainer.trainable_parameters[0]]["step"] == 8
    # The first update of each step is still on the sampler's policy.
    assert first["first_update_ratio_mean"] == pytest.approx(1.0, abs=1e-4)


def test_passes_per_step():
    def counts(**settings) -> list[int]:
        return [passes(TrainConfig(**settings), step) for step in (1, 2, 3, 4)]

    # The defaults: two passes on a run's first step (benchmarks/README.md), then one.
    assert counts() == [2, 1, 1, 1]
    assert counts(early_ppo_epochs_steps=0) == [1, 1, 1, 1]
    assert counts(ppo_epochs=2) == [2, 2, 2, 2]
    assert counts(early_ppo_epochs=2, early_ppo_epochs_steps=2) == [2, 2, 1, 1]
    # ppo_epochs is a floor: early_ppo_epochs never lowers it.
    assert counts(ppo_epochs=3, early_ppo_epochs=2, early_ppo_epochs_steps=2) == [3, 3, 3, 3]
    assert counts(early_ppo_epochs=4, early_ppo_epochs_steps=0) == [1, 1, 1, 1]
    with pytest.raises(ConfigError, match="early_ppo_epochs"):
        TrainConfig.from_dict({"early_ppo_epochs": 0})


def test_an_explicit_learning_rate_drives_the_step_and_one_pass_matches_the_default(tiny_model_dir):
    from training.base_models import load_base_model

    config = TrainConfig(group_size=4, max_new_tokens=8, learning_rate=1e-2, seed=1)
    states = []
    for rate in (None, 1e-2, 0.0):
        model, tokenizer = load_base_model(str(tiny_model_dir), tiny_model_dir.parent)
        torch.manual_seed(0)
        trainer = Policy(model, tokenizer, config, LoraSpec(rank=2, alpha=4))
        before = adapter_state(trainer)
        torch.manual_seed(0)
        groups = sample_groups(trainer, config)
        metrics = grpo_train_step(trainer, groups, learning_rate=rate)
        assert metrics["trainable_tokens"] > 0
        states.append((before, adapter_state(trainer)))
    (_, default), (_, explicit), (before, frozen) = states
    assert all(torch.equal(default[name], explicit[name]) for name in default)
    # lr 0: AdamW moves nothing (no weight decay).
    assert all(torch.equal(before[name], frozen[name]) for name in before)


# ------------------------------------------------------------------ overlong filter, length penalty
def trajectory(
    finish: str, completion: int, mask: list[int] | None = None, reward: float = 1.0
) -> Trajectory:
    return Trajectory(messages=[], prompt_token_ids=[1, 2], completion_token_ids=list(range(completion)),
                      logprobs=[-1.0] * completion, finish_reason=finish, completion_mask=mask, reward=reward)  # fmt: skip


def test_overlong_filter_masks_cut_off_completions_and_the_penalty_is_dapos():
    group = to_train_group([trajectory("length", 4), trajectory("stop", 3)], overlong_filter=True)
    assert group.samples[0].completion_mask == [0, 0, 0, 0] and group.samples[0].reward == 1.0
    assert group.samples[1].completion_mask is None
    assert to_train_group([trajectory("length", 4)]).samples[0].completion_mask is None  # off by default
    # max 10 tokens, buffer 4: no penalty up to 6, then -1/4 per token, -1 at 10 and beyond.
    assert [overlong_penalty(n, 10, 4) for n in (6, 7, 9, 10, 12)] == [0.0, -0.25, -0.75, -1.0, -1.0]
    assert overlong_penalty(10, 10, 0) == 0.0
    # Multi-turn: the longest model turn counts, not the tool results between turns.
    assert longest_turn(trajectory("stop", 7, mask=[1, 1, 0, 0, 1, 1, 1])) == 3
    penalised = to_train_group([trajectory("stop", 9)], max_new_tokens=10, length_penalty_buffer=4)
    assert penalised.samples[0].reward == pytest.approx(1.0 - 0.75)


def test_the_trainer_leaves_filtered_samples_out_of_the_update(tiny_model):
    model, tokenizer = tiny_model
    config = TrainConfig(group_size=4, max_new_tokens=8, learning_rate=1e-2, overlong_filter=True)
    trainer = Policy(model, tokenizer, config, LoraSpec(rank=2, alpha=4))
    groups = sample_groups(trainer, config)
    signal = [g for g in groups if not is_zero_variance([s.reward for s in g.samples])]
    assert signal, "the tiny model's rollouts carried no signal"
    for sample in signal[0].samples[:2]:
        sample.completion_mask = [0] * len(sample.completion_token_ids)
    expected = sum(s.trainable_tokens() for g in signal for s in g.samples)
    assert grpo_train_step(trainer, groups)["trainable_tokens"] == expected


# ------------------------------------------------------------------ dynamic sampling, in a run
def run_spec(tmp_path, grader: dict, **config) -> RunSpec:
    return RunSpec.resolving(
        base_model_source=str(config.pop("model")),
        model_cache_dir=config.pop("cache"),
        checkpoint_root=tmp_path,
        config=TrainConfig(**{"group_size": 2, "groups_per_step": 2, "max_new_tokens": 3, **config}),
        lora=LoraSpec(rank=2, alpha=4),
        environment=build_environment("chat"),
        grader_spec=grader,
        train_rows=ROWS,
        start_step=0,
        resume_step=None,
    )


def test_dynamic_sampling_draws_to_the_cap_when_no_group_carries_a_signal(tiny_model_dir, tmp_path):
    spec = run_spec(tmp_path, {"type": "regex", "name": "never", "pattern": "^never-ever$"},
                    model=tiny_model_dir, cache=tiny_model_dir.parent, steps=3, dynamic_sampling=True,
                    max_resample_factor=2.5, lr_schedule="linear", warmup_steps=1, min_lr_ratio=0.5,
                    learning_rate=1e-3)  # fmt: skip
    hooks = MeteredHooks()
    assert run_training(spec, hooks) == "succeeded"
    assert [m["learning_rate"] for m in hooks.metrics] == pytest.approx([5e-4, 1e-3, 5e-4])
    for metrics in hooks.metrics:
        # cap = int(2 × 2.5) = 5 rows; every group dropped, nothing trained, all kept as data.
        assert (metrics["groups_drawn"], metrics["groups_dropped"], metrics["groups_trained"]) == (
            5.0,
            5.0,
            0.0,
        )
        assert metrics["sampling_draws"] == 2.0  # the step's 2 rows, then the 3 left at once
        assert len(metrics["trajectories"]) == 5 * 2 and metrics["trainable_tokens"] == 0
        assert metrics["zero_variance_fraction"] == 1.0


def test_dynamic_sampling_trains_only_on_groups_with_a_signal(tiny_model_dir, tmp_path):
    # Rows "a" and "c" can never match (all 0: dropped); "b" and "d" match some answers only.
    grader = {"type": "regex", "name": "vowel", "pattern": "{{item.pattern}}"}
    rows = [{"index": i, "data": {"prompt": f"Say {w}", "item": {"pattern": p}}}
            for i, (w, p) in enumerate([("a", "^never$"), ("b", "[aeiou]"), ("c", "^never$"), ("d", "[aeiou]")])]  # fmt: skip
    spec = run_spec(tmp_path, grader, model=tiny_model_dir, cache=tiny_model_dir.parent, steps=2,
                    dynamic_sampling=True, max_resample_factor=4.0, max_new_tokens=6, group_size=4)  # fmt: skip
    spec.train_rows = rows
    hooks = MeteredHooks()
    assert run_training(spec, hooks) == "succeeded"
    for metrics in hooks.metrics:
        trajectories = metrics["trajectories"]
        groups = [trajectories[i : i + 4] for i in range(0, len(trajectories), 4)]
        dropped = sum(1 for g in groups if is_zero_variance([t.reward for t in g]))
        assert metrics["groups_drawn"] == len(groups) <= 8
        assert metrics["groups_dropped"] == dropped
        assert metrics["groups_trained"] == min(2, len(groups) - dropped)
        if metrics["groups_trained"] < 2:
            assert len(groups) == 8  # short of a full batch only at the cap
        rewards = [t.reward for t in trajectories]
        assert metrics["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
        assert (metrics["trainable_tokens"] > 0) == (metrics["groups_trained"] > 0)
    assert any(m["groups_trained"] > 0 for m in hooks.metrics), [m["groups_drawn"] for m in hooks.metrics]
    print([(m["groups_drawn"], m["groups_dropped"], m["groups_trained"]) for m in hooks.metrics])


def test_the_step_records_the_length_penalty_its_rewards_carried(tiny_model_dir, tmp_path):
    spec = run_spec(tmp_path, {"type": "regex", "name": "any", "pattern": "."}, model=tiny_model_dir,
                    cache=tiny_model_dir.parent, steps=1, max_new_tokens=3, length_penalty_buffer=2)  # fmt: skip
    hooks = MeteredHooks()
    assert run_training(spec, hooks) == "succeeded"
    (metrics,) = hooks.metrics
    penalties = [overlong_penalty(longest_turn(t), 3, 2) for t in metrics["trajectories"]]
    assert metrics["length_penalty_mean"] == pytest.approx(sum(penalties) / len(penalties))
    assert any(p < 0 for p in penalties), "the tiny model runs to the token limit: the penalty is real"
