"""usp/ has no import cycles: the module graph, read from the sources with ``ast`` (every
``import usp...`` and ``from usp... import ...``, at any depth, function-level imports
included), has no strongly connected component of more than one module.

A name imported from a package (``from usp.kernels import selfcheck``) counts as an
import of that submodule when it is one, else of the package (its ``__init__``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def module_files(root: Path) -> dict[str, Path]:
    modules = {}
    for path in sorted((root / "usp").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the usp modules it imports."""
    modules = module_files(root)
    graph = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(
                    _resolve(a.name, modules) for a in node.names if a.name.startswith("usp")
                )
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the containing package
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                if not base.startswith("usp"):
                    continue
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    deps.add(full if full in modules else _resolve(base, modules))
        deps.discard(None)
        deps.discard(module)
        graph[module] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_finder_sees_a_cycle(tmp_path):
    package = tmp_path / "usp"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from usp.sub import b\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text("def f():\n    from usp.sub.c import g\n")
    (package / "sub" / "c.py").write_text("from ..a import x\n")
    (package / "d.py").write_text("import usp.a\n")
    graph = import_graph(tmp_path)
    assert graph["usp.d"] == {"usp.a"}
    assert cycles(graph) == [["usp.a", "usp.sub.b", "usp.sub.c"]]


def test_usp_has_no_import_cycles():
    found = cycles(import_graph())
    if found:
        pytest.fail("import cycles in usp/: " + "; ".join(" <-> ".join(c) for c in found))
