"""Batched sampling with plain transformers models (CPU or GPU), with exact per-token logprobs.

The sampling loop (training.engines.decode.DecodeBatch) is written out rather than using
`model.generate`, so that the logprob of every sampled token is the one the trainer recomputes (see
`engines/base.py` for the convention).
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
    OnFinished,
    OnToken,
    SamplingParams,
)
from training.engines.decode import DecodeBatch
from training.engines.grammar import GrammarCompiler
from training.engines.packed import LinearPacks, packed_linears, packing_available
from training.engines.sampling import sample_tokens, uniform_draws


def sample_next_token(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row from `logits` [B, V]; return (tokens [B], their logprobs [B]).

    The logprob is under the full tempered distribution, before top-p truncation.
    """
    batch = logits.shape[0]
    sampled = sample_tokens(
        logits, [temperature] * batch, [top_p] * batch, uniform_draws(batch, generator, logits.device)
    )
    return sampled.tokens, sampled.logprobs


class TransformersEngine(Engine):
    """Engine over an in-memory transformers model (plain or peft).

    `adapter=None` means the model as given: the active adapter of a PeftModel, the base weights of
    a plain model (even after `load_adapter` has wrapped it). The model is not moved: put it on
    `device` first.
    """

    def __init__(
        self, model: Any, tokenizer: Any, device: str | torch.device = "cpu", *, pack_weights: bool = True
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self._given_peft = isinstance(model, PeftModel)
        self._loaded: set[str] = set()
        self.stop_token_ids = self._stop_token_ids()
        base = model.get_base_model() if self._given_peft else model
        # Computing vocabulary logits for the last position only saves most of the prompt pass.
        parameters = inspect.signature(base.forward).parameters
        self.can_keep_last_logits = "logits_to_keep" in parameters
        # transformers 5.x renamed the KV-cache argument `past_key_values` to `cache`.
        self.cache_argument = "cache" if "cache" in parameters else "past_key_values"
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_token_id = int(pad)
        self._grammars: GrammarCompiler | None = None
        self._scope: tuple[str | None] | None = None  # the adapter of the inference scope we are in
        # Decoding on the CPU computes linears through prepacked oneDNN weights (see packed.py).
        self.linear_packs = (
            LinearPacks() if pack_weights and self.device.type == "cpu" and packing_available() else None
        )

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
        return stop_token_ids_of(self.model, self.tokenizer)

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
        (training.engines.grammar): each step's logits are masked per row before sampling.
        `on_finished` gets each row's index in the step it finishes. One decode core: the rows go
        into a DecodeBatch, which steps until none is live (finished rows leave it at once)."""
        if not prompt_token_ids:
            return []
        batch = DecodeBatch(self, adapter)
        handles = batch.add(prompt_token_ids, sampling, on_token=on_token, grammars=grammars)
        index = {handle: position for position, handle in enumerate(handles)}
        finished: dict[int, Choice] = {}
        with self.inference(adapter):  # once for the whole loop, not per step
            while batch.live:
                for handle, choice in batch.step():
                    finished[handle] = choice
                    if on_finished is not None:
                        on_finished(index[handle])
        return [finished[handle] for handle in handles]

    @contextmanager
    def inference(self, adapter: str | None) -> Iterator[None]:
        """The model in eval mode without gradients, switched to `adapter`; restored after.
        Re-entering it for the same adapter costs nothing (a decode loop enters it once per call,
        its batch once per step: ~10 ms of mode switching and weight patching each time)."""
        if self._scope is not None and self._scope[0] == adapter:
            with torch.no_grad():
                yield
            return
        was_training = self.model.training
        if was_training:
            self.model.eval()
        outer = self._scope
        try:
            with torch.no_grad(), self._adapter_scope(adapter), self._packed():
                self._scope = (adapter,)
                yield
        finally:
            self._scope = outer
            if was_training:
                self.model.train(True)

    @contextmanager
    def _packed(self) -> Iterator[None]:
        if self.linear_packs is None or self._scope is not None:  # none, or an outer scope's
            yield
            return
        with packed_linears(self.model, self.linear_packs):
            yield

    def check_adapter(self, adapter: str | None) -> None:
        """Raise ValueError unless `adapter` can be sampled from (None always can)."""
        if adapter is not None and (
            not isinstance(self.model, PeftModel) or adapter not in self.model.peft_config
        ):
            raise ValueError(f"adapter {adapter!r} is not loaded")

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def returned_cache(self, out: Any) -> Any:
        return out.cache if self.cache_argument == "cache" else out.past_key_values

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
        self.check_adapter(adapter)
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
        self._forget_linears()

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
            if previous == name:  # make another active first: peft warns when deleting the active one
                model.set_adapter(next(other for other in model.peft_config if other != name))
            model.delete_adapter(name)
            if previous != name:
                model.set_adapter(previous)
            _restore_requires_grad(model, flags)
        self._loaded.discard(name)
        self._forget_linears()

    def _forget_linears(self) -> None:
        if self.linear_packs is not None:
            self.linear_packs.forget()


def _requires_grad_flags(model: torch.nn.Module) -> dict[str, bool]:
    return {name: p.requires_grad for name, p in model.named_parameters()}


def _restore_requires_grad(model: torch.nn.Module, flags: dict[str, bool]) -> None:
    for name, p in model.named_parameters():
        p.requires_grad_(flags.get(name, False))


def stop_token_ids_of(model: Any, tokenizer: Any) -> set[int]:
    """The ids that end a completion: the tokenizer's eos and the model's generation eos ids."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(generation_eos, int):
        ids.add(generation_eos)
    elif isinstance(generation_eos, list):
        ids.update(int(i) for i in generation_eos)
    return ids
