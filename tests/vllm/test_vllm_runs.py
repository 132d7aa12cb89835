"""A run whose rollout engine is vLLM (ARTWEB_ENGINE=vllm): the run starts a vLLM server of its own
(training.serving.vllm.LocalVLLM, from vLLM's own virtualenv) and samples it through RemoteEngine,
loading each checkpoint as it is saved. It runs in a daemonic child process, as a run does in a
Celery pool child, where vLLM's offline engine could not start (it starts its engine core with
multiprocessing, which daemonic processes may not); and each step's sampler check passes on
vLLM's processed logprobs at float32's tolerance.
"""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path
from typing import Any

from django.conf import settings

from tests.training.test_learning_signal import ROWS
from tests.vllm import child_run
from training.config import LoraSpec, TrainConfig
from training.environments import build_environment
from training.runs.spec import RunSpec


def vllm_run_spec(
    root: Path, model_dir: Path, *, engine: str = "vllm", vllm_python: str = "", **config: Any
) -> RunSpec:
    return RunSpec.resolving(
        base_model_source=str(model_dir),
        model_cache_dir=Path(model_dir).parent,
        checkpoint_root=Path(root),
        config=TrainConfig(
            **{
                "steps": 2,
                "group_size": 4,
                "groups_per_step": 2,
                "max_new_tokens": 6,
                "learning_rate": 1e-2,
                "top_p": 1.0,
                **config,
            }
        ),  # fmt: skip
        lora=LoraSpec(rank=4, alpha=8),
        environment=build_environment("chat"),
        grader_spec={"type": "regex", "name": "vowel", "pattern": "[aeiou]"},
        train_rows=ROWS,
        start_step=0,
        resume_step=None,
        device="cpu",
        engine=engine,
        vllm_python=vllm_python or settings.VLLM_PYTHON,
        vllm_cpu_kv_cache_gib=1.0,
    )


def test_a_run_samples_on_its_own_vllm_from_a_daemonic_child(vllm_python, vllm_model_dir, tmp_path):
    out = tmp_path / "record.json"
    options = {
        "root": str(tmp_path / "run"),
        "model_dir": str(vllm_model_dir),
        "vllm_python": vllm_python,
        "steps": 2,
    }
    child = multiprocessing.get_context("spawn").Process(
        target=child_run.run, args=(options, str(out)), daemon=True
    )
    child.start()
    child.join(timeout=600)
    assert child.exitcode == 0, (tmp_path / "run" / "vllm.log").read_text()[-3000:]
    record = json.loads(out.read_text())
    assert record["daemon"] is True and record["outcome"] == "succeeded", record["events"]
    assert record["policy_steps"] == [[0], [1]]  # each step sampled the checkpoint before it
    gaps = [m["sampler_logprob_gap"] for m in record["metrics"]]
    print("sampler logprob gaps (the run's own vLLM):", gaps)
    assert all(gap <= 1e-4 for gap in gaps)
    log = (tmp_path / "run" / "vllm.log").read_text()
    assert "load_lora_adapter" in log  # each checkpoint went in through vLLM's runtime LoRA API
    assert "/v1/completions" in log
