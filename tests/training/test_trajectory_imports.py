"""The web process holds trajectories (evaluations, scenario generation) without loading torch."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "module", ["training.rollouts.trajectory", "training.rollouts.remote", "training.runs.evaluation"]
)
def test_importing_trajectory_modules_loads_neither_torch_nor_peft(module: str) -> None:
    check = f"import {module}, sys; assert 'torch' not in sys.modules and 'peft' not in sys.modules"
    result = subprocess.run(
        [sys.executable, "-c", check], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
