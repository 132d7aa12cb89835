"""Stored completions as ART trajectories: one completion, or a whole conversation (the completions
whose metadata share a value under the team's ``conversation_key``) joined into one multi-turn
trajectory, and the exact token view of that join.

A conversation is read oldest turn first. Each turn's request carries the messages so far; where
they continue the history (the earlier turns' messages and replies, then new messages), the turn
joins it, else it starts a history of its own (ART's ``additional_histories``: a client that
rewrote or dropped earlier turns). Tokens are joined on the sampler's own ids, never re-rendered
(``training.runs.art_tokens.join_turns``): a turn whose prompt ids begin with the ids so far
continues the sample, with exact boundaries; one that does not (a template that writes an earlier
turn back differently) starts a sample of its own. So every trained id keeps the context it was
sampled in.
"""

from __future__ import annotations

from typing import Any

from projects.models import StoredCompletion
from training.runs.art_tokens import join_turns


def sampled(row: StoredCompletion) -> tuple[list[int], list[float]] | None:
    """The first choice's sampled ids and logprobs, or None when the row has no usable pair."""
    ids, logprobs = (row.token_ids or [None])[0], (row.logprobs or [None])[0]
    if not row.prompt_token_ids or not ids or not logprobs or len(ids) != len(logprobs):
        return None
    return list(ids), list(logprobs)


def art_choice(row: StoredCompletion) -> dict[str, Any]:
    """The row's first choice as ART's trajectories carry it, with the gateway's exact ids, the
    sampler's logprobs and the checkpoint that served it (token source ``gateway``)."""
    pair = sampled(row)
    assert pair is not None, "art_choice needs a row with ids and logprobs (see sampled)"
    ids, logprobs = pair
    choices = row.response.get("choices") or [{}]
    first = choices[0] if isinstance(choices[0], dict) else {}
    message = dict(first.get("message") or {})
    message.setdefault("role", "assistant")
    return {
        "index": 0,
        "message": message,
        "finish_reason": first.get("finish_reason") or "stop",
        "logprobs": {
            "content": [
                {"token": f"token_id:{i}", "logprob": lp, "bytes": None, "top_logprobs": []}
                for i, lp in zip(ids, logprobs, strict=True)
            ]
        },
        "token_ids": ids,
        "prompt_token_ids": row.prompt_token_ids,
        "artweb_model": row.served_by,
    }


def _calls(message: dict[str, Any]) -> list[tuple[Any, Any]]:
    calls = message.get("tool_calls") or []
    return [
        ((c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments"))
        for c in calls
        if isinstance(c, dict)
    ]


def _same(sent: dict[str, Any], kept: dict[str, Any]) -> bool:
    """Whether a message a client sent back is the one kept (role, text and tool calls: clients
    add fields of their own, such as ``refusal: null``, when they send a reply back)."""
    return (
        sent.get("role") == kept.get("role")
        and (sent.get("content") or None) == (kept.get("content") or None)
        and _calls(sent) == _calls(kept)
    )


def conversation_trajectory(rows: list[StoredCompletion], reward: float) -> dict[str, Any]:
    """One ART trajectory of ``rows`` (a conversation's turns that have ids and logprobs, oldest
    first), with ``reward``; its metadata names every completion."""
    histories: list[dict[str, Any]] = []
    said: list[dict[str, Any]] = []  # the current history's messages, replies included
    for row in rows:
        messages, choice = row.sent_messages, art_choice(row)
        continues = (
            histories
            and len(messages) >= len(said)
            and all(_same(sent, kept) for sent, kept in zip(messages, said, strict=False))
        )
        if continues:
            histories[-1]["messages_and_choices"] += [*messages[len(said) :], choice]
        else:
            histories.append({"messages_and_choices": [*messages, choice]})
        said = [*messages, choice["message"]]
        if row.request.get("tools") and "tools" not in histories[-1]:
            histories[-1]["tools"] = row.request["tools"]
    first, *more = histories
    trajectory: dict[str, Any] = {
        **first,
        "reward": float(reward),
        "metadata": {"completion_ids": ",".join(row.completion_id for row in rows)[:2000]},
    }
    if more:
        trajectory["additional_histories"] = more
    return trajectory


def conversation_tokens(rows: list[StoredCompletion]) -> dict[str, Any]:
    """The exact token join of a conversation's turns: its samples (token count, trained tokens)
    and, per turn, where its sampled ids lie (sample, start, end); a turn stored without ids is
    listed with ``sample`` None."""
    usable = [(row, sampled(row)) for row in rows]
    turns = [(list(row.prompt_token_ids or []), pair[0], pair[1]) for row, pair in usable if pair is not None]
    segments, placements = join_turns(turns)
    placed = iter(placements)
    turn_bodies = []
    for row, pair in usable:
        body: dict[str, Any] = {"id": row.completion_id, "served_by": row.served_by, "reward": row.reward}
        if pair is None:
            body.update(sample=None, start=None, end=None)
        else:
            place = next(placed)
            body.update(sample=place.sample, start=place.start, end=place.end)
        turn_bodies.append(body)
    return {
        "samples": [{"tokens": len(s.tokens), "trained_tokens": sum(s.mask)} for s in segments],
        "turns": turn_bodies,
    }
