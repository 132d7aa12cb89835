"""Check that the sampler samples the trainer's newest policy.

A sampler that keeps using an old adapter (a cached LoRA id, a missed reload, a stale path) still
produces plausible rollouts, and training then quietly optimises against the wrong logprobs.
`verify_sampler` catches that two ways: (a) checksums of the LoRA weights the sampler uses, the
saved checkpoint and the trainer's live adapter must agree; (b) the sampler's greedy logprob of one
token must match the trainer policy's teacher-forced logprob of it on the same prompt.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file

from training.engines.base import Engine, SamplingParams
from training.engines.remote_engine import RemoteEngine
from training.engines.vllm_engine import render_prompt
from training.session.checkpoint_files import ADAPTER_WEIGHTS


class AdapterMismatchError(RuntimeError):
    """The sampler does not sample the policy the trainer has (or the checkpoint holds)."""


@dataclass
class SamplerCheck:
    """What `verify_sampler` found when all was well."""

    fingerprint: str  # of the checkpoint's adapter
    max_logprob_gap: float  # largest |sampler - trainer| probe logprob difference


def adapter_fingerprint(state_dict: Mapping[str, torch.Tensor]) -> str:
    """A SHA-256 over the LoRA tensors (keys containing "lora_"), independent of the dict's order.

    Values are hashed as float32, so one adapter held in bf16 and in fp32 (exact widening) has one
    fingerprint; any changed value, shape or name changes it.
    """
    names = sorted(name for name in state_dict if "lora_" in name)
    if not names:
        raise ValueError("no LoRA tensors to fingerprint (no key contains 'lora_')")
    digest = hashlib.sha256()
    for name in names:
        tensor = state_dict[name].detach().to(device="cpu", dtype=torch.float32).contiguous()
        digest.update(name.encode())
        digest.update(repr(tuple(tensor.shape)).encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def saved_adapter_fingerprint(checkpoint_dir: Path) -> str:
    """The fingerprint of the adapter saved in a checkpoint (or any peft adapter) directory."""
    path = Path(checkpoint_dir) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"no {ADAPTER_WEIGHTS} in {checkpoint_dir}")
    return adapter_fingerprint(load_file(path))


def live_adapter_fingerprint(peft_model: PeftModel, adapter_name: str | None = None) -> str:
    """The fingerprint of a PeftModel's current weights of one adapter (default: the active one).

    Keys go through peft's `get_peft_model_state_dict`, the function `save_pretrained` writes the
    file with, so they lose the adapter name ("lora_A.default.weight" → "lora_A.weight") exactly
    as the saved keys did.
    """
    name = adapter_name if adapter_name is not None else peft_model.active_adapter
    if name not in peft_model.peft_config:
        raise ValueError(f"the model has no adapter {name!r}")
    return adapter_fingerprint(get_peft_model_state_dict(peft_model, adapter_name=name))


def sampler_adapter_fingerprint(engine: Engine, adapter: str | None) -> str:
    """The fingerprint of the adapter `engine.generate(..., adapter=adapter)` samples with.

    For a TransformersEngine asked for adapter=None this is its model's active adapter; one that
    wrapped a plain model samples the base weights then, which only the probe can tell apart.
    """
    if isinstance(engine, RemoteEngine):
        # vLLM's weights live in its workers (an inference server's in its process); what we can
        # read is the files it was pointed at. That the engine really serves them is what the probe checks.
        if adapter is None:
            raise AdapterMismatchError(f"the {type(engine).__name__} sampler is asked to sample the base model, "
                                       "not an adapter")  # fmt: skip
        return saved_adapter_fingerprint(engine.adapter_path(adapter))
    model = getattr(engine, "model", None)
    if not isinstance(model, PeftModel):
        raise AdapterMismatchError(f"the sampler ({type(engine).__name__}) has no LoRA adapter loaded")
    return live_adapter_fingerprint(model, adapter)


@dataclass
class PolicyProbe:
    """The trainer's side of the check, taken when a checkpoint is saved. A run whose rollouts
    overlap training (``max_off_policy_steps``) loads a checkpoint into its sampler after the
    trainer has moved on, so the trainer's answers are kept until then."""

    checkpoint_dir: Path
    fingerprint: str  # of the saved adapter, which the live one matched
    prompts: list[list[int]]  # each probe rendered by the trainer's tokenizer
    logprobs: list[torch.Tensor]  # the policy's next-token log-probabilities after each prompt


def verify_sampler(
    engine: Engine,
    trainer_or_policy: Any,
    tokenizer: Any,
    checkpoint_dir: Path,
    probe_messages: list[list[dict]],
    *,
    adapter: str | None = None,
    tolerance: float = 1e-4,
) -> SamplerCheck:
    """Raise AdapterMismatchError unless `engine` (sampling with `adapter`) samples the policy saved
    in `checkpoint_dir`, which must also be the trainer's current one.

    `trainer_or_policy` is a Policy (its `.policy` is used) or the PeftModel itself. Each probe is
    an OpenAI-style message list. `tolerance` bounds the logprob gap: ~1e-4 for fp32 on one device;
    a bf16 sampler against a trainer needs far more (~5e-2), where the checksums do the exact part.
    """
    probe = probe_policy(trainer_or_policy, tokenizer, checkpoint_dir, probe_messages)
    return check_sampler(engine, probe, probe_messages, adapter=adapter, tolerance=tolerance)


def probe_policy(
    trainer_or_policy: Any, tokenizer: Any, checkpoint_dir: Path, probe_messages: list[list[dict]]
) -> PolicyProbe:
    """The trainer's answers to the probes; AdapterMismatchError unless its live adapter is the one
    saved in `checkpoint_dir`."""
    policy = getattr(trainer_or_policy, "policy", trainer_or_policy)
    if not isinstance(policy, PeftModel):
        raise TypeError(f"expected a Policy or a PeftModel, got {type(trainer_or_policy).__name__}")
    if not probe_messages:
        raise ValueError("verify_sampler needs at least one probe prompt")
    saved = saved_adapter_fingerprint(checkpoint_dir)
    live = live_adapter_fingerprint(policy)
    if live != saved:
        raise AdapterMismatchError(
            f"the trainer's live adapter is not the one saved in {checkpoint_dir}: fingerprints "
            f"{live[:12]} vs {saved[:12]}; the checkpoint is stale or the policy changed after saving"
        )
    prompts = [render_prompt(tokenizer, messages) for messages in probe_messages]
    return PolicyProbe(
        checkpoint_dir=Path(checkpoint_dir),
        fingerprint=saved,
        prompts=prompts,
        logprobs=[next_token_logprobs(policy, prompt) for prompt in prompts],
    )


def probe_saved(
    trainer_or_policy: Any, tokenizer: Any, checkpoint_dir: Path, probe_messages: list[list[dict]]
) -> PolicyProbe:
    """The probe of a checkpoint the trainer saved before the one it holds (a resumed run whose
    rollouts overlap training samples those again): its adapter is loaded into the trainer's policy
    for the probe only, then the live weights are put back, exactly (checked)."""
    policy = getattr(trainer_or_policy, "policy", trainer_or_policy)
    if not isinstance(policy, PeftModel):
        raise TypeError(f"expected a Policy or a PeftModel, got {type(trainer_or_policy).__name__}")
    name = policy.active_adapter
    live = {
        key: value.detach().clone()
        for key, value in get_peft_model_state_dict(policy, adapter_name=name).items()
    }
    before = adapter_fingerprint(live)
    device = next(iter(live.values())).device
    with torch.no_grad():
        set_peft_model_state_dict(policy, load_file(Path(checkpoint_dir) / ADAPTER_WEIGHTS, device=str(device)),
                                  adapter_name=name)  # fmt: skip
        try:
            return probe_policy(policy, tokenizer, checkpoint_dir, probe_messages)
        finally:
            set_peft_model_state_dict(policy, live, adapter_name=name)
            if live_adapter_fingerprint(policy, name) != before:
                raise AdapterMismatchError("the trainer's adapter did not come back exactly after a probe")


def check_sampler(
    engine: Engine,
    probe: PolicyProbe,
    probe_messages: list[list[dict]],
    *,
    adapter: str | None = None,
    tolerance: float = 1e-4,
) -> SamplerCheck:
    """Raise AdapterMismatchError unless `engine` (sampling with `adapter`) holds the adapter the
    trainer had when `probe` was taken, and scores the probes as the trainer did then."""
    sampler = sampler_adapter_fingerprint(engine, adapter)
    if sampler != probe.fingerprint:
        raise AdapterMismatchError(
            f"the sampler's adapter{_named(adapter)} is not the one saved in {probe.checkpoint_dir}: "
            f"fingerprints {sampler[:12]} vs {probe.fingerprint[:12]}; the sampler was not given the "
            "newest checkpoint"
        )
    # Greedy, one token: the logprob is under the untempered policy (engines/base.py).
    choices = engine.generate(
        probe_messages, SamplingParams(temperature=0.0, max_new_tokens=1), adapter=adapter
    )
    largest_gap = 0.0
    for expected_prompt, logprobs, choice in zip(probe.prompts, probe.logprobs, choices, strict=True):
        if choice.prompt_token_ids != expected_prompt:
            raise AdapterMismatchError(
                "the sampler renders the probe prompt into other tokens than the trainer's tokenizer: "
                "sampler and trainer must share one tokenizer and chat template"
            )
        expected = float(logprobs[choice.token_ids[0]])
        gap = abs(choice.logprobs[0] - expected)
        largest_gap = max(largest_gap, gap)
        if not gap <= tolerance:  # `not <=` so that a NaN fails too
            raise AdapterMismatchError(
                f"the sampler's logprob of token {choice.token_ids[0]} after a probe prompt is "
                f"{choice.logprobs[0]:.6f}, the trainer policy's is {expected:.6f} (gap {gap:.2e} > "
                f"{tolerance:.0e}): the sampler{_named(adapter)} does not serve the trainer's weights"
            )
    return SamplerCheck(fingerprint=probe.fingerprint, max_logprob_gap=largest_gap)


def next_token_logprobs(policy: torch.nn.Module, prompt_token_ids: list[int]) -> torch.Tensor:
    """log p(· | prompt) under `policy` (untempered, float32, on the CPU), one forward pass in eval mode."""
    device = next(policy.parameters()).device
    was_training = policy.training
    policy.eval()  # LoRA dropout off, as the sampler has it
    try:
        with torch.no_grad():
            input_ids = torch.tensor([prompt_token_ids], dtype=torch.long, device=device)
            logits = policy(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits
    finally:
        policy.train(was_training)
    return torch.log_softmax(logits[0, -1].float(), dim=-1).cpu()


def _named(adapter: str | None) -> str:
    return f" {adapter!r}" if adapter is not None else ""
