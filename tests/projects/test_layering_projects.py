"""The layers of projects/ stay apart: the domain (services, selectors, jobs) never imports a front
(the REST API, the gateway, the Tinker API), and nothing in projects/ imports the Django project
package ``artweb`` (settings, Celery app, demo); what both need lives in the domain and the fronts
import it from there. Every import counts, a function's own included (a lazy import is still a
dependency); only ``if TYPE_CHECKING:`` blocks are left out, as they never run.

Read with ``ast``, not by importing, so a violation is named by file and line without loading Django.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

PROJECTS = Path(__file__).resolve().parents[2] / "projects"
DOMAIN = ("services", "selectors", "jobs")
FRONTS = ("projects.api", "projects.gateway", "projects.tinker")


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _nodes(node: ast.AST) -> Iterator[ast.AST]:
    """Every node under ``node``, ``if TYPE_CHECKING:`` bodies left out (their ``else`` kept)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _type_checking(child.test):
            for kept in child.orelse:
                yield kept
                yield from _nodes(kept)
            continue
        yield child
        yield from _nodes(child)


def imported_modules(path: Path, root: Path) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of each import in the file ``path``: ``import a.b`` gives ``a.b``,
    ``from a import b`` gives ``a.b`` (``b`` may be a module), a relative import resolved against the
    file's package under ``root``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in _nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = path.relative_to(root.parent).parent.parts
                package = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*package, *([base] if base else [])])
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}" if base else alias.name


def _under(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def violations(files: Iterable[Path], forbidden: Iterable[str], root: Path) -> list[str]:
    """``file:line imports name`` for every import of a module under one of ``forbidden``."""
    forbidden = tuple(forbidden)
    return [
        f"{path.relative_to(root.parent)}:{line} imports {name}"
        for path in sorted(files)
        for line, name in imported_modules(path, root)
        if _under(name, forbidden)
    ]


def test_the_domain_never_imports_a_front() -> None:
    files = [path for layer in DOMAIN for path in (PROJECTS / layer).rglob("*.py")]
    assert len(files) > 30, "the walk found the domain's modules"
    found = violations(files, FRONTS, PROJECTS)
    assert not found, "the domain imports a front (move what it needs down into the domain):\n" + "\n".join(
        found
    )


def test_projects_never_imports_the_django_project_package() -> None:
    files = [path for path in PROJECTS.rglob("*.py") if "migrations" not in path.relative_to(PROJECTS).parts]
    assert len(files) > 100, "the walk found projects/'s modules"
    found = violations(files, ("artweb",), PROJECTS)
    assert not found, "projects/ imports artweb (move what it needs into projects/):\n" + "\n".join(found)


def test_the_walk_sees_imports_inside_functions_and_skips_type_checking(tmp_path: Path) -> None:
    root = tmp_path / "projects"
    (root / "services").mkdir(parents=True)
    lazy = root / "services" / "lazy.py"
    lazy.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from projects.gateway.routing import Route\n"
        "def f():\n"
        "    import os\n"
        "    from projects.gateway.routing import resolve_model\n"
        "    return resolve_model\n"
    )
    relative = root / "services" / "relative.py"
    relative.write_text("def g():\n    from ..tinker import paths\n    import artweb.logs\n")
    assert violations([lazy, relative], FRONTS, root) == [
        "projects/services/lazy.py:6 imports projects.gateway.routing.resolve_model",
        "projects/services/relative.py:2 imports projects.tinker.paths",
    ]
    assert violations([lazy, relative], ("artweb",), root) == [
        "projects/services/relative.py:3 imports artweb.logs"
    ]
