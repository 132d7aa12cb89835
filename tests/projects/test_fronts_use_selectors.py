"""The Tinker API (projects/tinker/) and OpenAI's fine-tuning API (projects/api/fine_tuning.py) read
through projects.selectors and write through projects.services only: no model manager in them
(``Foo.objects``, or ``_default_manager``, its other name), so every query and its team scoping has
one home that the selector tests and the tenancy walks cover.

Read with ``ast``, not by importing, so a violation is named by file and line without loading Django.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FRONTS = sorted((ROOT / "projects" / "tinker").glob("*.py")) + [ROOT / "projects" / "api" / "fine_tuning.py"]
MANAGERS = ("objects", "_default_manager")


def manager_uses(path: Path) -> list[str]:
    """``file:line`` of every ``.objects`` / ``._default_manager`` attribute read in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        f"{path}:{node.lineno}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in MANAGERS
    ]


def test_the_walker_catches_a_manager(tmp_path: Path) -> None:
    sample = tmp_path / "views.py"
    sample.write_text(
        "def view(team):\n"
        "    ok = selectors.thing_get(team=team)\n"
        "    return Foo.objects.filter(team=team).first()\n"
    )
    assert manager_uses(sample) == [f"{sample}:3"]


def test_the_fronts_exist() -> None:
    """A moved or renamed front would make the walk below pass over nothing."""
    names = {path.name for path in FRONTS}
    assert {"views.py", "rest.py", "exports.py", "fine_tuning.py"} <= names
    assert all(path.is_file() for path in FRONTS)


def test_fronts_use_no_model_manager() -> None:
    found = [use for path in FRONTS for use in manager_uses(path)]
    assert not found, "query through projects.selectors / projects.services instead:\n" + "\n".join(found)
