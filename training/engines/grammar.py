"""Constrained decoding: a grammar masks, at every sampling step, each token that would break it,
so that a completion asked for with `response_format` is JSON (of a given schema) token by token.

The grammar engine is llguidance (MIT), the Rust library behind vLLM's `guidance` structured
output backend: one abi3 wheel with no dependencies. xgrammar, vLLM's other backend, was not
chosen: its wheel requires torch, triton and apache-tvm-ffi, i.e. a second GPU stack on a CPU
machine, for nothing llguidance does not do here.

- `json_grammar(schema)`: the grammar of a JSON schema (None: any JSON object, `json_object`).
- `GrammarCompiler`: per engine tokenizer (its llguidance tokenizer is built once and cached per
  tokenizer object, ~0.5 s for a 49k vocabulary); `check` a grammar (GrammarError with the
  reason), and `matchers` for one batch.
- `BatchMatchers`: one matcher per constrained row of a batch; `mask_logits` puts -inf on every
  token its grammar forbids (rows without a grammar are untouched), `advance` feeds each row the
  token it sampled and says whether its grammar is complete.

JSON is written the way Python's `json.dumps` writes it, `{"a": 1, "b": [2, 3]}`, with no other
whitespace: the form models see most, and no room for a weak model to spend its whole budget on
blanks (the failure vLLM's `disable_any_whitespace` option exists for; even with whitespace
bounded to 20 characters per gap, the tiny test model decoded greedily filled every gap and ran out
of tokens). Object properties come in schema order, as in every llguidance-based server. A schema
may override the separators with llguidance's own `x-guidance` key.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Collection, Sequence
from copy import copy
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import llguidance
import torch

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# JSON as Python's json.dumps writes it (see the module doc).
_JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


class GrammarError(ValueError):
    """A grammar (a response_format's schema) the engine cannot compile; the message says why."""


def json_grammar(schema: dict[str, Any] | None) -> str:
    """The llguidance grammar text for JSON matching `schema` (None: any JSON object)."""
    try:
        return str(
            llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(ANY_JSON_OBJECT if schema is None else schema), defaults=_JSON_OPTIONS
            )
        )
    except (ValueError, TypeError) as exc:
        raise GrammarError(str(exc)) from exc


class GrammarCompiler:
    """Grammars for one tokenizer. `vocab_size` is the width of the model's logits (it may exceed
    the tokenizer's own count: padded embedding tables); `stop_token_ids` are the ids that end a
    completion, allowed exactly where the grammar may end."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Collection[int]) -> None:
        self.tokenizer = _grammar_tokenizer(tokenizer, vocab_size, tuple(sorted(stop_token_ids)))
        self.vocab_size = vocab_size
        # Compiled matchers by grammar text: a request's n rows, and the next request with the same
        # schema (a judge asks with one schema all day), start from a copy.
        self._compiled = lru_cache(maxsize=64)(self._compile)

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher

    def check(self, grammar: str) -> None:
        """Raise GrammarError (with llguidance's reason) if `grammar` cannot be used."""
        self._compiled(grammar)

    def matchers(self, grammars: Sequence[str | None]) -> BatchMatchers:
        return BatchMatchers(
            [None if grammar is None else self._compiled(grammar).deep_copy() for grammar in grammars],
            self.tokenizer.vocab_size,
        )


class BatchMatchers:
    """The grammar state of each row of one batch (None: an unconstrained row)."""

    def __init__(self, matchers: list[llguidance.LLMatcher | None], vocab_size: int) -> None:
        self.matchers = matchers
        self.rows = [row for row, matcher in enumerate(matchers) if matcher is not None]
        self.vocab_size = vocab_size
        self._bitmask = torch.zeros((len(self.rows), (vocab_size + 31) // 32), dtype=torch.int32)
        self._bits = torch.tensor([1 << bit for bit in range(32)], dtype=torch.int64).to(torch.int32)

    def mask_logits(self, logits: torch.Tensor, done: Sequence[bool]) -> torch.Tensor:
        """`logits` [B, V] with every token the row's grammar forbids at -inf (a new tensor when any
        row is constrained). Rows that are `done` are left alone (their samples are ignored)."""
        live = [(index, row) for index, row in enumerate(self.rows) if not done[row]]
        if not live:
            return logits
        bitmask = self._bitmask
        _executor().unsafe_compute_mask_ptr(
            [(self.matchers[row], index) for index, row in live],  # type: ignore[misc]
            bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0],
        )  # fmt: skip
        width = logits.shape[-1]
        allowed = ((bitmask.unsqueeze(-1) & self._bits) != 0).flatten(1)  # [constrained rows, 32 * words]
        if allowed.shape[1] < width:  # logits past the grammar's vocabulary are never allowed
            allowed = torch.cat(
                [allowed, allowed.new_zeros((len(self.rows), width - allowed.shape[1]))], dim=1
            )
        if len(live) == logits.shape[0]:  # every row constrained and still going: the usual case
            allowed = allowed[:, :width]
        else:
            every = torch.ones(logits.shape, dtype=torch.bool)
            indices = torch.tensor([index for index, _ in live])
            every[torch.tensor([row for _, row in live])] = allowed[indices, :width]
            allowed = every
        return torch.where(allowed.to(logits.device), logits, float("-inf"))

    def advance(self, row: int, token: int) -> bool:
        """Feed row `row` the token it sampled; True when its grammar is complete (nothing but a
        stop token could follow). An unconstrained row is never complete."""
        matcher = self.matchers[row]
        if matcher is None:
            return False
        if not matcher.consume_token(token):
            # Cannot happen for a token sampled under the mask; a row that gets here ends.
            raise GrammarError(f"the grammar refused token {token}: {matcher.get_error()}")
        return bool(matcher.is_stopped())


_tokenizers: weakref.WeakKeyDictionary[Any, dict[tuple[int, tuple[int, ...]], Any]] = (
    weakref.WeakKeyDictionary()
)
_tokenizers_lock = threading.Lock()


def _grammar_tokenizer(tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> Any:
    """llguidance's view of a Hugging Face fast tokenizer, built once per tokenizer object."""
    with _tokenizers_lock:
        built = _tokenizers.setdefault(tokenizer, {})
        key = (vocab_size, stop_token_ids)
        if key not in built:
            backend = getattr(tokenizer, "backend_tokenizer", None)
            if backend is None:
                raise GrammarError("constrained decoding needs a fast (Rust) Hugging Face tokenizer")
            backend = copy(backend)  # as llguidance.hf does: serialise without padding/truncation
            backend.no_padding()
            backend.no_truncation()
            built[key] = llguidance.LLTokenizer(
                backend.to_str(), n_vocab=vocab_size, eos_token=list(stop_token_ids) or None
            )
        return built[key]


@lru_cache(maxsize=1)
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()
