"""The trainer's completion mask: environment tokens (mask 0) shape the context and nothing else."""

import pytest
import torch

from training.base_models import load_base_model
from training.config import LoraSpec, TrainConfig
from training.recipes.grpo_update import grpo_train_step
from training.rollouts.trajectory import TrainGroup, TrainSample
from training.session.policy import Policy

PROMPT = [5, 6, 7, 8]
# A two-turn completion: sampled [20, 21, 22], environment [30, 31], sampled [23, 24], environment [32].
COMPLETION = [20, 21, 22, 30, 31, 23, 24, 32]
MASK = [1, 1, 1, 0, 0, 1, 1, 0]
SAMPLED_LOGPROBS = [-5.1, -4.2, -6.3, 0.0, 0.0, -5.5, -4.9, 0.0]


def train_once(tiny_model_dir, tmp_path, groups, normalization="sequence"):
    """The update's metrics and the adapter's gradients as the optimizer step receives them. The
    gradients, not the weights after the step: AdamW's first step moves every weight by about
    ±lr whatever its gradient's size, so a gradient of float noise (1e-12 here, 1e-12 of the
    opposite sign on another CPU's kernels) would flip a weight by 2 × lr."""
    model, tokenizer = load_base_model(str(tiny_model_dir), tmp_path)
    config = TrainConfig(group_size=2, learning_rate=1e-2, normalization=normalization, seed=0)
    trainer = Policy(model, tokenizer, config, LoraSpec(rank=4, alpha=8))
    names = {id(p): n for n, p in trainer.policy.named_parameters() if "lora_" in n}
    grads: dict[str, torch.Tensor] = {}
    steps = []

    def keep(optimizer, args, kwargs):  # every optimizer step's gradients (one per minibatch)
        step = len(steps)
        steps.append(step)
        for group_ in optimizer.param_groups:
            for p in group_["params"]:
                if p.grad is not None:
                    grads[f"{names[id(p)]}#{step}"] = p.grad.detach().clone()

    trainer.optimizer.register_step_pre_hook(keep)
    metrics = grpo_train_step(trainer, groups)
    assert grads, "the optimizer took no step"
    return metrics, grads


def group(completion, mask, logprobs, other_reward=0.0):
    """A group of the multi-turn sample (reward 1) and a short single-turn one."""
    return TrainGroup(
        [
            TrainSample(PROMPT, completion, logprobs, reward=1.0, completion_mask=mask),
            TrainSample(PROMPT, [25, 26], [-5.0, -5.2], reward=other_reward),
        ]
    )


def assert_same_update(a, b):
    (metrics_a, params_a), (metrics_b, params_b) = a, b
    for name in ("loss", "entropy", "trainable_tokens", "ratio_mean", "clip_fraction"):
        assert metrics_a[name] == pytest.approx(metrics_b[name], abs=1e-6), name
    assert metrics_a["grad_norm"] == pytest.approx(metrics_b["grad_norm"], rel=1e-5)
    assert params_a.keys() == params_b.keys()
    for name in params_a:  # the gradients (train_once): equal to float32 noise
        # Noise is relative to the tensor's scale, not to each element: an element near zero
        # differed by 3.4e-8 (0.5% of itself, 1.4e-6 of the largest) on this machine's kernels.
        # After the first optimizer step the weights carry AdamW's amplified noise (±lr whatever
        # a gradient's size), so later steps' gradients agree less closely (seen: 1e-5 of the
        # largest, varying with the order the suite ran in); the first step's are held tight.
        scale = float(params_b[name].abs().max())
        first_step = name.endswith("#0")
        assert torch.allclose(params_a[name], params_b[name], rtol=1e-4,
                              atol=(1e-5 if first_step else 1e-3) * scale), name  # fmt: skip


@pytest.mark.parametrize("normalization", ["sequence", "token"])
def test_environment_tokens_get_no_gradient(tiny_model_dir, tmp_path, normalization):
    baseline = train_once(
        tiny_model_dir, tmp_path, [group(COMPLETION, MASK, SAMPLED_LOGPROBS)], normalization
    )
    assert baseline[0]["trainable_tokens"] == 5 + 2  # mask-1 tokens only
    assert baseline[0]["grad_norm"] > 0

    # Whatever "logprobs" the environment's tokens carry is ignored.
    odd_logprobs = [lp if m else -50.0 for lp, m in zip(SAMPLED_LOGPROBS, MASK, strict=True)]
    assert_same_update(
        baseline, train_once(tiny_model_dir, tmp_path, [group(COMPLETION, MASK, odd_logprobs)], normalization)
    )
    # Environment tokens after the last sampled one influence nothing, whatever they are or however many.
    longer = [*COMPLETION[:-1], 40, 41, 42]
    assert_same_update(
        baseline,
        train_once(
            tiny_model_dir,
            tmp_path,
            [group(longer, [*MASK[:-1], 0, 0, 0], [*SAMPLED_LOGPROBS[:-1], 0.0, 0.0, 0.0])],
            normalization,
        ),
    )


def test_a_full_mask_trains_as_no_mask(tiny_model_dir, tmp_path):
    completion, logprobs = [20, 21, 22], [-5.1, -4.2, -6.3]
    assert_same_update(
        train_once(tiny_model_dir, tmp_path, [group(completion, None, logprobs)]),
        train_once(tiny_model_dir, tmp_path, [group(completion, [1, 1, 1], logprobs)]),
    )


@pytest.mark.parametrize("mask", [[1, 0], [1, 0, 2]])
def test_a_mask_must_fit_the_completion(tiny_model, mask):
    model, tokenizer = tiny_model
    trainer = Policy(model, tokenizer, TrainConfig(group_size=2, learning_rate=1e-3), LoraSpec())
    bad = TrainSample(PROMPT, [20, 21, 22], [-1.0] * 3, reward=1.0, completion_mask=mask)
    with pytest.raises(ValueError, match="completion_mask"):
        grpo_train_step(trainer, [TrainGroup([bad, TrainSample(PROMPT, [25], [-1.0], reward=0.0)])])
