"""One client step (training.runs.art_step): ART's experimental_config of 0.5.18 and 0.5.23 read into the
job's settings (training.recipes.art_config) or refused by name, ART's advantages, and steps on the tiny model:
checkpoint N+1 from N, one optimizer step per packed sequence, the KL reference, trajectories
without logprobs skipped or (with ART's flag) trained."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer

from tests.training.test_client_groups import Sampler, group, trajectory
from training.config import ConfigError, LoraSpec
from training.recipes.art_config import EXPERIMENTAL_KEYS, art_job_config
from training.runs.art_groups import parse_groups
from training.runs.art_step import ClientStepSpec, art_advantages, off_policy_steps, train_client_step
from training.runs.art_tokens import sampled_step
from training.session.checkpoint_files import read_checkpoint_state

# What openpipe-art 0.5.23's ServerlessBackend.train() sends with every argument at its default.
ART_0523_DEFAULTS = {
    "advantage_balance": 0.0, "allow_training_without_logprobs": False, "epsilon": None, "epsilon_high": None,
    "importance_sampling_level": "token", "kimi_k2_tau": None, "kl_penalty_coef": 0.0,
    "kl_penalty_reference_step": None, "kl_penalty_source": "current_learner", "kl_penalty_step_lag": None,
    "kl_ref_adapter_path": None, "learning_rate": 5e-6, "logprob_calculation_chunk_size": 1024,
    "loss_fn": "cispo", "mask_prob_ratio": False, "max_negative_advantage_importance_sampling_weight": None,
    "normalize_advantages": True, "num_trajectories_learning_rate_multiplier_power": 0.0,
    "packed_sequence_length": None, "plot_tensors": False, "ppo": False, "precalculate_logprobs": False,
    "scale_learning_rate_by_reward_std_dev": False, "scale_rewards": True, "truncated_importance_sampling": None,
}  # fmt: skip


def test_arts_0523_defaults_are_all_accepted_and_mean_cispo_with_arts_clip_range():
    assert sorted(ART_0523_DEFAULTS) == sorted(EXPERIMENTAL_KEYS) and len(EXPERIMENTAL_KEYS) == 25
    config, options = art_job_config(ART_0523_DEFAULTS)
    assert (config.loss_type, config.epsilon, config.epsilon_high) == ("cispo", 1.0, 4.0)
    assert config.learning_rate == 5e-6 and config.scale_rewards
    assert not options.loss.ppo and options.loss.kl_penalty_coef == 0.0 and options.reference_step(7) is None
    assert options.packed_sequence_length is None and not options.needs_trainer_logprobs
    assert art_job_config(None) == art_job_config({})


def test_ppo_loss_fn_and_explicit_values_are_honoured():
    config, options = art_job_config({"loss_fn": "ppo", "epsilon": 0.1, "epsilon_high": 0.3,
                                      "normalize_advantages": False, "importance_sampling_level": "average"})  # fmt: skip
    assert (config.loss_type, config.epsilon, config.epsilon_high) == (
        "ppo",
        0.1,
        0.3,
    ) and not config.scale_rewards
    assert options.loss.ppo and options.loss.importance_sampling_level == "average"
    assert art_job_config({"ppo": True})[1].loss.epsilon_high == 0.2  # ART: epsilon_high defaults to epsilon
    options = art_job_config({"kl_penalty_coef": 0.1, "kl_penalty_step_lag": 2, "advantage_balance": -0.5,
                              "truncated_importance_sampling": 2.0, "packed_sequence_length": 256,
                              "num_trajectories_learning_rate_multiplier_power": 0.5,
                              "scale_learning_rate_by_reward_std_dev": True,
                              "allow_training_without_logprobs": True})[1]  # fmt: skip
    assert options.loss.kl_penalty_source == "sample"  # ServerlessBackend's default once KL is on
    assert options.reference_step(5) == 3 and options.reference_step(1) == 0
    assert options.needs_trainer_logprobs and options.sequence_length(9000, None) == 256
    assert art_job_config({"kl_penalty_coef": 0.1})[1].reference_step(5) == 0  # the base model
    assert art_job_config({"kl_penalty_coef": 0.1, "kl_penalty_reference_step": 2})[1].reference_step(5) == 2
    # ART's default packed length: the longest trajectory rounded up to 2048, at most the model's context.
    assert art_job_config({})[1].sequence_length(2049, 8192) == 4096
    assert art_job_config({})[1].sequence_length(10, 1024) == 1024


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"kl_ref_adapter_path": "/tmp/adapter"}, "kl_ref_adapter_path"),
        ({"plot_tensors": True}, "plot_tensors"),
        ({"loss_fn": "ppo", "ppo": False}, "loss_fn"),
        ({"loss_fn": "dro"}, "loss_fn"),
        ({"scale_rewards": True, "normalize_advantages": False}, "normalize_advantages"),
        ({"kl_penalty_reference_step": 1, "kl_penalty_step_lag": 1}, "kl_penalty_step_lag"),
        ({"kl_penalty_step_lag": 0}, "kl_penalty_step_lag"),
        ({"kl_penalty_source": "elsewhere"}, "kl_penalty_source"),
        ({"importance_sampling_level": "batch"}, "importance_sampling_level"),
        ({"advantage_balance": 2}, "advantage_balance"),
        ({"packed_sequence_length": 0}, "packed_sequence_length"),
        ({"learning_rate": -1.0}, "learning_rate"),
        ({"ppo": "yes"}, "ppo"),
        ({"warmup": 3}, "warmup"),
    ],
)
def test_what_artweb_cannot_honour_is_refused_by_name(config, field):
    with pytest.raises(ConfigError) as refused:
        art_job_config(config)
    assert refused.value.field == field


def test_an_unknown_key_is_refused_with_the_closest_name():
    with pytest.raises(ConfigError, match="did you mean kl_penalty_coef"):
        art_job_config({"kl_penalty_coeff": 0.1})


def test_advantages_are_arts_and_zero_ones_are_exact():
    groups = art_advantages([[0.0, 0.5, 1.0], [1.0, 1.0]], scale=True)
    assert groups[0][1] == 0.0 and groups[0][0] == pytest.approx(-0.5 / (0.408248 + 1e-6), rel=1e-4)
    assert groups[1] == [0.0, 0.0]
    assert art_advantages([[0.0, 1.0]], scale=False) == [[-0.5, 0.5]]


def test_a_step_saves_the_next_checkpoint_and_resumes_from_it(tiny_model_dir: Path, tmp_path: Path):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    sampler = Sampler(tokenizer)
    prompt = [{"role": "user", "content": "Hi"}]
    raw = [group(trajectory([*prompt, sampler.choice(prompt, "hello")], 1.0),
                 trajectory([*prompt, sampler.choice(prompt, "bye")], 0.0)),
           group(trajectory([*prompt, sampler.choice(prompt, "same")], 0.5),
                 trajectory([*prompt, sampler.choice(prompt, "same")], 0.5))]  # fmt: skip
    started: list[int] = []

    class Hooks:
        def started(self, *, num_sequences: int) -> None:
            started.append(num_sequences)

    def spec(from_step: int, resume_from: Path | None) -> ClientStepSpec:
        return ClientStepSpec(
            base_model_source=str(tiny_model_dir), model_cache_dir=tmp_path / "cache",
            checkpoint_root=tmp_path / "checkpoints", config=art_job_config({"learning_rate": 1e-3})[0],
            lora=LoraSpec(rank=2, alpha=4), groups=parse_groups(raw), from_step=from_step,
            resume_from=resume_from,
        )  # fmt: skip

    first = train_client_step(spec(0, None), Hooks())
    assert first.step == 1 and read_checkpoint_state(first.path)["step"] == 1
    assert first.metrics["num_groups_trainable"] == 1.0 and first.metrics["num_groups_submitted"] == 2.0
    assert first.metrics["trainable_tokens"] > 0 and first.metrics["grad_norm"] > 0
    assert first.events[-1]["num_groups_trainable"] == 1.0 and "reward" in first.events[-1]
    assert [s.advantage for s in first.trajectories][2:] == [0.0, 0.0]
    second = train_client_step(spec(1, first.path), Hooks())
    assert second.step == 2 and read_checkpoint_state(second.path)["step"] == 2
    assert started == [1, 1]


def test_each_trajectory_records_the_checkpoint_that_sampled_it_and_how_far_behind(tiny_model_dir, tmp_path):
    # ART's PipelineTrainer samples on while earlier steps train: the step records the staleness.
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    sampler = Sampler(tokenizer)
    prompt = [{"role": "user", "content": "Hi"}]

    def choice(text: str, sampled_by: str) -> dict:
        return {**sampler.choice(prompt, text), "artweb_model": sampled_by}

    raw = [group(trajectory([*prompt, choice("hello", "math/agent:3")], 1.0),
                 trajectory([*prompt, choice("bye", "math/agent:1")], 0.0)),
           group(trajectory([*prompt, choice("yes", "math/agent:3")], 0.5),
                 trajectory([*prompt, choice("no", "gateway-tiny")], 0.0))]  # fmt: skip
    spec = ClientStepSpec(
        base_model_source=str(tiny_model_dir), model_cache_dir=tmp_path / "cache",
        checkpoint_root=tmp_path / "checkpoints", config=art_job_config({"learning_rate": 1e-3})[0],
        lora=LoraSpec(rank=2, alpha=4), groups=parse_groups(raw), from_step=3, resume_from=None,
    )  # fmt: skip

    class Hooks:
        def started(self, *, num_sequences: int) -> None:
            pass

    result = train_client_step(spec, Hooks())
    assert [s.tokenized.policy_step for s in result.trajectories] == [3, 1, 3, None]
    assert [off_policy_steps(s, 3) for s in result.trajectories] == [0, 2, 0, None]
    # Only trajectories whose checkpoint is named count: (0 + 2 + 0) / 3.
    assert result.metrics["off_policy_steps"] == pytest.approx(2 / 3)
    assert result.metrics["off_policy_steps_max"] == 2.0
    assert (sampled_step("math/agent:12"), sampled_step("gateway-tiny"), sampled_step(None)) == (
        12,
        None,
        None,
    )


def optimizer_steps(checkpoint: Path) -> int:
    import torch

    state = torch.load(checkpoint / "optimizer.pt", weights_only=True)["state"]
    return int(next(iter(state.values()))["step"])


def test_one_optimizer_step_per_packed_sequence_as_art_counts_them(tiny_model_dir: Path, tmp_path: Path):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    sampler = Sampler(tokenizer)
    one, two = [{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Add two and two"}]
    raw = [group(trajectory([*one, sampler.choice(one, "hello there")], 1.0),
                 trajectory([*one, sampler.choice(one, "bye")], 0.0)),
           group(trajectory([*two, sampler.choice(two, "four")], 1.0),
                 trajectory([*two, sampler.choice(two, "five or so")], 0.0))]  # fmt: skip
    groups = parse_groups(raw)
    started: list[int] = []

    class Hooks:
        def started(self, *, num_sequences: int) -> None:
            started.append(num_sequences)

    def run(experimental: dict, root: str):
        config, options = art_job_config({"learning_rate": 1e-3, **experimental})
        return train_client_step(ClientStepSpec(
            base_model_source=str(tiny_model_dir), model_cache_dir=tmp_path / "cache",
            checkpoint_root=tmp_path / root, config=config, options=options, lora=LoraSpec(rank=2, alpha=4),
            groups=groups, from_step=0, resume_from=None), Hooks())  # fmt: skip

    # ART's default length holds all four: one sequence, one optimizer step (0.5.18's behaviour).
    whole = run({}, "whole")
    # Sequences as long as the longest trajectory: each group's prompt with what fits after it.
    longest = max(len(s.prompt_token_ids) + len(s.completion_token_ids)
                  for g in groups for t in g.trajectories for s in _tokenized(tokenizer, t))  # fmt: skip
    packed = run({"packed_sequence_length": longest}, "packed")
    assert started[0] == 1 and whole.metrics["gradient_steps"] == 1 and len(whole.events) == 1
    assert started[1] == packed.metrics["gradient_steps"] == len(packed.events) >= 2
    assert optimizer_steps(whole.path) == 1 and optimizer_steps(packed.path) == started[1]
    context = AutoConfig.from_pretrained(str(tiny_model_dir)).max_position_embeddings
    assert whole.metrics["packed_sequence_length"] == min(2048, context)  # ART's default, at most the context
    assert packed.metrics["packed_sequence_length"] == longest
    assert all(event["loss"] == event["loss"] and "learning_rate" in event for event in packed.events)
    assert sum(event["num_trajectories"] for event in packed.events) == 4  # every trajectory trained once
    assert "reward" in packed.events[-1] and "reward" not in packed.events[0]
    # Too short for a trajectory: ART drops it and says so.
    short = run({"packed_sequence_length": longest - 1}, "short")
    assert short.metrics["num_trajectories_too_long"] >= 1


def _tokenized(tokenizer, item):
    from training.runs.art_tokens import TrajectoryTokenizer

    return TrajectoryTokenizer(tokenizer).tokenize(item).samples


def test_a_kl_penalty_against_an_earlier_step_and_trajectories_without_logprobs(tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    sampler = Sampler(tokenizer)
    prompt = [{"role": "user", "content": "Hi"}]
    bare = sampler.choice(prompt, "bye")
    bare["logprobs"] = None
    raw = [group(trajectory([*prompt, sampler.choice(prompt, "hello")], 1.0), trajectory([*prompt, bare], 0.0),
                 trajectory([*prompt, sampler.choice(prompt, "so so")], 0.5))]  # fmt: skip

    class Hooks:
        def started(self, *, num_sequences: int) -> None:
            pass

    def run(experimental: dict, from_step: int, resume_from: Path | None, reference_dir: Path | None = None):
        config, options = art_job_config({"learning_rate": 1e-2, **experimental})
        groups = parse_groups(raw, allow_without_logprobs=options.allow_training_without_logprobs)
        return train_client_step(ClientStepSpec(
            base_model_source=str(tiny_model_dir), model_cache_dir=tmp_path / "cache",
            checkpoint_root=tmp_path / "checkpoints", config=config, options=options,
            lora=LoraSpec(rank=2, alpha=4), groups=groups, from_step=from_step, resume_from=resume_from,
            reference_dir=reference_dir), Hooks())  # fmt: skip

    first = run({}, 0, None)
    assert first.metrics["num_trajectories_without_logprobs"] == 1 and first.metrics["kl"] == 0.0
    assert first.metrics["num_trajectories"] == 3
    # Against step 1 (its adapter swapped in for the reference's logprobs), the learner's own source.
    second = run({"kl_penalty_coef": 0.5, "kl_penalty_reference_step": 1, "kl_penalty_source": "current_learner",
                  "allow_training_without_logprobs": True}, 1, first.path, reference_dir=first.path)  # fmt: skip
    assert second.metrics["num_trajectories_without_logprobs"] == 0
    # The first sequence is trained from step 1 itself: the learner's KL to it is zero until it moves.
    assert second.events[0]["kl_policy_ref"] == pytest.approx(0.0, abs=1e-6)
    # The live adapter was put back after the reference's logprobs: step 2 trained on from step 1.
    before = load_file(first.path / "adapter_model.safetensors")
    after = load_file(second.path / "adapter_model.safetensors")
    assert any(not (before[name] == after[name]).all() for name in before)
    # Against the base model (step 0, the adapter switched off) the trained adapter is some way off.
    third = run({"kl_penalty_coef": 0.5, "kl_penalty_source": "current_learner"}, 2, second.path)
    assert third.events[0]["kl_policy_ref"] != pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ConfigError, match="no checkpoint at step 1"):
        run({"kl_penalty_coef": 0.5, "kl_penalty_reference_step": 1}, 2, second.path)
    assert math.isfinite(third.metrics["loss"])
