#!/usr/bin/env bash
# The CUDA paths that need no vLLM, on a GPU host whose image already has torch and no package
# registry (this workplace's lent H200: Python 3.12, torch, accelerate and safetensors preinstalled).
#   1. installs the lock's transformers, peft, tokenizers, llguidance and uvicorn from wheels carried
#      in .whl/ (fetched beforehand on a machine with a registry, see below) into /tmp/site, beside
#      the image's torch,
#   2. runs tests/training/test_cuda.py (marked gpu): a bf16 run with the sampler check every step
#      and a resume, an overlapped run, one with its rollouts on an inference server process on the
#      GPU, a run on a trainer service, SFT and DPO runs, the fp32
#      update against the CPU's under every named loss, the data-parallel session over NCCL,
#   3. runs benchmarks/gpu_update.py: update and rollout speed on CUDA (bf16, fp32) against this
#      host's CPU, measured in the same run.
# vLLM, unsloth and the platform (Django, Celery) are not exercised: benchmarks/gpu_smoke.sh does
# that on a host that can install requirements/gpu.lock.
#
# Fetch the wheels first (on a machine with PyPI; the versions are requirements/cpu.lock's):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux_2_31_x86_64 -d .whl transformers==5.24.0 \
#     peft==0.21.2 tokenizers==0.23.3 llguidance==1.9.1 uvicorn==0.54.0 pytest-timeout==2.4.0
# Usage: benchmarks/gpu_image_check.sh   (env: OUT=folder for the logs, REPEATS=5, SKIP_BENCH=1, PYTHON=python3)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-image-check}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
START=$(date +%s)

nvidia-smi -L || { echo "gpu_image_check: no CUDA GPU here" >&2; exit 2; }
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 2
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
"$PYTHON" -c "import torch, transformers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__, '| peft', peft.__version__, '|', torch.cuda.get_device_name(0))" || exit 2

# The repository's pytest options name Django's plugin and the CPU suite's marker filter: neither
# applies here (no Django on the image; these tests are the gpu-marked ones). The root conftest's
# autouse fixtures set Django settings through pytest-django's `settings`: a stand-in takes them.
mkdir -p /tmp/gpu-plugin
cat > /tmp/gpu-plugin/no_django_settings.py <<'PY'
import types

import pytest


@pytest.fixture
def settings():
    return types.SimpleNamespace()
PY
PYTHONPATH=$PYTHONPATH:/tmp/gpu-plugin "$PYTHON" -m pytest -p no:cacheprovider -p no:django -p no_django_settings \
    -o addopts="" -q -s -m gpu --timeout 300 \
    tests/training/test_cuda.py 2>&1 | tee "$OUT/tests.log"
TESTS=${PIPESTATUS[0]}
echo "tests: exit $TESTS after $(($(date +%s) - START)) s"

BENCH=0
if [ "${SKIP_BENCH:-0}" != 1 ]; then
    "$PYTHON" -m benchmarks.gpu_update --repeats "${REPEATS:-5}" 2>&1 | tee "$OUT/gpu_update.log"
    BENCH=${PIPESTATUS[0]}
fi
echo "benchmark: exit $BENCH; total $(($(date +%s) - START)) s"
[ "$TESTS" = 0 ] && [ "$BENCH" = 0 ]
