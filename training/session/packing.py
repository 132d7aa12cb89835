"""The update's rows without padding and without repeating a group's prompt.

A GRPO group's completions share one prompt. Instead of one padded row per completion (the prompt
recomputed 8 times, short rows padded to the longest), a *unit* lays a prompt out once and its
completions after it, in one row:

    [prompt p0..pP-1 | completion 1 | completion 2 | ...]

with position ids restarting at P for every completion, and a 4-D attention mask in which a
completion token sees the prompt and the earlier tokens of its own completion only (a tree, the
prompt its trunk). Every position computes exactly what it computes in its own padded row, so the
logprobs, the loss and the gradients are those of the padded batch up to float rounding; the
prompt's activations (and, in the backward pass, its gradient contributions) are computed once
per unit instead of once per completion.

The last token of a completion predicts nothing, so it is not fed in; the prompt's last position
predicts every completion's first token. Several small units share a row (block-diagonal) up to
``row_tokens``; a group whose unit would exceed the memory budget is split into several units,
each with its own copy of the prompt. Rows are never padded.

Samples are grouped by identical prompt token ids (exact equality), so a client's trajectories
share prompts the same way a platform run's groups do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from training.rollouts.trajectory import TrainSample

# Rows longer than this pay for a mostly-masked attention (the mask is dense on CPU): units are
# combined into one row only up to it. See benchmarks/README.md, "The packed update, and threads for two torch processes".
ROW_TOKENS = 512


@dataclass
class Unit:
    """One prompt and the indices (into the caller's sample list) of completions laid out after it."""

    prompt: list[int]
    members: list[int]
    lengths: list[int]  # input positions of each member's completion (its length - 1, at least 0)

    @property
    def tokens(self) -> int:
        return len(self.prompt) + sum(self.lengths)


@dataclass
class PackedRow:
    """One forward pass: a single row of units, with what the loss needs for its sequences."""

    input_ids: torch.Tensor  # [1, W]
    position_ids: torch.Tensor  # [1, W]
    attention_mask: torch.Tensor  # [1, 1, W, W], additive (0 or the dtype's minimum)
    keep: torch.Tensor  # [1, W] bool: the positions whose logits are needed
    logit_index: torch.Tensor  # [N, T] long: for each sequence's t-th completion token, its kept position
    targets: torch.Tensor  # [N, T] long: the completion tokens (0 beyond a sequence's end)
    mask: torch.Tensor  # [N, T] float: 1 on trained tokens
    old_logprobs: torch.Tensor  # [N, T]
    advantages: torch.Tensor  # [N]
    members: list[int] = field(default_factory=list)  # indices of the N sequences in the caller's list

    @property
    def width(self) -> int:
        return int(self.input_ids.shape[1])


def completion_inputs(sample: TrainSample) -> int:
    """Positions a completion adds to a unit: all its tokens but the last (which predicts nothing)."""
    return max(len(sample.completion_token_ids) - 1, 0)


def plan_units(samples: Sequence[TrainSample], budget: int) -> list[Unit]:
    """Group samples by prompt, in first-seen order; split a group so each unit fits `budget`
    positions (a unit holds at least one completion, however long)."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for index, sample in enumerate(samples):
        by_prompt.setdefault(tuple(sample.prompt_token_ids), []).append(index)
    units: list[Unit] = []
    for prompt, members in by_prompt.items():
        unit = Unit(list(prompt), [], [])
        for index in members:
            length = completion_inputs(samples[index])
            if unit.members and unit.tokens + length > budget:
                units.append(unit)
                unit = Unit(list(prompt), [], [])
            unit.members.append(index)
            unit.lengths.append(length)
        units.append(unit)
    return units


def plan_rows(units: list[Unit], row_tokens: int) -> list[list[Unit]]:
    """First-fit-decreasing of units into rows of at most `row_tokens` positions (a longer unit
    gets a row of its own). Rows come out in the order of their first unit, largest first."""
    rows: list[list[Unit]] = []
    sizes: list[int] = []
    for unit in sorted(units, key=lambda u: -u.tokens):
        for row, size in enumerate(sizes):
            if size + unit.tokens <= row_tokens:
                rows[row].append(unit)
                sizes[row] += unit.tokens
                break
        else:
            rows.append([unit])
            sizes.append(unit.tokens)
    return rows


def build_row(
    units: list[Unit],
    samples: Sequence[TrainSample],
    advantages: Sequence[float],
    *,
    mask_dtype: torch.dtype = torch.float32,
) -> PackedRow:
    """The tensors of one packed row (on CPU)."""
    tokens: list[int] = []
    positions: list[int] = []
    block: list[int] = []  # which unit a position belongs to
    branch: list[int] = []  # 0 = the unit's prompt, j = its j-th completion
    keep_positions: list[int] = []  # row positions whose logits are needed, in row order
    sequence_positions: list[list[int]] = []  # per sequence: the row positions predicting its tokens
    members: list[int] = []
    for unit_index, unit in enumerate(units):
        prompt_last = len(tokens) + len(unit.prompt) - 1
        tokens.extend(unit.prompt)
        positions.extend(range(len(unit.prompt)))
        block.extend([unit_index] * len(unit.prompt))
        branch.extend([0] * len(unit.prompt))
        keep_positions.append(prompt_last)
        for j, (member, length) in enumerate(zip(unit.members, unit.lengths, strict=True), start=1):
            completion = samples[member].completion_token_ids
            start = len(tokens)
            tokens.extend(completion[:length])
            positions.extend(range(len(unit.prompt), len(unit.prompt) + length))
            block.extend([unit_index] * length)
            branch.extend([j] * length)
            keep_positions.extend(range(start, start + length))
            sequence_positions.append([prompt_last, *range(start, start + length)][: len(completion)])
            members.append(member)

    width = len(tokens)
    block_t = torch.tensor(block)
    branch_t = torch.tensor(branch)
    index = torch.arange(width)
    allowed = (
        (block_t[:, None] == block_t[None, :])
        & (index[None, :] <= index[:, None])
        & ((branch_t[None, :] == 0) | (branch_t[None, :] == branch_t[:, None]))
    )
    attention_mask = torch.zeros((width, width), dtype=mask_dtype)
    attention_mask.masked_fill_(~allowed, torch.finfo(mask_dtype).min)

    keep = torch.zeros(width, dtype=torch.bool)
    keep[keep_positions] = True
    # Kept logits come out in row order: a row position's rank among the kept ones is its index.
    rank = torch.cumsum(keep.long(), 0) - 1

    rows = len(members)
    longest = max((len(samples[m].completion_token_ids) for m in members), default=0)
    longest = max(longest, 1)
    logit_index = torch.zeros((rows, longest), dtype=torch.long)
    targets = torch.zeros((rows, longest), dtype=torch.long)
    mask = torch.zeros((rows, longest))
    old_logprobs = torch.zeros((rows, longest))
    for row, (member, predicting) in enumerate(zip(members, sequence_positions, strict=True)):
        sample = samples[member]
        n = len(sample.completion_token_ids)
        if not n:
            continue
        logit_index[row, :n] = rank[torch.tensor(predicting)]
        targets[row, :n] = torch.tensor(sample.completion_token_ids)
        sampled = [1] * n if sample.completion_mask is None else sample.completion_mask
        mask[row, :n] = torch.tensor(sampled, dtype=mask.dtype)
        old_logprobs[row, :n] = torch.tensor(sample.completion_logprobs)
    return PackedRow(
        input_ids=torch.tensor(tokens, dtype=torch.long)[None],
        position_ids=torch.tensor(positions, dtype=torch.long)[None],
        attention_mask=attention_mask[None, None],
        keep=keep[None],
        logit_index=logit_index,
        targets=targets,
        mask=mask,
        old_logprobs=old_logprobs,
        advantages=torch.tensor([advantages[m] for m in members], dtype=torch.float32),
        members=members,
    )


def pack(
    samples: Sequence[TrainSample],
    advantages: Sequence[float],
    *,
    budget: int,
    row_tokens: int = ROW_TOKENS,
    mask_dtype: torch.dtype = torch.float32,
) -> list[PackedRow]:
    """The packed rows of an update: every sample in exactly one row, no row over
    max(budget, one prompt + one completion) positions."""
    units = plan_units(samples, budget)
    return [
        build_row(row, samples, advantages, mask_dtype=mask_dtype)
        for row in plan_rows(units, min(row_tokens, budget))
    ]


# ART shares a common prefix between sequences in a packed row only when it is at least this long.
MIN_SHARED_PREFIX = 64


def plan_sequences(
    samples: Sequence[TrainSample],
    seq_len: int,
    *,
    groups: Sequence[int] | None = None,
    min_shared: int = MIN_SHARED_PREFIX,
) -> list[list[int]]:
    """ART's packing rule (art/preprocessing/pack.py with results packed, as its Megatron backend and
    ServerlessBackend pack): the samples' indices in packed sequences of at most ``seq_len`` tokens,
    one optimizer step each.

    Cost: the samples' token lists form a prefix tree over what may be shared (a sample's prompt
    but its last token); a stretch common to several samples is laid out once per sequence when it
    is at least ``min_shared`` tokens long, else each copies it. A sample costs the tree segments on
    its path that its sequence does not hold yet. Placement: the samples of one group (``groups``,
    default one group per distinct prompt) stay together, groups with the costliest sample first;
    each sample goes best-fit (the sequence it leaves the least room in), a new sequence when none
    has room. A sample longer than ``seq_len`` is the caller's to drop (ART drops it with a
    warning). The sequences come out in ART's order: shuffled with their number as the seed.
    ``tests/integration/test_art_packing_rule.py`` compares the counts with ART's own code.
    """
    import random

    rows = [tuple(s.prompt_token_ids) + tuple(s.completion_token_ids) for s in samples]
    shareable = [_shareable(sample) for sample in samples]
    paths: list[list[tuple[int, int]]] = [[] for _ in samples]  # per sample: (segment id, length)
    _segments(rows, shareable, min_shared, paths)
    if groups is None:
        first: dict[tuple[int, ...], int] = {}
        groups = [first.setdefault(tuple(s.prompt_token_ids), len(first)) for s in samples]
    by_group: dict[int, list[int]] = {}
    for index, group in enumerate(groups):
        by_group.setdefault(group, []).append(index)

    def cost(index: int) -> int:
        return sum(length for _, length in paths[index])

    ordered = sorted(by_group.values(), key=lambda members: max(cost(i) for i in members), reverse=True)
    sequences: list[list[int]] = []
    used: list[int] = []
    held: list[set[int]] = []
    for members in ordered:
        for index in members:
            if cost(index) > seq_len:
                raise ValueError(f"sample {index} is {cost(index)} tokens, over {seq_len}")
            best, room = None, seq_len + 1
            for row, count in enumerate(used):
                total = count + sum(n for segment, n in paths[index] if segment not in held[row])
                if total <= seq_len and seq_len - total < room:
                    best, room = row, seq_len - total
            if best is None:
                sequences.append([])
                used.append(0)
                held.append(set())
                best = len(sequences) - 1
            used[best] += sum(n for segment, n in paths[index] if segment not in held[best])
            held[best].update(segment for segment, _ in paths[index])
            sequences[best].append(index)
    random.Random(len(sequences)).shuffle(sequences)
    return sequences


def _shareable(sample: TrainSample) -> int:
    """How much of a sample may be shared with others: its prompt, but not the token before its
    first trained one (that position's logits are the sample's own)."""
    mask = sample.completion_mask or [1] * len(sample.completion_token_ids)
    first = next((i for i, bit in enumerate(mask) if bit), len(mask))
    return min(len(sample.prompt_token_ids), max(len(sample.prompt_token_ids) + first - 1, 0))


def _segments(
    rows: list[tuple[int, ...]], shareable: list[int], min_shared: int, paths: list[list[tuple[int, int]]]
) -> None:
    """Fill ``paths`` with each row's prefix-tree segments (see plan_sequences)."""
    counter = iter(range(1 << 62))

    def emit(indices: list[int], start: int, end: int) -> None:
        segment = next(counter)
        for index in indices:
            paths[index].append((segment, end - start))

    def split(indices: list[int], at: int) -> list[list[int]]:
        branches: dict[int, list[int]] = {}
        for index in indices:
            branches.setdefault(rows[index][at], []).append(index)
        return list(branches.values())

    def walk(indices: list[int], start: int) -> None:
        active = [i for i in indices if len(rows[i]) > start]
        sharing = [i for i in active if shareable[i] > start]
        for index in active:
            if index not in sharing or len(sharing) == 1:
                emit([index], start, len(rows[index]))
        if len(sharing) < 2:
            return
        limit = min(min(len(rows[i]), shareable[i]) for i in sharing)
        end = start
        while end < limit and len({rows[i][end] for i in sharing}) == 1:
            end += 1
        if end == start:
            for branch in split(sharing, start):
                walk(branch, start)
        elif end - start >= min_shared:
            emit(sharing, start, end)
            walk(sharing, end)
        else:  # too short to share: every branch after it copies it
            further = [i for i in sharing if len(rows[i]) > end and shareable[i] > end]
            for index in sharing:
                if index not in further:
                    emit([index], start, len(rows[index]))
            for branch in split(further, end):
                walk(branch, start)

    walk(list(range(len(rows))), 0)
