"""The GRPO trainer: a LoRA adapter on a frozen base model, one policy update per step.

A checkpoint is a directory, complete or absent: it is written under a temporary sibling name and
renamed into place, so a crash mid-save leaves the previous checkpoints and no half-written one.

Checkpoint layout (format_version 1):
    adapter_model.safetensors, adapter_config.json   the LoRA adapter (peft; servable as is)
    optimizer.pt                                     AdamW state_dict
    rng_state.pt                                     {"torch", "python"[, "cuda"]} RNG states
    state.json                                       {format_version, step, config, lora, metrics}
"""

from __future__ import annotations

import inspect
import json
import math
import os
import random
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from safetensors.torch import load_file

from training.checkpoint_files import (  # noqa: F401 (re-exported: callers import them from here)
    ADAPTER_WEIGHTS,
    CHECKPOINT_FORMAT_VERSION,
    CheckpointError,
    as_python_rng_state,
    move_into_place,
    read_checkpoint_state,
)
from training.config import LoraSpec, TrainConfig
from training.distributed import is_data_parallel
from training.grpo import compute_advantages, entropy_from_logits, is_zero_variance
from training.minibatches import grpo_data, split_evenly  # noqa: F401 (grpo_data: re-exported)
from training.trajectory import TrainGroup, TrainSample


def peft_lora_config(lora: LoraSpec) -> LoraConfig:
    """peft's LoraConfig for our LoRA spec (the trainer and the TRL benchmark share it)."""
    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


class Trainer:
    """Owns the policy (base model + LoRA) and its optimizer.

    The base model is modified in place (peft injects the LoRA layers), so give each Trainer its
    own freshly loaded base model. Train in fp32 on CPU: bf16 matmuls are ~30x slower there.
    """

    def __init__(
        self,
        base_model: Any,
        tokenizer: Any,
        config: TrainConfig,
        lora: LoraSpec,
        device: str | torch.device = "cpu",
        *,
        adapter_name: str = "default",
    ) -> None:
        self.config = config
        self.adapter_name = adapter_name
        self.lora = lora
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.step = 0  # train_step calls so far; restored by resume()
        # Seeding here makes a run reproducible from its config: the LoRA init below and every
        # rollout sampled with seed=None draw from these generators.
        random.seed(config.seed)
        torch.manual_seed(config.seed)
        peft_config = peft_lora_config(lora)
        with warnings.catch_warnings():
            # peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing`: not ours to fix.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            if isinstance(base_model, PeftModel):
                # A shared base (training.session_pool): one more adapter on it, and the live one.
                base_model.add_adapter(adapter_name, peft_config)
                base_model.set_adapter(adapter_name)
                self.model: PeftModel = base_model
            else:
                self.model = get_peft_model(
                    base_model.to(self.device), peft_config, adapter_name=adapter_name
                )
        self.model.train()
        forward = self.model.get_base_model().forward
        self._can_keep_logits = "logits_to_keep" in inspect.signature(forward).parameters
        # Packed rows (training.packing: a group's prompt once, no padding) need a 4-D attention
        # mask, which transformers' sdpa and eager attention take as given; other attention
        # kernels (flash-attention) get today's left-padded rows, length-sorted.
        attention = getattr(self.model.get_base_model().config, "_attn_implementation", None)
        self.packed = attention in ("sdpa", "eager")
        # The live adapter's parameters only (peft leaves the other adapters on a shared base frozen).
        self.trainable_parameters = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.trainable_parameters, lr=config.learning_rate, weight_decay=config.weight_decay
        )

    @property
    def policy(self) -> PeftModel:
        """The live policy; give it to TransformersEngine so rollouts sample the current adapter."""
        return self.model

    # ---------------------------------------------------------------- one update
    def train_step(self, groups: list[TrainGroup], *, learning_rate: float | None = None) -> dict[str, float]:
        """One GRPO step from sampled groups (``num_minibatches`` × ``ppo_epochs`` optimizer
        steps at ``learning_rate``, the config's when None); returns the step's metrics.

        When every group has zero variance there is no update: loss, grad_norm, entropy, kl and
        trainable_tokens are 0 (the step still counts, as the run's step counter does).
        """
        start = time.perf_counter()
        config = self.config
        rewards = [[sample.reward for sample in group.samples] for group in groups]
        advantages, zero_variance_groups = compute_advantages(rewards, scale=config.scale_rewards)
        all_rewards = torch.tensor([r for group in rewards for r in group], dtype=torch.float64)
        metrics: dict[str, float] = {
            "loss": 0.0,
            "grad_norm": 0.0,
            "entropy": 0.0,
            "clip_fraction": 0.0,
            "kl": 0.0,
            "ratio_mean": 1.0,
            "trainable_tokens": 0.0,
            "zero_variance_fraction": zero_variance_groups / max(len(groups), 1),
            "reward_mean": float(all_rewards.mean()) if len(all_rewards) else 0.0,
            "reward_std": float(all_rewards.std(unbiased=False)) if len(all_rewards) else 0.0,
        }
        # Groups whose rewards are all equal have zero advantage everywhere: nothing to learn. With
        # overlong_filter, a completion cut off at max_new_tokens (its mask all 0) is not trained on
        # either; it still counted in its group's advantages.
        samples: list[tuple[TrainSample, float]] = []
        for group, group_rewards, group_advantages in zip(groups, rewards, advantages, strict=True):
            if not is_zero_variance(group_rewards):
                samples.extend(
                    (sample, advantage)
                    for sample, advantage in zip(group.samples, group_advantages, strict=True)
                    if not (config.overlong_filter and sample.trainable_tokens() == 0)
                )
        return self._update(samples, metrics, start, learning_rate=learning_rate)

    def train_samples(self, samples: list[tuple[TrainSample, float]]) -> dict[str, float]:
        """One update from samples whose advantages the caller computed (a client's trajectory
        groups, training.client_step); the same objective and metrics as ``train_step``, without
        the reward and zero-variance metrics, which belong to the caller's groups."""
        metrics: dict[str, float] = {
            "loss": 0.0,
            "grad_norm": 0.0,
            "entropy": 0.0,
            "clip_fraction": 0.0,
            "kl": 0.0,
            "ratio_mean": 1.0,
            "trainable_tokens": 0.0,
        }
        return self._update(samples, metrics, time.perf_counter())

    def _update(
        self,
        samples: list[tuple[TrainSample, float]],
        metrics: dict[str, float],
        start: float,
        *,
        learning_rate: float | None = None,
    ) -> dict[str, float]:
        """The GRPO update as a loop over the session's primitives (training.session): the
        samples split into ``num_minibatches`` minibatches of datums whose weights carry the loss's
        normalisation (within the minibatch), the reference's logprobs when there is a KL term,
        then for each of ``ppo_epochs`` passes one ``forward_backward`` with the ``grpo`` loss and
        one ``optim_step`` per minibatch. Passes after the first take the minibatches in a seeded
        order. Metrics are token-weighted means over the updates (loss and grad_norm: plain means);
        ``first_update_ratio_mean`` is the first update's, where the learner is still the sampler."""
        from training.session import TrainingSession

        config = self.config
        rate = config.learning_rate if learning_rate is None else learning_rate
        for sample, _ in samples:
            _check_sample(sample)
        self.step += 1
        metrics["learning_rate"] = rate
        if not samples:
            metrics["train_seconds"] = time.perf_counter() - start
            return metrics

        session: Any = TrainingSession(self)
        if is_data_parallel():  # every rank runs this update on the same samples (training.distributed)
            from training.distributed import DataParallelSession

            session = DataParallelSession(session)
            metrics["update_devices"] = float(session.world_size)
        minibatches = [grpo_data(chunk, config) for chunk in split_evenly(samples, config.num_minibatches)]
        if config.kl_coef > 0:
            with torch.no_grad(), self.model.disable_adapter():
                for data in minibatches:
                    for datum, values in zip(data, session.forward(data), strict=True):
                        datum.loss_fn_inputs["ref_logprobs"] = values
        trained = [
            float(sum(1 for d in data for w in d.loss_fn_inputs["weights"] if w != 0)) for data in minibatches
        ]
        loss_config = {"loss_type": config.loss_type, "epsilon": config.epsilon, "epsilon_high": config.epsilon_high,
                       "importance_level": config.importance_level, "kl_coef": config.kl_coef}  # fmt: skip
        order = random.Random(config.seed * 1_000_003 + self.step)
        losses: list[float] = []
        norms: list[float] = []
        tokens, positions, padding = 0.0, 0.0, 0.0
        sums = {name: 0.0 for name in ("entropy", "clip_fraction", "kl", "ratio_mean", "ratio_sq_mean")}
        for epoch in range(config.ppo_epochs):
            indices = list(range(len(minibatches)))
            if epoch:
                order.shuffle(indices)
            for index in indices:
                result = session.forward_backward(minibatches[index], "grpo", loss_config)
                stepped = session.optim_step(learning_rate=rate, weight_decay=config.weight_decay)
                if not losses:
                    metrics["first_update_ratio_mean"] = result.metrics["ratio_mean"]
                losses.append(result.loss)
                norms.append(stepped["grad_norm"])
                count = trained[index]
                tokens += count
                for name in sums:
                    sums[name] += result.metrics[name] * count
                positions += result.metrics["positions"]
                padding += result.metrics["padding"]
        means = {name: value / max(tokens, 1.0) for name, value in sums.items()}
        metrics.update({name: means[name] for name in ("entropy", "clip_fraction", "kl", "ratio_mean")})
        metrics["ratio_std"] = math.sqrt(max(means["ratio_sq_mean"] - means["ratio_mean"] ** 2, 0.0))
        metrics["loss"] = sum(losses) / len(losses)
        metrics["grad_norm"] = sum(norms) / len(norms)
        metrics["optimizer_steps"] = float(len(losses))
        metrics["trainable_tokens"] = float(sum(sample.trainable_tokens() for sample, _ in samples))
        # What the forward passes computed: positions (each packed prompt once) and the share
        # of them that was padding.
        metrics["update_positions"] = positions
        metrics["padding_fraction"] = padding / max(positions, 1.0)
        metrics["train_seconds"] = time.perf_counter() - start
        return metrics

    def _micro_batches(
        self, samples: list[tuple[TrainSample, float]]
    ) -> list[list[tuple[TrainSample, float]]]:
        """Split into batches of at most micro_batch_tokens padded tokens (at least one sample
        each), so memory depends on the budget, not on group size or groups per step."""
        budget = self.config.micro_batch_tokens
        batches: list[list[tuple[TrainSample, float]]] = []
        current: list[tuple[TrainSample, float]] = []
        width = 0
        for item in samples:
            length = len(item[0].prompt_token_ids) + len(item[0].completion_token_ids)
            if current and max(width, length) * (len(current) + 1) > budget:
                batches.append(current)
                current, width = [], 0
            current.append(item)
            width = max(width, length)
        if current:
            batches.append(current)
        return batches

    def _collate(self, micro: list[tuple[TrainSample, float]]) -> dict[str, torch.Tensor]:
        """Left-padded prompt+completion rows, as the engine lays them out: every completion ends
        in the last column, so the last `completion_width` positions hold all completion tokens."""
        rows = len(micro)
        width = max(len(s.prompt_token_ids) + len(s.completion_token_ids) for s, _ in micro)
        completion_width = max(max(len(s.completion_token_ids) for s, _ in micro), 1)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        input_ids = torch.full((rows, width), int(pad), dtype=torch.long)
        attention_mask = torch.zeros((rows, width), dtype=torch.long)
        mask = torch.zeros((rows, completion_width))
        old_logprobs = torch.zeros((rows, completion_width))
        for row, (sample, _) in enumerate(micro):
            sequence = sample.prompt_token_ids + sample.completion_token_ids
            input_ids[row, width - len(sequence) :] = torch.tensor(sequence, dtype=torch.long)
            attention_mask[row, width - len(sequence) :] = 1
            n = len(sample.completion_token_ids)
            if n:
                sampled = [1] * n if sample.completion_mask is None else sample.completion_mask
                mask[row, completion_width - n :] = torch.tensor(sampled, dtype=mask.dtype)
                old_logprobs[row, completion_width - n :] = torch.tensor(sample.completion_logprobs)
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "mask": mask,
            "old_logprobs": old_logprobs,
            "advantages": torch.tensor([advantage for _, advantage in micro], dtype=torch.float32),
        }
        batch = {name: tensor.to(self.device) for name, tensor in batch.items()}
        real = sum(len(s.prompt_token_ids) + len(s.completion_token_ids) for s, _ in micro)
        batch["positions"] = torch.tensor(rows * width)
        batch["padding"] = torch.tensor(rows * width - real)
        return batch

    def _completion_logprobs(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprobs [B, T] of the completion tokens under the current model (with grad), computed
        as the engine does: log_softmax(logits / temperature). Also their entropy [B, T], detached."""
        if "keep" in batch:
            return self._packed_completion_logprobs(batch)
        completion_width = batch["mask"].shape[1]
        # Vocabulary logits only where they are needed: the positions predicting completions.
        extra = {"logits_to_keep": completion_width + 1} if self._can_keep_logits else {}
        out = self.model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            use_cache=False,
            **extra,
        )
        logits = out.logits[:, -(completion_width + 1) : -1, :].float() / self.config.temperature
        targets = batch["input_ids"][:, -completion_width:]
        logprobs = logits.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach())
        return logprobs, entropy

    def _packed_completion_logprobs(
        self, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same for a packed row: vocabulary logits at the kept positions only ([K, V], each
        prompt's last position once for all its completions), then gathered per sequence."""
        keep = batch["keep"]
        out = self.model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            use_cache=False,
            **({"logits_to_keep": keep} if self._can_keep_logits else {}),
        )
        logits = out.logits if self._can_keep_logits else out.logits[keep]
        logits = logits.float() / self.config.temperature
        index, targets = batch["logit_index"], batch["targets"]
        logprobs = logits[index, targets] - torch.logsumexp(logits, dim=-1)[index]
        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach())[index]
        return logprobs, entropy

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: Path, *, step: int, metrics: dict) -> None:
        """Write a complete checkpoint directory at `path` (replacing one that is there)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
        try:
            self.save_adapter(scratch)
            torch.save(self.optimizer.state_dict(), scratch / "optimizer.pt")
            rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
            if torch.cuda.is_available():
                rng["cuda"] = torch.cuda.get_rng_state_all()
            torch.save(rng, scratch / "rng_state.pt")
            state = {
                "format_version": CHECKPOINT_FORMAT_VERSION,
                "step": step,
                "config": self.config.to_dict(),
                "lora": self.lora.to_dict(),
                "metrics": metrics,
            }
            (scratch / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
            move_into_place(scratch, path)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def save_adapter(self, path: Path) -> None:
        """The live adapter alone as peft's folder (``adapter_model.safetensors``,
        ``adapter_config.json``), servable as is, whatever other adapters share the base."""
        path = Path(path)
        if self.adapter_name == "default":
            self.model.save_pretrained(str(path), selected_adapters=["default"])
            return
        # peft writes a named adapter into a subfolder of that name: move its files up.
        self.model.save_pretrained(str(path), selected_adapters=[self.adapter_name])
        for item in (path / self.adapter_name).iterdir():
            os.replace(item, path / item.name)
        (path / self.adapter_name).rmdir()

    @classmethod
    def resume(
        cls,
        base_model: Any,
        tokenizer: Any,
        checkpoint_path: Path,
        config: TrainConfig,
        lora: LoraSpec,
        device: str | torch.device = "cpu",
        *,
        adapter_name: str = "default",
    ) -> Trainer:
        """A Trainer that continues from a checkpoint exactly as if it had never stopped: adapter
        weights, optimizer moments and RNG states are restored. `config` may differ from the
        checkpoint's (e.g. more steps, another learning rate); `lora` must match it."""
        checkpoint_path = Path(checkpoint_path)
        state = read_checkpoint_state(checkpoint_path)
        if LoraSpec.from_dict(state["lora"]) != lora:
            raise CheckpointError(
                f"{checkpoint_path}: LoRA settings differ from the checkpoint's {state['lora']}"
            )
        trainer = cls(base_model, tokenizer, config, lora, device, adapter_name=adapter_name)
        weights = load_file(checkpoint_path / ADAPTER_WEIGHTS, device=str(trainer.device))
        result: Any = set_peft_model_state_dict(trainer.model, weights, adapter_name=adapter_name)
        if result.unexpected_keys:
            raise CheckpointError(
                f"{checkpoint_path}: adapter weights do not fit the model: {result.unexpected_keys[:3]}"
            )
        optimizer_state = torch.load(
            checkpoint_path / "optimizer.pt", map_location=trainer.device, weights_only=True
        )
        trainer.optimizer.load_state_dict(optimizer_state)
        # load_state_dict also restores the saved hyperparameters; the new config wins.
        for group in trainer.optimizer.param_groups:
            group["lr"] = config.learning_rate
            group["weight_decay"] = config.weight_decay
        rng = torch.load(checkpoint_path / "rng_state.pt", weights_only=True)
        torch.set_rng_state(rng["torch"])
        random.setstate(as_python_rng_state(rng["python"]))
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        trainer.step = int(state["step"])
        return trainer


def _check_sample(sample: TrainSample) -> None:
    if len(sample.completion_logprobs) != len(sample.completion_token_ids):
        raise ValueError("a sample needs one logprob per completion token")
    if not sample.prompt_token_ids:
        raise ValueError("a sample needs a non-empty prompt")
    if sample.completion_mask is not None:
        if len(sample.completion_mask) != len(sample.completion_token_ids):
            raise ValueError("a sample's completion_mask needs one entry per completion token")
        if any(value not in (0, 1) for value in sample.completion_mask):
            raise ValueError("a sample's completion_mask holds only 0 and 1")
