"""The inference engine interface: chat requests in, sampled tokens with their logprobs out.

Logprob convention (every engine and the trainer follow it, so importance ratios start at 1):
each sampled token's logprob is `log_softmax(logits / temperature)` at that token, i.e. under the
untempered policy when temperature == 1 and under the tempered distribution otherwise. Top-p
truncation is *not* reflected (the logprob is under the full tempered distribution), because the
trainer cannot recompute the truncation cheaply. temperature == 0 means greedy decoding, with
logprobs under the untempered policy.

Constrained decoding (a per-row grammar, training.engines.grammar) is the one exception: the tokens
the grammar forbids get -inf logits before the softmax, so a constrained token's logprob (and its
top_logprobs alternatives) are those of the masked distribution it was actually sampled from, as
vLLM reports them; the trainer, which does not recompute the mask, would see ratios that do not
start at 1 on such samples.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

FinishReason = Literal["stop", "length"]
MAX_TOP_LOGPROBS = 20  # OpenAI's limit


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 32
    stop: list[str] = field(default_factory=list)  # stop strings; the text is cut before them
    seed: int | None = None  # None = draw from torch's global RNG (so a resumed run continues it)
    top_logprobs: int = 0  # most likely alternatives reported per sampled token (0-20; 0 = none)
    top_k: int = 0  # keep only the k most likely tokens (0 = off)
    min_p: float = 0.0  # keep tokens at least this fraction as likely as the most likely (0 = off)
    stop_token_ids: list[int] = field(default_factory=list)  # these end the completion too (kept last)

    def __post_init__(self) -> None:
        if self.top_k < 0:
            raise ValueError("top_k must be 0 (off) or more")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.temperature < 0:
            raise ValueError("temperature must be 0 or more")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}")


@dataclass
class Choice:
    """One completion.

    `token_ids` are exactly the sampled tokens, including a final eos, and including the tokens of
    a stop string (the trainer trains on what was sampled); `text` is decoded without special
    tokens and cut before the stop string, as OpenAI's API does.
    """

    text: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # one per token_ids entry, see the module docstring
    finish_reason: FinishReason
    # With SamplingParams.top_logprobs = k: per token_ids entry, the k most likely (token id,
    # logprob) pairs of the distribution it was sampled from, most likely first. None: not asked
    # for, or an engine that cannot report them.
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class TokenDelta:
    """One newly sampled token of one sequence, reported while the batch is still generating.

    `text` is what the token adds to the sequence's text: joined in order, a sequence's deltas
    equal its Choice.text. A token that ends inside a multi-byte character, or text that may be
    the start of a stop string, adds "" until the following tokens settle it; nothing past a stop
    string is ever reported.
    """

    index: int  # the sequence's position in the batch (prompt order)
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]  # empty unless SamplingParams.top_logprobs
    text: str
    finish_reason: FinishReason | None  # set on the sequence's last token


OnToken = Callable[[TokenDelta], None]
OnFinished = Callable[[int], None]  # a row index of the batch


class TextDeltas:
    """Turns the decoded text of a growing sequence into append-only deltas (see TokenDelta).

    `update` takes the decoding of every token so far and returns what may be shown now: it holds
    back a trailing U+FFFD (a character whose bytes have not all arrived) and the longest suffix
    that is a prefix of a stop string. `finish` takes the final text (already cut before a stop)
    and returns the rest. Decoding is assumed to be prefix-stable (true of byte-level BPE
    tokenizers without clean-up of spaces); where it is not, text that no longer matches is held
    back until `finish`, and if even the final text does not start with what was shown, the
    remainder cannot be expressed as a delta and "" is returned.
    """

    def __init__(self, stop: list[str]) -> None:
        self.stop = [s for s in stop if s]
        self.emitted = ""

    def update(self, text: str) -> str:
        safe = text.rstrip("\ufffd")
        for length in range(min(len(safe), max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            if any(stop.startswith(safe[-length:]) for stop in self.stop):
                safe = safe[:-length]
                break
        return self._advance(safe)

    def finish(self, text: str) -> str:
        return self._advance(text)

    def _advance(self, text: str) -> str:
        if len(text) <= len(self.emitted) or not text.startswith(self.emitted):
            return ""
        delta = text[len(self.emitted) :]
        self.emitted = text
        return delta


class Engine(ABC):
    """Samples completions. Every engine sets `tokenizer` (a Hugging Face tokenizer with a chat
    template: prompts and the agent loop's environment turns are rendered with it) and may set
    `stop_token_ids` (the ids that end a completion, beyond the tokenizer's eos)."""

    tokenizer: Any
    stop_token_ids: Set[int] = frozenset()

    def generate(
        self, requests: list[list[dict]], sampling: SamplingParams, adapter: str | None = None
    ) -> list[Choice]:
        """One Choice per request (an OpenAI-style message list), in order.

        `adapter` names an adapter loaded with `load_adapter`; None means the engine's default model.
        """
        return self.generate_from_tokens([self.render(messages) for messages in requests], sampling, adapter)

    @abstractmethod
    def generate_from_tokens(
        self,
        prompt_token_ids: list[list[int]],
        sampling: SamplingParams,
        adapter: str | None = None,
        *,
        on_token: OnToken | None = None,
        grammars: Sequence[str | None] | None = None,
        on_finished: OnFinished | None = None,
    ) -> list[Choice]:
        """One Choice per prompt, given as token ids, in order; nothing is re-tokenised.

        The agent loop continues a conversation from the exact tokens sampled so far with this.
        `on_token`, when given, is called on the calling thread with every sampled token
        (TokenDelta) as soon as the engine has it; an engine that cannot report tokens one by one
        reports them all when the batch ends (`report_after`). `grammars`, one per prompt (None:
        unconstrained), constrain each row's tokens to its grammar (training.engines.grammar,
        checked first with `check_grammar`); a row whose grammar is complete ends with "stop".
        `on_finished`, when given, is called with a row's index as soon as that row is finished
        (progress reports; it costs nothing per token); an engine that cannot tell calls it for
        every row when the batch ends (`report_finished_after`).
        """

    def check_grammar(self, grammar: str) -> None:
        """Raise ValueError (GrammarError) saying why `grammar` cannot constrain this engine, or
        NotImplementedError when the engine cannot constrain decoding at all."""
        raise NotImplementedError(f"{type(self).__name__} cannot constrain decoding")

    def render(self, messages: list[dict]) -> list[int]:
        """Prompt token ids of a chat request, ending with the assistant header."""
        return render_chat(self.tokenizer, messages)

    @abstractmethod
    def load_adapter(self, name: str, path: Path) -> None:
        """Make the LoRA adapter saved in `path` available as `name`."""

    @abstractmethod
    def unload_adapter(self, name: str) -> None:
        """Free an adapter loaded with `load_adapter`."""


def report_finished_after(choices: list[Choice], on_finished: OnFinished | None) -> list[Choice]:
    """For engines that cannot report rows as they finish: every row, when the batch ends."""
    if on_finished is not None:
        for index in range(len(choices)):
            on_finished(index)
    return choices


def report_after(choices: list[Choice], on_token: OnToken | None) -> list[Choice]:
    """Report finished choices token by token, for engines that cannot stream: the whole text
    comes with each sequence's last token."""
    if on_token is not None:
        for index, choice in enumerate(choices):
            last = len(choice.token_ids) - 1
            for position, token_id in enumerate(choice.token_ids):
                top = choice.top_logprobs[position] if choice.top_logprobs else []
                on_token(
                    TokenDelta(
                        index, token_id, choice.logprobs[position], top,
                        choice.text if position == last else "",
                        choice.finish_reason if position == last else None,
                    )
                )  # fmt: skip
    return choices


def render_chat(
    tokenizer: Any,
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    variables: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of `messages` rendered with the tokenizer's chat template.

    `tools` (OpenAI-style function schemas) go to the template only when given, so a template
    without tool support renders exactly as before. With `add_generation_prompt` the ids end with
    the assistant header, ready for the model's turn. `variables` are extra template variables (a
    request's `chat_template_kwargs`, e.g. `enable_thinking`), checked by the protocol.
    """
    extra: dict[str, Any] = {**(variables or {})}
    if tools:
        extra["tools"] = tools
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
    )
    # The template already wrote any bos token; do not let the tokenizer add another.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
