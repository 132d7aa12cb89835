import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from training.base_models import build_tiny_model, load_base_model
from training.config import LoraSpec, TrainConfig
from training.engines.base import SamplingParams
from training.engines.transformers_engine import TransformersEngine
from training.environments import EnvironmentSpec
from training.recipes.grpo_update import grpo_train_step
from training.rollouts.agent import rollout_groups
from training.rollouts.trajectory import to_train_group
from training.session.adapter_check import (
    AdapterMismatchError,
    adapter_fingerprint,
    check_sampler,
    live_adapter_fingerprint,
    probe_policy,
    probe_saved,
    saved_adapter_fingerprint,
    verify_sampler,
)
from training.session.policy import Policy

PROBES = [
    [{"role": "user", "content": "Hello! How are you today?"}],
    [
        {"role": "system", "content": "Reply with a short answer."},
        {"role": "user", "content": "What is 1 + 2?"},
    ],
]


def lora_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "base_model.model.layers.0.q_proj.lora_A.weight": torch.randn(4, 8, generator=generator),
        "base_model.model.layers.0.q_proj.lora_B.weight": torch.randn(8, 4, generator=generator),
        "base_model.model.layers.1.v_proj.lora_A.weight": torch.randn(4, 8, generator=generator),
    }


def test_fingerprint_ignores_dict_order_and_non_lora_keys():
    tensors = lora_tensors()
    reordered = dict(reversed(list(tensors.items())))
    assert adapter_fingerprint(tensors) == adapter_fingerprint(reordered)
    with_base = {**tensors, "base_model.model.layers.0.q_proj.weight": torch.ones(8, 8)}
    assert adapter_fingerprint(with_base) == adapter_fingerprint(tensors)


def test_fingerprint_changes_with_any_value_shape_or_name():
    tensors = lora_tensors()
    reference = adapter_fingerprint(tensors)
    nudged = {name: tensor.clone() for name, tensor in tensors.items()}
    nudged["base_model.model.layers.1.v_proj.lora_A.weight"][3, 7] += 1e-6
    assert adapter_fingerprint(nudged) != reference
    q_a = "base_model.model.layers.0.q_proj.lora_A.weight"
    reshaped = {**tensors, q_a: tensors[q_a].reshape(8, 4)}
    assert adapter_fingerprint(reshaped) != reference
    renamed = {name.replace("layers.1", "layers.2"): tensor for name, tensor in tensors.items()}
    assert adapter_fingerprint(renamed) != reference


def test_fingerprint_is_of_values_not_storage_dtype():
    tensors = {name: tensor.to(torch.bfloat16) for name, tensor in lora_tensors().items()}
    widened = {name: tensor.float() for name, tensor in tensors.items()}
    assert adapter_fingerprint(tensors) == adapter_fingerprint(widened)


def test_fingerprint_of_nothing_is_an_error():
    with pytest.raises(ValueError, match="no LoRA tensors"):
        adapter_fingerprint({"lm_head.weight": torch.ones(2)})


CONFIG = TrainConfig(group_size=4, max_new_tokens=8, learning_rate=1e-2, seed=0)
LORA = LoraSpec(rank=4, alpha=8)


@dataclass
class TrainedRun:
    trainer: Policy  # one real GRPO step past its step-0 checkpoint; tests must not change it
    tokenizer: Any
    root: Path  # holds step-0 and step-1


@pytest.fixture(scope="module")
def run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainedRun:
    """Built once per module: a step-0 checkpoint, one real train_step, a step-1 checkpoint."""
    root = tmp_path_factory.mktemp("run")
    model, tokenizer = load_base_model(str(tiny_model_dir), root)
    trainer = Policy(model, tokenizer, CONFIG, LORA)
    trainer.save_checkpoint(root / "step-0", step=0, metrics={})
    engine = TransformersEngine(trainer.policy, tokenizer)
    rows = [{"prompt": "Hello! How are you today?"}, {"prompt": "What is the answer?"}]
    sampling = SamplingParams(max_new_tokens=CONFIG.max_new_tokens, seed=0)
    groups = rollout_groups(engine, rows, EnvironmentSpec(), sampling, CONFIG.group_size)
    for group in groups:
        for index, trajectory in enumerate(group):
            trajectory.reward = float(index)  # distinct rewards: every group trains
    metrics = grpo_train_step(trainer, [to_train_group(group) for group in groups])
    assert metrics["grad_norm"] > 0
    trainer.save_checkpoint(root / "step-1", step=1, metrics=metrics)
    return TrainedRun(trainer, tokenizer, root)


def serving_engine(tiny_model_dir: Path, tokenizer: Any, adapter: str, path: Path) -> TransformersEngine:
    """A sampler with its own copy of the base model and one adapter loaded from `path`."""
    model, _ = load_base_model(str(tiny_model_dir), tiny_model_dir.parent)
    engine = TransformersEngine(model, tokenizer)
    engine.load_adapter(adapter, path)
    return engine


def test_live_and_saved_fingerprints_agree_after_a_step(run):
    saved_keys = set(load_file(run.root / "step-1" / "adapter_model.safetensors"))
    assert saved_keys and all(".default." not in key for key in saved_keys)
    assert live_adapter_fingerprint(run.trainer.policy) == saved_adapter_fingerprint(run.root / "step-1")
    assert saved_adapter_fingerprint(run.root / "step-0") != saved_adapter_fingerprint(run.root / "step-1")
    with pytest.raises(FileNotFoundError):
        saved_adapter_fingerprint(run.root)


def test_sampler_on_the_live_policy_passes(run):
    engine = TransformersEngine(run.trainer.policy, run.tokenizer)
    check = verify_sampler(engine, run.trainer, run.tokenizer, run.root / "step-1", PROBES)
    assert check.fingerprint == saved_adapter_fingerprint(run.root / "step-1")
    assert check.max_logprob_gap <= 1e-4
    assert run.trainer.policy.training  # the probe put the policy back in training mode


def test_separate_sampler_with_the_newest_checkpoint_passes(run, tiny_model_dir):
    engine = serving_engine(tiny_model_dir, run.tokenizer, "step-1", run.root / "step-1")
    policy = run.trainer.policy
    verify_sampler(engine, policy, run.tokenizer, run.root / "step-1", PROBES, adapter="step-1")


def test_sampler_with_an_old_checkpoint_fails(run, tiny_model_dir):
    # The reload after step 1 never happened: the sampler still has step 0 under the name it uses.
    engine = serving_engine(tiny_model_dir, run.tokenizer, "latest", run.root / "step-0")
    with pytest.raises(AdapterMismatchError, match="not the one saved in"):
        verify_sampler(engine, run.trainer, run.tokenizer, run.root / "step-1", PROBES, adapter="latest")


def test_live_weights_changed_after_saving_fail(run, tiny_model_dir):
    model, tokenizer = load_base_model(str(tiny_model_dir), run.root)
    trainer = Policy.resume(model, tokenizer, run.root / "step-1", CONFIG, LORA)
    engine = TransformersEngine(trainer.policy, tokenizer)
    verify_sampler(engine, trainer, tokenizer, run.root / "step-1", PROBES)  # as saved: fine
    with torch.no_grad():
        next(p for n, p in trainer.policy.named_parameters() if "lora_B" in n).add_(0.01)
    with pytest.raises(AdapterMismatchError, match="fingerprints"):
        verify_sampler(engine, trainer, tokenizer, run.root / "step-1", PROBES)


def test_an_earlier_checkpoints_probe_is_the_trainers_at_that_checkpoint_and_leaves_it_as_it_was(
    run, tiny_model_dir
):
    # The trainer holds step 1; a resumed overlapped run needs the probe of step 0 too.
    live = {
        name: tensor.clone() for name, tensor in run.trainer.policy.state_dict().items() if "lora_" in name
    }
    earlier = probe_saved(run.trainer, run.tokenizer, run.root / "step-0", PROBES)
    after = run.trainer.policy.state_dict()
    assert all(torch.equal(after[name], tensor) for name, tensor in live.items())
    assert earlier.fingerprint == saved_adapter_fingerprint(run.root / "step-0")
    model, tokenizer = load_base_model(str(tiny_model_dir), run.root)
    at_step_0 = probe_policy(Policy.resume(model, tokenizer, run.root / "step-0", CONFIG, LORA),
                             tokenizer, run.root / "step-0", PROBES)  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(earlier.logprobs, at_step_0.logprobs, strict=True))
    # A sampler holding step 0 passes against it; one holding step 1 does not.
    check_sampler(
        serving_engine(tiny_model_dir, run.tokenizer, "s0", run.root / "step-0"),
        earlier,
        PROBES,
        adapter="s0",
    )
    with pytest.raises(AdapterMismatchError, match="fingerprints"):
        engine = serving_engine(tiny_model_dir, run.tokenizer, "s1", run.root / "step-1")
        check_sampler(engine, earlier, PROBES, adapter="s1")


def test_same_adapter_on_another_base_model_fails_the_logprob_probe(run, tmp_path):
    # Checksums agree (same adapter files); only the probe sees that the weights under them differ.
    other_base = build_tiny_model(tmp_path / "other", seed=1)
    engine = serving_engine(other_base, run.tokenizer, "step-1", run.root / "step-1")
    with pytest.raises(AdapterMismatchError, match="does not serve the trainer's weights"):
        verify_sampler(engine, run.trainer, run.tokenizer, run.root / "step-1", PROBES, adapter="step-1")


def test_sampler_with_another_chat_template_fails(run):
    engine = TransformersEngine(run.trainer.policy, run.tokenizer)
    other = copy.deepcopy(run.tokenizer)
    other.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    with pytest.raises(AdapterMismatchError, match="chat template"):
        verify_sampler(engine, run.trainer, other, run.root / "step-1", PROBES)
