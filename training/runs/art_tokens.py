"""Client trajectories (training.runs.art_groups) tokenized for one base model, on the exact token
ids the sampler produced.

Where a choice's ids come from, best first (the trajectory's ``token_source``):
- ``gateway``: artweb's gateway attaches ``token_ids`` (the sampled ids, a final end token
  included), ``prompt_token_ids`` (the ids the sampler was given) and ``artweb_model`` (the
  checkpoint that sampled) to every choice of a request with logprobs. OpenAI's ``Choice`` keeps
  unknown fields and ``model_dump`` writes them, so they reach the job untouched: exact.
- ``token_ids``: ids without a prompt (vLLM's ``return_token_ids``): the completion is exact, the
  prompt is re-rendered with the serving code's own renderer (``training.serving.prompts``).
- ``logprobs``: ART's own rule: the token strings of ``logprobs.content`` (``token_id:N`` accepted,
  else the vocabulary token, else the one token whose text it is); a string that is none of
  these is an error (a choice of another model), never an end token put in its place. Flagged.

Sequences: a history is one sample while each choice's prompt begins with the tokens so far (then
the ids between two choices are the prompt's continuation: the end of the turn, the environment's
messages, the next header, mask 0). Where a later prompt does not (the template writes an earlier
turn back differently from how it was sampled, typical of tool calls), the history is split and
the later choice gets a sample of its own whose prompt is exactly what its sampler saw. So every
trained id is scored in the context it was sampled in; a split trajectory counts as several
sequences in the loss's normalisation.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from training.rollouts.trajectory import TrainSample
from training.runs.art_groups import (
    PROMPT_TOKEN_IDS,
    TOKEN_IDS,
    ClientChoice,
    ClientHistory,
    ClientTrajectory,
    GroupError,
    Item,
)
from training.serving.protocol import Limits, RequestError, parse_chat_request

__all__ = ["Placement", "TokenizedTrajectory", "TrajectoryTokenizer", "join_turns"]

_TOKEN_ID_FORM = re.compile(r"^token_id:(\d+)$")


@dataclass
class TokenizedTrajectory:
    """A trajectory's samples (one per history, more where it was split) and how exact they are."""

    samples: list[TrainSample]
    token_source: str  # "gateway" | "token_ids" | "logprobs" (the least exact of its choices)
    prompt_mismatches: int = 0  # carried prompts that differ from the re-rendered one (carried wins)
    splits: int = 0  # where a later prompt did not continue the tokens so far
    sampled_steps: list[int] = field(default_factory=list)  # the checkpoints its choices name

    @property
    def policy_step(self) -> int | None:
        """The oldest checkpoint that sampled a trained choice (its ``artweb_model`` ``…:N``); None
        when no choice names one (another server, the base model)."""
        return min(self.sampled_steps) if self.sampled_steps else None

    @property
    def prompt_tokens(self) -> int:
        return len(self.samples[0].prompt_token_ids) if self.samples else 0

    @property
    def trainable_tokens(self) -> int:
        return sum(sample.trainable_tokens() for sample in self.samples)


_SOURCE_RANK = {"gateway": 0, "token_ids": 1, "logprobs": 2}


@dataclass
class _Segment:
    prompt: list[int]
    completion: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.completion

    def add(self, ids: list[int], logprobs: list[float] | None) -> None:
        self.completion += ids
        self.mask += [0 if logprobs is None else 1] * len(ids)
        self.logprobs += [0.0] * len(ids) if logprobs is None else logprobs


@dataclass(frozen=True)
class Placement:
    """Where one turn's sampled ids lie in the joined samples: sample ``sample``'s tokens
    ``[start, end)`` (``start`` is also the length of the prompt it was sampled after)."""

    sample: int
    start: int
    end: int


def join_turns(
    turns: Sequence[tuple[list[int], list[int], list[float] | None]],
) -> tuple[list[_Segment], list[Placement]]:
    """Turns (each the exact prompt ids its sampler was given, the sampled ids and their logprobs,
    in order) joined into as few samples as exactness allows: a turn whose prompt begins with the
    tokens so far continues the sample (the ids between are context, mask 0); one that does not
    starts a sample of its own. Every sampled id keeps the exact context it was sampled in."""
    segments: list[_Segment] = []
    placements: list[Placement] = []
    current: _Segment | None = None
    for prompt, ids, logprobs in turns:
        if current is not None and prompt[: len(current.tokens)] == current.tokens:
            current.add(prompt[len(current.tokens) :], None)
        else:
            current = _Segment(prompt=list(prompt))
            segments.append(current)
        start = len(current.tokens)
        current.add(list(ids), list(logprobs) if logprobs is not None else [math.nan] * len(ids))
        placements.append(Placement(len(segments) - 1, start, start + len(ids)))
    return segments, placements


def sampled_step(sampled_by: str | None) -> int | None:
    """The step of the checkpoint an ``artweb_model`` names (``project/model:N``), else None."""
    _, colon, step = (sampled_by or "").rpartition(":")
    return int(step) if colon and step.isdigit() else None


class TrajectoryTokenizer:
    """Tokenizes client trajectories for one base model.

    ``accepts_model(name)`` says whether a choice's ``artweb_model`` (the checkpoint that sampled
    it) belongs to the model being trained; ``max_length`` bounds a sample's tokens.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        accepts_model: Callable[[str], bool] | None = None,
        max_length: int | None = None,
        allow_without_logprobs: bool = False,
    ) -> None:
        from training.rollouts.agent import template_supports_tools

        self.tokenizer = tokenizer
        self.without_logprobs = allow_without_logprobs
        self.accepts_model = accepts_model
        self.max_length = max_length
        self.native_tools = template_supports_tools(tokenizer)
        self.vocabulary_size = max(len(tokenizer), int(getattr(tokenizer, "vocab_size", 0) or 0))

    def tokenize(self, trajectory: ClientTrajectory) -> TokenizedTrajectory:
        result = TokenizedTrajectory(samples=[], token_source="gateway")
        for history in trajectory.histories:
            for segment in self._segments(history, result):
                if self.max_length is not None and len(segment.tokens) > self.max_length:
                    raise GroupError(
                        history.path,
                        f"is {len(segment.tokens)} tokens long; the model takes at most {self.max_length}",
                    )
                result.samples.append(
                    TrainSample(
                        prompt_token_ids=segment.prompt,
                        completion_token_ids=segment.completion,
                        completion_logprobs=segment.logprobs,
                        reward=trajectory.reward,
                        completion_mask=segment.mask,
                    )
                )
        return result

    def _segments(self, history: ClientHistory, result: TokenizedTrajectory) -> list[_Segment]:
        last = max(
            (
                i
                for i, item in enumerate(history.items)
                if isinstance(item, ClientChoice) and item.trains(self.without_logprobs)
            ),
            default=-1,
        )
        turns: list[tuple[list[int], list[int], list[float]]] = []
        for index, item in enumerate(history.items[: last + 1]):
            if not isinstance(item, ClientChoice) or not item.trains(self.without_logprobs):
                continue  # context: it reaches the samples through the next choice's prompt
            prompt = self._sampler_prompt(history, index, item, result)
            ids, source = self._sampled_ids(item)
            step = sampled_step(item.sampled_by)
            if step is not None:
                result.sampled_steps.append(step)
            if _SOURCE_RANK[source] > _SOURCE_RANK[result.token_source]:
                result.token_source = source
            # Trained without logprobs (allow_training_without_logprobs): NaN, the learner's own.
            turns.append((prompt, ids, item.logprobs if item.logprobs is not None else [math.nan] * len(ids)))
        segments, _ = join_turns(turns)
        result.splits += max(len(segments) - 1, 0)
        return segments

    def _sampler_prompt(
        self, history: ClientHistory, index: int, choice: ClientChoice, result: TokenizedTrajectory
    ) -> list[int]:
        """The ids the sampler was given for the choice at ``index``: the carried ones when the
        gateway attached them (a re-render that differs is counted, not used), else the re-render."""
        before = history.items[:index]
        if not before:
            raise GroupError(choice.path, "a choice needs the messages it answered before it")
        rendered = self._render(history, before)
        if choice.prompt_token_ids is None:
            return rendered
        self._check_vocabulary(choice.prompt_token_ids, f"{choice.path}.{PROMPT_TOKEN_IDS}")
        if rendered != choice.prompt_token_ids:
            result.prompt_mismatches += 1
        return list(choice.prompt_token_ids)

    def _render(self, history: ClientHistory, before: list[Item]) -> list[int]:
        from training.serving.prompts import render_prompt

        messages = [item.message if isinstance(item, ClientChoice) else item for item in before]
        try:
            request = parse_chat_request(
                {"model": "client", "messages": messages, "tools": history.tools}, Limits.shape_only()
            )
            return render_prompt(self.tokenizer, request, native_tools=self.native_tools)
        except RequestError as exc:
            raise GroupError(
                history.path, f"cannot be rendered with the model's chat template: {exc.message}"
            ) from None

    def _sampled_ids(self, choice: ClientChoice) -> tuple[list[int], str]:
        if (
            choice.sampled_by is not None
            and self.accepts_model is not None
            and not self.accepts_model(choice.sampled_by)
        ):
            raise GroupError(
                choice.path,
                f"was sampled from `{choice.sampled_by}`, not from this model: train a model only on "
                "choices of its own checkpoints (or of its base model)",
            )
        if choice.token_ids is not None:
            self._check_vocabulary(choice.token_ids, f"{choice.path}.{TOKEN_IDS}")
            return list(choice.token_ids), "gateway" if choice.prompt_token_ids is not None else "token_ids"
        assert choice.tokens is not None
        return [
            self._token_id(token, f"{choice.path}.logprobs.content[{i}].token")
            for i, token in enumerate(choice.tokens)
        ], "logprobs"

    def _token_id(self, token: str, path: str) -> int:
        """ART's rule for a token string (see the module doc), without its end-token fallback."""
        match = _TOKEN_ID_FORM.match(token)
        if match:
            token_id = int(match[1])
            self._check_vocabulary([token_id], path)
            return token_id
        vocabulary = self.tokenizer.get_vocab()
        if token in vocabulary:
            return int(vocabulary[token])
        encoded = self.tokenizer.encode(token, add_special_tokens=False)
        if len(encoded) == 1 and self.tokenizer.decode(encoded) == token:
            return int(encoded[0])
        raise GroupError(
            path,
            f"{token!r} is not one token of this model's vocabulary: was the choice sampled from "
            "another model? (sample through artweb's gateway, or ask vLLM for token ids)",
        )

    def _check_vocabulary(self, ids: list[int], path: str) -> None:
        bad = next((token_id for token_id in ids if token_id >= self.vocabulary_size), None)
        if bad is not None:
            raise GroupError(
                path, f"token id {bad} is outside the model's vocabulary of {self.vocabulary_size}"
            )
