"""Scored trajectory groups sent by a client (OpenPipe ART's ``TrajectoryGroup.model_dump(mode="json")``)
read and turned into the trainer's samples, on the exact token ids the sampler produced.

Two halves, so the web process can refuse a bad upload without a tokenizer:
- ``parse_groups`` checks the shape of the upload (no tokenizer, no torch): every trajectory has
  a reward and items that are message dicts or OpenAI ``Choice`` dicts, messages validate as the
  gateway validates a chat request, and at least one choice carries logprobs. Each problem is a
  ``GroupError`` naming its place (``trajectory_groups[0].trajectories[1].messages_and_choices[2]``).
- ``TrajectoryTokenizer`` (in the training job) renders the message dicts with the base model's
  chat template and trains on the choices only.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from training.serving.protocol import Limits, RequestError, parse_chat_request
from training.trajectory import TrainSample

__all__ = [
    "ClientChoice",
    "ClientGroup",
    "ClientHistory",
    "ClientTrajectory",
    "GroupError",
    "TokenizedTrajectory",
    "TrajectoryTokenizer",
    "annotate_completion",
    "parse_groups",
]

# The extension fields artweb's gateway adds to each choice (``annotate_completion``).
TOKEN_IDS = "token_ids"
PROMPT_TOKEN_IDS = "prompt_token_ids"
SAMPLED_BY = "artweb_model"

_TOKEN_ID_FORM = re.compile(r"^token_id:(\d+)$")


def annotate_completion(body: dict[str, Any], *, model: str, keep_prompt: bool) -> dict[str, Any]:
    """The gateway's side of the extension (see the module doc): a non-streamed completion that
    the server answered with ``return_token_ids`` gets ``prompt_token_ids`` and ``artweb_model`` on
    each choice that carries ``token_ids``; the top-level ``prompt_token_ids`` stays only when the
    client asked for it (``keep_prompt``)."""
    prompt = body.get(PROMPT_TOKEN_IDS) if keep_prompt else body.pop(PROMPT_TOKEN_IDS, None)
    for choice in body.get("choices") or []:
        if isinstance(choice, dict) and choice.get(TOKEN_IDS) is not None:
            if prompt is not None:
                choice[PROMPT_TOKEN_IDS] = prompt
            choice[SAMPLED_BY] = model
    return body


class GroupError(ValueError):
    """A trajectory group that cannot be trained on; ``path`` names the offending place."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}")


@dataclass
class ClientChoice:
    """An OpenAI ``Choice`` of a trajectory: trained on when it has logprobs."""

    path: str
    message: dict[str, Any]  # the assistant message as the next request sends it (ART's get_messages)
    finish_reason: str
    tokens: list[str] | None  # logprobs.content[*].token; None: no logprobs (context only)
    logprobs: list[float] | None
    token_ids: list[int] | None = None  # extension fields, see the module doc
    prompt_token_ids: list[int] | None = None
    sampled_by: str | None = None

    def trains(self, without_logprobs: bool = False) -> bool:
        """Trained on: it has logprobs, or (``without_logprobs``: ART's
        allow_training_without_logprobs) the sampled ids, trained with the learner's own logprobs."""
        return self.logprobs is not None or (without_logprobs and self.token_ids is not None)


Item = dict[str, Any] | ClientChoice  # a message dict, or a choice


@dataclass
class ClientHistory:
    path: str
    items: list[Item]
    tools: list[dict[str, Any]] | None  # OpenAI tool params, as the client sent them

    def trainable(self, without_logprobs: bool = False) -> bool:
        return any(isinstance(item, ClientChoice) and item.trains(without_logprobs) for item in self.items)

    def messages(self) -> list[dict[str, Any]]:
        return [item.message if isinstance(item, ClientChoice) else item for item in self.items]


@dataclass
class ClientTrajectory:
    path: str
    histories: list[ClientHistory]  # the main one first, then ``additional_histories``
    reward: float
    metrics: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    logs: list[str] = field(default_factory=list)

    def trainable(self, without_logprobs: bool = False) -> bool:
        return any(history.trainable(without_logprobs) for history in self.histories)

    def messages(self) -> list[dict[str, Any]]:
        """The main conversation as OpenAI messages (choices as assistant messages): what is stored."""
        return self.histories[0].messages()


@dataclass
class ClientGroup:
    path: str
    trajectories: list[ClientTrajectory]
    exceptions: int = 0  # rollouts that raised on the client (ART keeps them apart)
    metadata: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------ parsing


def parse_groups(
    value: Any,
    *,
    path: str = "trajectory_groups",
    for_training: bool = True,
    allow_without_logprobs: bool = False,
) -> list[ClientGroup]:
    """The upload's groups, checked (see the module doc); raises GroupError on the first problem.

    For training, at least one trajectory must have a choice to train on (with logprobs, or with
    token ids when ``allow_without_logprobs``); the others are kept, and skipped and counted by the
    job, as ART's backends do. ``for_training=False`` (logged groups) asks for none."""
    if not isinstance(value, list) or not value:
        raise GroupError(path, "must be a non-empty list of trajectory groups")
    groups = [_group(raw, f"{path}[{index}]") for index, raw in enumerate(value)]
    trajectories = [trajectory for group in groups for trajectory in group.trajectories]
    if not trajectories:
        raise GroupError(path, "holds no trajectories")
    if for_training and not any(t.trainable(allow_without_logprobs) for t in trajectories):
        raise GroupError(
            path,
            "no trajectory has a choice with logprobs, so there is nothing to train on: sample with "
            "logprobs=True and put the returned choice (not only its message) in messages_and_choices, "
            "or capture the exchange (with art.Trajectory())",
        )
    return groups


def _object(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise GroupError(path, f"must be an object, got {type(value).__name__}")
    return value


def _optional(raw: dict[str, Any], key: str, kind: type, path: str, default: Any) -> Any:
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise GroupError(f"{path}.{key}", f"must be {'an object' if kind is dict else 'a list'}")
    return value


def _group(raw: Any, path: str) -> ClientGroup:
    raw = _object(raw, path)
    trajectories = raw.get("trajectories")
    if not isinstance(trajectories, list):
        raise GroupError(f"{path}.trajectories", "must be a list of trajectories")
    return ClientGroup(
        path=path,
        trajectories=[
            _trajectory(item, f"{path}.trajectories[{index}]") for index, item in enumerate(trajectories)
        ],
        exceptions=len(_optional(raw, "exceptions", list, path, [])),
        metadata=_optional(raw, "metadata", dict, path, {}),
        metrics=_optional(raw, "metrics", dict, path, {}),
    )


def _trajectory(raw: Any, path: str) -> ClientTrajectory:
    raw = _object(raw, path)
    # openpipe-art 0.5.23 dumps leave out every field at its default: a reward of 0.0 too.
    reward = raw.get("reward", 0.0)
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise GroupError(f"{path}.reward", "must be a finite number")
    exchanges = _optional(raw, "exchanges", dict, path, {})
    if any(exchanges.get(kind) for kind in ("chat_completions", "completions", "responses", "messages")):
        if raw.get("messages_and_choices") or raw.get("additional_histories"):
            raise GroupError(path, "holds both captured exchanges and messages_and_choices: send one")
        histories = exchange_histories(exchanges, f"{path}.exchanges")
    else:
        histories = [_history(raw, path, "messages_and_choices")]
    extra = _optional(raw, "additional_histories", list, path, [])
    for index, history in enumerate(extra):
        histories.append(_history(_object(history, f"{path}.additional_histories[{index}]"),
                                  f"{path}.additional_histories[{index}]", "messages_and_choices"))  # fmt: skip
    logs = _optional(raw, "logs", list, path, [])
    return ClientTrajectory(
        path=path,
        histories=histories,
        reward=float(reward),
        metrics=_optional(raw, "metrics", dict, path, {}),
        metadata=_optional(raw, "metadata", dict, path, {}),
        logs=[str(line) for line in logs],
    )


def exchange_histories(exchanges: dict[str, Any], path: str) -> list[ClientHistory]:
    """A trajectory captured by openpipe-art 0.5.23 (``with art.Trajectory(): ...``): its recorded
    chat-completion exchanges as histories of messages and choices, the form ``messages_and_choices``
    has. An exchange whose request continues the history so far (its messages are the earlier
    request's and that request's answer) extends it; another starts a history of its own. Each
    choice keeps the ids the server returned (``token_ids``, and the response's
    ``prompt_token_ids`` when the choice has none), so it trains on exactly what was sampled."""
    for kind in ("completions", "responses", "messages"):
        if exchanges.get(kind):
            raise GroupError(
                f"{path}.{kind}",
                "artweb trains on captured chat completions only (exchanges.chat_completions)",
            )
    recorded = exchanges.get("chat_completions")
    if not isinstance(recorded, list):
        raise GroupError(f"{path}.chat_completions", "must be a list of exchanges")
    histories: list[tuple[list[dict[str, Any]], ClientHistory]] = []  # (messages as sent, history)
    for index, exchange in enumerate(recorded):
        where = f"{path}.chat_completions[{index}]"
        exchange = _object(exchange, where)
        request = _object(exchange.get("request"), f"{where}.request")
        response = _object(exchange.get("response"), f"{where}.response")
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages:
            raise GroupError(f"{where}.request.messages", "must be a non-empty list of messages")
        choices = response.get("choices")
        if not isinstance(choices, list) or not choices:
            raise GroupError(f"{where}.response.choices", "must be a non-empty list of choices")
        for number, choice in enumerate(choices):
            choice = dict(_object(choice, f"{where}.response.choices[{number}]"))
            if choice.get(PROMPT_TOKEN_IDS) is None and response.get(PROMPT_TOKEN_IDS) is not None:
                choice[PROMPT_TOKEN_IDS] = response[PROMPT_TOKEN_IDS]
            continued = next(
                (h for sent, h in histories if len(choices) == 1 and _continues(messages, sent)), None
            )
            if continued is not None:
                sent = next(sent for sent, h in histories if h is continued)
                for message in messages[len(sent) :]:
                    continued.items.append(dict(_object(message, f"{where}.request.messages")))
                continued.items.append(_choice(choice, f"{where}.response.choices[{number}]"))
                sent[:] = [*messages, {"role": "assistant"}]
                _check_messages(continued, "exchanges")
                continue
            history = _history(
                {"messages_and_choices": [*messages, choice], "tools": request.get("tools")},
                where,
                "messages_and_choices",
            )
            histories.append(([*messages, {"role": "assistant"}], history))
    return [history for _, history in histories]


def _continues(messages: list[Any], sent: list[dict[str, Any]]) -> bool:
    """Whether ``messages`` begin with ``sent`` (a history's requests so far, its answers as bare
    assistant placeholders: any assistant message stands for the answer the client carried over)."""
    if len(messages) <= len(sent):
        return False
    for message, earlier in zip(messages, sent, strict=False):
        if not isinstance(message, dict):
            return False
        if earlier == {"role": "assistant"}:
            if message.get("role") != "assistant":
                return False
        elif message != earlier:
            return False
    return True


def _history(raw: dict[str, Any], path: str, key: str) -> ClientHistory:
    items = raw.get(key)
    if not isinstance(items, list) or not items:
        raise GroupError(f"{path}.{key}", "must be a non-empty list of messages and choices")
    tools = raw.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise GroupError(f"{path}.tools", "must be a list of tools or null")
    parsed: list[Item] = []
    for index, item in enumerate(items):
        item_path = f"{path}.{key}[{index}]"
        item = _object(item, item_path)
        if "role" in item:
            parsed.append(dict(item))
        elif "message" in item and "finish_reason" in item:
            parsed.append(_choice(item, item_path))
        else:
            raise GroupError(
                item_path, "is neither a message (with a role) nor a choice (message, finish_reason)"
            )
    history = ClientHistory(path=path, items=parsed, tools=tools or None)
    _check_messages(history, key)
    return history


def _choice(raw: dict[str, Any], path: str) -> ClientChoice:
    message = _object(raw.get("message"), f"{path}.message")
    if message.get("role", "assistant") != "assistant":
        raise GroupError(f"{path}.message.role", "a choice's message is the assistant's")
    assistant: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("tool_calls"):
        assistant["tool_calls"] = message["tool_calls"]
    tokens: list[str] | None = None
    logprobs: list[float] | None = None
    if raw.get("logprobs") is not None:
        entries = _object(raw["logprobs"], f"{path}.logprobs").get("content")
        if not isinstance(entries, list) or not entries:
            raise GroupError(f"{path}.logprobs.content", "must be a non-empty list of token logprobs")
        tokens, logprobs = [], []
        for index, entry in enumerate(entries):
            entry_path = f"{path}.logprobs.content[{index}]"
            entry = _object(entry, entry_path)
            token, logprob = entry.get("token"), entry.get("logprob")
            if not isinstance(token, str):
                raise GroupError(f"{entry_path}.token", "must be a string")
            if (
                isinstance(logprob, bool)
                or not isinstance(logprob, int | float)
                or not math.isfinite(logprob)
            ):
                raise GroupError(f"{entry_path}.logprob", "must be a finite number")
            tokens.append(token)
            logprobs.append(float(logprob))
    choice = ClientChoice(
        path=path,
        message=assistant,
        finish_reason=str(raw.get("finish_reason") or ""),
        tokens=tokens,
        logprobs=logprobs,
        token_ids=_ids(raw, TOKEN_IDS, path),
        prompt_token_ids=_ids(raw, PROMPT_TOKEN_IDS, path),
        sampled_by=raw.get(SAMPLED_BY) if isinstance(raw.get(SAMPLED_BY), str) else None,
    )
    if choice.token_ids is not None and logprobs is not None and len(choice.token_ids) != len(logprobs):
        raise GroupError(
            f"{path}.{TOKEN_IDS}", f"has {len(choice.token_ids)} ids for {len(logprobs)} token logprobs"
        )
    if choice.prompt_token_ids is not None and not choice.prompt_token_ids:
        raise GroupError(f"{path}.{PROMPT_TOKEN_IDS}", "must not be empty")
    return choice


def _ids(raw: dict[str, Any], key: str, path: str) -> list[int] | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(item, int) and not isinstance(item, bool) and item >= 0 for item in value
    ):
        raise GroupError(f"{path}.{key}", "must be a list of token ids (integers, 0 or more)")
    return list(value)


def _check_messages(history: ClientHistory, key: str) -> None:
    """The history's messages must be what a chat request may hold, checked by the gateway's own
    validator; its ``messages[i]`` is this history's item ``i``."""
    try:
        parse_chat_request(
            {"model": "client", "messages": history.messages(), "tools": history.tools}, Limits.shape_only()
        )
    except RequestError as exc:
        where = exc.param or ""
        match = re.match(r"messages\[(\d+)\](.*)", where)
        if match:
            item = history.items[int(match[1])]
            place = f"{history.path}.{key}[{match[1]}]" + (
                ".message" if isinstance(item, ClientChoice) else ""
            )
            raise GroupError(place + match[2], exc.message) from None
        raise GroupError(f"{history.path}.{where or key}", exc.message) from None


# ------------------------------------------------------------------------------------ tokenizing


@dataclass
class TokenizedTrajectory:
    """A trajectory's samples (one per history, more where it was split) and how exact they are."""

    samples: list[TrainSample]
    token_source: str  # "gateway" | "token_ids" | "logprobs" (the least exact of its choices)
    prompt_mismatches: int = 0  # carried prompts that differ from the re-rendered one (carried wins)
    splits: int = 0  # where a later prompt did not continue the tokens so far

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
        from training.agent import template_supports_tools

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
        segments: list[_Segment] = []
        current: _Segment | None = None
        for index, item in enumerate(history.items[: last + 1]):
            if not isinstance(item, ClientChoice) or not item.trains(self.without_logprobs):
                continue  # context: it reaches the samples through the next choice's prompt
            prompt = self._sampler_prompt(history, index, item, result)
            ids, source = self._sampled_ids(item)
            if _SOURCE_RANK[source] > _SOURCE_RANK[result.token_source]:
                result.token_source = source
            if current is not None and prompt[: len(current.tokens)] == current.tokens:
                current.add(prompt[len(current.tokens) :], None)
            else:
                if current is not None:
                    segments.append(current)
                    result.splits += 1
                current = _Segment(prompt=prompt)
            # Trained without logprobs (allow_training_without_logprobs): NaN, the learner's own.
            current.add(ids, item.logprobs if item.logprobs is not None else [math.nan] * len(ids))
        if current is not None:
            segments.append(current)
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
