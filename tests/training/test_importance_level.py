"""Sequence-level importance ratios (GSPO) on hand-computed values."""

import math

import pytest
import torch

from training.config import ConfigError, TrainConfig
from training.recipes.grpo import policy_loss


def test_sequence_ratio_is_the_geometric_mean_over_the_sequence():
    # Token log-ratios 0.1 and -0.3 -> sequence log-ratio -0.1 -> s = exp(-0.1) = 0.904837 for both
    # tokens; third token is padding (mask 0) and must not count.
    old = torch.tensor([[0.0, 0.0, 0.0]])
    new = torch.tensor([[0.1, -0.3, 5.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    advantages = torch.tensor([1.0])
    loss, metrics = policy_loss(
        new, old, advantages, mask, loss_type="ppo", epsilon=0.2, epsilon_high=None,
        normalization="sequence", importance_level="sequence",
    )  # fmt: skip
    s = math.exp(-0.1)
    # ppo with A=1 and s inside the clip range: loss = -mean over the 2 tokens of s * A = -s.
    assert loss.item() == pytest.approx(-s, abs=1e-6)
    assert metrics["ratio_mean"] == pytest.approx(s, abs=1e-6)
    loss.backward()
    # d/d logprob_t of -(1/2) * sum_t sg(s) * exp(l_t - sg(l_t)) = -s / 2 for each unmasked token.
    assert new.grad.tolist()[0][:2] == pytest.approx([-s / 2, -s / 2], abs=1e-6)
    assert new.grad.tolist()[0][2] == 0.0


def test_sequence_ratio_clips_whole_sequences():
    old = torch.zeros(1, 2)
    new = torch.tensor([[0.5, 0.5]], requires_grad=True)  # s = e^0.5 = 1.6487 > 1.2
    loss, metrics = policy_loss(
        new, old, torch.tensor([1.0]), torch.ones(1, 2), loss_type="ppo", epsilon=0.2, epsilon_high=None,
        normalization="token", importance_level="sequence",
    )  # fmt: skip
    assert loss.item() == pytest.approx(-1.2, abs=1e-6)  # min(s*A, 1.2*A) = 1.2
    assert metrics["clip_fraction"] == 1.0
    loss.backward()
    assert new.grad.abs().sum().item() == 0.0  # clipped: no gradient, as in PPO


def test_token_level_differs_from_sequence_level():
    old = torch.zeros(1, 2)
    new = torch.tensor([[0.1, -0.3]])
    kwargs = dict(loss_type="ppo", epsilon=0.2, epsilon_high=None, normalization="sequence")
    token, _ = policy_loss(
        new, old, torch.tensor([1.0]), torch.ones(1, 2), importance_level="token", **kwargs
    )
    sequence, _ = policy_loss(
        new, old, torch.tensor([1.0]), torch.ones(1, 2), importance_level="sequence", **kwargs
    )
    # token: -(e^0.1 + max(e^-0.3, 0.8)... ) / 2 with clipping at 0.8 for the second token under min()
    expected_token = -(min(math.exp(0.1), 1.2) + min(math.exp(-0.3), 0.8)) / 2
    assert token.item() == pytest.approx(expected_token, abs=1e-6)
    assert sequence.item() == pytest.approx(-math.exp(-0.1), abs=1e-6)


def test_unknown_importance_level_is_a_config_error():
    with pytest.raises(ConfigError) as caught:
        TrainConfig.from_dict({"importance_level": "batch"})
    assert caught.value.field == "importance_level"


def test_trainer_uses_the_configured_importance_level(monkeypatch):
    """The trainer passes importance_level through to the loss (checked by intercepting it: the
    session's ``grpo`` loss, training.session.losses, computes the objective with token_objective)."""
    import training.session.losses as losses_module

    seen = []
    original = losses_module.token_objective

    def spy(*args, **kwargs):
        seen.append(kwargs.get("importance_level"))
        return original(*args, **kwargs)

    monkeypatch.setattr(losses_module, "token_objective", spy)
    import tempfile
    from pathlib import Path

    from training.base_models import build_tiny_model, load_base_model
    from training.config import LoraSpec
    from training.recipes.grpo_update import grpo_train_step
    from training.rollouts.trajectory import TrainGroup, TrainSample
    from training.session.policy import Policy

    with tempfile.TemporaryDirectory() as tmp:
        directory = build_tiny_model(Path(tmp) / "tiny")
        model, tokenizer = load_base_model(str(directory), Path(tmp))
        trainer = Policy(
            model, tokenizer, TrainConfig(importance_level="sequence", learning_rate=1e-3), LoraSpec()
        )
        group = TrainGroup(
            samples=[
                TrainSample(
                    prompt_token_ids=[5, 6],
                    completion_token_ids=[7, 8],
                    completion_logprobs=[-1.0, -1.0],
                    reward=1.0,
                ),
                TrainSample(
                    prompt_token_ids=[5, 6],
                    completion_token_ids=[9, 10],
                    completion_logprobs=[-1.0, -1.0],
                    reward=0.0,
                ),
            ]
        )
        grpo_train_step(trainer, [group])
    assert seen and set(seen) == {"sequence"}
