"""training.cost: device-seconds (wall clock × devices held) and sampled tokens, on plain values."""

from __future__ import annotations

import pytest

from training import cost
from training.rollouts.trajectory import Trajectory


def test_cpu_worker_counts_one_device():
    assert cost.device_usage("cpu", 12.5) == {
        "device_kind": "cpu",
        "device_count": 1.0,
        "device_seconds": 12.5,
    }


def test_gpu_device_seconds_multiply_the_wall_clock_by_the_devices():
    usage = cost.device_usage("cuda", 10.0, count=4)
    assert usage == {"device_kind": "gpu", "device_count": 4.0, "device_seconds": 40.0}


def test_a_pinned_cuda_device_is_one_gpu():
    assert (cost.device_kind("cuda:1"), cost.device_count("cuda:1")) == ("gpu", 1)


def test_unpinned_cuda_counts_every_visible_device(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert cost.device_usage("cuda", 2.0)["device_seconds"] == 6.0


def test_sampled_tokens_count_only_the_models_own_tokens():
    masked = Trajectory(messages=[], prompt_token_ids=[1], completion_token_ids=[5, 6, 7, 8], logprobs=[0.0] * 4,
                        finish_reason="stop", completion_mask=[1, 1, 0, 1])  # fmt: skip
    assert cost.sampled_tokens(masked) == 3
    masked.completion_mask = None
    assert cost.sampled_tokens(masked) == 4


def test_judge_usage_sums_every_model():
    usage = [{"a": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}},
             {"a": {"prompt_tokens": 2, "completion_tokens": 2}, "b": {"prompt_tokens": 10}}, {}]  # fmt: skip
    assert cost.judge_token_usage(usage) == {"judge_prompt_tokens": 17.0, "judge_completion_tokens": 3.0}
