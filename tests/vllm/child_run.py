"""A GRPO run with vLLM as its rollout engine, in a process of its own (tests/vllm/test_vllm_runs.py
starts it as a daemonic child, as a Celery pool child is); it writes what the run recorded as JSON.
Imports only the training library: no Django in the child."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path
from typing import Any


def run(spec_options: dict[str, Any], out: str) -> None:
    from tests.training.test_cost_loop import MeteredHooks
    from tests.vllm.test_vllm_runs import vllm_run_spec
    from training.runs.loop import run_training

    spec = vllm_run_spec(**spec_options)
    hooks = MeteredHooks()
    outcome = run_training(spec, hooks)
    record = {
        "daemon": multiprocessing.current_process().daemon,
        "outcome": outcome,
        "events": [str(event) for event in hooks.events],
        "metrics": [{k: v for k, v in m.items() if isinstance(v, int | float)} for m in hooks.metrics],
        "policy_steps": [
            sorted({t.metrics["policy_step"] for t in m["trajectories"]}) for m in hooks.metrics
        ],
    }
    Path(out).write_text(json.dumps(record))
