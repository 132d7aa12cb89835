"""The policy a training session owns: a LoRA adapter on a frozen base model, its optimizer and RNG,
and the checkpoint format.

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
import os
import random
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Self

import torch
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from safetensors.torch import load_file

from training.base_models import base_model_dir, load_base_model, resolve_dtype
from training.config import LoraSpec, TrainConfig
from training.recipes.grpo import entropy_from_logits
from training.rollouts.trajectory import TrainSample
from training.session.checkpoint_files import (
    ADAPTER_WEIGHTS,
    CHECKPOINT_FORMAT_VERSION,
    CheckpointError,
    as_python_rng_state,
    move_into_place,
    read_checkpoint_state,
)


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


class Policy:
    """The policy (base model + LoRA adapter), its optimizer, RNG and checkpoint format: what a
    training session (training.session) owns and runs its primitives over.

    The base model is modified in place (peft injects the LoRA layers), so give each Policy its
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
        # The config as it came (resolved where the work was created: TrainConfig.resolved); an
        # empty learning rate stays empty, for work whose every optim_step names its rate (a
        # Tinker client's), and GRPO's update refuses it (TrainConfig.peak_learning_rate).
        self.config = config
        self.adapter_name = adapter_name
        self.lora = lora
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.step = 0  # train_step calls so far; restored by resume()
        # The base sharded across data-parallel ranks (training.hosting.ranks.shard_base): every
        # forward pass is then a collective, run by every rank together.
        self.sharded = False
        # Seeding here makes a run reproducible from its config: the LoRA init below and every
        # rollout sampled with seed=None draw from these generators.
        random.seed(config.seed)
        torch.manual_seed(config.seed)
        peft_config = peft_lora_config(lora)
        with warnings.catch_warnings():
            # peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing`: not ours to fix.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            if isinstance(base_model, PeftModel):
                # A shared base (training.hosting.pool): one more adapter on it, and the live one.
                base_model.add_adapter(adapter_name, peft_config)
                base_model.set_adapter(adapter_name)
                self.model: PeftModel = base_model
            else:
                # A base to be sharded (fsdp) stays where it was loaded (CPU memory):
                # training.hosting.ranks.shard_base puts each rank's shard of it on the device.
                placed = base_model if config.fsdp else base_model.to(self.device)
                self.model = get_peft_model(placed, peft_config, adapter_name=adapter_name)
        if config.fsdp:  # the adapter, whole on every rank, is on the device from the start
            for name, module in self.model.named_modules():
                if name.rsplit(".", 1)[-1].startswith("lora_"):  # peft's lora_A, lora_B, ... containers
                    module.to(self.device)
        self.model.train()
        forward = self.model.get_base_model().forward
        self._can_keep_logits = "logits_to_keep" in inspect.signature(forward).parameters
        # Packed rows (training.session.packing: a group's prompt once, no padding) need a 4-D attention
        # mask, which transformers' sdpa and eager attention take as given; other attention
        # kernels (flash-attention) get today's left-padded rows, length-sorted.
        attention = getattr(self.model.get_base_model().config, "_attn_implementation", None)
        self.packed = attention in ("sdpa", "eager")
        # The live adapter's parameters only (peft leaves the other adapters on a shared base frozen).
        self.trainable_parameters = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.trainable_parameters, lr=initial_rate(config), weight_decay=config.weight_decay
        )

    @property
    def policy(self) -> PeftModel:
        """The live policy; give it to TransformersEngine so rollouts sample the current adapter."""
        return self.model

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
    ) -> Self:
        """A policy that continues from a checkpoint exactly as if it had never stopped: adapter
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
            group["lr"] = initial_rate(trainer.config)
            group["weight_decay"] = trainer.config.weight_decay
        rng = torch.load(checkpoint_path / "rng_state.pt", weights_only=True)
        torch.set_rng_state(rng["torch"])
        random.setstate(as_python_rng_state(rng["python"]))
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        trainer.step = int(state["step"])
        return trainer


def initial_rate(config: TrainConfig) -> float:
    """The optimizer's rate until the first ``optim_step`` names one (every optim_step sets it):
    the config's peak, or 0.0 in a config without one (a Tinker client's, which names its rate
    at every step)."""
    return config.learning_rate if config.learning_rate is not None else 0.0


def load_policy_model(
    source: str, cache_dir: Path, *, device: str, unsloth: str, fsdp: bool = False
) -> tuple[Any, Any, Any]:
    """The base model for training, its tokenizer and dtype: unsloth's loader on CUDA when
    installed (``unsloth``: auto | on | off), else transformers, which leaves the weights in CPU
    memory for the Policy to move. ``fsdp`` (a base to be sharded across ranks): transformers
    always, so that no rank ever holds the whole base on its device (the Policy leaves it in CPU
    memory; training.hosting.ranks.shard_base puts each rank's shard on the device)."""
    from training.unsloth_loader import load_with_unsloth, use_unsloth  # unsloth: a GPU extra

    dtype = resolve_dtype("auto", device)
    if not fsdp and use_unsloth(device, unsloth):
        model, tokenizer = load_with_unsloth(
            base_model_dir(source, cache_dir), max_seq_length=4096, dtype=dtype
        )
    else:
        model, tokenizer = load_base_model(source, cache_dir, dtype=dtype, device=device)
    return model, tokenizer, dtype
