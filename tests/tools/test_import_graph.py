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


# docs/architecture.md's layers, bottom up: a module imports only from its own layer or
# the ones below (the front door ``usp`` itself may be imported by the jobs).
LAYERS = [
    ("usp.options", "usp.errors", "usp.planning_mode", "usp.compile_marks"),
    ("usp.process_groups", "usp.comm", "usp.config"),
    ("usp.kernels",),
    ("usp.ring",),
    ("usp.sp",),
    ("usp.linear", "usp.models", "usp.rl"),
    ("usp.train", "usp.evaluation", "usp.planner", "usp.integrations", "usp.cli"),
]


def layer_of(module: str) -> int | None:
    for index, packages in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in packages):
            return index
    return None


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, what it imports) pairs that reach a higher layer, or a module no layer holds."""
    found = []
    for module, imports in graph.items():
        if module in ("usp", "usp.__main__"):
            continue
        below = layer_of(module)
        for imported in imports:
            if imported == "usp" and below == len(LAYERS) - 1:
                continue
            above = layer_of(imported)
            if below is None or above is None or above > below:
                found.append((module, imported))
    return sorted(found)


def test_every_module_imports_only_its_own_layer_or_lower():
    assert upward_imports(import_graph()) == []


def test_every_module_has_a_layer():
    unplaced = [
        m for m in import_graph() if m not in ("usp", "usp.__main__") and layer_of(m) is None
    ]
    assert unplaced == [], "add the package to LAYERS here and to docs/architecture.md"


def test_an_upward_import_is_found():
    graph = {"usp.ring.p2p": {"usp.sp.plan"}, "usp.sp.plan": {"usp.ring.p2p"}}
    assert upward_imports(graph) == [("usp.ring.p2p", "usp.sp.plan")]
    assert upward_imports({"usp.newpkg.x": {"usp.errors"}}) == [("usp.newpkg.x", "usp.errors")]
