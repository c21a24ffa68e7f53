"""The package's shape: no import cycle among tierrun's modules, no module over 500 lines.

Every import counts: at module level, under ``TYPE_CHECKING`` and inside functions alike
(a cycle hidden in a function is still two modules that cannot be read, tested or
changed one without the other).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent  # (this tree's tierrun, wherever it is installed from)
MAX_LINES = 500


def modules_under(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the ``tierrun`` package in ``root``."""
    modules = {}
    for path in sorted((root / "tierrun").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its file."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                graph[name] |= {alias.name for alias in node.names if alias.name in modules}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    submodule = f"{target}.{alias.name}"
                    if submodule in modules:
                        graph[name].add(submodule)
                    elif target in modules:
                        graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_cycle_finder_counts_every_kind_of_import(tmp_path):
    pkg = tmp_path / "tierrun"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .a import A\n")
    (pkg / "sub" / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from tierrun.sub import a\n")
    (pkg / "c.py").write_text("import tierrun.sub.b\n")
    graph = import_graph(modules_under(tmp_path))
    assert graph["tierrun.sub"] == {"tierrun.sub.a"}
    assert graph["tierrun.c"] == {"tierrun.sub.b"}
    assert cycles(graph) == [["tierrun.sub.a", "tierrun.sub.b"]]


def test_no_import_cycles():
    found = cycles(import_graph(modules_under(ROOT)))
    assert not found, "import cycles among tierrun's modules:\n" + "\n".join(" <-> ".join(c) for c in found)


def _size_cases() -> list:
    cases = []
    for path in modules_under(ROOT).values():
        cases.append(pytest.param(path, id=path.relative_to(ROOT).as_posix()))
    return cases


@pytest.mark.parametrize("path", _size_cases())
def test_module_size(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)}: {lines} lines (at most {MAX_LINES}: split it)"
