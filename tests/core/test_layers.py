"""The rooms of the tree, read from the sources: the library never imports the bench; the bench's colocated loop
and the anchors use the library's public names only (the few private ones they need are named here with why); the
examples import public modules of the library and nothing of its bench, test support or anchors."""
from __future__ import annotations

import ast
import pathlib

from test_import_cycles import PACKAGE_DIR, import_graph

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the checkout (the package may be installed elsewhere)
# Modules outside ebbtide.bench that may import it: the command line is the entry point that runs the benchmarks.
BENCH_USERS = {"ebbtide.cli": "`ebbtide bench` and `ebbtide colocate` run the bench"}
# Private library modules the harness and the anchors may import, and why no public name serves.
PRIVATE_OK = {"ebbtide._nvml": "the package's one NVML reader (NVML is not an API ebbtide offers)"}


def _private(name: str) -> bool:
    return any(part.startswith("_") for part in name.split(".")[1:])


def test_nothing_outside_the_bench_and_test_support_imports_the_bench():
    graph = import_graph(PACKAGE_DIR)
    assert "ebbtide.bench.colocate.launcher" in graph and "ebbtide.testing.models" in graph
    inside = ("ebbtide.bench", "ebbtide.testing")
    bad = [f"{m} -> {t}" for m, targets in graph.items() for t in sorted(targets)
           if (t == "ebbtide.bench" or t.startswith("ebbtide.bench.")) and not m.startswith(inside)
           and m not in BENCH_USERS]
    assert not bad, "the library imports the bench:\n" + "\n".join(bad)


def test_the_harness_and_the_anchors_use_public_names_of_the_library():
    graph = import_graph(PACKAGE_DIR)
    users = [m for m in graph if m.startswith(("ebbtide.bench.colocate", "ebbtide.anchors"))]
    assert len(users) >= 15, users
    bad = [f"{m} -> {t}" for m in users for t in sorted(graph[m])
           if _private(t) and not t.startswith(("ebbtide.bench.", "ebbtide.anchors.", "ebbtide.testing."))
           and t not in PRIVATE_OK]
    assert not bad, "private library modules imported:\n" + "\n".join(bad)


def _example_imports(path: pathlib.Path) -> list:
    """Every ebbtide module (and every name taken from one) that ``path`` imports."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.split(".")[0] == "ebbtide"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ebbtide":
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return out


def test_the_examples_import_public_modules_only():
    examples = sorted((ROOT / "examples").rglob("*.py"))
    assert any(p.name == "colocate.py" for p in examples), examples
    bad = []
    for path in examples:
        for name in _example_imports(path):
            if _private(name) or name.startswith(("ebbtide.bench", "ebbtide.testing", "ebbtide.anchors")):
                bad.append(f"{path.relative_to(ROOT)}: {name}")
    assert not bad, "examples must use the public API alone:\n" + "\n".join(bad)


def test_the_import_checks_see_a_private_import(tmp_path):
    (tmp_path / "ex.py").write_text("import ebbtide.memory as em\nfrom ebbtide.memory import _hooks\n"
                                    "from ebbtide.bench.colocate import launcher\n")
    names = _example_imports(tmp_path / "ex.py")
    assert "ebbtide.memory._hooks" in names and "ebbtide.bench.colocate.launcher" in names
    assert [n for n in names if _private(n)] == ["ebbtide.memory._hooks"]
