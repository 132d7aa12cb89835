"""One client step (training.client_step): ART's experimental_config mapped onto TrainConfig (or
refused by name), ART's advantages, and a step on the tiny model that saves checkpoint N+1 from N."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.training.test_client_groups import Sampler, group, trajectory
from training.client_groups import parse_groups
from training.client_step import ClientStepSpec, art_advantages, art_train_config, train_client_step
from training.config import ConfigError, LoraSpec
from training.trainer import read_checkpoint_state


def test_arts_defaults_map_to_cispo_with_arts_clip_range():
    config = art_train_config({"learning_rate": 5e-6, "ppo": False, "scale_rewards": True,
                               "importance_sampling_level": "token", "advantage_balance": 0.0,
                               "mask_prob_ratio": False, "precalculate_logprobs": False, "epsilon": None,
                               "epsilon_high": None, "kimi_k2_tau": None,
                               "max_negative_advantage_importance_sampling_weight": None})  # fmt: skip
    assert (config.loss_type, config.epsilon, config.epsilon_high) == ("cispo", 1.0, 4.0)
    assert config.learning_rate == 5e-6 and config.scale_rewards and config.importance_level == "token"


def test_ppo_and_explicit_values_are_honoured():
    config = art_train_config({"ppo": True, "epsilon": 0.1, "epsilon_high": 0.3, "scale_rewards": False,
                               "importance_sampling_level": "sequence"})  # fmt: skip
    assert (config.loss_type, config.epsilon, config.epsilon_high) == ("ppo", 0.1, 0.3)
    assert not config.scale_rewards and config.importance_level == "sequence"
    assert art_train_config(None).loss_type == "cispo"


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"advantage_balance": 0.5}, "advantage_balance"),
        ({"mask_prob_ratio": True}, "mask_prob_ratio"),
        ({"kimi_k2_tau": 0.1}, "kimi_k2_tau"),
        ({"precalculate_logprobs": True}, "precalculate_logprobs"),
        (
            {"max_negative_advantage_importance_sampling_weight": 2.0},
            "max_negative_advantage_importance_sampling_weight",
        ),
        ({"importance_sampling_level": "geometric_average"}, "importance_sampling_level"),
        ({"learning_rate": -1.0}, "learning_rate"),
        ({"ppo": "yes"}, "ppo"),
        ({"warmup": 3}, "warmup"),
    ],
)
def test_what_artweb_cannot_honour_is_refused_by_name(config, field):
    with pytest.raises(ConfigError) as refused:
        art_train_config(config)
    assert refused.value.field == field


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
            checkpoint_root=tmp_path / "checkpoints", config=art_train_config({"learning_rate": 1e-3}),
            lora=LoraSpec(rank=2, alpha=4), groups=parse_groups(raw), from_step=from_step,
            resume_from=resume_from,
        )  # fmt: skip

    first = train_client_step(spec(0, None), Hooks())
    assert first.step == 1 and read_checkpoint_state(first.path)["step"] == 1
    assert first.metrics["num_groups_trainable"] == 1.0 and first.metrics["num_groups_submitted"] == 2.0
    assert first.metrics["trainable_tokens"] > 0 and first.metrics["grad_norm"] > 0
    assert first.art_metrics["num_groups_trainable"] == 1.0 and "reward" in first.art_metrics
    assert [s.advantage for s in first.trajectories][2:] == [0.0, 0.0]
    second = train_client_step(spec(1, first.path), Hooks())
    assert second.step == 2 and read_checkpoint_state(second.path)["step"] == 2
    assert started == [1, 1]
