"""A run's own vLLM server (training.serving.vllm.LocalVLLM, started by training.runs.sampler.start_run_vllm)
and sleep mode when the trainer and the sampler share one GPU: the loop puts vLLM to sleep for
every policy update and wakes it before the new checkpoint's adapter loads and the next rollouts.

vLLM's CPU build has no sleep mode (vLLM offers it on CUDA, ROCm and XPU only), so the order is
checked here against doubles: the loop's calls over a run whose vLLM is a recording stand-in
sampled through the real RemoteEngine over the vLLM-dialect double (tests/training/vllm_double.py,
the tiny model's transformers engine), and LocalVLLM's own calls against the process double of
vLLM's server (tests/projects/gateway/fake_vllm.py), which has vLLM's development routes. The
real vLLM runs a whole run in tests/vllm/test_vllm_runs.py (no sleep mode on CPU).
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.training.test_learning_signal import ROWS, Hooks
from tests.training.vllm_double import VLLMDouble
from training.config import LoraSpec, TrainConfig
from training.engines.vllm_engine import sleep_mode_memory_utilization
from training.environments import build_environment
from training.runs.loop import run_training
from training.runs.spec import RunSpec
from training.serving.vllm import LocalVLLM, VLLMServeOptions, VLLMStartError

GIB = 1 << 30
ROOT = Path(__file__).resolve().parents[3]
FAKE_VLLM = [sys.executable, str(ROOT / "tests" / "projects" / "gateway" / "fake_vllm.py")]


class MetricHooks(Hooks):
    def __init__(self) -> None:
        super().__init__()
        self.metrics: dict[int, dict[str, Any]] = {}

    def record_step(self, *, step, metrics, trajectories, path) -> bool:
        self.metrics[step] = dict(metrics)
        return super().record_step(step=step, metrics=metrics, trajectories=trajectories, path=path)


class RecordingServer:
    """What the loop asks of its own vLLM server (LocalVLLM's interface), recorded in `calls`."""

    def __init__(self, calls: list[tuple[str, Any]]) -> None:
        self.calls = calls
        self.options = VLLMServeOptions(model_dir=Path("/unused"), served_model_name="tiny", sleep_mode=True)
        self.asleep = False

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))
        self.asleep = True

    def wake_up(self) -> None:
        self.calls.append(("wake_up", None))
        self.asleep = False

    def close(self) -> None:
        self.calls.append(("close", None))


def test_the_loop_sleeps_vllm_through_each_update_and_wakes_it_before_the_new_adapter(
    tiny_model_dir, tmp_path, monkeypatch
):
    import training.engines
    import training.hosting.in_process
    import training.runs.sampler
    from training.base_models import load_base_model
    from training.engines.remote_engine import RemoteEngine, RolloutServer
    from training.engines.transformers_engine import TransformersEngine, stop_token_ids_of

    calls: list[tuple[str, Any]] = []
    model, tokenizer = load_base_model(str(tiny_model_dir), tiny_model_dir.parent)
    double = VLLMDouble(TransformersEngine(model, tokenizer), served_model="tiny", token="t")
    url = double.start()

    def start_run_vllm(spec, trainer, tokenizer, dtype, *, sleep_mode):
        calls.append(("start", sleep_mode))
        server = RolloutServer(url=url, token="t", engine="vllm", served_model="tiny")
        return RecordingServer(calls), RemoteEngine(
            server, tokenizer, stop_token_ids=stop_token_ids_of(trainer.model, tokenizer)
        )

    monkeypatch.setattr(training.runs.sampler, "start_run_vllm", start_run_vllm)
    monkeypatch.setattr(training.engines, "select_engine_kind", lambda *args, **kwargs: "vllm")
    train_step = training.hosting.in_process.InProcessRun.train_step

    def recorded_train_step(self, groups, **options):
        calls.append(("train_step", None))
        return train_step(self, groups, **options)

    monkeypatch.setattr(training.hosting.in_process.InProcessRun, "train_step", recorded_train_step)
    spec = RunSpec.resolving(
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
    try:
        assert run_training(spec, hooks) == "succeeded"
    finally:
        double.stop()

    adapters = [(path.rsplit("_", 3)[0][4:], body["lora_name"]) for path, body in double.requests
                if path.endswith("_lora_adapter")]  # fmt: skip
    assert adapters == [("load", "step-0"), ("load", "step-1"), ("unload", "step-0"),
                        ("load", "step-2"), ("unload", "step-1")]  # fmt: skip
    assert [name for name, _ in calls] == ["start", *["sleep", "train_step", "wake_up"] * 2, "close"]
    assert calls[0] == ("start", True)  # not detached: it shares the device with the trainer
    assert [level for name, level in calls if name == "sleep"] == [1, 1]  # level 1: LoRA-safe
    # Each step's rollouts sampled the checkpoint before it, through the run's own server.
    rollouts = [body["model"] for path, body in double.requests if path == "/v1/completions"]
    assert {"step-0", "step-1"} <= set(rollouts)
    assert hooks.steps == [1, 2]
    for step in (1, 2):
        metrics = hooks.metrics[step]
        assert 0 < metrics["sync_seconds"] < metrics["step_seconds"]
        # The sampler check ran on the server's logprobs (the double's: the same weights).
        assert metrics["sampler_logprob_gap"] <= 1e-4


def _get(url: str, token: str) -> Any:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def test_a_runs_own_vllm_listens_on_loopback_with_a_token_of_its_own_and_sleeps_on_request(
    tiny_model_dir, tmp_path
):
    options = VLLMServeOptions(model_dir=tiny_model_dir, served_model_name="tiny", port=0, sleep_mode=True)
    server = LocalVLLM(options, executable=FAKE_VLLM, startup_timeout_s=60, log_path=tmp_path / "vllm.log")
    try:
        assert server.url.startswith("http://127.0.0.1:") and server.options.host == "127.0.0.1"
        info = _get(f"{server.url}/fake/info", server.token)
        assert len(server.token) >= 40 and not any(server.token in argument for argument in info["argv"])
        assert "--enable-sleep-mode" in info["argv"]
        with pytest.raises(urllib.error.HTTPError):  # every route but /health needs the token
            _get(f"{server.url}/is_sleeping", "wrong")
        server.sleep()
        server.sleep()  # already asleep: no second call
        assert _get(f"{server.url}/is_sleeping", server.token) == {"is_sleeping": True}
        server.wake_up()
        assert _get(f"{server.url}/is_sleeping", server.token) == {"is_sleeping": False}
        sleeps = [call["path"] for call in _get(f"{server.url}/fake/calls", server.token)]
        assert sleeps == ["/sleep?level=1", "/wake_up"]
    finally:
        server.close()
    assert server.process.poll() is not None  # stopped


def test_a_vllm_that_fails_to_start_says_why_with_the_end_of_its_log(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_EXIT_AT_START", "3")
    options = VLLMServeOptions(model_dir=tiny_model_dir, served_model_name="tiny", port=0)
    with pytest.raises(VLLMStartError, match=r"exited with status 3(.|\n)*end of its log"):
        LocalVLLM(options, executable=FAKE_VLLM, startup_timeout_s=60, log_path=tmp_path / "vllm.log")
    monkeypatch.delenv("FAKE_VLLM_EXIT_AT_START")
    server = LocalVLLM(options, executable=FAKE_VLLM, startup_timeout_s=60)
    try:
        with pytest.raises(RuntimeError, match="without sleep mode"):
            server.sleep()
    finally:
        server.close()


def test_sleep_mode_gives_vllm_the_free_memory_but_a_reserve():
    assert sleep_mode_memory_utilization(70 * GIB, 80 * GIB) == pytest.approx(0.775)
    # A small GPU: the reserve is at least 1 GiB.
    assert sleep_mode_memory_utilization(7 * GIB, 8 * GIB) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="too little"):
        sleep_mode_memory_utilization(8 * GIB + GIB // 2, 80 * GIB)
    with pytest.raises(ValueError, match="impossible"):
        sleep_mode_memory_utilization(90 * GIB, 80 * GIB)
