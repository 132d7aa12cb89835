"""SFT and DPO runs (training.recipes.supervised): targets marked on the right tokens, DPO's gradient applied
exactly through cross_entropy, and whole runs on the tiny model whose held-out figures improve."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tests.training.test_cost_loop import MeteredHooks
from training.config import LoraSpec, TrainConfig
from training.environments import build_environment
from training.recipes.supervised import (
    RowError,
    _with_weights,
    dpo_pair,
    dpo_terms,
    prompt_row,
    row_problem,
    sequence_logprobs,
    sft_sample,
)
from training.runs.loop import run_training
from training.runs.spec import RunSpec
from training.session.contract import BASE_MODEL
from training.session.local import TrainingSession
from training.session.policy import Policy


def test_row_problems_name_what_is_missing():
    assert row_problem({"prompt": "q", "completion": "a"}, "sft") is None
    assert (
        row_problem(
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "sft"
        )
        is None
    )
    assert "completion" in row_problem({"prompt": "q"}, "sft")
    assert "assistant" in row_problem({"messages": [{"role": "user", "content": "q"}]}, "sft")
    assert (
        row_problem({"prompt": "q", "chosen": "a", "rejected": {"role": "assistant", "content": "b"}}, "dpo")
        is None
    )
    assert "'rejected'" in row_problem({"prompt": "q", "chosen": "a"}, "dpo")
    assert "'chosen' must be" in row_problem({"prompt": "q", "chosen": 3, "rejected": "b"}, "dpo")
    assert "prompt" in row_problem({"completion": "a"}, "sft")


def test_sft_targets_are_exactly_the_assistant_replies(tiny_model):
    _, tokenizer = tiny_model
    sample = sft_sample(tokenizer, {"prompt": "Say hi", "completion": "hello there"}, "Be brief.")
    targets = [t for t, bit in zip(sample.completion_token_ids, sample.completion_mask, strict=True) if bit]
    assert sample.completion_mask[0] == 1 and "hello there" in tokenizer.decode(targets)
    assert "Say hi" not in tokenizer.decode(targets) and "Be brief" in tokenizer.decode(
        sample.prompt_token_ids
    )
    # Two replies: both are targets, the user turn between them is not.
    row = {"messages": [{"role": "user", "content": "one"}, {"role": "assistant", "content": "first reply"},
                        {"role": "user", "content": "two"}, {"role": "assistant", "content": "second reply"}]}  # fmt: skip
    sample = sft_sample(tokenizer, row, "")
    trained = tokenizer.decode(
        [t for t, b in zip(sample.completion_token_ids, sample.completion_mask, strict=True) if b]
    )
    skipped = tokenizer.decode(
        [t for t, b in zip(sample.completion_token_ids, sample.completion_mask, strict=True) if not b]
    )
    assert (
        "first reply" in trained and "second reply" in trained and "two" in skipped and "two" not in trained
    )
    with pytest.raises(RowError, match="completion"):
        sft_sample(tokenizer, {"prompt": "q"}, "")


def test_prompt_rows_drop_the_targets():
    assert prompt_row({"prompt": "q", "completion": "a", "item": {"x": 1}}) == {
        "prompt": "q",
        "item": {"x": 1},
    }
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    assert prompt_row(row) == {"messages": [{"role": "user", "content": "q"}]}
    assert prompt_row({"prompt": "q", "chosen": "a", "rejected": "b"}) == {"prompt": "q"}


def test_dpo_terms_match_autograd_on_hand_values():
    policy = [(-3.0, -2.5), (-1.0, -4.0)]
    reference = [(-3.2, -2.0), (-1.5, -3.0)]
    beta = 0.3
    loss, grads, metrics = dpo_terms(policy, reference, beta)
    p = torch.tensor(policy, dtype=torch.float64, requires_grad=True)
    r = torch.tensor(reference, dtype=torch.float64)
    margin = beta * ((p[:, 0] - r[:, 0]) - (p[:, 1] - r[:, 1]))
    expected = -torch.nn.functional.logsigmoid(margin).mean()
    expected.backward()
    assert loss == pytest.approx(float(expected.detach()), abs=1e-12)
    assert [g for pair in grads for g in pair] == pytest.approx(p.grad.flatten().tolist(), abs=1e-12)
    # margins 0.3·(0.2 + 0.5) > 0 and 0.3·(0.5 + 1.0) > 0; the policy prefers chosen in the second only.
    assert metrics["reward_accuracy"] == 1.0 and metrics["preference_accuracy"] == 0.5
    assert metrics["reward_margin"] == pytest.approx((0.7 + 1.5) / 2)
    assert dpo_terms([(0.0, 0.0)], [(0.0, 0.0)], 0.1)[0] == pytest.approx(math.log(2))


def direct_sequence_logprob(model: Any, sample: Any) -> torch.Tensor:
    ids = torch.tensor([sample.prompt_token_ids + sample.completion_token_ids])
    logprobs = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
    token = logprobs.gather(-1, ids[0, 1:, None]).squeeze(-1)
    start = len(sample.prompt_token_ids) - 1
    mask = torch.tensor(sample.completion_mask, dtype=token.dtype)
    return (token[start:] * mask).sum()


def test_dpo_gradient_through_cross_entropy_equals_the_direct_one(tiny_model):
    model, tokenizer = tiny_model
    trainer = Policy(model, tokenizer, TrainConfig(), LoraSpec(rank=2, alpha=4))
    with torch.no_grad():  # move the policy off the reference (LoRA B starts at 0)
        generator = torch.Generator().manual_seed(0)
        for name, parameter in trainer.model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    pairs = [dpo_pair(tokenizer, {"prompt": f"Pick {w}", "chosen": f"{w} yes", "rejected": "no thanks"}, "")
             for w in ("red", "blue")]  # fmt: skip
    session = TrainingSession(trainer)
    beta = 0.5
    samples = [s for pair in pairs for s in (pair.chosen, pair.rejected)]
    from training.session.contract import datum_of

    data = [datum_of(s) for s in samples]
    sums = [sequence_logprobs(s, v) for s, v in zip(samples, session.forward(data), strict=True)]
    refs = [
        sequence_logprobs(s, v)
        for s, v in zip(samples, session.forward(data, reference=BASE_MODEL), strict=True)
    ]
    loss, grads, _ = dpo_terms(
        list(zip(sums[::2], sums[1::2], strict=True)), list(zip(refs[::2], refs[1::2], strict=True)), beta
    )
    weighted = [d for pair, (gc, gr) in zip(pairs, grads, strict=True)
                for d in (_with_weights(pair.chosen, gc), _with_weights(pair.rejected, gr))]  # fmt: skip
    session.forward_backward(weighted, "cross_entropy")
    ours = [p.grad.detach().clone() for p in trainer.trainable_parameters]
    trainer.optimizer.zero_grad(set_to_none=True)

    direct = [direct_sequence_logprob(trainer.model, s) for s in samples]
    with torch.no_grad(), trainer.model.disable_adapter():
        reference = [direct_sequence_logprob(trainer.model, s) for s in samples]
    margins = torch.stack(
        [beta * ((direct[i] - reference[i]) - (direct[i + 1] - reference[i + 1])) for i in (0, 2)]
    )
    expected = -torch.nn.functional.logsigmoid(margins).mean()
    expected.backward()
    assert loss == pytest.approx(float(expected.detach()), abs=1e-5)
    for got, want in zip(ours, (p.grad for p in trainer.trainable_parameters), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)
    assert any(float(g.abs().sum()) > 0 for g in ours)


# ------------------------------------------------------------------ whole runs
WORDS = ["red", "blue", "green", "gold", "pink", "gray", "teal", "rust"]


def run(
    tmp_path, tiny_model_dir, objective: str, rows: list[dict], validation: list[dict], **config
) -> MeteredHooks:
    hooks = Hooks()
    assert run_training(
        supervised_spec(tmp_path, tiny_model_dir, objective, rows, validation, **config), hooks
    ) == ("succeeded")
    return hooks


def supervised_spec(
    tmp_path, tiny_model_dir, objective: str, rows: list[dict], validation: list[dict], **config
) -> RunSpec:
    return RunSpec.resolving(
        base_model_source=str(tiny_model_dir),
        model_cache_dir=tiny_model_dir.parent,
        checkpoint_root=tmp_path,
        config=TrainConfig(
            **{
                "steps": 8,
                "groups_per_step": 4,
                "learning_rate": 1e-2,
                "max_new_tokens": 4,
                "eval_max_rows": len(validation),
                **config,
            }
        ),  # fmt: skip
        lora=LoraSpec(rank=4, alpha=8),
        environment=build_environment("chat"),
        grader_spec={"type": "regex", "name": "word", "pattern": "{{item.word}}"},
        train_rows=[{"index": i, "data": row} for i, row in enumerate(rows)],
        validation_rows=[{"index": 100 + i, "data": row} for i, row in enumerate(validation)],
        start_step=0,
        resume_step=None,
        objective=objective,
    )


class Hooks(MeteredHooks):
    def record_evaluation(self, *, step: int, results: dict[str, Any], samples: list[Any]) -> None:
        self.evaluations.append({"step": step, **results})


def test_an_sft_run_lowers_the_held_out_loss_and_is_graded_by_the_reward(tiny_model_dir, tmp_path):
    rows = [{"prompt": f"Say {w}", "completion": f"{w} {w}", "item": {"word": w}} for w in WORDS]
    validation = [
        {"prompt": f"Say {w}", "completion": f"{w} {w}", "item": {"word": w}} for w in ("red", "teal")
    ]
    hooks = run(tmp_path, tiny_model_dir, "sft", rows, validation, learning_rate=2e-2, steps=12)
    before = next(e for e in hooks.events if e["message"].startswith("Held-out before training"))["data"][
        "heldout_loss"
    ]
    after = hooks.metrics[-1]["heldout_loss"]
    print(f"SFT held-out loss {before:.3f} -> {after:.3f}")
    assert after < before * 0.6  # measured 6.59 -> 3.24
    assert len(hooks.metrics) == 12 and all(m["trajectories"] == [] for m in hooks.metrics)
    assert hooks.metrics[0]["learning_rate"] == 2e-2 / 2  # the default one warm-up step: half the peak
    assert hooks.metrics[0]["device_seconds"] > 0
    # Graded on the validation prompts (targets removed) at step 0 and at the end.
    assert [e["step"] for e in hooks.evaluations] == [0, 12]
    assert (tmp_path / "step-000012" / "adapter_model.safetensors").exists()


def test_a_dpo_run_learns_the_preference(tiny_model_dir, tmp_path):
    rows = [{"prompt": f"Name {w}", "chosen": f"{w} is fine", "rejected": "nothing here", "item": {"word": w}}
            for w in WORDS]  # fmt: skip
    validation = [{"prompt": f"Name {w}", "chosen": f"{w} is fine", "rejected": "nothing here", "item": {"word": w}}
                  for w in ("red", "teal")]  # fmt: skip
    hooks = run(tmp_path, tiny_model_dir, "dpo", rows, validation, dpo_beta=0.5, learning_rate=5e-3)
    before = next(e for e in hooks.events if e["message"].startswith("Held-out before training"))["data"]
    after = hooks.metrics[-1]
    print(f"DPO held-out loss {before['heldout_loss']:.3f} -> {after['heldout_loss']:.3f}, "
          f"preference accuracy {before['heldout_preference_accuracy']} -> {after['heldout_preference_accuracy']}")  # fmt: skip
    assert before["heldout_loss"] == pytest.approx(math.log(2), abs=1e-6)  # the policy is the reference
    assert after["heldout_loss"] < 0.5 * math.log(2)
    assert after["heldout_reward_accuracy"] == 1.0 and after["heldout_preference_accuracy"] == 1.0
    assert all(m["loss"] > 0 for m in hooks.metrics)
