"""``training/`` imports in one direction: no module reaches itself again through its imports,
counting the imports inside functions (an import moved into a function to break a cycle still
fails here) and leaving out only those under ``if TYPE_CHECKING:`` (never executed)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def training_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted((ROOT / "training").rglob("*.py"))}


def imported(name: str, modules: dict[str, Path]) -> str | None:
    """The training module an imported name lives in (``training.x.y`` for ``from training.x import y``
    when y is a function; ``training.x.y`` itself when it is a module)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if is_type_checking(child):
                continue
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                names = [base, *(f"{base}.{alias.name}" for alias in child.names)]
            for name in names:
                target = imported(name, modules)
                if target is not None and target != module:
                    found.add(target)
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_training_has_no_import_cycle():
    modules = training_modules()
    graph = {module: imports_of(module, path, modules) for module, path in modules.items()}
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_cycle_through_a_function_level_import(tmp_path):
    """The check itself: two modules that import each other, one of them inside a function."""
    graph = {"training.a": {"training.b"}, "training.b": {"training.c"}, "training.c": {"training.a"},
             "training.d": {"training.a"}}  # fmt: skip
    assert cycles(graph) == [["training.a", "training.b", "training.c"]]
    first = tmp_path / "training" / "first.py"
    first.parent.mkdir()
    first.write_text("from training.second import thing\n")
    second = tmp_path / "training" / "second.py"
    second.write_text("def thing():\n    from training import first\n")
    typed = tmp_path / "training" / "typed.py"
    typed.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from training.first import x\n"
    )
    modules = {"training.first": first, "training.second": second, "training.typed": typed}
    graph = {module: imports_of(module, path, modules) for module, path in modules.items()}
    assert graph == {"training.first": {"training.second"}, "training.second": {"training.first"},
                     "training.typed": set()}  # fmt: skip
    assert cycles(graph) == [["training.first", "training.second"]]
