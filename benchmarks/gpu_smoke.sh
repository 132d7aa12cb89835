#!/usr/bin/env bash
# GPU smoke test: on a CUDA host, from a clean checkout, in under 8 minutes (budget checked at the end):
#   1. install the GPU stack from requirements/gpu.lock into its own virtualenv (.venv-gpu),
#   2. run the gpu-marked tests (`make test-gpu`: the real VLLMEngine, the real vLLM server behind
#      the gateway),
#   3. train 3 GRPO steps on the bundled model with vLLM sampling (sleep mode through each update),
#   4. print each step's time split into rollout / update / sync (read back from the run's step
#      metrics) and the wall time of every phase.
# Embedded defaults (SQLite, filesystem broker) in a fresh data dir: no PostgreSQL or Redis needed;
# an existing PostgreSQL at 127.0.0.1:5432 is used for the tests when it answers.
#
# UNVERIFIED: written and checked (bash -n, tests/platform/test_gpu_smoke.py) on CPU machines only;
# the first GPU host to run it is its first real test.
#
# Usage: benchmarks/gpu_smoke.sh   (env: BUDGET_S=480 STEPS=3 VENV=.venv-gpu PYTHON=python3.11 KEEP=1)
set -euo pipefail
cd "$(dirname "$0")/.."

BUDGET_S=${BUDGET_S:-480}
STEPS=${STEPS:-3}
VENV=${VENV:-.venv-gpu}
PYTHON=${PYTHON:-python3.11}  # the locks are resolved for CPython 3.11
DATA=$(mktemp -d "${TMPDIR:-/tmp}/artweb-gpu-smoke.XXXXXX")
START=$(date +%s)
PHASES=()

phase_done() { # name, started-at
    PHASES+=("$(printf '%-22s %5ss' "$1" "$(($(date +%s) - $2))")")
}
cleanup() {
    if [ "${KEEP:-0}" = 1 ]; then echo "data dir kept: $DATA"; else rm -rf "$DATA"; fi
}
trap cleanup EXIT

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_smoke: no CUDA GPU here (nvidia-smi -L failed)" >&2
    exit 2
fi
nvidia-smi -L

# 1. The GPU stack, exactly as locked (torch first, then vLLM and the rest).
t=$(date +%s)
make install-python PYTHON="$PYTHON" VENV="$VENV" LOCK=requirements/gpu.lock EXTRAS=gpu,dev
"$VENV/bin/python" -c "import torch, vllm; assert torch.cuda.is_available(), 'torch sees no GPU'; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| vllm', vllm.__version__, '|', torch.cuda.get_device_name(0))"
phase_done install "$t"

# 2. The gpu-marked tests.
t=$(date +%s)
if ! pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; then
    export DATABASE_URL="sqlite:///$DATA/tests.sqlite3"
fi
make test-gpu VENV="$VENV" LOCK=requirements/gpu.lock EXTRAS=gpu,dev PYTEST_ARGS="-q -x -p no:cacheprovider"
unset DATABASE_URL
phase_done "gpu tests" "$t"

# 3. A short run on the bundled model through vLLM, on the embedded stack in a fresh data dir.
t=$(date +%s)
export ARTWEB_DATA_DIR="$DATA" ARTWEB_ENGINE=vllm TRAINING_DEVICE=cuda DEBUG=1 HF_HUB_OFFLINE=1
"$VENV/bin/python" manage.py demo --steps "$STEPS" --timeout "$((BUDGET_S > 60 ? BUDGET_S : 60))"
phase_done "${STEPS}-step vLLM run" "$t"

# 4. The step times, from what the run recorded (ARTWEB_ENGINE=vllm: a run that could not sample
# with vLLM failed at its start, so a succeeded run sampled with vLLM).
"$VENV/bin/python" manage.py shell -c "$(cat <<'PY'
from projects.models import Run, StepMetrics

run = Run.objects.latest("id")
print(f"run {run.pk}: {run.status}, sampled with vLLM (ARTWEB_ENGINE=vllm)")
print("step  rollout_s  update_s    sync_s   other_s    step_s  tokens/s")
for row in StepMetrics.objects.filter(run=run).order_by("step"):
    m = row.metrics or {}
    rollout, update, sync, step, speed = (
        float(m.get(key) or 0)
        for key in ("rollout_seconds", "train_seconds", "sync_seconds", "step_seconds", "tokens_per_second")
    )
    other = step - rollout - update - sync
    print(f"{row.step:>4} {rollout:>10.2f} {update:>9.2f} {sync:>9.2f} {other:>9.2f} {step:>9.2f} {speed:>9.1f}")
print("update: the policy update (trainer); sync: save + vLLM wake-up + adapter load + sampler check;")
print("other: grading and bookkeeping. vLLM sleeps through each update (training/loop.py).")
PY
)"

TOTAL=$(($(date +%s) - START))
echo
echo "phase                  wall"
printf '%s\n' "${PHASES[@]}"
printf '%-22s %5ss (budget %ss)\n' total "$TOTAL" "$BUDGET_S"
if [ "$TOTAL" -gt "$BUDGET_S" ]; then
    echo "gpu_smoke: over budget" >&2
    exit 1
fi
echo "gpu_smoke: OK"
