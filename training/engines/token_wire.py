"""Sampling from token ids over HTTP: the JSON both token-in routes speak (the trainer service's
``/sessions/{id}/sample`` and the inference server's ``/generate``) and the clients that call them.

A request is ``{"prompts": [[token id, ...], ...], "sampling": {SamplingParams' fields}}``; the
answer ``{"choices": [{token_ids, logprobs, text, finish_reason, top_logprobs}, ...],
"stop_token_ids": [...]}``, one choice per prompt, in order. Nothing is re-tokenised on either side.
"""

from __future__ import annotations

from typing import Any

from training.engines.base import Choice, SamplingParams

SAMPLING_FIELDS = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "max_new_tokens",
        "seed",
        "stop_token_ids",
        "stop",
        "top_logprobs",
    }
)


class TokenRequestError(ValueError):
    """A token-in request the server will not run; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param


def sampling_body(sampling: SamplingParams) -> dict[str, Any]:
    return {
        "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
        "min_p": sampling.min_p, "max_new_tokens": sampling.max_new_tokens, "seed": sampling.seed,
        "stop": list(sampling.stop), "top_logprobs": sampling.top_logprobs,
        "stop_token_ids": list(sampling.stop_token_ids),
    }  # fmt: skip


def parse_prompts(value: Any, *, vocabulary: int | None = None) -> list[list[int]]:
    """The prompts of a request; ``vocabulary``: token ids must lie below it."""
    if (
        not isinstance(value, list)
        or not value
        or not all(
            isinstance(p, list)
            and p
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p)
            for p in value
        )
    ):
        raise TokenRequestError("prompts must be a non-empty list of non-empty token id lists", "prompts")
    if vocabulary is not None:
        for index, prompt in enumerate(value):
            if max(prompt) >= vocabulary:
                raise TokenRequestError(
                    f"prompts[{index}] holds token id {max(prompt)}; the model's vocabulary has {vocabulary}",
                    f"prompts[{index}]",
                )
    return value


def parse_sampling(given: Any) -> SamplingParams:
    given = {} if given is None else given
    if not isinstance(given, dict) or set(given) - SAMPLING_FIELDS:
        raise TokenRequestError(f"sampling takes only {', '.join(sorted(SAMPLING_FIELDS))}", "sampling")
    try:
        return SamplingParams(**given)
    except (TypeError, ValueError) as exc:
        raise TokenRequestError(f"sampling: {exc}", "sampling") from None


def choice_body(choice: Choice) -> dict[str, Any]:
    return {
        "token_ids": choice.token_ids, "logprobs": choice.logprobs, "text": choice.text,
        "finish_reason": choice.finish_reason, "top_logprobs": choice.top_logprobs,
    }  # fmt: skip


def choices_of(prompts: list[list[int]], answers: list[dict[str, Any]]) -> list[Choice]:
    """The Choices of an answer's ``choices`` (one per prompt, in order)."""
    return [
        Choice(
            text=answer["text"],
            prompt_token_ids=list(prompt),
            token_ids=list(answer["token_ids"]),
            logprobs=list(answer["logprobs"]),
            finish_reason=answer["finish_reason"],
            top_logprobs=None
            if answer.get("top_logprobs") is None
            else [[(int(t), float(p)) for t, p in row] for row in answer["top_logprobs"]],
        )
        for prompt, answer in zip(prompts, answers, strict=True)
    ]
