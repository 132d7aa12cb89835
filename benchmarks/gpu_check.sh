#!/usr/bin/env bash
# The GPU check, for a host whose image already has a CUDA torch, transformers and peft and that
# reaches no package registry (this workplace's lent H100/H200: torch 2.11 for CUDA 13, transformers
# 5.17). Nothing is installed from an index; the image's torch is used, never replaced.
#   0. installs the wheels carried in .gpu-bundle/wheels (`make gpu-bundle` fetches them on a machine
#      with PyPI; they travel with the working tree) with --no-index --no-deps into a --target
#      folder put first on PYTHONPATH: transformers 5.24.0 (on 5.17 the trainer's packed logprob
#      pass fails: IndexError in tests/training/test_trainer.py), peft, TRL, pytest and its plugin,
#      llguidance and uvicorn; huggingface-hub only when the image's is older than transformers
#      5.24 needs,
#   1. runs the gpu-marked tests that need no vLLM (tests/training/test_cuda.py): bf16 runs on CUDA,
#      the session primitives in fp32 against the CPU's under every named loss, NCCL,
#   2. benchmarks/gpu_update.py --devices cuda:bf16: a bf16 LoRA GRPO step (Trainer.train_step over
#      the session's forward_backward / optim_step) and rollouts through the transformers engine,
#   3. benchmarks/trl_compare.py: the same GRPO update against TRL's GRPOTrainer on a Qwen3-4B-shaped
#      model (random weights), with tokens/s, MFU and rollout tokens/s.
# Each step is timed and the total is checked against BUDGET_S. Steps go on after a failure, so one
# run reports on all of them; the exit status is 1 when any failed or the budget was passed, 2 when
# there is no GPU or the wheels cannot be installed.
#
# Usage: benchmarks/gpu_check.sh   (env: PYTHON=python3 BUDGET_S=540 MODEL=qwen3-4b OUT=folder for the logs)
set -uo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no CUDA GPU here (nvidia-smi -L failed)" >&2
    exit 2
fi
nvidia-smi -L

PYTHON=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-540}
MODEL=${MODEL:-qwen3-4b}
BUNDLE=.gpu-bundle/wheels
LOGS=${OUT:-/tmp/gpu-check}
SITE=$(mktemp -d "${TMPDIR:-/tmp}/artweb-gpu-site.XXXXXX")
trap 'rm -rf "$SITE"' EXIT
mkdir -p "$LOGS"
START=$(date +%s)
PHASES=()
FAILED=0

# step NAME LIMIT_S COMMAND...: runs it under a time limit, its output also in $LOGS/NAME.log.
step() {
    local name=$1 limit=$2 started rc
    shift 2
    started=$(date +%s)
    echo "== $name"
    timeout "$limit" "$@" 2>&1 | tee "$LOGS/$name.log"
    rc=${PIPESTATUS[0]}
    PHASES+=("$(printf '%-12s %5ss  exit %s' "$name" "$(($(date +%s) - started))" "$rc")")
    [ "$rc" = 0 ] || FAILED=1
}

# 0. The carried wheels, beside the image's torch.
t=$(date +%s)
if ! ls "$BUNDLE"/*.whl >/dev/null 2>&1; then
    echo "gpu_check: no wheels in $BUNDLE (run \`make gpu-bundle\` where PyPI is reachable)" >&2
    exit 2
fi
WHEELS=()
for wheel in "$BUNDLE"/*.whl; do
    case ${wheel##*/} in huggingface_hub-*) ;; *) WHEELS+=("$wheel") ;; esac
done
"$PYTHON" -m pip install -q --no-index --find-links "$BUNDLE" --no-deps --no-compile --no-cache-dir \
    --target "$SITE" "${WHEELS[@]}" || exit 2
if ! "$PYTHON" -c "import sys, huggingface_hub; from packaging.version import Version; sys.exit(Version(huggingface_hub.__version__) < Version('1.31'))" 2>/dev/null; then
    "$PYTHON" -m pip install -q --no-index --find-links "$BUNDLE" --no-deps --no-compile --no-cache-dir \
        --target "$SITE" --upgrade "$BUNDLE"/huggingface_hub-*.whl || exit 2
fi
# The repository's pytest options name Django's plugin and the CPU suite's marker filter: neither
# applies here. The root conftest's autouse fixtures set Django settings through pytest-django's
# `settings`: this plugin's stand-in takes them.
cat > "$SITE/no_django_settings.py" <<'PY'
import types

import pytest


@pytest.fixture
def settings():
    return types.SimpleNamespace()
PY
export PYTHONPATH=$SITE:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 \
    TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 TRL_EXPERIMENTAL_SILENCE=1
"$PYTHON" - "$SITE" <<'PY' || exit 2
import sys

import peft, torch, transformers, trl

site = sys.argv[1]
assert torch.cuda.is_available(), "torch sees no GPU"
assert not torch.__file__.startswith(site), "torch must be the image's"
print(f"torch {torch.__version__} (cuda {torch.version.cuda}, the image's) | transformers {transformers.__version__}"
      f" | peft {peft.__version__} | trl {trl.__version__} | {torch.cuda.get_device_name(0)} | python {sys.version.split()[0]}")
PY
PHASES+=("$(printf '%-12s %5ss' install "$(($(date +%s) - t))")")

# 1. The gpu-marked tests that need no vLLM.
step gpu-tests 300 "$PYTHON" -m pytest -p no:cacheprovider -p no:django -p no_django_settings -o addopts="" \
    -q -s -m gpu --timeout 240 tests/training/test_cuda.py

# 2. A bf16 LoRA GRPO step and rollouts on the GPU (SmolLM2-135M's shape).
step gpu-update 120 "$PYTHON" -m benchmarks.gpu_update --devices cuda:bf16 --repeats 3

# 3. artweb's update against TRL's on a realistic shape, in what is left of the budget.
LEFT=$((BUDGET_S - ($(date +%s) - START)))
step trl-compare "$((LEFT > 60 ? LEFT : 60))" "$PYTHON" -W ignore::FutureWarning -m benchmarks.trl_compare --model "$MODEL"

TOTAL=$(($(date +%s) - START))
echo
echo "step          wall"
printf '%s\n' "${PHASES[@]}"
printf '%-12s %5ss (budget %ss)\n' total "$TOTAL" "$BUDGET_S"
if [ "$TOTAL" -gt "$BUDGET_S" ]; then
    echo "gpu_check: over budget" >&2
    FAILED=1
fi
if [ "$FAILED" = 0 ]; then echo "gpu_check: OK"; else echo "gpu_check: FAILED (logs in $LOGS)" >&2; fi
exit "$FAILED"
