"""GRPO math on hand-computed values."""

import math

import pytest
import torch

from training.recipes.grpo import (
    compute_advantages,
    entropy_from_logits,
    group_advantages,
    normalize,
    policy_loss,
)


def test_advantages_are_mean_centred_without_scaling():
    advantages = group_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0]), scale=False)
    assert advantages.tolist() == pytest.approx([-2.0, -1.0, 0.0, 3.0])


def test_advantages_are_divided_by_population_std():
    # mean 3, centred [-2, -1, 0, 3], population variance (4 + 1 + 0 + 9) / 4 = 3.5
    advantages = group_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0]), scale=True, eps=0.0)
    std = math.sqrt(3.5)
    assert advantages.tolist() == pytest.approx([-2 / std, -1 / std, 0.0, 3 / std])
    # A two-sample group [0, 1] has std 0.5: advantages are exactly -1, +1 (up to eps).
    assert group_advantages(torch.tensor([0.0, 1.0]), scale=True).tolist() == pytest.approx([-1, 1], abs=1e-5)


def test_zero_variance_groups_are_counted_and_get_zero_advantages():
    advantages, zero_variance = compute_advantages([[1.0, 1.0, 1.0], [0.0, 1.0], [0.5, 0.5]], scale=True)
    assert zero_variance == 2
    assert advantages[0] == [0.0, 0.0, 0.0]
    assert advantages[1] == pytest.approx([-1.0, 1.0], abs=1e-5)
    assert advantages[2] == [0.0, 0.0]
    _, none = compute_advantages([[0.0, 0.2], [1.0, 0.0]], scale=False)
    assert none == 0


def _two_tokens(new_probs, old_probs, advantage):
    logprobs = torch.tensor([[math.log(p) for p in new_probs]], requires_grad=True)
    old = torch.tensor([[math.log(p) for p in old_probs]])
    return logprobs, old, torch.tensor([advantage]), torch.ones(1, 2)


def test_ppo_clips_the_ratio_on_the_side_that_matters():
    # ratios [1.5, 0.5], epsilon 0.2 -> clip range [0.8, 1.2]
    logprobs, old, advantages, mask = _two_tokens([0.6, 0.2], [0.4, 0.4], advantage=1.0)
    loss, metrics = policy_loss(
        logprobs,
        old,
        advantages,
        mask,
        loss_type="ppo",
        epsilon=0.2,
        epsilon_high=None,
        normalization="sequence",
    )
    # A > 0: min(1.5, 1.2) = 1.2 and min(0.5, 0.8) = 0.5; loss = -(1.2 + 0.5) / 2
    assert loss.item() == pytest.approx(-0.85)
    loss.backward()
    # The clipped token gets no gradient; the other one -r * A / T = -0.5 / 2.
    assert logprobs.grad.flatten().tolist() == pytest.approx([0.0, -0.25])
    assert metrics["clip_fraction"] == pytest.approx(1.0)
    assert metrics["ratio_mean"] == pytest.approx(1.0)

    logprobs, old, advantages, mask = _two_tokens([0.6, 0.2], [0.4, 0.4], advantage=-1.0)
    loss, _ = policy_loss(
        logprobs,
        old,
        advantages,
        mask,
        loss_type="ppo",
        epsilon=0.2,
        epsilon_high=None,
        normalization="sequence",
    )
    # A < 0: min(-1.5, -1.2) = -1.5 and min(-0.5, -0.8) = -0.8; loss = (1.5 + 0.8) / 2
    assert loss.item() == pytest.approx(1.15)
    loss.backward()
    assert logprobs.grad.flatten().tolist() == pytest.approx([0.75, 0.0])


def test_epsilon_high_widens_only_the_upper_clip():
    logprobs, old, advantages, mask = _two_tokens([0.6, 0.2], [0.4, 0.4], advantage=1.0)
    loss, metrics = policy_loss(
        logprobs,
        old,
        advantages,
        mask,
        loss_type="ppo",
        epsilon=0.2,
        epsilon_high=0.6,
        normalization="sequence",
    )
    # 1.5 is inside [0.8, 1.6] now: loss = -(1.5 + 0.5) / 2
    assert loss.item() == pytest.approx(-1.0)
    assert metrics["clip_fraction"] == pytest.approx(0.5)


def test_cispo_keeps_a_gradient_on_clipped_tokens():
    logprobs, old, advantages, mask = _two_tokens([0.6, 0.2], [0.4, 0.4], advantage=1.0)
    loss, _ = policy_loss(
        logprobs,
        old,
        advantages,
        mask,
        loss_type="cispo",
        epsilon=0.2,
        epsilon_high=None,
        normalization="sequence",
    )
    # -sg(clip(r)) * A * logp, clip(r) = [1.2, 0.8]
    expected = -(1.2 * math.log(0.6) + 0.8 * math.log(0.2)) / 2
    assert loss.item() == pytest.approx(expected)
    loss.backward()
    assert logprobs.grad.flatten().tolist() == pytest.approx([-0.6, -0.4])


def test_on_policy_ppo_gradient_is_minus_advantage():
    # ratio 1 everywhere: d loss / d logp = -A / T per token (token normalisation, 3 tokens)
    logprobs = torch.log(torch.tensor([[0.5, 0.5], [0.25, 0.25]])).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, metrics = policy_loss(
        logprobs,
        logprobs.detach(),
        torch.tensor([2.0, -1.0]),
        mask,
        loss_type="ppo",
        epsilon=0.2,
        epsilon_high=None,
        normalization="token",
    )
    assert loss.item() == pytest.approx(-(2 + 2 - 1) / 3)
    loss.backward()
    assert logprobs.grad.flatten().tolist() == pytest.approx([-2 / 3, -2 / 3, 1 / 3, 0.0])
    assert metrics["clip_fraction"] == 0.0


def test_the_three_normalisations():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert normalize(per_token, mask, "token").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert normalize(per_token, mask, "sequence").item() == pytest.approx((2 + 4) / 2)
    assert normalize(per_token, mask, "constant", max_tokens_constant=5).item() == pytest.approx(10 / (2 * 5))
    with pytest.raises(ValueError):
        normalize(per_token, mask, "constant")


@pytest.mark.parametrize("normalization", ["token", "sequence", "constant"])
def test_the_grpo_datums_weights_make_the_summed_loss_the_normalised_one(normalization):
    from training.config import TrainConfig
    from training.recipes.minibatches import grpo_data
    from training.rollouts.trajectory import TrainSample

    generator = torch.Generator().manual_seed(0)
    per_token = torch.rand(5, 4, generator=generator)
    mask = [[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 1, 0]]
    samples = [(TrainSample(prompt_token_ids=[1, 2], completion_token_ids=[3, 4, 5, 6], completion_logprobs=[0.0] * 4,
                            reward=0.0, completion_mask=row), 1.0) for row in mask]  # fmt: skip
    data = grpo_data(samples, TrainConfig(normalization=normalization, max_new_tokens=4))
    weights = torch.tensor([datum.loss_fn_inputs["weights"][1:] for datum in data])  # the completion's 4
    full = normalize(per_token, torch.tensor(mask, dtype=torch.float32), normalization, max_tokens_constant=4)
    assert (per_token * weights).sum().item() == pytest.approx(full.item())


def test_kl_penalty_uses_the_k3_estimator():
    logprobs = torch.log(torch.tensor([[0.5, 0.5]])).requires_grad_(True)
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    loss, metrics = policy_loss(
        logprobs,
        logprobs.detach(),
        torch.tensor([0.0]),  # no advantage: the loss is the KL term alone
        torch.ones(1, 2),
        loss_type="ppo",
        epsilon=0.2,
        epsilon_high=None,
        normalization="token",
        ref_logprobs=ref,
        kl_coef=0.5,
    )
    # d = ref - logp = log 0.5: k3 = 0.5 - log 0.5 - 1 = 0.19315; the second token matches: 0
    k3 = 0.5 - math.log(0.5) - 1
    assert metrics["kl"] == pytest.approx(k3 / 2)
    assert loss.item() == pytest.approx(0.5 * k3 / 2)
    loss.backward()
    # d k3 / d logp = 1 - exp(d) = 0.5, times kl_coef / tokens
    assert logprobs.grad.flatten().tolist() == pytest.approx([0.5 * 0.5 / 2, 0.0])


def test_entropy_from_logits():
    uniform = torch.zeros(3, 4)
    assert entropy_from_logits(uniform).tolist() == pytest.approx([math.log(4)] * 3)
    logits = torch.tensor([2.0, 0.0, -1.0])
    p = torch.softmax(logits, dim=-1)
    assert entropy_from_logits(logits).item() == pytest.approx(-(p * p.log()).sum().item())
    assert entropy_from_logits(torch.tensor([100.0, 0.0])).item() == pytest.approx(0.0, abs=1e-6)


def test_unknown_loss_type_is_rejected():
    logprobs, old, advantages, mask = _two_tokens([0.5, 0.5], [0.5, 0.5], advantage=1.0)
    with pytest.raises(ValueError):
        policy_loss(
            logprobs,
            old,
            advantages,
            mask,
            loss_type="grpo",
            epsilon=0.2,
            epsilon_high=None,
            normalization="token",
        )
