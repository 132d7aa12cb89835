"""The session in this process: the primitives of training.session.contract over a policy
(training.session.policy.Policy) held here, on one device or (through training.hosting.ranks) one rank.

``data`` is a list of ``Datum``: Tinker's layout, one sequence each: ``model_input`` (N tokens) and
``loss_fn_inputs`` with ``target_tokens`` (N: position i predicts target i, so target i is input
i + 1 for all but the last) and any per-token inputs a loss reads (``weights``, ``logprobs``,
``advantages``, ...). The session lays datums out the way the trainer's update does
(training.session.packing: the tokens before a datum's first weighted target once per shared prefix, no
padding), so a datum only pays for the positions whose logprobs are needed: those from its first
weighted target on (from the first position when it has no ``weights``). Logprobs of positions
before that are not computed and read 0.0 in the outputs.

Losses are sums over tokens, so ``forward_backward`` works through the data one packed row at a
time and the gradients of several calls add up; a loss that needs the whole call at once (ART's:
its KL term averages over the sequence) gets every row in one call.

On a base sharded across data-parallel ranks (``trainer.sharded``: training.hosting.ranks.shard_base,
FSDP2) every forward pass is a collective: each rank gathers a layer's weights from the others as it
reaches it. A call then runs as many passes on every rank as the rank with the most (its own rows,
then idle one-token passes with a zero loss), checks its input before the first pass (a token outside
the vocabulary), and a call that fails in one pass runs its remaining passes idle before it raises:
no rank is left waiting in a gather the others never reach.

Every session, sharded or not, checks token ids before they reach the embedding (an id outside the
vocabulary is an IndexError on the CPU and a device-side assert that poisons a CUDA process for every
session on it): datums' inputs and targets, and sample prompts, whose length plus ``max_new_tokens``
must also fit the model's context. ``start_sample`` runs a sample a few decode steps at a time
(``SampleInProgress.advance``), so a host can let other sessions' primitives in between.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file

from training.engines.base import Choice, SamplingParams
from training.rollouts.trajectory import TrainSample
from training.session.adapter_check import live_adapter_fingerprint
from training.session.contract import (
    BASE_MODEL,
    WHOLE_CALL_LOSSES,
    Datum,
    ForwardBackwardResult,
    check_prompt_ids,
    check_token_ids,
)
from training.session.losses import LossInputError, LossInputs, loss_named
from training.session.packing import ROW_TOKENS, pack
from training.session.policy import Policy


@dataclass
class _Row:
    """One forward pass: its members (indices into the call's datums, in the tensors' order)."""

    members: list[int]
    batch: dict[str, torch.Tensor]
    positions: int
    padding: int
    padded: bool = False


def context_length_of(model: Any) -> int | None:
    """The model's context in tokens, from its config (None when it states none)."""
    from training.model_files import CONTEXT_KEYS

    config = getattr(model, "config", None)
    for key in CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class SampleInProgress:
    """A sample decoding on a session's engine, ``advance``d a bounded number of decode steps at a
    time. Between two ``advance`` calls the host may run other sessions' primitives on the same base
    (the KV cache is this object's); before each, the host makes this session live again (its
    adapter active, its RNG states in the generators: training.hosting.pool), so the choices are
    those of one uninterrupted ``sample``."""

    def __init__(self, engine: Any, prompts: list[list[int]], sampling: Any) -> None:
        from training.engines.decode import DecodeBatch

        self.engine = engine
        self._batch = DecodeBatch(engine, None)
        self._handles = self._batch.add(prompts, sampling)
        self._finished: dict[int, Any] = {}

    @property
    def done(self) -> bool:
        return not self._batch.live

    def advance(self, steps: int | None = None) -> bool:
        """Decode up to ``steps`` tokens for every live row (None: to the end); True when done."""
        taken = 0
        with self.engine.inference(None):  # once per slice, not per step
            while self._batch.live and (steps is None or taken < steps):
                for handle, choice in self._batch.step():
                    self._finished[handle] = choice
                taken += 1
        return self.done

    def choices(self) -> list[Any]:
        """One ``Choice`` per prompt, in order (once ``done``)."""
        return [self._finished[handle] for handle in self._handles]


class TrainingSession:
    """The primitives over one policy. Built on a ``training.session.policy.Policy`` (which owns the
    peft model, the optimizer and the checkpoint format); the session adds nothing to its state."""

    def __init__(self, trainer: Any, engine: Any = None) -> None:
        self.trainer = trainer
        self._engine = engine  # a TransformersEngine over the trainer's model (built on first sample)

    def sample(self, prompts: Sequence[list[int]], sampling: SamplingParams) -> list[Choice]:
        """Completions of each prompt (token ids) by the current policy, with the sampler's
        logprobs (``training.engines.base.Choice``, one per prompt). ``sampling``: a
        ``SamplingParams``; with ``seed=None`` it draws from the session's RNG, so a session's
        samples do not depend on what other sessions did."""
        running = self.start_sample(prompts, sampling)
        running.advance()
        return running.choices()

    def start_sample(self, prompts: Sequence[list[int]], sampling: SamplingParams) -> SampleInProgress:
        """``sample``, checked (ids in the vocabulary, each prompt plus ``max_new_tokens`` within the
        model's context) and queued, not yet decoded: the caller ``advance``s it."""
        if self.trainer.sharded or self.trainer.config.fsdp:  # sharded, or to be at its first call
            raise ValueError(
                "this session's base model is sharded across its devices (fsdp): it cannot sample on "
                "one of them; save_weights_for_sampler and sample that checkpoint on an inference server"
            )
        prompts = [list(p) for p in prompts]
        check_prompt_ids(prompts, self.vocabulary)
        context = context_length_of(self.trainer.model)
        for index, prompt in enumerate(prompts):
            if context is not None and len(prompt) + sampling.max_new_tokens > context:
                raise LossInputError(
                    f"prompts[{index}]: {len(prompt)} prompt tokens plus max_new_tokens "
                    f"{sampling.max_new_tokens} exceed the model's context of {context} tokens"
                )
        if self._engine is None:
            from training.engines.transformers_engine import TransformersEngine

            self._engine = TransformersEngine(
                self.trainer.model, self.trainer.tokenizer, device=self.trainer.device
            )
        return SampleInProgress(self._engine, prompts, sampling)

    @property
    def vocabulary(self) -> int:
        """How many token ids the model's embedding can look up."""
        return int(self.trainer.model.get_input_embeddings().weight.shape[0])

    # ------------------------------------------------------------------ primitives
    def forward(self, data: Sequence[Datum], *, reference: Path | str | None = None) -> list[list[float]]:
        """The learner's logprobs of each datum's targets, without gradients. ``reference``: those
        of another policy on the same base instead: ``BASE_MODEL`` (the adapter off) or a
        checkpoint folder's adapter weights, swapped in for the call and the live ones put back."""
        outputs: list[list[float]] = [[0.0] * len(d.model_input) for d in data]
        policy = self._reference_policy(reference) if reference is not None else contextlib.nullcontext()
        with torch.no_grad(), policy:
            samples, rows, failure = self._plan(data, whole=False)
            for row_layout in self._in_step(rows):
                if row_layout is None or failure is not None:
                    self._idle_pass()
                    continue
                members = row_layout.members
                logprobs, _ = self._learner_logprobs(row_layout, samples)
                for row, index in enumerate(members):
                    start, length = data[index].first_computed, len(samples[index].completion_token_ids)
                    outputs[index][start : start + length] = logprobs[row, :length].tolist()
        if failure is not None:
            raise failure
        return outputs

    def forward_backward(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: dict[str, Any] | None = None,
        *, forward_only: bool = False,
    ) -> ForwardBackwardResult:  # fmt: skip
        """Compute ``loss_fn`` over ``data`` and accumulate its gradients (see the module doc);
        ``forward_only``: the loss and logprobs alone, no gradients (Tinker's ``forward``)."""
        if forward_only:
            with torch.no_grad():
                return self.forward_backward(data, loss_fn, loss_fn_config)
        loss = loss_named(loss_fn)
        config = dict(loss_fn_config or {})
        total, tokens, positions, padding = 0.0, 0.0, 0, 0
        sums: dict[str, float] = {}
        outputs: list[list[float]] = [[0.0] * len(d.model_input) for d in data]
        samples, rows, failure = self._plan(data, whole=loss_fn in WHOLE_CALL_LOSSES)
        for row_layout in self._in_step(rows):
            if row_layout is None or failure is not None:
                self._idle_pass()
                continue
            members = row_layout.members
            try:
                batch, lengths = self._tensors(data, samples, members)
            except Exception as exc:
                if not self.trainer.sharded:
                    raise
                failure = exc
                self._idle_pass()
                continue
            logprobs, entropy = self._learner_logprobs(row_layout, samples)
            inputs = LossInputs(
                logprobs=logprobs, mask=batch.pop("__mask__"), weights=batch.pop("weights"), inputs=batch
            )
            try:
                value, metrics = loss(inputs, config)
            except Exception as exc:
                if not self.trainer.sharded:
                    raise
                # This pass's backward still runs (a zero loss): the other ranks run theirs.
                failure, value, metrics = exc, logprobs.sum() * 0.0, {}
            if value.requires_grad:
                value.backward()
            elif self.trainer.sharded and torch.is_grad_enabled():
                (logprobs.sum() * 0.0).backward()  # every rank's pass has a backward
            if failure is not None:
                continue
            positions += row_layout.positions
            padding += row_layout.padding
            total += float(value.detach())
            count = float((inputs.weights != 0).sum())
            tokens += count
            weighted = (inputs.weights != 0).to(entropy.dtype)
            metrics = {**metrics, "entropy": float((entropy * weighted).sum()) / max(count, 1.0)}
            for name, number in metrics.items():
                sums[name] = sums.get(name, 0.0) + number * count
            for row, (index, length) in enumerate(zip(members, lengths, strict=True)):
                start = data[index].first_computed
                outputs[index][start : start + length] = logprobs[row, :length].detach().tolist()
        if failure is not None:
            raise failure
        metrics = {name: value / max(tokens, 1.0) for name, value in sums.items()}
        # What the forward passes computed: positions (a shared prompt once per row) and padding.
        metrics.update({"loss:sum": total, "positions": float(positions), "padding": float(padding)})
        return ForwardBackwardResult(loss=total, metrics=metrics, logprobs=outputs)

    def optim_step(
        self,
        *,
        learning_rate: float,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float | None = None,
        max_grad_norm: float | None = None,
    ) -> dict[str, float]:
        """One AdamW step with the accumulated gradients, then clear them. ``max_grad_norm``
        defaults to the trainer's config; a non-finite gradient norm skips the step."""
        trainer = self.trainer
        clip = trainer.config.max_grad_norm if max_grad_norm is None else max_grad_norm
        grad_norm = float(torch.nn.utils.clip_grad_norm_(trainer.trainable_parameters, clip))
        for group in trainer.optimizer.param_groups:
            group["lr"] = learning_rate
            group["betas"] = (beta1, beta2)
            group["eps"] = eps
            if weight_decay is not None:
                group["weight_decay"] = weight_decay
        stepped = math.isfinite(grad_norm)
        if stepped:
            trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm, "learning_rate": learning_rate, "skipped": float(not stepped)}

    def reset_optimizer(self) -> None:
        """Forget AdamW's moments (the weights stay): Tinker's ``load_state`` without optimizer."""
        self.trainer.optimizer.state.clear()

    def stop_token_ids(self) -> set[int]:
        """The ids that end a completion this session samples (training.engines)."""
        from training.engines.transformers_engine import stop_token_ids_of

        return stop_token_ids_of(self.trainer.model, self.trainer.tokenizer)

    def live_fingerprint(self) -> str:
        """The fingerprint of the live adapter (training.session.adapter_check): a saved state holds it."""
        return live_adapter_fingerprint(self.trainer.model, self.trainer.adapter_name)

    def save_state(self, path: Path, *, step: int, metrics: dict[str, Any]) -> None:
        """Adapter, optimizer and RNG: what ``load_state`` (``Policy.resume``) continues from.
        The session is at ``step`` from now on."""
        self.trainer.step = step
        self.trainer.save_checkpoint(path, step=step, metrics=metrics)

    @classmethod
    def load_state(
        cls, base_model: Any, tokenizer: Any, path: Path, config: Any, lora: Any, *, device: str = "cpu"
    ) -> TrainingSession:
        """A session that continues exactly from ``save_state``'s folder (adapter, optimizer, RNG),
        on a freshly loaded ``base_model`` (peft injects the adapter into it)."""
        return cls(Policy.resume(base_model, tokenizer, path, config, lora, device=device))

    def save_weights_for_sampler(self, path: Path) -> None:
        """The adapter alone (peft's folder), as an inference server loads it."""
        self.trainer.save_adapter(Path(path))

    @contextlib.contextmanager
    def _reference_policy(self, reference: Path | str) -> Iterator[None]:
        trainer = self.trainer
        if reference == BASE_MODEL:
            with trainer.model.disable_adapter():
                yield
            return
        name = trainer.adapter_name
        live = {
            key: tensor.detach().clone()
            for key, tensor in get_peft_model_state_dict(trainer.model, adapter_name=name).items()
        }
        weights = load_file(Path(reference) / "adapter_model.safetensors", device=str(trainer.device))
        set_peft_model_state_dict(trainer.model, weights, adapter_name=name)
        try:
            yield
        finally:
            set_peft_model_state_dict(trainer.model, live, adapter_name=name)

    # ------------------------------------------------------------------ passes
    def _plan(
        self, data: Sequence[Datum], *, whole: bool
    ) -> tuple[list[TrainSample], list[_Row], Exception | None]:
        """The call's samples and forward passes. On a sharded base a datum that cannot be laid
        out is not raised here but returned, to be raised once every rank has run its passes."""
        try:
            check_token_ids(data, self.vocabulary)
            samples = [datum.sample() for datum in data]
            return samples, self._layout(samples, whole=whole), None
        except Exception as exc:
            if not self.trainer.sharded:
                raise
            return [], [], exc

    def _in_step(self, rows: list[_Row]) -> list[_Row | None]:
        """``rows``, and on a sharded base as many idle passes (None) after them as make this
        rank's count the largest any rank has (one all-reduce)."""
        if not self.trainer.sharded:
            return list(rows)
        count = torch.tensor([len(rows)], dtype=torch.int64, device=self.trainer.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return [*rows, *[None] * (int(count.item()) - len(rows))]

    def _idle_pass(self) -> None:
        """A pass over one token with a zero loss: the same gathers (and, with gradients on, the
        same backward) as any other pass, and nothing added to the gradients."""
        token = 0
        sample = TrainSample(prompt_token_ids=[token], completion_token_ids=[token],
                             completion_logprobs=[0.0], reward=0.0)  # fmt: skip
        row = self._layout([sample], whole=False)[0]
        logprobs, _ = self._learner_logprobs(row, [sample])
        if torch.is_grad_enabled():
            (logprobs.sum() * 0.0).backward()

    # ------------------------------------------------------------------ layout
    def _layout(self, samples: list[TrainSample], *, whole: bool) -> list[_Row]:
        """The forward passes over ``samples``: the trainer's packed rows (a 4-D mask; its prompt
        once per row, no padding) or left-padded micro-batches of length-sorted samples; ``whole``:
        everything in one pass."""
        trainer = self.trainer
        budget = 1 << 30 if whole else trainer.config.micro_batch_tokens
        if trainer.packed:
            dtype = trainer.model.get_input_embeddings().weight.dtype
            rows = pack(samples, [0.0] * len(samples), budget=budget,
                        row_tokens=budget if whole else ROW_TOKENS,
                        mask_dtype=dtype if dtype.is_floating_point else torch.float32)  # fmt: skip
            return [
                _Row(
                    members=row.members,
                    batch={
                        "input_ids": row.input_ids,
                        "position_ids": row.position_ids,
                        "attention_mask": row.attention_mask,
                        "keep": row.keep,
                        "logit_index": row.logit_index,
                        "targets": row.targets,
                    },  # fmt: skip
                    positions=row.width,
                    padding=0,
                )
                for row in rows
            ]
        order = sorted(
            range(len(samples)),
            key=lambda i: len(samples[i].prompt_token_ids) + len(samples[i].completion_token_ids),
        )
        # The trainer's micro-batches read each pair's sample; the pair's number is the member index.
        pairs = [(samples[i], i) for i in order]
        layouts = []
        for micro in [pairs] if whole else trainer._micro_batches(pairs):
            members = [int(index) for _, index in micro]
            batch = trainer._collate([(samples[i], 0.0) for i in members])
            layouts.append(_Row(members=members, batch=batch, positions=int(batch["positions"]),
                                padding=int(batch["padding"]), padded=True))  # fmt: skip
        return layouts

    def _learner_logprobs(self, row: _Row, samples: list[TrainSample]) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, T] logprobs of the row's completion tokens, in its members' order, with grad, and
        their entropies (detached)."""
        trainer = self.trainer
        batch = {name: tensor.to(trainer.device) for name, tensor in row.batch.items()}
        logprobs, entropy = trainer._completion_logprobs(batch)
        if not row.padded:
            return logprobs, entropy
        # Padded layout: completions end in the last column; realign them to start at column 0.
        width = logprobs.shape[1]
        aligned, aligned_entropy = torch.zeros_like(logprobs), torch.zeros_like(entropy)
        for position, index in enumerate(row.members):
            n = len(samples[index].completion_token_ids)
            aligned[position, :n] = logprobs[position, width - n :]
            aligned_entropy[position, :n] = entropy[position, width - n :]
        return aligned, aligned_entropy

    def _tensors(
        self, data: Sequence[Datum], samples: list[TrainSample], members: list[int]
    ) -> tuple[dict[str, torch.Tensor], list[int]]:
        """The members' loss inputs as [n, T] tensors from their first computed position (0 beyond
        a datum's end), their weights (1 where none were given) and mask."""
        lengths = [len(samples[i].completion_token_ids) for i in members]
        width = max(max(lengths, default=1), 1)
        names = {name for i in members for name in data[i].loss_fn_inputs} - {"target_tokens"}
        tensors = {name: torch.zeros((len(members), width)) for name in names | {"weights", "__mask__"}}
        for row, (index, length) in enumerate(zip(members, lengths, strict=True)):
            start = data[index].first_computed
            tensors["__mask__"][row, :length] = 1.0
            tensors["weights"][row, :length] = 1.0
            for name, values in data[index].loss_fn_inputs.items():
                if name != "target_tokens":
                    tensors[name][row, :length] = torch.tensor(
                        [float(v) for v in values[start : start + length]]
                    )
        return {name: tensor.to(self.trainer.device) for name, tensor in tensors.items()}, lengths
