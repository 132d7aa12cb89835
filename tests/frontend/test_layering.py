"""Pages reach the training core only through the domain (projects.catalog, services, selectors):
no module under frontend/ imports from training."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FRONTEND = ROOT / "frontend"


def test_no_frontend_module_imports_the_training_core():
    offenders = []
    for path in sorted(FRONTEND.rglob("*.py")):
        if "node_modules" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            offenders += [
                f"{path.relative_to(ROOT)}:{node.lineno}: {m}"
                for m in modules
                if m.split(".")[0] == "training"
            ]
    assert offenders == []
