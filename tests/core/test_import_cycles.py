"""No import cycle inside the ebbtide package, and every module of ebbtide.memory imports on its own.

The graph is read from the sources: an edge A -> B for every ``import``/``from ... import`` of B in A, at module
level or inside a function (a deferred import still ties the two modules together). ``from pkg import name``
counts as an import of ``pkg.name`` when that is a module, else of ``pkg``. A cycle is a strongly connected
component of more than one module.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ebbtide
from ebbtide.testing import spawn

PACKAGE_DIR = Path(ebbtide.__file__).resolve().parent


def modules(root: Path) -> dict:
    """Dotted name -> (path, is_package) of every .py file under the package ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_package)
    return out


def import_graph(root: Path) -> dict:
    mods = modules(root)
    top = root.name
    graph = {}
    for name, (path, is_package) in mods.items():
        package = name if is_package else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = alias.name
                    while target and target not in mods:  # "import a.b.c" where c is a name in a.b: a.b
                        target = target.rpartition(".")[0]
                    if target:
                        edges.add(target)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] != top:
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in mods:
                        edges.add(sub)
                    elif target in mods:
                        edges.add(target)
        edges.discard(name)
        graph[name] = edges
    return graph


def cycles(graph: dict) -> list:
    """Strongly connected components of more than one node (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _edges_within(graph: dict, comp: list) -> list:
    return [f"{a} -> {b}" for a in comp for b in sorted(graph[a]) if b in comp]


def test_no_import_cycle_in_the_package():
    graph = import_graph(PACKAGE_DIR)
    assert len(graph) > 20, f"found only {len(graph)} modules under {PACKAGE_DIR}"
    assert {"ebbtide.memory._engine", "ebbtide.memory._hooks", "ebbtide.memory._common"} <= set(graph)
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join("  " + "; ".join(_edges_within(graph, c)) for c in found)


def test_the_check_finds_a_cycle(tmp_path):
    pkg = tmp_path / "cyc"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .sub.c import g\n")  # deferred: still an edge
    (pkg / "sub" / "c.py").write_text("import cyc.a\nimport os\n")
    (pkg / "d.py").write_text("from .a import x\n")  # into the cycle, not part of it
    graph = import_graph(pkg)
    assert graph["cyc.a"] == {"cyc.b"} and graph["cyc.b"] == {"cyc.sub.c"} and graph["cyc.sub.c"] == {"cyc.a"}
    assert cycles(graph) == [["cyc.a", "cyc.b", "cyc.sub.c"]]


MEMORY_MODULES = sorted(n for n in modules(PACKAGE_DIR) if n.startswith("ebbtide.memory"))


@pytest.mark.parametrize("name", MEMORY_MODULES)
def test_memory_module_imports_alone(name):
    # First import in a fresh interpreter: a cycle that Python resolves only in one import order fails here.
    p = spawn.python(f"import {name}", timeout=120, check=False)
    assert p.returncode == 0, p.stderr[-4000:]
