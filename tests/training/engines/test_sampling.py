"""The exact sampler (training.engines.sampling): its draws follow the tempered, top-p truncated
distribution (chi-square against the expected counts; wrong samplers fail the same check), and
its logprobs are those of the full tempered distribution."""

import pytest
import torch

from training.engines.sampling import sample_tokens, uniform_draws

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
DRAWS = 40_000
# Chi-square critical value for 5 degrees of freedom at p = 0.001.
CRITICAL_DF5 = 20.515


def chi_square(tokens: torch.Tensor, expected_probs: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=len(expected_probs)).double()
    expected = expected_probs.double() * len(tokens)
    support = expected > 0
    assert observed[~support].sum() == 0, "drew a token of probability 0"
    return float(((observed[support] - expected[support]) ** 2 / expected[support]).sum())


def draw(temperature: float, top_p: float = 1.0, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = LOGITS.expand(DRAWS, -1)
    uniforms = uniform_draws(DRAWS, generator, torch.device("cpu"))
    return sample_tokens(logits, [temperature] * DRAWS, [top_p] * DRAWS, uniforms).tokens


def test_draws_follow_the_tempered_distribution_and_wrong_samplers_fail_the_same_test():
    expected = torch.softmax(LOGITS / 0.7, dim=-1)
    assert chi_square(draw(0.7), expected) < CRITICAL_DF5
    # The check has power: a sampler that ignores the temperature, or one that takes the argmax,
    # fails it by far.
    assert chi_square(draw(1.0), expected) > 10 * CRITICAL_DF5
    argmax = LOGITS.argmax().expand(DRAWS)
    assert chi_square(argmax, expected) > 10 * CRITICAL_DF5
    # Same distribution as torch.multinomial (the sampler it replaces), by the same test.
    multinomial = torch.multinomial(
        expected.expand(DRAWS, -1), 1, generator=torch.Generator().manual_seed(1)
    ).squeeze(-1)
    assert chi_square(multinomial, expected) < CRITICAL_DF5


def test_top_p_draws_follow_the_renormalised_nucleus():
    probs = torch.softmax(LOGITS, dim=-1)  # [0.57, 0.21, 0.13, 0.08, 0.03, 0.004]
    # top_p = 0.85: the mass before token 3 is 0.91 >= 0.85, so the nucleus is tokens 0-2.
    nucleus = torch.where(torch.arange(6) < 3, probs, 0.0)
    tokens = draw(1.0, top_p=0.85)
    assert chi_square(tokens, nucleus / nucleus.sum()) < 13.816  # df = 2, p = 0.001
    # Untruncated draws hit tokens 3-5, which the nucleus excludes: the same check rejects them.
    with pytest.raises(AssertionError, match="probability 0"):
        chi_square(draw(1.0), nucleus / nucleus.sum())


def test_logprobs_are_of_the_full_tempered_distribution_per_row():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=generator) * 3
    temperatures, top_ps = [1.0, 0.5, 0.0, 0.8], [1.0, 1.0, 1.0, 0.3]
    sampled = sample_tokens(logits, temperatures, top_ps, uniform_draws(4, generator, torch.device("cpu")))
    for row, (temperature, tokens) in enumerate(zip(temperatures, sampled.tokens.tolist(), strict=True)):
        expected = torch.log_softmax(logits[row] / (temperature or 1.0), dim=-1)
        assert sampled.logprobs[row].item() == pytest.approx(expected[tokens].item(), abs=1e-5)
        values, ids = sampled.top_logprobs(3)
        assert torch.allclose(values[row], expected.topk(3).values, atol=1e-5)
        assert ids[row].tolist() == expected.topk(3).indices.tolist()
    assert sampled.tokens[2].item() == logits[2].argmax().item()  # greedy row


def test_masked_tokens_are_never_drawn_even_at_the_ends_of_the_unit_interval():
    logits = torch.full((4, 10), float("-inf"))
    logits[:, 3] = 0.0
    logits[:, 6] = 1.0
    uniforms = torch.tensor([1.0, 1e-300, 0.5, 1.0], dtype=torch.float64)
    sampled = sample_tokens(logits, [1.0, 1.0, 0.9, 0.9], [1.0, 1.0, 1.0, 0.5], uniforms)
    assert sampled.tokens.tolist()[:2] == [6, 3]
    assert set(sampled.tokens.tolist()) <= {3, 6}


def test_a_wide_nucleus_is_found_beyond_the_first_sorted_tokens():
    # 1000 near-equal tokens: top_p = 0.9 keeps ~900 of them, far more than the first 64 sorted.
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1000, generator=generator) * 0.01
    probs = torch.softmax(logits, dim=-1)
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]
    kept = set(order[mass_before < 0.9].tolist())
    count = 20_000
    tokens = sample_tokens(
        logits.expand(count, -1),
        [1.0] * count,
        [0.9] * count,
        uniform_draws(count, generator, torch.device("cpu")),
    ).tokens
    drawn = set(tokens.tolist())
    assert drawn <= kept
    assert len(drawn) > 0.95 * len(kept) > 64
