"""benchmarks/gpu_smoke.sh is for GPU hosts; here (no GPU) only what can be checked without one:
it parses, it refuses to start without a GPU, and it installs, tests and reads back what the
project really names."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_smoke.sh"


def test_the_script_parses():
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def test_without_a_gpu_it_stops_before_installing_anything(tmp_path):
    # A PATH with bash and coreutils but no nvidia-smi.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "date", "mktemp", "rm"):
        found = subprocess.run(["bash", "-c", f"command -v {tool}"], capture_output=True, text=True)
        (bin_dir / tool).symlink_to(found.stdout.strip())
    done = subprocess.run(
        [str(bin_dir / "bash"), str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": str(bin_dir), "HOME": str(tmp_path), "TMPDIR": str(tmp_path)},
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no CUDA GPU" in done.stderr
    assert not list(tmp_path.glob("artweb-gpu-smoke.*")), "the data dir is removed on exit"


def test_it_installs_from_the_gpu_lock_and_reads_metrics_the_loop_records():
    script = SCRIPT.read_text()
    assert "LOCK=requirements/gpu.lock EXTRAS=gpu,dev" in script
    assert "make install-python" in script and "make test-gpu" in script
    assert "ARTWEB_ENGINE=vllm" in script and "TRAINING_DEVICE=cuda" in script
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^install-python: \$\(STAMP\)$", makefile, re.M)
    assert re.search(r"^test-gpu: install-python$", makefile, re.M)
    recorded = "".join(
        (ROOT / "training" / name).read_text() for name in ("loop.py", "run_steps.py", "grpo_update.py")
    )
    for key in ("rollout_seconds", "train_seconds", "sync_seconds", "step_seconds", "tokens_per_second"):
        assert f'"{key}"' in script, key
        assert f'"{key}"' in recorded, f"the loop no longer records {key}"


IMAGE_CHECK = ROOT / "benchmarks" / "gpu_image_check.sh"


def test_the_image_check_parses_and_carries_the_locks_versions():
    """gpu_image_check.sh installs carried wheels beside a GPU image's torch: the versions it tells
    to fetch are the ones the CPU lock pins, so the GPU run tests what CI tests."""
    done = subprocess.run(["bash", "-n", str(IMAGE_CHECK)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    script = IMAGE_CHECK.read_text()
    named = dict(re.findall(r"\b([a-z][a-z0-9-]*)==([0-9][^\s\\]*)", script))
    assert {"transformers", "peft", "tokenizers", "llguidance", "uvicorn"} <= named.keys(), named
    lock = dict(
        re.findall(r"^([a-z0-9-]+)==([^\s]+)", (ROOT / "requirements" / "cpu.lock").read_text(), re.M)
    )
    assert {name: lock.get(name) for name in named} == named
    # It runs the gpu-marked tests that need no vLLM, which exist and are marked so.
    assert "tests/training/test_cuda.py" in script and "-m gpu" in script
    assert "pytestmark = pytest.mark.gpu" in (ROOT / "tests" / "training" / "test_cuda.py").read_text()
