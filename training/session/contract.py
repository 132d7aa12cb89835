"""The session contract: what every way of training is written over, whichever host holds the
session (this process, the trainer service, data-parallel ranks).

A session holds a policy (a base model + LoRA adapter), its optimizer and RNG, and offers:

    forward(data, *, reference=None)                         -> list[list[float]]   logprobs only
    forward_backward(data, loss_fn, loss_fn_config=None, *, forward_only=False)
                                                             -> ForwardBackwardResult (gradients add up)
    optim_step(*, learning_rate, beta1, beta2, eps, weight_decay, max_grad_norm)
                                                             -> dict[str, float]    one AdamW step
    reset_optimizer()                                        -> None   forget AdamW's moments
    sample(prompts, sampling: SamplingParams)                -> list[Choice]  one per prompt
    save_state(path, *, step, metrics)                       the checkpoint (adapter, optimizer, RNG)
    save_weights_for_sampler(path)                           the adapter alone, as a server loads it

``data`` is a list of ``Datum`` (Tinker's layout; see ``Datum``); ``loss_fn`` names a loss of
training.session.losses. Every implementation takes and answers these same types, and checks its input
here, once: ``Datum`` checks its own shape, ``check_token_ids`` / ``check_prompt_ids`` the ids
against the model's vocabulary before any tensor is built.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from training.engines.base import Choice, SamplingParams
from training.rollouts.trajectory import TrainSample

BASE_MODEL = "base"  # forward's reference: the base model itself (the adapter switched off)


class LossInputError(ValueError):
    """A loss was called without an input it needs, or with a config it does not take."""


# Losses whose value over a call is not the sum of their values over its parts.
WHOLE_CALL_LOSSES = frozenset({"art"})


@dataclass
class Datum:
    model_input: list[int]
    loss_fn_inputs: dict[str, list[float]] = field(default_factory=dict)  # target_tokens among them

    def __post_init__(self) -> None:
        targets = self.loss_fn_inputs.get("target_tokens")
        if not self.model_input:
            raise LossInputError("a datum needs a non-empty model_input")
        if targets is None or len(targets) != len(self.model_input):
            raise LossInputError("loss_fn_inputs.target_tokens must have one token per model_input token")
        for name, values in self.loss_fn_inputs.items():
            if len(values) != len(self.model_input):
                raise LossInputError(
                    f"loss_fn_inputs.{name} has {len(values)} values for {len(self.model_input)} tokens"
                )
        if [int(t) for t in targets[:-1]] != list(self.model_input[1:]):
            raise LossInputError(
                "target_tokens must be model_input shifted by one (target i is input i + 1): "
                "artweb trains on the sequence itself"
            )

    @property
    def first_computed(self) -> int:
        """The first position whose logprob is computed (see the module doc)."""
        weights = self.loss_fn_inputs.get("weights")
        if weights is None:
            return 0
        return next((i for i, w in enumerate(weights) if w != 0), len(weights))

    def sample(self) -> TrainSample:
        """The datum as the trainer's packed layout takes it: the positions from ``first_computed``
        on are the completion."""
        start = self.first_computed
        tokens = [*self.model_input, int(self.loss_fn_inputs["target_tokens"][-1])]
        completion = tokens[start + 1 :]
        return TrainSample(
            prompt_token_ids=tokens[: start + 1],
            completion_token_ids=completion,
            completion_logprobs=[0.0] * len(completion),
            reward=0.0,
        )


def datum_of(sample: TrainSample, **per_token: list[float]) -> Datum:
    """A sample as a session datum: its completion positions carry ``per_token`` values (one per
    completion token), the prompt's carry 0 weight."""
    tokens = sample.prompt_token_ids + sample.completion_token_ids
    before = len(sample.prompt_token_ids) - 1
    inputs = {name: [0.0] * before + list(values) for name, values in per_token.items()}
    return Datum(
        model_input=tokens[:-1], loss_fn_inputs={"target_tokens": [float(t) for t in tokens[1:]], **inputs}
    )


@dataclass
class ForwardBackwardResult:
    loss: float
    metrics: dict[str, float]
    logprobs: list[list[float]]  # per datum, N values (0.0 before its first computed position)


def check_token_ids(data: Sequence[Datum], vocabulary: int) -> None:
    """Every datum's input and target ids lie in ``0..vocabulary - 1``; else a LossInputError that
    names the datum and the position (``data[3].model_input[17]``)."""
    for index, datum in enumerate(data):
        for name, ids in (("model_input", datum.model_input),
                          ("loss_fn_inputs.target_tokens", datum.loss_fn_inputs.get("target_tokens") or [])):  # fmt: skip
            _check_ids(ids, vocabulary, f"data[{index}].{name}")


def check_prompt_ids(prompts: Sequence[Sequence[int]], vocabulary: int) -> None:
    """Every prompt's ids lie in the vocabulary (``prompts[0][5]`` names a bad one)."""
    for index, prompt in enumerate(prompts):
        _check_ids(prompt, vocabulary, f"prompts[{index}]")


def _check_ids(ids: Sequence[Any], vocabulary: int, where: str) -> None:
    try:
        if not ids or (min(ids) >= 0 and max(ids) < vocabulary):  # at C speed; the loop finds the culprit
            return
    except TypeError:
        pass
    for position, token in enumerate(ids):
        if (
            isinstance(token, bool)
            or not isinstance(token, int | float)
            or not math.isfinite(token)
            or token != int(token)
        ):
            raise LossInputError(f"{where}[{position}]: {token!r} is not a token id")
        if not 0 <= int(token) < vocabulary:
            raise LossInputError(
                f"{where}[{position}]: token id {int(token)} is outside the model's vocabulary of "
                f"{vocabulary} (ids 0..{vocabulary - 1})"
            )


class Session(Protocol):
    """The primitives every session offers (module doc); recipes (GRPO, SFT, DPO, ART's update)
    are written over this and nothing else."""

    def forward(self, data: Sequence[Datum], *, reference: Path | str | None = None) -> list[list[float]]: ...

    def forward_backward(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: dict[str, Any] | None = None,
        *, forward_only: bool = False,
    ) -> ForwardBackwardResult: ...  # fmt: skip

    def optim_step(
        self, *, learning_rate: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
        weight_decay: float | None = None, max_grad_norm: float | None = None,
    ) -> dict[str, float]: ...  # fmt: skip

    def reset_optimizer(self) -> None: ...

    def sample(self, prompts: Sequence[list[int]], sampling: SamplingParams) -> list[Choice]: ...

    def save_state(self, path: Path, *, step: int, metrics: dict[str, Any]) -> object: ...

    def save_weights_for_sampler(self, path: Path) -> None: ...
