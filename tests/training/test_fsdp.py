"""A base sharded across data-parallel ranks (training.hosting.ranks.shard_base, FSDP2) on CPU: 2
gloo processes each hold half the base's weights, and train, forward and fail exactly as the
unsharded ranks and one process do; a call whose shares need different numbers of forward passes,
and one that fails on one rank only, leave no rank waiting in a gather."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.training.test_distributed import (
    DATA,
    STEPS,
    WEIGHT_TOLERANCE,
    datum,
    train,
    train_art,
)
from training.config import ConfigError, LoraSpec, TrainConfig
from training.hosting.ranks import DataParallelSession, local_parameter_bytes, run_ranks, shares
from training.session.contract import BASE_MODEL, Datum
from training.session.local import TrainingSession


def make_session(model_dir: str, seed: int, **config) -> TrainingSession:
    from training.session.policy import Policy

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    settings = TrainConfig(micro_batch_tokens=16, seed=seed, **config)
    return TrainingSession(Policy(model, tokenizer, settings, LoraSpec(rank=2, alpha=4)))


# Rank 0's share of these is the longest datum, in one packed row; rank 1's the other two, in two
# rows (micro_batch_tokens 16): the ranks run different numbers of passes of their own.
UNEVEN = [datum(list(range(5, 5 + n)), 1, 1.0 - 0.5 * i) for i, n in enumerate((30, 28, 4))]


def _rank(rank: int, world_size: int, model_dir: str, out: str) -> None:
    session = make_session(model_dir, seed=100 + rank)
    full_bytes = local_parameter_bytes(session.trainer.model)
    parallel = DataParallelSession(session, shard=True)
    report: dict = {"full_bytes": full_bytes, "sharded_bytes": local_parameter_bytes(session.trainer.model)}
    report["adapter_bytes"] = sum(p.numel() * p.element_size() for p in parallel.parameters)
    report.update(train(parallel, STEPS))
    report["passes"] = [len(session._layout([UNEVEN[i].sample() for i in part], whole=False))
                        for part in shares(UNEVEN, world_size)]  # fmt: skip
    report["uneven"] = parallel.forward_backward(UNEVEN, "ppo", forward_only=True).logprobs
    report["reference"] = parallel.forward(UNEVEN, reference=BASE_MODEL)
    # Bad input in one rank's share: a token outside the vocabulary (before any pass), then a loss
    # input the loss refuses (after the first pass): both calls fail on every rank, and leave no
    # gradient behind.
    out_of_vocabulary = Datum(model_input=[5, 10**6], loss_fn_inputs={"target_tokens": [10**6, 7]})
    missing_advantages = Datum(
        model_input=[8, 2, 11], loss_fn_inputs={"target_tokens": [2, 11, 4], "logprobs": [-2.0] * 3}
    )
    report["errors"] = []
    # The second call's shares: UNEVEN[0] on rank 0, the datum without advantages alone on rank 1.
    report["bad_shares"] = shares([UNEVEN[0], missing_advantages], world_size)
    for call in ([*DATA, out_of_vocabulary], [UNEVEN[0], missing_advantages]):
        try:
            parallel.forward_backward(call, "ppo")
        except Exception as exc:  # noqa: BLE001 (recorded for the test)
            report["errors"].append((type(exc).__name__, str(exc)))
    report["grads_after_errors"] = [p.grad for p in parallel.parameters]
    report["after"] = parallel.forward(DATA)  # still in step: the next call works on every rank
    try:
        session.sample([[5, 9]], None)
    except ValueError as exc:
        report["sample"] = str(exc)
    report["art"] = train_art(parallel)
    report["final"] = [p.detach().clone() for p in parallel.parameters]
    torch.save(report, Path(out) / f"rank-{rank}.pt")
    parallel.save_state(Path(out) / "state", step=STEPS, metrics={})


@pytest.fixture(scope="module")
def sharded(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    run_ranks(_rank, 2, str(tiny_model_dir), str(out), rendezvous=out / "rendezvous")
    return out


def ranks(out: Path) -> list[dict]:
    return [torch.load(out / f"rank-{rank}.pt", weights_only=False) for rank in (0, 1)]


def test_each_rank_holds_half_of_the_base_and_all_of_the_adapter(sharded):
    for report in ranks(sharded):
        base = report["full_bytes"] - report["adapter_bytes"]
        assert report["sharded_bytes"] - report["adapter_bytes"] == pytest.approx(base / 2, rel=0.02)


def test_a_sharded_update_is_one_process_update_on_the_same_batch(sharded, tiny_model_dir):
    alone = make_session(str(tiny_model_dir), seed=100)
    single = train(alone, STEPS)
    zero, one = ranks(sharded)
    assert all(torch.equal(a, b) for a, b in zip(zero["params"], one["params"], strict=True))
    differences = [float((a - b).abs().max()) for a, b in zip(zero["params"], single["params"], strict=True)]
    assert max(differences) < WEIGHT_TOLERANCE, max(differences)
    assert max(float(p.abs().max()) for p in single["params"]) > 100 * WEIGHT_TOLERANCE  # it did train
    for parallel, expected in zip(zero["history"], single["history"], strict=True):
        assert parallel["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-6)
        assert parallel["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
        for name in ("positions", "padding", "loss:sum", "entropy"):
            assert parallel["metrics"][name] == pytest.approx(expected["metrics"][name], rel=1e-5, abs=1e-6)
        for got, want in zip(parallel["logprobs"], expected["logprobs"], strict=True):
            assert got == pytest.approx(want, abs=1e-5)
    # Then ART's loss with its KL penalty over the whole call (one more all-reduce, a forward of its own).
    art = train_art(alone)
    for got, want in zip(zero["art"], art, strict=True):
        for name in ("loss", "kl", "grad_norm"):
            assert got[name] == pytest.approx(want[name], rel=1e-4, abs=1e-6), name


def test_shares_needing_different_numbers_of_passes_forward_in_step(sharded, tiny_model_dir):
    zero, one = ranks(sharded)
    assert zero["passes"] == [1, 2]  # the ranks' own passes differ
    alone = make_session(str(tiny_model_dir), seed=100)
    train(alone, STEPS)
    expected = alone.forward_backward(UNEVEN, "ppo", forward_only=True).logprobs
    for got, want in zip(zero["uneven"], expected, strict=True):
        assert got == pytest.approx(want, abs=1e-5)
    reference = alone.forward(UNEVEN, reference=BASE_MODEL)
    assert zero["reference"] == one["reference"]
    for got, want in zip(zero["reference"], reference, strict=True):
        assert got == pytest.approx(want, abs=1e-5)
    assert zero["after"] == one["after"]


def test_bad_input_on_one_rank_fails_the_call_on_every_rank_and_leaves_them_in_step(sharded):
    for report in ranks(sharded):
        (kind, vocabulary), (loss_kind, loss_message) = report["errors"]
        assert kind == "LossInputError" and "outside the model's vocabulary" in vocabulary, vocabulary
        assert loss_kind == "LossInputError" and "advantages" in loss_message, loss_message
        assert report["bad_shares"] == [[0], [1]]
        assert all(grad is None for grad in report["grads_after_errors"])
        assert "sharded" in report["sample"] and "inference server" in report["sample"]


def test_rank_zero_saves_an_adapter_the_unsharded_trainer_resumes(sharded, tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    resumed = TrainingSession.load_state(
        model,
        tokenizer,
        sharded / "state",
        TrainConfig(micro_batch_tokens=16, seed=100),
        LoraSpec(rank=2, alpha=4),
    )
    final = ranks(sharded)[0]["final"]
    assert all(
        torch.equal(a, b.detach()) for a, b in zip(final, resumed.trainer.trainable_parameters, strict=True)
    )
    assert resumed.trainer.step == STEPS


def test_fsdp_needs_several_devices():
    with pytest.raises(ConfigError) as caught:
        TrainConfig(fsdp=True)
    assert "fsdp" in str(caught.value) and "devices of 2" in str(caught.value)


@pytest.mark.parametrize("fsdp", [True, False])
def test_a_base_to_be_sharded_stays_in_cpu_memory_and_only_its_adapter_goes_to_the_device(
    tiny_model_dir, fsdp
):
    """With ``fsdp`` no rank puts the whole base on its device (shard_base's fully_shard moves each
    rank's shard there); the adapter, which every rank holds whole, goes there at once. The
    ``meta`` device stands in for an accelerator, which this host lacks: where a tensor is shows."""
    from training.session.policy import Policy

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    settings = TrainConfig(devices=2, fsdp=fsdp, max_off_policy_steps=1)
    trainer = Policy(model, tokenizer, settings, LoraSpec(rank=2, alpha=4), device="meta")
    places = {name: parameter.device.type for name, parameter in trainer.model.named_parameters()}
    adapter = {place for name, place in places.items() if "lora_" in name}
    base = {place for name, place in places.items() if "lora_" not in name}
    assert adapter == {"meta"}
    assert base == ({"cpu"} if fsdp else {"meta"})
    assert {p.device.type for p in trainer.trainable_parameters} == {"meta"}
    if fsdp:  # not sharded yet, and still no sampling on one rank
        with pytest.raises(ValueError, match="sharded across its devices"):
            TrainingSession(trainer).sample([[5, 9]], None)


def test_a_base_to_be_sharded_is_never_loaded_by_unsloth(tiny_model_dir, monkeypatch):
    """unsloth's loader puts the whole base on the GPU; a base to be sharded takes transformers'."""
    import training.unsloth_loader as unsloth_loader
    from training.session.policy import load_policy_model

    def whole_on_the_device(*args, **kwargs):
        raise AssertionError("unsloth's loader was used")

    monkeypatch.setattr(unsloth_loader, "use_unsloth", lambda device, setting: True)
    monkeypatch.setattr(unsloth_loader, "load_with_unsloth", whole_on_the_device)
    model, _, _ = load_policy_model(str(tiny_model_dir), tiny_model_dir.parent, device="cpu", unsloth="on",
                                    fsdp=True)  # fmt: skip
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    with pytest.raises(AssertionError, match="unsloth's loader was used"):
        load_policy_model(str(tiny_model_dir), tiny_model_dir.parent, device="cpu", unsloth="on")


def test_fsdp_in_a_grpo_run_needs_a_sampler_of_its_own_and_sft_and_dpo_runs_take_it_as_it_is():
    with pytest.raises(ConfigError) as caught:
        TrainConfig(fsdp=True, devices=2).check_objective("grpo")
    assert caught.value.field == "fsdp" and "max_off_policy_steps" in str(caught.value)
    TrainConfig(fsdp=True, devices=2, max_off_policy_steps=1).check_objective("grpo")
    for objective in (
        "sft",
        "dpo",
    ):  # their held-out grading has a sampler of its own (training.recipes.supervised)
        TrainConfig(fsdp=True, devices=2).check_objective(objective)


def test_an_overlapped_run_with_a_sharded_base_trains_as_one_without(tiny_model_dir, tmp_path):
    """A GRPO run with ``devices: 2, fsdp: true`` (its rollouts on a sampler of its own, one step
    off-policy): the follower takes each update and each probe of the saved policy with rank 0, and
    the checkpoints match the unsharded two-device run's within float32 noise."""
    from safetensors.torch import load_file

    from tests.training.test_cost_loop import MeteredHooks
    from tests.training.test_recipes import run_spec
    from training.runs.loop import run_training

    results = {}
    for fsdp in (False, True):
        root = tmp_path / f"fsdp-{fsdp}"
        spec = run_spec(root, {"type": "regex", "name": "vowel", "pattern": "[aeiou]"}, model=tiny_model_dir,
                        cache=tiny_model_dir.parent, steps=3, max_new_tokens=6, group_size=4,
                        learning_rate=1e-2, devices=2, fsdp=fsdp, max_off_policy_steps=1)  # fmt: skip
        hooks = MeteredHooks()
        assert run_training(spec, hooks) == "succeeded", [e["message"] for e in hooks.events]
        results[fsdp] = (hooks, root)
    (plain, plain_root), (sharded, sharded_root) = results[False], results[True]
    assert any(
        "(gloo), the base's weights sharded across them (FSDP2)" in e["message"] for e in sharded.events
    )
    assert [m["reward_mean"] for m in sharded.metrics] == [m["reward_mean"] for m in plain.metrics]
    assert any(m["trainable_tokens"] > 0 for m in sharded.metrics)
    for step in (1, 2, 3):
        weights = [load_file(root / f"step-00000{step}" / "adapter_model.safetensors")
                   for root in (plain_root, sharded_root)]  # fmt: skip
        assert max(float((weights[0][k] - weights[1][k]).abs().max()) for k in weights[0]) < WEIGHT_TOLERANCE
    # Every step's sampler check passed against the sharded trainer's probe.
    assert all(m["sampler_logprob_gap"] <= 1e-4 for m in sharded.metrics)


def test_a_rank_lost_before_or_during_the_probe_is_restarted_and_the_ranks_probe_together(
    tiny_model_dir, tmp_path
):
    """The check of a saved policy on a base to be sharded (Followers.probe): the first probe shards
    the base on every rank, and every rank runs the probe's forward passes, of the checkpoint the
    trainer holds or of an earlier one. With the follower killed before the probe, or between two
    of its forward passes: rank 0 loads its base again, the follower starts again from the
    checkpoint, every rank shards the base anew and the probe is taken again on all of them, giving
    the unsharded policy's answers (a rank probing alone on its shards would wait in a gather)."""
    import signal
    from functools import partial

    from training.engines.vllm_engine import render_prompt
    from training.hosting.followers import Followers, FollowerSpec
    from training.session.adapter_check import next_token_logprobs, probe_policy, probe_saved
    from training.session.policy import Policy, load_policy_model

    config = TrainConfig(devices=2, fsdp=True, max_off_policy_steps=1, seed=3)
    lora = LoraSpec(rank=2, alpha=4)
    base, tokenizer, _ = load_policy_model(str(tiny_model_dir), tiny_model_dir.parent, device="cpu",
                                           unsloth="off", fsdp=True)  # fmt: skip
    trainer = Policy(base, tokenizer, config, lora)
    earlier, checkpoint = tmp_path / "step-000000", tmp_path / "step-000001"
    trainer.save_checkpoint(earlier, step=0, metrics={})
    with torch.no_grad():  # an adapter that changes the answers
        for parameter in trainer.trainable_parameters:
            parameter.copy_(torch.randn_like(parameter) * 0.05)
    trainer.save_checkpoint(checkpoint, step=1, metrics={})
    probes = [[{"role": "user", "content": "a b c"}], [{"role": "user", "content": "what is two and two?"}]]
    whole = probe_policy(trainer, tokenizer, checkpoint, probes).logprobs
    whole_earlier = probe_saved(trainer, tokenizer, earlier, probes).logprobs
    assert max(float((a - b).abs().max()) for a, b in zip(whole, whole_earlier, strict=True)) > 1e-3
    spec = FollowerSpec(base_model_source=str(tiny_model_dir), model_cache_dir=tiny_model_dir.parent,
                        device="cpu", unsloth="off", config=config, lora=lora, checkpoint=checkpoint)  # fmt: skip
    followers = Followers(spec, 2, rendezvous_dir=tmp_path / "ranks", start_timeout_s=120)

    def kill_follower() -> None:
        (process,) = followers.processes
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)

    takes = []

    def take(kill_midway: bool = False):
        takes.append(kill_midway)
        if kill_midway and takes.count(True) == 1:  # the first pass on every rank, then one rank dies
            next_token_logprobs(trainer.policy, render_prompt(tokenizer, probes[0]))
            kill_follower()
        return probe_policy(trainer, tokenizer, checkpoint, probes)

    try:
        assert not trainer.sharded
        answers = [followers.probe(trainer, probes, checkpoint=checkpoint, take=take)]
        assert trainer.sharded  # the first probe sharded the base, on every rank
        earlier_answer = followers.probe(trainer, probes, checkpoint=checkpoint, saved=earlier,
                                         take=partial(probe_saved, trainer, tokenizer, earlier, probes))  # fmt: skip
        gaps = [
            float((a - b).abs().max()) for a, b in zip(whole_earlier, earlier_answer.logprobs, strict=True)
        ]
        assert max(gaps) < 1e-4, gaps
        answers.append(followers.probe(trainer, probes, checkpoint=checkpoint, take=take))
        kill_follower()
        answers.append(followers.probe(trainer, probes, checkpoint=checkpoint, take=take))
        assert followers.restarts == 1 and trainer.sharded
        said: list[str] = []
        answers.append(followers.probe(trainer, probes, checkpoint=checkpoint, take=lambda: take(True),
                                       on_restart=said.append))  # fmt: skip
        assert followers.restarts == 2 and trainer.sharded
        assert len(said) == 1 and "rank was lost at the check of step-000001" in said[0], said
        assert takes == [False, False, False, True, True]  # the probe killed midway was taken again
        for answer in answers:
            gaps = [float((a - b).abs().max()) for a, b in zip(whole, answer.logprobs, strict=True)]
            assert max(gaps) < 1e-4, gaps
    finally:
        followers.close()


def test_a_rank_of_a_sharded_base_killed_mid_run_is_restarted_and_the_run_loses_nothing(
    tiny_model_dir, tmp_path
):
    """The follower is killed (SIGKILL) once step 1 is recorded: rank 0 loads its base whole again
    (its shards cannot be gathered without the lost rank), the follower starts again from the last
    checkpoint, the update is redone, and every checkpoint equals an unbroken sharded run's."""
    from safetensors.torch import load_file

    from tests.training.test_cost_loop import MeteredHooks
    from tests.training.test_distributed import killing_follower_after_step_one
    from tests.training.test_recipes import run_spec
    from training.hosting.followers import follower_pids
    from training.runs.loop import run_training

    KillingHooks = killing_follower_after_step_one(MeteredHooks)
    roots = {}
    for name, hooks in (("unbroken", MeteredHooks()), ("killed", KillingHooks())):
        roots[name] = tmp_path / name
        spec = run_spec(roots[name], {"type": "regex", "name": "vowel", "pattern": "[aeiou]"}, model=tiny_model_dir,
                        cache=tiny_model_dir.parent, steps=3, max_new_tokens=6, group_size=4,
                        learning_rate=1e-2, devices=2, fsdp=True, max_off_policy_steps=1)  # fmt: skip
        assert run_training(spec, hooks) == "succeeded", [e["message"] for e in hooks.events]
        if name == "killed":
            warnings = [e["message"] for e in hooks.events if e["level"] == "warn"]
            assert any("data-parallel rank was lost" in w for w in warnings), warnings
    assert follower_pids() == []
    for step in (1, 2, 3):
        weights = [load_file(roots[n] / f"step-00000{step}" / "adapter_model.safetensors") for n in roots]
        assert max(float((weights[0][k] - weights[1][k]).abs().max()) for k in weights[0]) < 1e-6, step


def test_a_tinker_session_with_a_sharded_base_trains_as_one_process_on_a_base_of_its_own(
    tiny_model_dir, tmp_path
):
    """A SessionPool session with ``devices: 2, fsdp: true`` (a Tinker training client's): its base
    is its own (the other session of the same source keeps the shared one, whole), its calls train
    as one process's, a follower lost between calls is restarted with rank 0's base loaded whole
    again and the calls since the step replayed, and it does not sample."""
    from tests.training.test_session_ranks import (
        LORA,
        alone,
        calls,
        close,
        gap,
        kill,
        pool_of,
    )
    from tests.training.test_session_ranks import (
        WEIGHT_TOLERANCE as POOL_WEIGHTS,
    )
    from training.hosting.followers import follower_pids

    expected, expected_params = alone(tiny_model_dir)
    pool = pool_of(tiny_model_dir, tmp_path)
    sharded = TrainConfig(seed=3, micro_batch_tokens=16, devices=2, fsdp=True)
    pool.open("fsdp", str(tiny_model_dir), sharded, LORA)
    pool.open("solo", str(tiny_model_dir), TrainConfig(seed=9, micro_batch_tokens=16), LORA)
    assert len(pool.stats()["base_models"]) == 2 and pool.base_loads == 2
    with pool.use("fsdp") as session:
        first = follower_pids()
        got = calls(session, after_first=lambda: kill(first[0]))
        assert session.recoveries == 1 and session.trainer.sharded
        params = [p.detach().clone() for p in session.trainer.trainable_parameters]
        with pytest.raises(ValueError, match="sharded across its devices"):
            session.sample([[5, 9]], None)
    assert close(got, expected), (got[:6], expected[:6])
    assert gap(params, expected_params) < POOL_WEIGHTS
    with pool.use("solo") as solo:  # the shared base stayed whole: it runs on its own
        assert not solo.trainer.sharded and solo.forward(DATA[:1])
    with pytest.raises(ValueError, match="fsdp"):
        pool.configure("fsdp", TrainConfig(seed=3, micro_batch_tokens=16, devices=2))
    pool.close("fsdp")
    assert follower_pids() == [] and len(pool.stats()["base_models"]) == 1
    pool.close("solo")


def test_an_art_job_with_a_sharded_base_trains_as_on_one_device(tiny_model_dir, tmp_path):
    """A model's ART training job with ``devices: 2, fsdp: true`` (its session in the worker's pool
    on a base of its own, ART's loss with a KL penalty against the base) records the step one
    device does; the kept session's key names fsdp, so a job without it gets another session."""
    from safetensors.torch import load_file

    from tests.training.test_session_ranks import LORA, QuietHooks, art_groups, load
    from tests.training.test_session_ranks import WEIGHT_TOLERANCE as POOL_WEIGHTS
    from training.hosting.followers import follower_pids
    from training.hosting.resident import ResidentSessions, SessionKey
    from training.recipes.art_config import art_job_config
    from training.runs.art_groups import parse_groups
    from training.runs.art_step import ClientStepSpec, train_client_step

    source = str(tiny_model_dir)
    groups = art_groups(source)

    def job(sessions: ResidentSessions, devices: int, fsdp: bool, root: str):
        config, options = art_job_config({"learning_rate": 1e-2, "kl_penalty_coef": 0.5})
        config = TrainConfig(
            **{**config.to_dict(), "devices": devices, "fsdp": fsdp, "micro_batch_tokens": 16}
        )
        spec = ClientStepSpec(base_model_source=source, model_cache_dir=tiny_model_dir.parent,
                              checkpoint_root=tmp_path / root, config=config, options=options, lora=LORA,
                              groups=parse_groups(groups), from_step=0, resume_from=None)  # fmt: skip
        key = SessionKey(model="m", step=0, digest="d", base_model_source=source, devices=devices, fsdp=fsdp)
        sessions.attach(spec, key)
        try:
            result = train_client_step(spec, QuietHooks())
        finally:
            sessions.settle("m", None)
        return result

    one = job(ResidentSessions(load, capacity=2, spill_dir=tmp_path / "one"), 1, False, "one")
    sessions = ResidentSessions(
        load, capacity=2, spill_dir=tmp_path / "two", model_cache_dir=tiny_model_dir.parent
    )
    sharded = job(sessions, 2, True, "two")
    assert one.metrics["kl"] != 0.0
    for name in ("loss", "grad_norm", "kl", "trainable_tokens"):
        assert sharded.metrics[name] == pytest.approx(one.metrics[name], rel=1e-4, abs=1e-6), name
    expected = load_file(Path(one.path) / "adapter_model.safetensors")
    got = load_file(Path(sharded.path) / "adapter_model.safetensors")
    assert max(float((got[k] - v).abs().max()) for k, v in expected.items()) < POOL_WEIGHTS
    assert follower_pids() == []
    key = SessionKey(model="m", step=1, digest="e", base_model_source=source, devices=2)
    assert key.tag != SessionKey(**{**key.__dict__, "fsdp": True}).tag
