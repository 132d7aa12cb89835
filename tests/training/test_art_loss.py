"""ART's objective (training.recipes.art_loss) on hand-computed values: the job's token weights and shaped
advantages, then one sequence's loss for each setting ART's experimental_config can change, and
ART's packing rule (training.session.packing.plan_sequences) on hand-counted sequences."""

from __future__ import annotations

import math

import pytest
import torch

from training.recipes.art import learning_rate_of
from training.recipes.art_config import ArtOptions
from training.recipes.art_loss import ArtLoss, art_policy_loss, art_shaped_advantages, art_token_weights
from training.rollouts.trajectory import TrainSample
from training.session.packing import plan_sequences

HALF, QUARTER = math.log(0.5), math.log(0.25)
CISPO = ArtLoss()
PPO = ArtLoss(ppo=True, epsilon=0.2, epsilon_high=0.2)


def loss_of(config: ArtLoss, new=(HALF, QUARTER), old=(HALF, HALF), advantage=1.0, weight=1.0, **extra):
    """One trajectory of two trained tokens; the loss, its metrics and d loss / d new."""
    new_t = torch.tensor([list(new)], requires_grad=True)
    loss, metrics = art_policy_loss(
        new_t, torch.tensor([list(old)]), torch.tensor([advantage]), torch.tensor([weight]),
        torch.ones(1, 2), config, **{k: torch.tensor([list(v)]) for k, v in extra.items()},
    )  # fmt: skip
    loss.backward()
    return float(loss.detach()), metrics, new_t.grad[0].tolist()


def test_weights_make_every_trajectory_count_the_same_and_average_one_per_token():
    # raw 1/2 and 1/4; their mean over the 6 tokens is (2 * 1/2 + 4 * 1/4) / 6 = 1/3.
    assert art_token_weights([2, 4]) == pytest.approx([1.5, 0.75])


def test_advantages_are_balanced_then_divided_by_their_mean_magnitude():
    weights = [1.5, 0.75]
    # mean |A| w over tokens: (1 * 1.5 * 2 + 1 * 0.75 * 4) / 6 = 1: unchanged.
    assert art_shaped_advantages([1.0, -1.0], [2, 4], weights) == pytest.approx([1.0, -1.0])
    # balance 0.5 halves the negative one: [1, -0.5]; mean (3 + 1.5) / 6 = 0.75.
    assert art_shaped_advantages([1.0, -1.0], [2, 4], weights, balance=0.5) == pytest.approx([4 / 3, -2 / 3])
    assert art_shaped_advantages([2.0, -1.0], [2, 4], weights, balance=-1.0) == pytest.approx(
        [0.0, -1.0 / 0.5]
    )


def test_cispo_weighs_every_tokens_logprob_by_its_clipped_detached_ratio():
    # ratios [1, 0.5] inside [0, 5]: loss = -(1 * ln .5 + 0.5 * ln .25) / 2 = ln 2; grad -r * A / 2.
    loss, metrics, grad = loss_of(CISPO)
    assert loss == pytest.approx(math.log(2), abs=1e-6) and grad == pytest.approx([-0.5, -0.25])
    assert metrics["clip_fraction"] == 0.0 and metrics["ratio_mean"] == pytest.approx(0.75)
    assert loss_of(CISPO, weight=2.0)[0] == pytest.approx(2 * math.log(2), abs=1e-6)


def test_ppo_takes_the_pessimistic_clipped_surrogate():
    # A = 1: min(r, clip r) = [1, 0.5] -> -0.75. A = -1: max(r, clip r) = [1, 0.8] -> 0.9, one token clipped.
    assert loss_of(PPO)[0] == pytest.approx(-0.75)
    loss, metrics, grad = loss_of(PPO, advantage=-1.0)
    assert (
        loss == pytest.approx(0.9) and metrics["clip_fraction"] == 0.5 and grad == pytest.approx([0.5, 0.0])
    )


def test_a_missing_old_logprob_counts_as_sampled_by_the_learner():
    assert loss_of(CISPO, old=(math.nan, HALF))[0] == pytest.approx(loss_of(CISPO, old=(HALF, HALF))[0])
    loss, metrics, _ = loss_of(CISPO, new=(HALF, HALF), old=(math.nan, math.nan))
    assert metrics["ratio_mean"] == 1.0 and loss == pytest.approx(math.log(2), abs=1e-6)


def test_sequence_level_ratios_are_the_geometric_mean_of_the_tokens():
    # log ratios [0, -ln 2]: mean -ln 2 / 2, ratio 2**-0.5 for both tokens.
    loss, _, _ = loss_of(ArtLoss(importance_sampling_level="sequence"))
    assert loss == pytest.approx(-(2**-0.5) * (HALF + QUARTER) / 2)
    average, _, _ = loss_of(ArtLoss(importance_sampling_level="average"))
    assert average == pytest.approx(-((1 + 2**-0.5) / 2 * HALF + (0.5 + 2**-0.5) / 2 * QUARTER) / 2)
    geometric, _, _ = loss_of(ArtLoss(importance_sampling_level="geometric_average"))
    assert geometric == pytest.approx(-(2**-0.25 * HALF + (0.5 * 2**-0.5) ** 0.5 * QUARTER) / 2)


def test_mask_cap_and_kimi_tau_change_the_ratio_and_the_advantage_as_art_does():
    # mask_prob_ratio: 0.5 lies outside (0.8, 1.2): its ratio is 0 -> -(1 + 0) / 2.
    assert loss_of(ArtLoss(ppo=True, epsilon=0.2, epsilon_high=0.2, mask_prob_ratio=True))[
        0
    ] == pytest.approx(-0.5)
    capped = ArtLoss(
        ppo=True, epsilon=0.2, epsilon_high=0.2, max_negative_advantage_importance_sampling_weight=0.4
    )
    assert loss_of(capped)[0] == pytest.approx(-0.4)  # ratios capped at 0.4: min(0.4, 0.8)
    # tau 0.1: A = 1 - 0.1 * [0, -ln 2] -> the second token's advantage is 1 + 0.1 ln 2.
    tau = loss_of(ArtLoss(kimi_k2_tau=0.1))[0]
    assert tau == pytest.approx(-(HALF + 0.5 * (1 + 0.1 * math.log(2)) * QUARTER) / 2)


def test_the_kl_penalty_moves_each_tokens_advantage_by_its_distance_from_the_mean_kl():
    # kl (sampler - ref) = [ln 2, 0], mean ln 2 / 2; A = 1 + 0.5 * (mean - kl) = [1 - ln2/4, 1 + ln2/4].
    config = ArtLoss(kl_penalty_coef=0.5, kl_penalty_source="sample")
    _, metrics, grad = loss_of(config, ref_logprobs=(QUARTER, HALF))
    shift = math.log(2) / 4
    assert metrics["kl_policy_ref"] == pytest.approx(math.log(2) / 2)
    assert grad == pytest.approx([-(1 - shift) / 2, -0.5 * (1 + shift) / 2])
    # current_learner: the learner's logprobs [ln .5, ln .25] against ref [ln .25, ln .5]: kl [ln 2, -ln 2].
    _, metrics, grad = loss_of(ArtLoss(kl_penalty_coef=0.5, kl_penalty_source="current_learner"),
                               ref_logprobs=(QUARTER, HALF))  # fmt: skip
    assert metrics["kl_policy_ref"] == pytest.approx(0.0, abs=1e-7)
    assert grad == pytest.approx([-(1 - 0.5 * math.log(2)) / 2, -0.5 * (1 + 0.5 * math.log(2)) / 2])
    with pytest.raises(ValueError, match="reference"):
        loss_of(config)


def test_truncated_importance_sampling_weighs_by_trainer_over_sampler_capped():
    # old (trainer) [ln .5, ln .5] vs original (sampler) [ln .25, ln .5]: weights min([2, 1], 1.5) = [1.5, 1].
    loss, _, _ = loss_of(ArtLoss(truncated_importance_sampling=1.5), original_logprobs=(QUARTER, HALF))
    assert loss == pytest.approx((1.5 * math.log(2) + 0.5 * 2 * math.log(2)) / 2)
    assert loss_of(ArtLoss(truncated_importance_sampling=1.5))[0] == pytest.approx(math.log(2), abs=1e-6)


def test_a_sequences_learning_rate_follows_arts_trajectory_multiplier_and_the_reward_std():
    options = ArtOptions(num_trajectories_learning_rate_multiplier_power=0.5)
    assert learning_rate_of(1e-4, options, trajectories=4, reward_std=0.3) == pytest.approx(2e-4)
    assert learning_rate_of(1e-4, ArtOptions(), trajectories=4, reward_std=0.3) == 1e-4
    scaled = ArtOptions(scale_learning_rate_by_reward_std_dev=True)
    assert learning_rate_of(1e-4, scaled, trajectories=4, reward_std=0.3) == pytest.approx(3e-5)


def sample(prompt: list[int], completion: int) -> TrainSample:
    return TrainSample(prompt_token_ids=prompt, completion_token_ids=list(range(10, 10 + completion)),
                       completion_logprobs=[-1.0] * completion, reward=0.0)  # fmt: skip


def test_arts_packing_rule_counts_the_optimizer_steps():
    a, b = [1, 2, 3], [4, 5, 6, 7, 8]
    samples = [sample(a, 2), sample(a, 2), sample(a, 2), sample(b, 4)]

    def rows(seq_len: int, **kwargs) -> list[list[int]]:
        return sorted(sorted(row) for row in plan_sequences(samples, seq_len, **kwargs))

    # Sharing every common stretch: A's prompt but its last token ([1, 2]) is laid out once per
    # sequence, each A sample then costs 1 + 2; B (9) goes first, alone.
    assert rows(11, min_shared=1) == [[0, 1, 2], [3]]  # 2 + 3 + 3 + 3
    assert rows(10, min_shared=1) == [[0, 1], [2], [3]]
    # ART shares only stretches of 64 tokens or more: each A sample costs its 5 tokens.
    assert rows(11) == [[0, 1], [2], [3]]
    # Best fit: a sample of A with a 1-token completion (delta 2) goes where it leaves the least room.
    samples.append(sample(a, 1))
    assert rows(10, min_shared=1) == [[0, 1, 4], [2], [3]]
    assert len(plan_sequences(samples, 100)) == 1
    with pytest.raises(ValueError, match="over 8"):
        plan_sequences(samples, 8)
