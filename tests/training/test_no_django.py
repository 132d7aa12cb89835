"""The training core is a plain library: no module under training/ imports Django, the domain, DRF
or Celery (the jobs that drive it live in projects.jobs; their settings reach it through the run
spec and function arguments)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAINING = ROOT / "training"
FORBIDDEN = {"django", "projects", "rest_framework", "celery", "artweb", "frontend"}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every absolute module an import statement in ``path`` names, lazy ones inside functions included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def test_no_training_module_imports_django_or_the_platform():
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in sorted(TRAINING.rglob("*.py"))
        for line, module in imported_modules(path)
        if module.split(".")[0] in FORBIDDEN
    ]
    assert offenders == []


def test_the_training_packages_import_without_django():
    packages = sorted(".".join(path.parent.relative_to(ROOT).parts) for path in TRAINING.rglob("__init__.py"))
    code = (
        "import importlib, sys\n"
        f"for name in {packages!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in {'django', 'projects', 'celery'}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
