"""The inference engine interface: chat requests in, sampled tokens with their logprobs out.

Logprob convention (every engine and the trainer follow it, so importance ratios start at 1):
each sampled token's logprob is `log_softmax(logits / temperature)` at that token, i.e. under the
untempered policy when temperature == 1 and under the tempered distribution otherwise. Top-p
truncation is *not* reflected (the logprob is under the full tempered distribution), because the
trainer cannot recompute the truncation cheaply. temperature == 0 means greedy decoding, with
logprobs under the untempered policy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

FinishReason = Literal["stop", "length"]


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 32
    stop: list[str] = field(default_factory=list)  # stop strings; the text is cut before them
    seed: int | None = None  # None = draw from torch's global RNG (so a resumed run continues it)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be 0 or more")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")


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
        self, prompt_token_ids: list[list[int]], sampling: SamplingParams, adapter: str | None = None
    ) -> list[Choice]:
        """One Choice per prompt, given as token ids, in order; nothing is re-tokenised.

        The agent loop continues a conversation from the exact tokens sampled so far with this.
        """

    def render(self, messages: list[dict]) -> list[int]:
        """Prompt token ids of a chat request, ending with the assistant header."""
        return render_chat(self.tokenizer, messages)

    @abstractmethod
    def load_adapter(self, name: str, path: Path) -> None:
        """Make the LoRA adapter saved in `path` available as `name`."""

    @abstractmethod
    def unload_adapter(self, name: str) -> None:
        """Free an adapter loaded with `load_adapter`."""


def render_chat(
    tokenizer: Any,
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of `messages` rendered with the tokenizer's chat template.

    `tools` (OpenAI-style function schemas) go to the template only when given, so a template
    without tool support renders exactly as before. With `add_generation_prompt` the ids end with
    the assistant header, ready for the model's turn.
    """
    extra = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
    )
    # The template already wrote any bos token; do not let the tokenizer add another.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
