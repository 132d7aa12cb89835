"""ART's own loss code against artweb's on random packed sequences: openpipe-art 0.5.23's
``art.loss.loss_fn`` and training.recipes.art_loss.art_policy_loss, and the session's ``art`` loss
(training.session.losses.art) fed as training.recipes.art.art_update feeds it, must give the same
loss, the same gradient w.r.t. the learner's logprobs and the same clip fraction, ratio mean and KL.
Run with artweb's virtualenv; ART's package is read from ``.venv-art23`` (which has no torch).
Prints ``<agreeing>/<cases> agree``, each disagreement, and how often the clips bound.

    python tests/integration/art_loss_check.py [seed] [cases]

Each case draws an ``experimental_config`` as ART's client sends it (loss_fn/ppo, epsilon and
epsilon_high set or unset, importance_sampling_level, mask_prob_ratio, the negative-advantage cap,
kimi_k2_tau, a KL penalty from either source, truncated importance sampling) and one packed
sequence of 1-6 trajectories: masked prompt tokens, multi-turn gaps, missing (NaN) sampler
logprobs, and log ratios up to ±30, so ratios fall far beyond both clip bounds (and ART's log-ratio
bound of 20) with advantages of both signs. artweb reads the settings with
training.recipes.art_config.art_job_config; ART with its ServerlessBackend.train's resolution (ppo
from loss_fn, the KL source's default) and its own build_rl_train_configs.

Compared only where the two are meant to agree:
- the layout: ART's loss gets the sequence packed into one row, its trajectories told apart by
  group_ids (1, 2, ...: ART's prefix-tree segment ids, never 0 on trained tokens), already aligned
  (``AlignedLossInputs``: ART's one-token shift belongs to its packing); artweb gets a row per
  trajectory. Weights and advantages are artweb's art_token_weights/art_shaped_advantages for both.
- float64: ART bounds log ratios at 10 in float16, artweb (which keeps logprobs in float32) always
  at 20, ART's bound for wider types; float64 keeps rounding from hiding a difference.
- a KL penalty always comes with reference logprobs (without them ART skips the penalty, artweb
  refuses); missing original logprobs are NaN (ART replaces NaN only, artweb any non-finite);
  the KL mean is the sequence's (artweb's data-parallel whole-call mean is not exercised here).
- reduction "mean" (artweb has no "sum"); ART's entropy and probs_corr are not artweb's.
"""

from __future__ import annotations

import dataclasses
import math
import random
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.append(str(next((ROOT / ".venv-art23" / "lib").glob("python3*")) / "site-packages"))

import torch  # noqa: E402  (artweb's torch: .venv-art23 has none)
from art._backend_training import build_rl_train_configs  # noqa: E402
from art.loss import AlignedLossInputs, loss_fn  # noqa: E402

from training.recipes.art_config import art_job_config  # noqa: E402
from training.recipes.art_loss import ArtLoss, art_policy_loss, art_shaped_advantages, art_token_weights  # noqa: E402
from training.session.losses import LossInputs, art  # noqa: E402

RTOL = 1e-5
NAN = float("nan")


@dataclass
class Case:
    experimental: dict[str, Any]
    masks: list[list[bool]]  # per trajectory, per position: trained
    new: list[list[float]]
    old: list[list[float]]  # NaN: no sampler logprob
    ref: list[list[float]] | None
    original: list[list[float]] | None
    advantages: list[float]  # raw group advantages, shaped by art_shaped_advantages


def experimental_config(rng: random.Random) -> dict[str, Any]:
    """Random ART settings, each key unset (None or absent) some of the time."""
    use_ppo = rng.random() < 0.5
    config: dict[str, Any] = rng.choice(
        [{"ppo": True}, {"loss_fn": "ppo"}, {"ppo": True, "loss_fn": "ppo"}]
        if use_ppo
        else [{}, {"ppo": False}, {"loss_fn": "cispo"}, {"ppo": None, "loss_fn": None}]
    )

    def maybe(key: str, value: Any, chance: float = 0.5) -> None:
        if rng.random() < chance:
            config[key] = value
        elif rng.random() < 0.3:
            config[key] = None

    maybe("epsilon", rng.choice([rng.uniform(0.05, 0.95), rng.uniform(1.0, 2.0)]), 0.6)
    maybe("epsilon_high", rng.uniform(0.05, 5.0), 0.6)
    maybe("importance_sampling_level", rng.choice(["token", "sequence", "average", "geometric_average"]))
    maybe("mask_prob_ratio", rng.random() < 0.5, 0.25)
    maybe("max_negative_advantage_importance_sampling_weight", rng.uniform(0.5, 12.0), 0.2)
    maybe("kimi_k2_tau", rng.choice([0.0, rng.uniform(0.01, 1.0)]), 0.2)
    maybe("kl_penalty_coef", rng.choice([0.0, rng.uniform(0.01, 2.0)]), 0.35)
    maybe("kl_penalty_source", rng.choice(["sample", "current_learner"]), 0.4)
    maybe("truncated_importance_sampling", rng.uniform(0.3, 5.0), 0.3)
    maybe("advantage_balance", rng.uniform(-0.9, 0.9), 0.2)
    return config


def logprob_pair(rng: random.Random) -> tuple[float, float]:
    """(new, old): mostly near each other, often far apart (ratios up to e^±30) either way."""
    roll = rng.random()
    if roll < 0.2:
        return -rng.uniform(0.0, 30.0), -rng.uniform(0.0, 30.0)
    old = -rng.expovariate(1.0)
    return min(0.0, old + (rng.uniform(-4.0, 4.0) if roll < 0.45 else rng.gauss(0.0, 0.2))), old


def random_case(rng: random.Random) -> Case:
    experimental = experimental_config(rng)
    masks, new, old, ref, original, advantages = [], [], [], [], [], []
    for _ in range(rng.randint(1, 6)):
        prompt = rng.randint(0, 8)
        completion = rng.randint(1, 40)
        mask = [False] * prompt + [rng.random() > 0.1 for _ in range(completion)]
        if not any(mask):
            mask[-1] = True
        pairs = [logprob_pair(rng) for _ in mask]
        masks.append(mask)
        new.append([n for n, _ in pairs])
        # ART's prompt tokens have no logprob; some sampled tokens lack one too.
        old.append([o if m and rng.random() > 0.05 else NAN for (_, o), m in zip(pairs, mask, strict=True)])
        ref.append([n + rng.gauss(0.0, 0.5) for n, _ in pairs])
        original.append([o + rng.gauss(0.0, 1.5) if rng.random() > 0.05 else NAN for _, o in pairs])
        advantages.append(rng.choice([0.0, rng.gauss(0.0, 1.0), rng.gauss(0.0, 1.0), rng.gauss(0.0, 1.0)]))
    with_ref = (experimental.get("kl_penalty_coef") or 0.0) > 0 or rng.random() < 0.2
    with_original = experimental.get("truncated_importance_sampling") is not None or rng.random() < 0.2
    if rng.random() < 0.15:  # truncated IS asked for, but no sampler logprobs were kept
        with_original = False
    return Case(experimental, masks, new, old, ref if with_ref else None, original if with_original else None,
                advantages)  # fmt: skip


def art_dev_config(experimental: dict[str, Any]) -> dict[str, Any]:
    """The dev.TrainConfig ART's loss reads for a client's ``experimental_config``: ppo from
    loss_fn, the KL source's default and then build_rl_train_configs, as ServerlessBackend.train
    (art/serverless/backend.py) resolves them; unset keys are left out (loss_fn's own defaults)."""
    given = {k: v for k, v in experimental.items() if v is not None}
    loss = given.pop("loss_fn", None)
    ppo = given.pop("ppo", None)
    given.pop("advantage_balance", None)  # applied before the loss (art_shaped_advantages)
    coef = given.pop("kl_penalty_coef", 0.0)
    source = given.pop("kl_penalty_source", None) or ("sample" if coef > 0 else "current_learner")
    _, dev_config = build_rl_train_configs(
        learning_rate=1e-5, ppo=loss == "ppo" if loss is not None else bool(ppo), kl_penalty_coef=coef,
        kl_penalty_source=source, **given,
    )  # fmt: skip
    return dict(dev_config)


def tensor(rows: list[list[float]], width: int) -> torch.Tensor:
    return torch.tensor([row + [0.0] * (width - len(row)) for row in rows], dtype=torch.float64)


def packed(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor([[value for row in rows for value in row]], dtype=torch.float64)


def art_side(case: Case, advantages: list[float], weights: list[float], dev_config: dict[str, Any]):
    """ART's loss, its gradient (one packed row) and metrics."""
    mask = torch.tensor([[m for row in case.masks for m in row]])
    repeat = [len(row) for row in case.masks]
    group_ids = torch.tensor([[i + 1 for i, n in enumerate(repeat) for _ in range(n)]])
    per_token = [[a * m for m in row] for a, row in zip(advantages, case.masks, strict=True)]
    per_weight = [[w * m for m in row] for w, row in zip(weights, case.masks, strict=True)]
    inputs = AlignedLossInputs(
        assistant_mask=mask,
        old_logprobs=packed(case.old),
        advantages=packed(per_token),
        weights=packed(per_weight),
        group_ids=group_ids,
        original_logprobs=packed(case.original) if case.original is not None else None,
    )
    new = packed(case.new).requires_grad_()
    ref = packed(case.ref) if case.ref is not None else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # truncated IS without original logprobs: ART warns, skips
        result = loss_fn(inputs, new, ref, None, dev_config)
    result.policy_loss.backward()
    diagnostics = result.offpolicy_diagnostics
    count = max(float(diagnostics.token_count), 1.0)
    metrics = {
        "clip_fraction": float(diagnostics.clipped_count) / count,
        "ratio_mean": float(diagnostics.ratio_sum) / count,
        "kl_policy_ref": float(result.kl_policy_ref) if result.kl_policy_ref is not None else 0.0,
    }
    return float(result.policy_loss.detach()), new.grad[0], metrics


def unpack(grad: torch.Tensor, case: Case) -> torch.Tensor:
    """artweb's [N, T] gradient in ART's packed order."""
    return torch.cat([grad[i, : len(row)] for i, row in enumerate(case.masks)])


def recipe_side(case: Case, advantages: list[float], weights: list[float], loss: ArtLoss):
    """training.recipes.art_loss.art_policy_loss: a row per trajectory, [N] advantages and weights."""
    width = max(len(row) for row in case.masks)
    new = tensor(case.new, width).requires_grad_()
    value, metrics = art_policy_loss(
        new,
        tensor(case.old, width),
        torch.tensor(advantages, dtype=torch.float64),
        torch.tensor(weights, dtype=torch.float64),
        tensor([[float(m) for m in row] for row in case.masks], width),
        loss,
        ref_logprobs=tensor(case.ref, width) if case.ref is not None else None,
        original_logprobs=tensor(case.original, width) if case.original is not None else None,
    )
    value.backward()
    return float(value.detach()), unpack(new.grad, case), metrics


def session_side(case: Case, advantages: list[float], weights: list[float], loss: ArtLoss):
    """The session's ``art`` loss on the datums training.recipes.art.art_update builds: weights
    w / (the sequence's trained tokens) on trained tokens, the config as a dict."""
    width = max(len(row) for row in case.masks)
    tokens = sum(sum(row) for row in case.masks)
    new = tensor(case.new, width).requires_grad_()
    inputs = {
        "logprobs": tensor(case.old, width),
        "advantages": tensor([[a] * len(row) for a, row in zip(advantages, case.masks, strict=True)], width),
    }
    if case.ref is not None:
        inputs["ref_logprobs"] = tensor(case.ref, width)
    if case.original is not None:
        inputs["original_logprobs"] = tensor(case.original, width)
    batch = LossInputs(
        logprobs=new,
        mask=tensor([[1.0] * len(row) for row in case.masks], width),
        weights=tensor(
            [[w * m / tokens for m in row] for w, row in zip(weights, case.masks, strict=True)], width
        ),
        inputs=inputs,
    )
    value, _ = art(batch, dataclasses.asdict(loss))
    value.backward()
    return float(value.detach()), unpack(new.grad, case)


def close(ours: float, theirs: float) -> bool:
    return math.isfinite(ours) and abs(ours - theirs) <= RTOL * max(abs(ours), abs(theirs), 1e-6)


def grads_close(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    scale = float(theirs.abs().max()) if theirs.numel() else 0.0
    return bool(torch.isfinite(ours).all()) and torch.allclose(
        ours, theirs, rtol=RTOL, atol=RTOL * 1e-3 * scale + 1e-12
    )


def clip_counts(case: Case, advantages: list[float], loss: ArtLoss) -> tuple[int, int]:
    """Trained tokens whose token ratio exp(new - old) is above 1 + epsilon_high with A > 0, and
    below 1 - epsilon with A < 0 (where ppo clips; cispo clips either side whatever A's sign)."""
    upper = lower = 0
    for a, mask, new, old in zip(advantages, case.masks, case.new, case.old, strict=True):
        for m, n, o in zip(mask, new, old, strict=True):
            if m and not math.isnan(o):
                ratio = math.exp(max(min(n - o, 20.0), -20.0))
                upper += a > 0 and ratio > 1 + loss.epsilon_high
                lower += a < 0 and ratio < 1 - loss.epsilon
    return upper, lower


def main(seed: int, cases: int) -> int:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    agree = upper_tokens = upper_cases = lower_tokens = moved_by_epsilon_high = 0
    for number in range(cases):
        case = random_case(rng)
        _, options = art_job_config(case.experimental)
        loss = options.loss
        lengths = [sum(row) for row in case.masks]
        weights = art_token_weights(lengths)
        advantages = art_shaped_advantages(
            case.advantages, lengths, weights, balance=options.advantage_balance
        )
        dev_config = art_dev_config(case.experimental)

        theirs, their_grad, their_metrics = art_side(case, advantages, weights, dev_config)
        ours, our_grad, our_metrics = recipe_side(case, advantages, weights, loss)
        session, session_grad = session_side(case, advantages, weights, loss)
        problems = []
        if not close(ours, theirs):
            problems.append(f"loss: art_policy_loss {ours!r}, ART {theirs!r}")
        if not grads_close(our_grad, their_grad):
            worst = int((our_grad - their_grad).abs().argmax())
            problems.append(
                f"gradient at packed token {worst}: art_policy_loss {float(our_grad[worst])!r}, "
                f"ART {float(their_grad[worst])!r}"
            )
        if not close(session, theirs):
            problems.append(f"loss: session 'art' {session!r}, ART {theirs!r}")
        if not grads_close(session_grad, their_grad):
            worst = int((session_grad - their_grad).abs().argmax())
            problems.append(
                f"gradient at packed token {worst}: session 'art' {float(session_grad[worst])!r}, "
                f"ART {float(their_grad[worst])!r}"
            )
        for name, value in their_metrics.items():
            if abs(our_metrics[name] - value) > RTOL * max(abs(value), 1.0):
                problems.append(f"{name}: artweb {our_metrics[name]!r}, ART {value!r}")
        agree += not problems
        for problem in problems:
            print(f"case {number} ({case.experimental}): {problem}")

        upper, lower = clip_counts(case, advantages, loss)
        upper_tokens += upper
        upper_cases += upper > 0
        lower_tokens += lower
        # The upper clip bound the loss: ART's own value moves with epsilon_high.
        wider = art_side(case, advantages, weights, {**dev_config, "epsilon_high": loss.epsilon_high + 3.0})[
            0
        ]
        moved_by_epsilon_high += not close(wider, theirs)
    print(f"{agree}/{cases} agree")
    print(f"upper clip: {upper_tokens} tokens with ratio > 1 + epsilon_high and A > 0 in {upper_cases} cases")
    print(f"lower clip: {lower_tokens} tokens with ratio < 1 - epsilon and A < 0")
    print(f"epsilon_high changes ART's loss in {moved_by_epsilon_high} cases")
    return 0 if agree == cases else 1


if __name__ == "__main__":
    sys.exit(
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 0, int(sys.argv[2]) if len(sys.argv) > 2 else 300)
    )
