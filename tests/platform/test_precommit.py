"""The pre-commit hooks run the same ruff and mypy commands as `make test` (lint, typecheck)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _make_commands(target: str) -> list[str]:
    text = (ROOT / "Makefile").read_text()
    body = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", text, re.M)
    assert body, f"no {target} target in the Makefile"
    return [line.strip().replace("$(VENV)", ".venv") for line in body.group(1).splitlines()]


def test_pre_commit_runs_what_make_test_runs():
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    hooks = {hook["id"]: hook for repo in config["repos"] for hook in repo["hooks"]}
    make = _make_commands("lint") + _make_commands("typecheck")
    assert make == [
        ".venv/bin/ruff check .",
        ".venv/bin/ruff format --check .",
        ".venv/bin/mypy artweb projects training",
    ]
    assert hooks["ruff-check"]["entry"].startswith(".venv/bin/ruff check")
    assert hooks["ruff-format"]["entry"].startswith(".venv/bin/ruff format --check")
    assert hooks["mypy"]["entry"] == make[2] and hooks["mypy"]["pass_filenames"] is False
