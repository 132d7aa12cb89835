"""Batched sampling with plain transformers models (CPU or GPU), with exact per-token logprobs.

The sampling loop is written out here rather than using `model.generate`, so that the logprob of
every sampled token is the one the trainer recomputes (see `engines/base.py` for the convention).
The engine either wraps the trainer's live PeftModel (sampling follows the adapter as it trains)
or owns a plain model and loads LoRA checkpoints into it for serving.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel

from training.engines.base import (
    Choice,
    Engine,
    FinishReason,
    OnFinished,
    OnToken,
    SamplingParams,
    TextDeltas,
    TokenDelta,
    report_finished_after,
)
from training.engines.grammar import BatchMatchers, GrammarCompiler


def sample_next_token(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row from `logits` [B, V]; return (tokens [B], their logprobs [B]).

    The logprob is under the full tempered distribution, before top-p truncation.
    """
    tokens, logprobs = _sample_with_distribution(logits, temperature, top_p, generator)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def _sample_with_distribution(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B], the full log-distribution [B, V] they were sampled from, see the module doc)."""
    logits = logits.float()
    if temperature == 0:
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
    else:
        logprobs = torch.log_softmax(logits / temperature, dim=-1)
        probs = logprobs.exp()
        if top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass
            # before it already does. The most likely token is always kept.
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        tokens = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
    return tokens, logprobs


class TransformersEngine(Engine):
    """Engine over an in-memory transformers model (plain or peft).

    `adapter=None` means the model as given: the active adapter of a PeftModel, the base weights of
    a plain model (even after `load_adapter` has wrapped it). The model is not moved: put it on
    `device` first.
    """

    def __init__(self, model: Any, tokenizer: Any, device: str | torch.device = "cpu") -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self._given_peft = isinstance(model, PeftModel)
        self._loaded: set[str] = set()
        self.stop_token_ids = self._stop_token_ids()
        base = model.get_base_model() if self._given_peft else model
        # Computing vocabulary logits for the last position only saves most of the prompt pass.
        parameters = inspect.signature(base.forward).parameters
        self._can_keep_last_logits = "logits_to_keep" in parameters
        # transformers 5.x renamed the KV-cache argument `past_key_values` to `cache`.
        self._cache_argument = "cache" if "cache" in parameters else "past_key_values"
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_token_id = int(pad)
        self._grammars: GrammarCompiler | None = None

    @property
    def grammars(self) -> GrammarCompiler:
        """Built at the first constrained request (building the tokenizer's view takes ~0.5 s)."""
        if self._grammars is None:
            width = getattr(getattr(self.model, "config", None), "vocab_size", None) or 0
            self._grammars = GrammarCompiler(
                self.tokenizer, max(int(width), len(self.tokenizer)), self.stop_token_ids
            )
        return self._grammars

    def check_grammar(self, grammar: str) -> None:
        self.grammars.check(grammar)

    def _stop_token_ids(self) -> set[int]:
        ids = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        generation_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if isinstance(generation_eos, int):
            ids.add(generation_eos)
        elif isinstance(generation_eos, list):
            ids.update(int(i) for i in generation_eos)
        return ids

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
        """See Engine.generate_from_tokens. `on_token`, when given, is called (on this thread)
        with each sequence's every new token as soon as it is sampled, while the rest of the batch
        goes on; the returned Choices are the same with or without it. `grammars` constrain rows
        (training.engines.grammar): each step's logits are masked per row before sampling."""
        if not prompt_token_ids:
            return []
        if not all(prompt_token_ids):
            raise ValueError("every prompt needs at least one token")
        if grammars is not None and len(grammars) != len(prompt_token_ids):
            raise ValueError(f"got {len(prompt_token_ids)} prompts but {len(grammars)} grammars")
        matchers = None
        if grammars is not None and any(grammar is not None for grammar in grammars):
            matchers = self.grammars.matchers(grammars)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), self._adapter_scope(adapter):
                prompts = [list(prompt) for prompt in prompt_token_ids]
                # TODO(decode core): report each row when it finishes, not all at the end.
                return report_finished_after(self._sample(prompts, sampling, on_token, matchers), on_finished)
        finally:
            self.model.train(was_training)

    def _sample(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        on_token: OnToken | None = None,
        matchers: BatchMatchers | None = None,
    ) -> list[Choice]:
        batch = len(prompts)
        width = max(len(p) for p in prompts)
        # Left padding lines up every row's last prompt token, so one column of logits per step
        # serves the whole batch. Positions count real tokens only, as if each row were alone.
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        input_ids, attention_mask, position_ids = (
            t.to(self.device) for t in (input_ids, attention_mask, position_ids)
        )
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(sampling.seed)

        extra = {"logits_to_keep": 1} if self._can_keep_last_logits else {}
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **extra,
        )
        cache = self._returned_cache(out)
        logits = out.logits[:, -1, :]
        next_position = position_ids[:, -1:] + 1

        token_ids: list[list[int]] = [[] for _ in range(batch)]
        logprobs: list[list[float]] = [[] for _ in range(batch)]
        top_k = sampling.top_logprobs
        tops: list[list[list[tuple[int, float]]]] = [[] for _ in range(batch)]
        finish: list[FinishReason | None] = [None] * batch
        texts: list[str | None] = [None] * batch
        deltas = [TextDeltas(sampling.stop) for _ in range(batch)] if on_token else []
        last_step = sampling.max_new_tokens - 1
        for step in range(sampling.max_new_tokens):
            if matchers is not None:  # forbidden tokens at -inf: sampled from, and logprobs of, the rest
                logits = matchers.mask_logits(logits, [reason is not None for reason in finish])
            tokens, distribution = _sample_with_distribution(
                logits, sampling.temperature, sampling.top_p, generator
            )
            token_logprobs = distribution.gather(-1, tokens[:, None]).squeeze(-1).tolist()
            step_tops: list[list[tuple[int, float]]] = [[] for _ in range(batch)]
            if top_k:
                values, ids = distribution.topk(top_k, dim=-1)
                step_tops = [
                    [(i, v) for i, v in zip(row_ids, row_values, strict=True) if v != float("-inf")]
                    for row_ids, row_values in zip(ids.tolist(), values.tolist(), strict=True)
                ]
            for row in range(batch):
                if finish[row] is not None:
                    continue
                token = int(tokens[row])
                token_ids[row].append(token)
                logprobs[row].append(token_logprobs[row])
                if top_k:
                    tops[row].append(step_tops[row])
                text = None
                if token in self.stop_token_ids:
                    finish[row] = "stop"
                else:
                    # A complete grammar ends the row: nothing but a stop token could follow.
                    complete = matchers is not None and matchers.advance(row, token)
                    if sampling.stop or on_token:
                        text = self.tokenizer.decode(token_ids[row], skip_special_tokens=True)
                        cut = _first_stop(text, sampling.stop)
                        if cut is not None:
                            finish[row], texts[row] = "stop", text[:cut]
                    if complete:
                        finish[row] = "stop"
                if finish[row] is None and step == last_step:
                    finish[row] = "length"
                if on_token:
                    if finish[row] is None:
                        piece = deltas[row].update(text or "")
                    else:
                        final = texts[row]
                        if final is None:
                            final = text if text is not None else self._decode(token_ids[row])
                            texts[row] = final
                        piece = deltas[row].finish(final)
                    on_token(TokenDelta(row, token, token_logprobs[row], step_tops[row], piece, finish[row]))
            if all(reason is not None for reason in finish):
                break
            # Finished rows keep being fed their last sample; their outputs are ignored.
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((batch, 1))], dim=-1)
            out = self.model(
                input_ids=tokens[:, None],
                attention_mask=attention_mask,
                position_ids=next_position,
                use_cache=True,
                **{self._cache_argument: cache},
            )
            cache = self._returned_cache(out)
            logits = out.logits[:, -1, :]
            next_position = next_position + 1

        choices = []
        for row in range(batch):
            text = texts[row]
            if text is None:
                text = self._decode(token_ids[row])
            choices.append(
                Choice(
                    text=text,
                    prompt_token_ids=prompts[row],
                    token_ids=token_ids[row],
                    logprobs=logprobs[row],
                    finish_reason=finish[row] or "length",
                    top_logprobs=tops[row] if top_k else None,
                )
            )
        return choices

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _returned_cache(self, out: Any) -> Any:
        return out.cache if self._cache_argument == "cache" else out.past_key_values

    @contextmanager
    def _adapter_scope(self, adapter: str | None) -> Iterator[None]:
        model = self.model
        if adapter is None:
            if isinstance(model, PeftModel) and not self._given_peft:
                with model.disable_adapter():
                    yield
            else:
                yield
            return
        if not isinstance(model, PeftModel) or adapter not in model.peft_config:
            raise ValueError(f"adapter {adapter!r} is not loaded")
        previous = model.active_adapter
        flags = _requires_grad_flags(model)
        model.set_adapter(adapter, inference_mode=True)
        try:
            yield
        finally:
            model.set_adapter(previous)
            _restore_requires_grad(model, flags)

    def load_adapter(self, name: str, path: Path) -> None:
        path = Path(path)
        if name in self._loaded or (isinstance(self.model, PeftModel) and name in self.model.peft_config):
            raise ValueError(f"adapter {name!r} is already loaded")
        if not (path / "adapter_config.json").is_file():
            raise FileNotFoundError(f"no LoRA adapter in {path} (adapter_config.json missing)")
        if isinstance(self.model, PeftModel):
            # peft's loaders flip requires_grad on other adapters; the trainer's must stay as it was.
            flags = _requires_grad_flags(self.model)
            self.model.load_adapter(str(path), adapter_name=name, is_trainable=False)
            _restore_requires_grad(self.model, flags)
        else:
            with warnings.catch_warnings():
                # peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing`.
                warnings.filterwarnings(
                    "ignore", message=".*is_gradient_checkpointing", category=FutureWarning
                )
                self.model = PeftModel.from_pretrained(
                    self.model, str(path), adapter_name=name, is_trainable=False
                )
        self._loaded.add(name)

    def unload_adapter(self, name: str) -> None:
        if name not in self._loaded:
            raise ValueError(f"adapter {name!r} was not loaded by this engine")
        model = self.model
        if not self._given_peft and len(model.peft_config) == 1:
            # The last adapter of a model we wrapped: go back to the plain model.
            self.model = model.unload()
        else:
            previous = model.active_adapter
            flags = _requires_grad_flags(model)
            model.delete_adapter(name)
            if previous != name:
                model.set_adapter(previous)
            _restore_requires_grad(model, flags)
        self._loaded.discard(name)


def _first_stop(text: str, stops: list[str]) -> int | None:
    positions = [text.find(stop) for stop in stops if stop]
    found = [p for p in positions if p >= 0]
    return min(found) if found else None


def _requires_grad_flags(model: torch.nn.Module) -> dict[str, bool]:
    return {name: p.requires_grad for name, p in model.named_parameters()}


def _restore_requires_grad(model: torch.nn.Module, flags: dict[str, bool]) -> None:
    for name, p in model.named_parameters():
        p.requires_grad_(flags.get(name, False))
