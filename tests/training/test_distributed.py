"""Data-parallel sessions (training.hosting.ranks) on CPU: 2 processes joined with the gloo backend
train on the same batch as one process, and the updates agree within float32 summation noise."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from training.config import LoraSpec, TrainConfig
from training.hosting.followers import follower_pids
from training.hosting.ranks import DataParallelSession, run_ranks, shares
from training.session.contract import Datum
from training.session.local import TrainingSession

STEPS = 2
LEARNING_RATE = 1e-2
# Gradients summed across ranks differ from one process's only in the order of float32 additions;
# the tolerance is on the adapter weights after STEPS AdamW steps at LEARNING_RATE.
WEIGHT_TOLERANCE = 1e-5


def datum(tokens: list[int], trained_from: int, advantage: float) -> Datum:
    targets = len(tokens) - 1
    return Datum(
        model_input=tokens[:-1],
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "weights": [0.0] * trained_from + [1.0] * (targets - trained_from),
            "logprobs": [-2.0] * targets,
            "advantages": [advantage] * targets,
        },
    )


DATA = [
    datum([5, 9, 14, 3, 22, 7, 30], 2, 1.0),
    datum([5, 9, 40, 41, 42, 43], 1, -0.5),
    datum([8, 2, 11], 0, 2.0),
    datum([12, 13, 14, 15, 16, 17, 18, 19], 3, -1.0),
    datum([4, 6, 33, 35], 1, 0.5),
]


def make_session(model_dir: str, seed: int) -> TrainingSession:
    from training.session.policy import Policy

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = TrainConfig(micro_batch_tokens=16, seed=seed)
    return TrainingSession(Policy(model, tokenizer, config, LoraSpec(rank=2, alpha=4)))


def train(session, steps: int) -> dict:
    history = []
    for _ in range(steps):
        result = session.forward_backward(DATA, "ppo")
        stepped = session.optim_step(learning_rate=LEARNING_RATE)
        history.append({"loss": result.loss, "metrics": result.metrics, "logprobs": result.logprobs,
                        "grad_norm": stepped["grad_norm"]})  # fmt: skip
    params = (
        session.parameters
        if isinstance(session, DataParallelSession)
        else session.trainer.trainable_parameters
    )
    return {"history": history, "params": [p.detach().clone() for p in params]}


def _rank(rank: int, world_size: int, model_dir: str, out: str) -> None:
    # Another seed on rank 1: its own LoRA init, which the broadcast replaces with rank 0's.
    parallel = DataParallelSession(make_session(model_dir, seed=100 + rank))
    torch.save(train(parallel, STEPS), Path(out) / f"rank-{rank}.pt")
    parallel.save_state(Path(out) / "state", step=STEPS, metrics={})


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ddp")
    run_ranks(_rank, 2, str(tiny_model_dir), str(out), rendezvous=out / "rendezvous")
    return out


def test_two_gloo_ranks_update_as_one_process_does_on_the_same_batch(two_ranks, tiny_model_dir):
    single = train(make_session(str(tiny_model_dir), seed=100), STEPS)
    ranks = [torch.load(two_ranks / f"rank-{rank}.pt") for rank in (0, 1)]
    # The ranks hold the very same weights (rank 1 started from another init).
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True))
    differences = [
        float((a - b).abs().max()) for a, b in zip(ranks[0]["params"], single["params"], strict=True)
    ]
    assert max(differences) < WEIGHT_TOLERANCE, max(differences)
    assert max(float(p.abs().max()) for p in single["params"]) > 100 * WEIGHT_TOLERANCE  # it did train
    for parallel, alone in zip(ranks[0]["history"], single["history"], strict=True):
        assert parallel["loss"] == pytest.approx(alone["loss"], rel=1e-5, abs=1e-6)
        assert parallel["grad_norm"] == pytest.approx(alone["grad_norm"], rel=1e-5)
        for name in ("positions", "padding", "loss:sum", "entropy"):
            assert parallel["metrics"][name] == pytest.approx(alone["metrics"][name], rel=1e-5, abs=1e-6), (
                name
            )
        for got, expected in zip(parallel["logprobs"], alone["logprobs"], strict=True):
            assert got == pytest.approx(expected, abs=1e-5)


def test_rank_zero_writes_the_state_and_it_resumes_as_the_single_process_state(two_ranks, tiny_model_dir):
    state = two_ranks / "state"
    assert (state / "adapter_model.safetensors").is_file() and (state / "optimizer.pt").is_file()
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    resumed = TrainingSession.load_state(
        model, tokenizer, state, TrainConfig(micro_batch_tokens=16, seed=100), LoraSpec(rank=2, alpha=4)
    )
    rank_zero = torch.load(two_ranks / "rank-0.pt")["params"]
    assert all(
        torch.equal(a, b.detach())
        for a, b in zip(rank_zero, resumed.trainer.trainable_parameters, strict=True)
    )
    assert resumed.trainer.step == STEPS


def test_the_split_balances_tokens_and_covers_every_datum_once():
    split = shares(DATA, 2)
    assert sorted(i for part in split for i in part) == list(range(len(DATA)))
    loads = [sum(len(DATA[i].model_input) for i in part) for part in split]
    assert abs(loads[0] - loads[1]) <= max(len(d.model_input) for d in DATA)
    assert shares(DATA, 2) == split  # every rank computes the same split
    assert shares(DATA[:1], 3) == [[0], [], []]  # a rank may have nothing: it still takes part


def art_datum(tokens: list[int], trained_from: int, advantage: float, missing: int | None = None) -> Datum:
    """A datum of ART's loss with a KL reference; ``missing``: a position the sampler gave no
    logprob for (NaN: the learner's own is used)."""
    base = datum(tokens, trained_from, advantage)
    targets = len(tokens) - 1
    logprobs = [-2.0 - 0.1 * i for i in range(targets)]
    if missing is not None:
        logprobs[missing] = float("nan")
    weights = [w / max(sum(base.loss_fn_inputs["weights"]), 1.0) for w in base.loss_fn_inputs["weights"]]
    return Datum(model_input=base.model_input, loss_fn_inputs={
        **base.loss_fn_inputs, "weights": weights, "logprobs": logprobs,
        "ref_logprobs": [-2.5 + 0.05 * i for i in range(targets)],
    })  # fmt: skip


ART_DATA = [
    art_datum([5, 9, 14, 3, 22, 7, 30], 2, 1.0),
    art_datum([5, 9, 40, 41, 42, 43], 1, -0.5, missing=3),
    art_datum([8, 2, 11], 0, 2.0),
    art_datum([12, 13, 14, 15, 16, 17, 18, 19], 3, -1.0),
]
# ART's KL penalty from both sources: each token's KL is compared with the mean over the call.
ART_CONFIGS = [
    {"kl_penalty_coef": 0.5, "kl_penalty_source": "sample"},
    {"kl_penalty_coef": 0.5, "kl_penalty_source": "current_learner"},
    {},
]


def train_art(session) -> list[dict]:
    history = []
    for config in ART_CONFIGS:
        result = session.forward_backward(ART_DATA, "art", config)
        stepped = session.optim_step(learning_rate=LEARNING_RATE)
        history.append(
            {"loss": result.loss, "kl": result.metrics["kl_policy_ref"], "grad_norm": stepped["grad_norm"]}
        )
    return history


def _art_rank(rank: int, world_size: int, model_dir: str, out: str) -> None:
    parallel = DataParallelSession(make_session(model_dir, seed=100 + rank))
    history = train_art(parallel)
    torch.save({"history": history, "params": [p.detach().clone() for p in parallel.parameters]},
               Path(out) / f"art-{rank}.pt")  # fmt: skip


def test_arts_loss_with_a_kl_penalty_splits_across_ranks_as_the_whole_call(tmp_path, tiny_model_dir):
    run_ranks(_art_rank, 2, str(tiny_model_dir), str(tmp_path), rendezvous=tmp_path / "rendezvous")
    alone = make_session(str(tiny_model_dir), seed=100)
    single = train_art(alone)
    parallel = torch.load(tmp_path / "art-0.pt")
    for config, got, expected in zip(ART_CONFIGS, parallel["history"], single, strict=True):
        assert (expected["kl"] != 0.0) == bool(config)
        for name in ("loss", "kl", "grad_norm"):
            assert got[name] == pytest.approx(expected[name], rel=1e-4, abs=1e-6), (name, got, expected)
    difference = max(
        float((a - b).abs().max())
        for a, b in zip(parallel["params"], alone.trainer.trainable_parameters, strict=True)
    )
    assert difference < 10 * WEIGHT_TOLERANCE, difference  # 3 AdamW steps (see test_session_ranks)


def test_a_run_with_two_devices_trains_as_a_run_with_one(tiny_model_dir, tmp_path):
    """The run loop with ``devices: 2``: rank 0 rolls out and grades, a spawned follower takes each
    update with it (gloo); the checkpoints match the one-device run's within float32 noise."""
    from safetensors.torch import load_file

    from tests.training.test_cost_loop import MeteredHooks
    from tests.training.test_recipes import run_spec
    from training.runs.loop import run_training

    results = {}
    for devices in (1, 2):
        root = tmp_path / f"devices-{devices}"
        spec = run_spec(root, {"type": "regex", "name": "vowel", "pattern": "[aeiou]"}, model=tiny_model_dir,
                        cache=tiny_model_dir.parent, steps=2, max_new_tokens=6, group_size=4,
                        learning_rate=1e-2, devices=devices)  # fmt: skip
        hooks = MeteredHooks()
        assert run_training(spec, hooks) == "succeeded"
        results[devices] = (hooks, root)
    (one, one_root), (two, two_root) = results[1], results[2]
    assert any("data-parallel on 2 devices (gloo)" in event["message"] for event in two.events)
    first = [m for m in (one.metrics[0], two.metrics[0])]
    assert first[0]["trainable_tokens"] > 0, "the tiny model's first step carried no signal"
    assert first[1]["reward_mean"] == first[0]["reward_mean"]  # the same rollouts
    assert first[1]["loss"] == pytest.approx(first[0]["loss"], rel=1e-4, abs=1e-6)
    weights = [load_file(root / "step-000001" / "adapter_model.safetensors") for root in (one_root, two_root)]
    assert max(float((weights[0][k] - weights[1][k]).abs().max()) for k in weights[0]) < WEIGHT_TOLERANCE
    assert len(two.metrics) == 2
    # Rank 0's update was the data-parallel one, whose collectives need the follower.
    updated = [m.get("update_devices") for m in two.metrics if m["trainable_tokens"] > 0]
    assert updated and updated == [2.0] * len(updated)
    assert "update_devices" not in one.metrics[0]


def test_devices_is_a_validated_run_setting():
    from training.config import ConfigError

    with pytest.raises(ConfigError) as caught:
        TrainConfig(devices=0)
    assert caught.value.field == "devices"
    assert TrainConfig().devices == 1


def killing_follower_after_step_one(hooks: type) -> type:
    """``hooks`` that SIGKILL the run's one follower once step 1 is recorded."""
    import signal

    class KillingHooks(hooks):
        def record_step(self, *, step, metrics, trajectories, path) -> bool:
            if step == 1:
                (follower,) = follower_pids()
                os.kill(follower, signal.SIGKILL)
            return super().record_step(step=step, metrics=metrics, trajectories=trajectories, path=path)

    return KillingHooks


def test_a_rank_killed_mid_run_is_restarted_and_the_run_loses_nothing(tiny_model_dir, tmp_path):
    """The follower is killed (SIGKILL) once step 1 is recorded: step 2's update restarts it from
    the step-1 checkpoint and redoes the update; every checkpoint equals an unbroken run's."""

    from safetensors.torch import load_file

    from tests.training.test_cost_loop import MeteredHooks
    from tests.training.test_recipes import run_spec
    from training.runs.loop import run_training

    KillingHooks = killing_follower_after_step_one(MeteredHooks)
    roots = {}
    for name, hooks in (("unbroken", MeteredHooks()), ("killed", KillingHooks())):
        roots[name] = tmp_path / name
        spec = run_spec(roots[name], {"type": "regex", "name": "vowel", "pattern": "[aeiou]"}, model=tiny_model_dir,
                        cache=tiny_model_dir.parent, steps=3, max_new_tokens=6, group_size=4,
                        learning_rate=1e-2, devices=2)  # fmt: skip
        assert run_training(spec, hooks) == "succeeded"
        if name == "killed":
            warnings = [e["message"] for e in hooks.events if e["level"] == "warn"]
            assert any("data-parallel rank was lost" in w and "step-000001" in w for w in warnings), warnings
    assert follower_pids() == []
    for step in (1, 2, 3):
        weights = [load_file(roots[n] / f"step-00000{step}" / "adapter_model.safetensors") for n in roots]
        assert max(float((weights[0][k] - weights[1][k]).abs().max()) for k in weights[0]) < 1e-6, step


@pytest.mark.parametrize("objective,fsdp", [("sft", False), ("dpo", False), ("sft", True), ("dpo", True)])
def test_sft_and_dpo_runs_with_two_devices_train_as_runs_with_one(tiny_model_dir, tmp_path, objective, fsdp):
    """An SFT or DPO run with ``devices: 2``: every session primitive rank 0 calls (the forward
    passes of DPO's terms and its reference, the update, the held-out measurements) is mirrored on
    the follower; the losses, held-out figures and checkpoints match the one-device run's. With
    ``fsdp`` the base is sharded across the two and the held-out answers are graded by a sampler
    with a copy of its own."""
    from safetensors.torch import load_file

    from tests.training.test_supervised import WORDS, Hooks, supervised_spec
    from training.runs.loop import run_training

    if objective == "sft":
        rows = [{"prompt": f"Say {w}", "completion": f"{w} {w}", "item": {"word": w}} for w in WORDS]
        options = {"learning_rate": 2e-2}
    else:
        rows = [{"prompt": f"Name {w}", "chosen": f"{w} is fine", "rejected": "nothing here",
                 "item": {"word": w}} for w in WORDS]  # fmt: skip
        options = {"learning_rate": 5e-3, "dpo_beta": 0.5}
    results = {}
    for devices in (1, 2):
        root = tmp_path / f"devices-{devices}"
        hooks = Hooks()
        spec = supervised_spec(
            root,
            tiny_model_dir,
            objective,
            rows,
            rows[:2],
            steps=3,
            devices=devices,
            fsdp=fsdp and devices > 1,
            eval_interval=1,
            **options,
        )
        assert run_training(spec, hooks) == "succeeded", hooks.events
        results[devices] = (hooks, root)
    (one, one_root), (two, two_root) = results[1], results[2]
    assert [m.get("update_devices") for m in two.metrics] == [2.0, 2.0, 2.0]
    assert "update_devices" not in one.metrics[0]
    assert any("data-parallel on 2 devices (gloo)" in event["message"] for event in two.events)
    assert any(("sharded across them (FSDP2)" in event["message"]) == fsdp for event in two.events)
    # The held-out answers were graded at the start and at each step, on either path.
    assert len(two.evaluations) == len(one.evaluations) == 4, (two.evaluations, one.evaluations)
    assert follower_pids() == []
    for mine, theirs in zip(two.metrics, one.metrics, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-4, abs=1e-6)
        assert mine["heldout_loss"] == pytest.approx(theirs["heldout_loss"], rel=1e-4, abs=1e-6)
    assert one.metrics[-1]["heldout_loss"] < one.metrics[0]["heldout_loss"], (
        "nothing learned: equality says little"
    )
    for step in (1, 2, 3):
        weights = [
            load_file(root / f"step-00000{step}" / "adapter_model.safetensors")
            for root in (one_root, two_root)
        ]
        assert max(float((weights[0][k] - weights[1][k]).abs().max()) for k in weights[0]) < WEIGHT_TOLERANCE


def test_an_sft_run_whose_rank_is_killed_redoes_the_update_and_loses_nothing(tiny_model_dir, tmp_path):
    """The follower of an SFT run is killed (SIGKILL) once step 1 is recorded: step 2's update
    restarts it from the step-1 checkpoint (a new process group) and redoes the update; every
    checkpoint equals an unbroken run's."""

    from safetensors.torch import load_file

    from tests.training.test_supervised import WORDS, Hooks, supervised_spec
    from training.runs.loop import run_training

    KillingHooks = killing_follower_after_step_one(Hooks)
    rows = [{"prompt": f"Say {w}", "completion": f"{w} {w}", "item": {"word": w}} for w in WORDS]
    roots = {}
    for name, hooks in (("unbroken", Hooks()), ("killed", KillingHooks())):
        roots[name] = tmp_path / name
        spec = supervised_spec(
            roots[name], tiny_model_dir, "sft", rows, rows[:1], steps=3, devices=2, learning_rate=2e-2
        )
        assert run_training(spec, hooks) == "succeeded", hooks.events
        if name == "killed":
            warnings = [e["message"] for e in hooks.events if e["level"] == "warn"]
            assert any("data-parallel rank was lost" in w and "step-000001" in w for w in warnings), warnings
            assert len(hooks.metrics) == 3
    assert follower_pids() == []
    for step in (1, 2, 3):
        weights = [load_file(roots[n] / f"step-00000{step}" / "adapter_model.safetensors") for n in roots]
        assert max(float((weights[0][k] - weights[1][k]).abs().max()) for k in weights[0]) < 1e-6, step
