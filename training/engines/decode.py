"""A live decode batch: rows join and leave between steps, sharing one KV cache.

Invariant: position i of `_rows`, of every cache layer's keys/values and of `_mask` is the same
sequence; every change to the row set (a join, a finish, a cancel) updates all three together.
Each row's last sampled token is not in the cache yet: the next step feeds it, so a row that
finishes or is cancelled never costs another forward pass. A batch switches its engine's model to
its adapter for each call: one thread steps one engine's batches, one batch at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from training.engines.base import Choice, FinishReason, OnToken, SamplingParams, TextDeltas, TokenDelta
from training.engines.grammar import BatchMatchers
from training.engines.sampling import sample_tokens, uniform_draws

if TYPE_CHECKING:
    from training.engines.transformers_engine import TransformersEngine


def row_seed(seed: int, index: int) -> int:
    """The generator seed of row `index` of a request seeded with `seed`: the n rows of one request
    (a group's samples) draw independent streams, and a row's stream does not depend on which
    other rows share its batch. Row 0 keeps the request's seed."""
    return seed if index == 0 else (seed * 1_000_003 + index * 9_973) % (2**63)


@dataclass(eq=False)
class _Row:
    handle: int
    index: int  # position in its add() call: TokenDelta.index
    prompt: list[int]
    sampling: SamplingParams
    on_token: OnToken | None
    generator: torch.Generator | None
    matchers: BatchMatchers | None  # its add() call's grammars, and its row in them
    matcher_row: int
    deltas: TextDeltas | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str | None = None  # set when a stop string cut it, or when the row ends while streaming
    finish: FinishReason | None = None
    cached: int = 0  # this row's real tokens in the cache (the next position id)

    def choice(self, decode: Any) -> Choice:
        return Choice(
            text=self.text if self.text is not None else decode(self.token_ids),
            prompt_token_ids=self.prompt,
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            finish_reason=self.finish or "length",
            top_logprobs=self.tops if self.sampling.top_logprobs else None,
        )


class DecodeBatch:
    """Rows decoding together over one model and one adapter scope (`adapter`: see
    TransformersEngine; the caller groups requests by adapter).

    `add` queues rows (prefilled at the next `step`, identical prompts once: `share_prompts`);
    `step` decodes one token for every live row and returns the rows that finished, which leave the
    batch and its cache at once; `cancel` drops a row now. Rows may differ in every SamplingParams
    field; a seeded row draws from its own generator (see `row_seed`).
    """

    def __init__(
        self, engine: TransformersEngine, adapter: str | None, *, share_prompts: bool = True
    ) -> None:
        engine.check_adapter(adapter)
        self.engine = engine
        self.adapter = adapter
        self.share_prompts = share_prompts
        self._next_handle = 0
        self._pending: list[_Row] = []  # added, prefilled at the next step
        self._rows: list[_Row] = []  # in the cache, in cache order
        self._cache: Any = None
        self._mask: torch.Tensor | None = None  # [rows, cache length]: 1 = a real token
        self.forward_rows = 0  # rows × forward passes so far (prefill rows counted once per prompt)

    @property
    def live(self) -> int:
        """Rows still decoding (queued ones included)."""
        return len(self._rows) + len(self._pending)

    def add(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        *,
        on_token: OnToken | None = None,
        grammars: Sequence[str | None] | None = None,
    ) -> list[int]:
        """Queue one row per prompt; returns their handles, in order. `on_token` gets every token of
        these rows (TokenDelta.index: the row's position in `prompts`); `grammars`, one per prompt,
        constrain rows (training.engines.grammar)."""
        if not all(prompts):
            raise ValueError("every prompt needs at least one token")
        if grammars is not None and len(grammars) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(grammars)} grammars")
        matchers = None
        if grammars is not None and any(grammar is not None for grammar in grammars):
            matchers = self.engine.grammars.matchers(grammars)
        handles = []
        for index, prompt in enumerate(prompts):
            generator = None
            if sampling.seed is not None:
                generator = torch.Generator(device=self.engine.device)
                generator.manual_seed(row_seed(sampling.seed, index))
            row = _Row(
                handle=self._next_handle,
                index=index,
                prompt=list(prompt),
                sampling=sampling,
                on_token=on_token,
                generator=generator,
                matchers=matchers,
                matcher_row=index,
                deltas=TextDeltas(sampling.stop) if on_token else None,
            )
            self._next_handle += 1
            self._pending.append(row)
            handles.append(row.handle)
        return handles

    def cancel(self, handle: int) -> None:
        """Drop a row now; a handle that is not live (finished, cancelled, unknown) is ignored."""
        self._pending = [row for row in self._pending if row.handle != handle]
        keep = [position for position, row in enumerate(self._rows) if row.handle != handle]
        if len(keep) < len(self._rows):
            with torch.no_grad():
                self._keep(keep)

    def step(self) -> list[tuple[int, Choice]]:
        """Decode one token for every live row; return (handle, Choice) of the rows that finished."""
        if not self.live:
            return []
        with self.engine.inference(self.adapter):
            logits = []
            if self._rows:
                logits.append(self._decode_forward())
            if self._pending:
                logits.append(self._prefill())
            return self._sample(torch.cat(logits) if len(logits) > 1 else logits[0])

    # -- forward passes ------------------------------------------------------------------------

    def _decode_forward(self) -> torch.Tensor:
        """Feed every row its last sampled token; return the next logits [rows, V]."""
        assert self._mask is not None
        device = self.engine.device
        rows = self._rows
        tokens = torch.tensor([[row.token_ids[-1]] for row in rows], dtype=torch.long, device=device)
        positions = torch.tensor([[row.cached] for row in rows], dtype=torch.long, device=device)
        self._mask = torch.cat([self._mask, self._mask.new_ones((len(rows), 1))], dim=1)
        out = self.engine.model(
            input_ids=tokens,
            attention_mask=_unless_full(self._mask),
            position_ids=positions,
            use_cache=True,
            **{self.engine.cache_argument: self._cache},
        )
        self._cache = self.engine.returned_cache(out)
        for row in rows:
            row.cached += 1
        self.forward_rows += len(rows)
        return out.logits[:, -1, :]

    def _prefill(self) -> torch.Tensor:
        """Prefill the queued rows (each distinct prompt once), join them to the batch; return
        their first logits [queued rows, V]."""
        rows, self._pending = self._pending, []
        distinct: dict[tuple[int, ...], int] = {}
        source = []  # row -> its prompt's position in the prefill batch
        prompts: list[list[int]] = []
        for row in rows:
            key = tuple(row.prompt)
            if not self.share_prompts or key not in distinct:
                distinct[key] = len(prompts)
                prompts.append(row.prompt)
            source.append(distinct[key])
        width = max(len(prompt) for prompt in prompts)
        # Left padding lines up every row's last token; positions count real tokens only.
        input_ids = torch.full((len(prompts), width), self.engine.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for position, prompt in enumerate(prompts):
            input_ids[position, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[position, width - len(prompt) :] = 1
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        device = self.engine.device
        input_ids, mask, position_ids = (t.to(device) for t in (input_ids, mask, position_ids))
        extra: dict[str, Any] = {self.engine.cache_argument: self._new_cache()}
        if self.engine.can_keep_last_logits:
            extra["logits_to_keep"] = 1
        out = self.engine.model(
            input_ids=input_ids,
            attention_mask=_unless_full(mask),
            position_ids=position_ids,
            use_cache=True,
            **extra,
        )
        cache = self.engine.returned_cache(out)
        logits = out.logits[:, -1, :]
        self.forward_rows += len(prompts)
        if source != list(range(len(prompts))):  # fan the shared prompts out to their rows
            index = torch.tensor(source, dtype=torch.long, device=device)
            cache.batch_select_indices(index)
            logits, mask = logits[index], mask[index]
        for row in rows:
            row.cached = len(row.prompt)
        self._join(cache, mask, rows)
        return logits

    def _new_cache(self) -> DynamicCache:
        """The model's own dynamic cache, with growing layers where all its layers are plain."""
        cache = DynamicCache(config=self.engine.model.config)
        if cache.layers and all(type(layer) is DynamicLayer for layer in cache.layers):
            cache.layers = [GrowingLayer() for _ in cache.layers]
        return cache

    def _join(self, cache: Any, mask: torch.Tensor, rows: list[_Row]) -> None:
        if not self._rows:
            self._cache, self._mask, self._rows = cache, mask, rows
            return
        assert self._mask is not None
        length = max(self._mask.shape[1], mask.shape[1])
        for mine, theirs in zip(self._cache.layers, cache.layers, strict=True):
            if type(mine) not in _PLAIN_LAYERS or type(theirs) not in _PLAIN_LAYERS:
                raise NotImplementedError(
                    f"rows can join a running batch only with a plain dynamic KV cache, not {type(mine).__name__}"
                )
            if not mine.is_initialized:
                continue
            for name in ("keys", "values"):
                joined = [_pad_left(getattr(layer, name), length, 2) for layer in (mine, theirs)]
                setattr(mine, name, torch.cat(joined))
        self._mask = torch.cat([_pad_left(self._mask, length, 1), _pad_left(mask, length, 1)])
        self._rows = self._rows + rows

    def _keep(self, positions: list[int]) -> None:
        """Keep only these rows (cache order); drop the left padding no remaining row needs."""
        if len(positions) == len(self._rows):
            return
        if not positions:
            self._rows, self._cache, self._mask = [], None, None
            return
        assert self._mask is not None
        index = torch.tensor(positions, dtype=torch.long, device=self._mask.device)
        self._cache.batch_select_indices(index)
        self._mask = self._mask[index]
        self._rows = [self._rows[position] for position in positions]
        first = int(self._mask.any(dim=0).to(torch.int8).argmax())  # first column still attended to
        if first > 0 and all(type(layer) in _PLAIN_LAYERS for layer in self._cache.layers):
            for layer in self._cache.layers:
                if layer.is_initialized:
                    layer.keys = layer.keys[:, :, first:]
                    layer.values = layer.values[:, :, first:]
            self._mask = self._mask[:, first:]

    # -- sampling ------------------------------------------------------------------------------

    def _sample(self, logits: torch.Tensor) -> list[tuple[int, Choice]]:
        rows = self._rows
        logits = self._grammar_masked(logits)
        draws = uniform_draws(
            sum(1 for row in rows if row.generator is None and row.sampling.temperature > 0),
            None,
            self.engine.device,
        ).tolist()
        uniforms = []
        for row in rows:
            if row.sampling.temperature == 0:
                uniforms.append(1.0)
            elif row.generator is None:
                uniforms.append(draws.pop(0))
            else:
                uniforms.append(float(uniform_draws(1, row.generator, self.engine.device)))
        sampled = sample_tokens(
            logits,
            [row.sampling.temperature for row in rows],
            [row.sampling.top_p for row in rows],
            torch.tensor(uniforms, dtype=torch.float64, device=logits.device),
            top_ks=[row.sampling.top_k for row in rows],
            min_ps=[row.sampling.min_p for row in rows],
        )
        tokens = sampled.tokens.tolist()
        logprobs = sampled.logprobs.tolist()
        widest = max(row.sampling.top_logprobs for row in rows)
        top_values: list[list[float]] = []
        top_ids: list[list[int]] = []
        if widest:
            values, ids = sampled.top_logprobs(widest)
            top_values, top_ids = values.tolist(), ids.tolist()

        finished: list[tuple[int, Choice]] = []
        keep = []
        for position, row in enumerate(rows):
            k = row.sampling.top_logprobs
            tops = []
            if k:
                pairs = zip(top_ids[position][:k], top_values[position][:k], strict=True)
                tops = [(i, v) for i, v in pairs if v != float("-inf")]
            self._advance(row, tokens[position], logprobs[position], tops)
            if row.finish is None:
                keep.append(position)
            else:
                finished.append((row.handle, row.choice(self.engine.decode)))
        self._keep(keep)
        return finished

    def _grammar_masked(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` with each constrained row's forbidden tokens at -inf (BatchMatchers works on its
        add() call's rows, so each call's live rows are masked together)."""
        groups: dict[int, tuple[BatchMatchers, list[int]]] = {}
        for position, row in enumerate(self._rows):
            if row.matchers is not None:
                groups.setdefault(id(row.matchers), (row.matchers, []))[1].append(position)
        if not groups:
            return logits
        logits = logits.clone()
        for matchers, positions in groups.values():
            local = [self._rows[position].matcher_row for position in positions]
            width = len(matchers.matchers)
            view = logits.new_zeros((width, logits.shape[1]))
            local_index = torch.tensor(local, dtype=torch.long, device=logits.device)
            batch_index = torch.tensor(positions, dtype=torch.long, device=logits.device)
            view[local_index] = logits[batch_index]
            live = set(local)
            masked = matchers.mask_logits(view, [row not in live for row in range(width)])
            logits[batch_index] = masked[local_index]
        return logits

    def _advance(self, row: _Row, token: int, logprob: float, tops: list[tuple[int, float]]) -> None:
        """Append a sampled token to its row, decide whether the row ends, report it."""
        row.token_ids.append(token)
        row.logprobs.append(logprob)
        if row.sampling.top_logprobs:
            row.tops.append(tops)
        stop = row.sampling.stop
        text = None
        if token in self.engine.stop_token_ids or token in row.sampling.stop_token_ids:
            row.finish = "stop"
        else:
            # A complete grammar ends the row: nothing but a stop token could follow.
            complete = row.matchers is not None and row.matchers.advance(row.matcher_row, token)
            if stop or row.on_token:
                text = self.engine.decode(row.token_ids)
                cut = _first_stop(text, stop)
                if cut is not None:
                    row.finish, row.text = "stop", text[:cut]
            if complete:
                row.finish = "stop"
        if row.finish is None and len(row.token_ids) >= row.sampling.max_new_tokens:
            row.finish = "length"
        if row.on_token is None:
            return
        assert row.deltas is not None
        if row.finish is None:
            piece = row.deltas.update(text or "")
        else:
            if row.text is None:
                row.text = text if text is not None else self.engine.decode(row.token_ids)
            piece = row.deltas.finish(row.text)
        row.on_token(TokenDelta(row.index, token, logprob, tops, piece, row.finish))


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are the leading positions of buffers with room to spare:
    a decode step writes one position instead of copying the layer's whole cache (which
    DynamicLayer.update does by concatenation). Anything that replaces `keys`/`values` (row
    selection, trimming, a join) leaves them outside the buffer; the next update starts a new one."""

    spare = 32  # positions allocated ahead

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys, self.values
        if not self.is_initialized or keys is None or values is None or keys.numel() == 0:
            return super().update(key_states, value_states, *args, **kwargs)
        self._key_buffer, keys = _append(getattr(self, "_key_buffer", None), keys, key_states, self.spare)
        self._value_buffer, values = _append(
            getattr(self, "_value_buffer", None), values, value_states, self.spare
        )
        self.keys, self.values = keys, values
        return keys, values


_PLAIN_LAYERS = (DynamicLayer, GrowingLayer)


def _append(
    buffer: torch.Tensor | None, view: torch.Tensor, new: torch.Tensor, spare: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view of its first positions) after appending `new` along the sequence dim."""
    length, extra = view.shape[-2], new.shape[-2]
    inside = (
        buffer is not None
        and buffer.data_ptr() == view.data_ptr()
        and buffer.shape[:2] == view.shape[:2]
        and buffer.stride() == view.stride()
        and buffer.shape[-2] >= length + extra
    )
    if not inside:
        buffer = view.new_empty((*view.shape[:2], length + extra + spare, view.shape[-1]))
        buffer[:, :, :length] = view
    assert buffer is not None
    buffer[:, :, length : length + extra] = new
    return buffer, buffer[:, :, : length + extra]


def _unless_full(mask: torch.Tensor) -> torch.Tensor | None:
    """No mask when no row has padding: attention then needs no mask tensor, and grouped-query
    attention runs without copying the keys and values per query head (transformers' SDPA path)."""
    return None if bool(mask.all()) else mask


def _pad_left(tensor: Any, length: int, dim: int) -> torch.Tensor:
    missing = length - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def _first_stop(text: str, stops: list[str]) -> int | None:
    positions = [text.find(stop) for stop in stops if stop]
    found = [p for p in positions if p >= 0]
    return min(found) if found else None
