"""Scored trajectory groups sent by a client (OpenPipe ART's ``TrajectoryGroup.model_dump(mode="json")``)
read and checked, without a tokenizer or torch, so the web process can refuse a bad upload: every
trajectory has a reward and items that are message dicts or OpenAI ``Choice`` dicts (or, from
openpipe-art 0.5.23, captured ``exchanges``), messages validate as the gateway validates a chat
request, and at least one trajectory of the upload has a choice to train on. Each problem is a
``GroupError`` naming its place (``trajectory_groups[0].trajectories[1].messages_and_choices[2]``).
training.runs.art_tokens turns the checked groups into the trainer's samples on the exact ids that
were sampled; ``annotate_completion`` is the gateway's side of that exactness.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from training.serving.protocol import Limits, RequestError, parse_chat_request

__all__ = [
    "ClientChoice",
    "ClientGroup",
    "ClientHistory",
    "ClientTrajectory",
    "GroupError",
    "annotate_completion",
    "exchange_histories",
    "parse_groups",
]

# The extension fields artweb's gateway adds to each choice (``annotate_completion``).
TOKEN_IDS = "token_ids"
PROMPT_TOKEN_IDS = "prompt_token_ids"
SAMPLED_BY = "artweb_model"


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
