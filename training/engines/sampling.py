"""Exact sampling of one token per row from a batch of logits, with each row's own temperature,
top-p and uniform random number.

Inverse-CDF sampling: a row draws one uniform `u` in (0, 1] and takes the first token whose
cumulative weight reaches `u × total`, so token i is drawn with probability weight_i / total —
the same distribution as `torch.multinomial`, which on CPU draws one exponential per vocabulary
entry (the exponential race) and cost ~6× more per step at 49k tokens. The cumulative sum is taken
in float64 so rounding cannot shift mass between neighbours. Top-p (nucleus) rows sort only the
most likely tokens (`topk`, widened until the nucleus fits) instead of the whole vocabulary.

Top-k and min-p (vLLM's sampling extensions) truncate a row first: only its k most likely tokens
(ties at the k-th weight kept), and only tokens at least min_p times as likely as the most likely
one; top-p then applies to what is left, renormalised, as in vLLM.

The reported logprob of a token follows `engines/base.py`: `log_softmax(logits / temperature)`
at that token, before any top-k, min-p or top-p truncation (greedy rows: the untempered
distribution).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

NUCLEUS_FIRST_WIDTH = 64  # tokens sorted first for a top-p row; widened ×4 until the nucleus fits


@dataclass
class Sampled:
    """The tokens drawn for a batch and the distribution they were drawn from."""

    tokens: torch.Tensor  # [B] long
    logprobs: torch.Tensor  # [B] float32, see the module doc
    scaled: torch.Tensor  # [B, V] the tempered logits (greedy rows: untempered)
    log_normaliser: torch.Tensor  # [B, 1]: scaled - log_normaliser is the log-distribution

    def top_logprobs(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs [B, k], token ids [B, k]) of each row's k most likely tokens, best first."""
        values, ids = self.scaled.topk(k, dim=-1)
        return values - self.log_normaliser, ids


def sample_tokens(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    uniforms: torch.Tensor,
    top_ks: Sequence[int] | None = None,
    min_ps: Sequence[float] | None = None,
) -> Sampled:
    """Draw one token per row of `logits` [B, V].

    `temperatures[row] == 0` is greedy; `top_ps[row] < 1` keeps the smallest set of most likely
    tokens whose mass reaches it (the most likely token always). `top_ks[row] > 0` and
    `min_ps[row] > 0` truncate first (module doc). `uniforms` [B] (float64, in (0, 1]) is each
    row's random number; greedy rows ignore theirs.
    """
    logits = logits.float()
    batch, width = logits.shape
    scale = [temperature if temperature > 0 else 1.0 for temperature in temperatures]
    if all(value == 1.0 for value in scale):
        scaled = logits
    else:
        scaled = logits / torch.tensor(scale, dtype=logits.dtype, device=logits.device)[:, None]
    shift = scaled.amax(dim=-1, keepdim=True)
    weights = (scaled - shift).exp_()
    total = weights.sum(dim=-1, keepdim=True)
    log_normaliser = shift + total.log()
    truncated = [
        row
        for row in range(batch)
        if temperatures[row] > 0
        and ((top_ks is not None and 0 < top_ks[row] < width) or (min_ps is not None and min_ps[row] > 0))
    ]
    if truncated:
        weights = weights.clone()  # `scaled` and the logprobs keep the whole distribution
        for row in truncated:
            _truncate(weights[row], top_ks[row] if top_ks is not None else 0, min_ps[row] if min_ps else 0.0)
        total = weights.sum(dim=-1, keepdim=True)

    greedy = [row for row in range(batch) if temperatures[row] == 0]
    plain = [row for row in range(batch) if temperatures[row] > 0 and top_ps[row] >= 1.0]
    nucleus = [row for row in range(batch) if temperatures[row] > 0 and top_ps[row] < 1.0]
    if len(greedy) == batch:
        tokens = scaled.argmax(dim=-1)
    else:
        tokens = torch.empty(batch, dtype=torch.long, device=logits.device)
        if greedy:
            index = _index(greedy, logits.device)
            tokens[index] = scaled[index].argmax(dim=-1)
        if plain:
            index = _index(plain, logits.device)
            chosen = weights if len(plain) == batch else weights[index]
            tokens[index] = _inverse_cdf(chosen, uniforms[index])
        if nucleus:
            index = _index(nucleus, logits.device)
            limits = torch.tensor([top_ps[row] for row in nucleus], dtype=torch.float64, device=logits.device)
            tokens[index] = _nucleus(weights[index], total[index], limits, uniforms[index])
    logprobs = (scaled.gather(-1, tokens[:, None]) - log_normaliser).squeeze(-1)
    return Sampled(tokens, logprobs, scaled, log_normaliser)


def _truncate(weights: torch.Tensor, top_k: int, min_p: float) -> None:
    """Zero, in place, the weights [V] of one row outside its top-k and its min-p set (the most
    likely token has weight 1 after the shift by the row's maximum, so min-p compares with 1)."""
    if 0 < top_k < weights.shape[-1]:
        kth = weights.topk(top_k).values[-1]
        weights[weights < kth] = 0.0
    if min_p > 0:
        weights[weights < min_p] = 0.0


def uniform_draws(count: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """`count` uniforms in (0, 1] (float64) from `generator` (None: torch's global RNG)."""
    return 1.0 - torch.rand(count, dtype=torch.float64, generator=generator, device=device)


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the first position whose cumulative weight reaches u × total.

    With t = u × total in (0, total], position i is chosen exactly when cdf[i-1] < t <= cdf[i],
    i.e. with probability weight_i / total; a zero-weight position is never first (its cdf equals
    its predecessor's), and t never exceeds cdf[-1] (u <= 1), so the result is always in range.
    """
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)
    target = uniforms.to(torch.float64)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target).squeeze(-1)


def _nucleus(
    weights: torch.Tensor, total: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    width = weights.shape[-1]
    k = min(width, NUCLEUS_FIRST_WIDTH)
    while True:
        values, ids = weights.topk(k, dim=-1)  # sorted, most likely first
        # Keep a token while the mass before it is still short of top_p (as in a full sort).
        mass_before = (values.cumsum(dim=-1, dtype=torch.float64) - values) / total
        keep = mass_before < top_p[:, None]
        if k == width or not bool(keep[:, -1].any()):
            break
        k = min(width, k * 4)
    position = _inverse_cdf(values * keep, uniforms)
    return ids.gather(-1, position[:, None]).squeeze(-1)
