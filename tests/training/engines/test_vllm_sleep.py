"""vLLM sleep mode when the trainer and the sampler share one GPU: the loop puts vLLM to sleep for
every policy update and wakes it before the new checkpoint's adapter loads and the next rollouts.

No GPU or vLLM here: a stand-in `vllm` module at the boundary records what the real training loop
asks of `vllm.LLM`, in order, over a two-step run on the tiny model. It returns well-formed outputs
and checks nothing about sampling; whether vLLM itself samples correctly after a wake-up is what
benchmarks/gpu_smoke.sh and the gpu-marked tests check on a GPU host.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.training.test_learning_signal import ROWS, Hooks
from training.config import LoraSpec, TrainConfig
from training.engines import vllm_engine
from training.engines.base import SamplingParams
from training.engines.vllm_engine import VLLMEngine, sleep_mode_memory_utilization
from training.environments import build_environment
from training.loop import RunSpec, run_training

GIB = 1 << 30


@dataclass
class Logprob:
    logprob: float


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]
    finish_reason: str


@dataclass
class Output:
    prompt_token_ids: list[int]
    outputs: list[Completion]


class FakeVLLM:
    """`vllm`, `vllm.LLM` and `vllm.lora.request.LoRARequest` as VLLMEngine uses them; every call
    lands in `calls` as (name, detail)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        fake = self

        class LLM:
            def __init__(self, **kwargs: Any) -> None:
                fake.calls.append(("init", kwargs))
                self.llm_engine = types.SimpleNamespace(
                    add_lora=lambda request: fake.calls.append(("add_lora", request.lora_name)),
                    remove_lora=lambda lora_id: fake.calls.append(("remove_lora", lora_id)),
                )

            def sleep(self, level: int = 1) -> None:
                fake.calls.append(("sleep", level))

            def wake_up(self, tags: list[str] | None = None) -> None:
                fake.calls.append(("wake_up", tags))

            def generate(self, prompts, params, lora_request=None, use_tqdm=True):
                fake.calls.append(("generate", lora_request.lora_name if lora_request else None))
                outputs = []
                for prompt, sampling in zip(prompts, params, strict=True):
                    tokens = [3] * sampling.kwargs["max_tokens"]
                    logprobs = [{3: Logprob(-0.7)} for _ in tokens]
                    completion = Completion("x" * len(tokens), tokens, logprobs, "length")
                    outputs.append(Output(prompt["prompt_token_ids"], [completion]))
                return outputs

        class SamplingParamsStandIn:
            def __init__(self, **kwargs: Any) -> None:
                self.kwargs = kwargs

        @dataclass
        class LoRARequest:
            lora_name: str
            lora_int_id: int
            lora_path: str

        self.module = types.ModuleType("vllm")
        self.module.LLM = LLM  # type: ignore[attr-defined]
        self.module.SamplingParams = SamplingParamsStandIn  # type: ignore[attr-defined]
        self.lora = types.ModuleType("vllm.lora")
        self.request = types.ModuleType("vllm.lora.request")
        self.request.LoRARequest = LoRARequest  # type: ignore[attr-defined]

    def install(self, monkeypatch) -> None:
        monkeypatch.setitem(sys.modules, "vllm", self.module)
        monkeypatch.setitem(sys.modules, "vllm.lora", self.lora)
        monkeypatch.setitem(sys.modules, "vllm.lora.request", self.request)

    def sequence(self) -> list[str]:
        """Call names with runs of generate collapsed (a step's rollouts are several batches)."""
        names: list[str] = []
        for name, _ in self.calls:
            if not (name == "generate" and names and names[-1] == "generate"):
                names.append(name)
        return names


@pytest.fixture
def fake_vllm(monkeypatch) -> FakeVLLM:
    fake = FakeVLLM()
    fake.install(monkeypatch)
    # 70 of 80 GiB free once the trainer's model is loaded.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *args: (70 * GIB, 80 * GIB))
    return fake


class MetricHooks(Hooks):
    def __init__(self) -> None:
        super().__init__()
        self.metrics: dict[int, dict[str, Any]] = {}

    def record_step(self, *, step, metrics, trajectories, path) -> bool:
        self.metrics[step] = dict(metrics)
        return super().record_step(step=step, metrics=metrics, trajectories=trajectories, path=path)


def test_the_loop_sleeps_vllm_through_each_update_and_wakes_it_before_the_new_adapter(
    fake_vllm, tiny_model_dir, tmp_path, monkeypatch
):
    import training.adapter_check
    import training.engines
    import training.trainer

    monkeypatch.setattr(training.engines, "select_engine_kind", lambda device, setting="auto": "vllm")
    # The sampler check compares vLLM's logprobs with the trainer's: the stand-in has none to give.
    monkeypatch.setattr(
        training.adapter_check,
        "verify_sampler",
        lambda *args, **kwargs: (
            fake_vllm.calls.append(("verify_sampler", kwargs["adapter"]))
            or types.SimpleNamespace(max_logprob_gap=0.0)
        ),
    )
    train_step = training.trainer.Trainer.train_step

    def recorded_train_step(self, groups, **options):
        fake_vllm.calls.append(("train_step", None))
        return train_step(self, groups, **options)

    monkeypatch.setattr(training.trainer.Trainer, "train_step", recorded_train_step)
    spec = RunSpec(
        base_model_source=str(tiny_model_dir),
        model_cache_dir=tiny_model_dir.parent,
        checkpoint_root=tmp_path,
        config=TrainConfig(steps=2, group_size=2, groups_per_step=2, max_new_tokens=2, top_p=1.0),
        lora=LoraSpec(rank=2, alpha=4),
        environment=build_environment("chat"),
        grader_spec={"type": "regex", "pattern": "x"},
        train_rows=ROWS,
        start_step=0,
        resume_step=None,
        engine="vllm",
    )
    hooks = MetricHooks()

    assert run_training(spec, hooks) == "succeeded"

    init = fake_vllm.calls[0][1]
    assert init["enable_sleep_mode"] is True and init["enable_lora"] is True
    assert init["gpu_memory_utilization"] == pytest.approx(0.775)  # (70 - 8 reserve) / 80 GiB
    update = ["sleep", "train_step", "wake_up", "add_lora", "remove_lora", "verify_sampler"]
    assert fake_vllm.sequence() == ["init", "add_lora", *(["generate", *update] * 2)]
    assert [detail for name, detail in fake_vllm.calls if name == "sleep"] == [1, 1]  # level 1: LoRA-safe
    assert [detail for name, detail in fake_vllm.calls if name == "add_lora"] == [
        "step-0",
        "step-1",
        "step-2",
    ]
    assert [detail for name, detail in fake_vllm.calls if name == "generate"][-1] == "step-1"
    assert hooks.steps == [1, 2]
    for step in (1, 2):
        metrics = hooks.metrics[step]
        assert 0 < metrics["sync_seconds"] < metrics["step_seconds"]
        assert metrics["rollout_seconds"] > 0 and metrics["train_seconds"] > 0


def test_an_asleep_engine_refuses_to_sample_or_load_and_sleeps_only_in_sleep_mode(fake_vllm, tiny_model_dir):
    engine = VLLMEngine(
        tiny_model_dir, sleep_mode=True, gpu_memory_utilization=0.5, tokenizer=_tokenizer(tiny_model_dir)
    )
    engine.sleep()
    engine.sleep()  # already asleep: no second call into vLLM
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate_from_tokens([[1, 2]], SamplingParams(max_new_tokens=1))
    with pytest.raises(RuntimeError, match="asleep"):
        engine.load_adapter("a", tiny_model_dir)
    engine.wake_up()
    engine.wake_up()
    assert [name for name, _ in fake_vllm.calls] == ["init", "sleep", "wake_up"]
    assert engine.generate_from_tokens([[1, 2]], SamplingParams(max_new_tokens=1))[0].token_ids == [3]

    shared = VLLMEngine(tiny_model_dir, tokenizer=_tokenizer(tiny_model_dir))
    assert fake_vllm.calls[-1][1]["gpu_memory_utilization"] == vllm_engine.SHARED_GPU_MEMORY_UTILIZATION
    assert "enable_sleep_mode" not in fake_vllm.calls[-1][1]
    with pytest.raises(RuntimeError, match="sleep_mode"):
        shared.sleep()


def _tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def test_sleep_mode_gives_vllm_the_free_memory_but_a_reserve():
    assert sleep_mode_memory_utilization(70 * GIB, 80 * GIB) == pytest.approx(0.775)
    # A small GPU: the reserve is at least 1 GiB.
    assert sleep_mode_memory_utilization(7 * GIB, 8 * GIB) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="too little"):
        sleep_mode_memory_utilization(8 * GIB + GIB // 2, 80 * GIB)
    with pytest.raises(ValueError, match="impossible"):
        sleep_mode_memory_utilization(90 * GIB, 80 * GIB)
