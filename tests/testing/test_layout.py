"""Test support lives in ebbtide.testing, read from the sources (AST, no imports):
- no test imports a private module of the bench (``ebbtide.bench._spawn``, ``ebbtide.bench.suites._worker``, ...):
  tests and the bench share through ebbtide.testing. The bench's own tests (tests/bench) test its private parts as
  any component's tests do theirs, and are not held to this;
- ebbtide.testing imports nothing from ebbtide.bench, and the library (every package but bench and testing)
  imports nothing from ebbtide.testing;
- one free-port helper: no ``socket.bind((host, 0))`` outside ebbtide/testing/ports.py.
"""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "ebbtide"
PORTS = PACKAGE / "testing" / "ports.py"


def _py_files(*dirs: Path) -> list:
    return sorted(p for d in dirs for p in d.rglob("*.py") if "build" not in p.relative_to(ROOT).parts[:1])


def _module_of(path: Path) -> str:
    """Dotted name of a file in the package (``ebbtide.x.y``); "" outside it."""
    try:
        rel = path.relative_to(PACKAGE.parent)
    except ValueError:
        return ""
    parts = list(rel.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    """Whether ``name`` (``ebbtide.x.y``) is a module or package of this tree (else ``from x import y`` names an
    attribute of ``x``)."""
    if name.split(".")[0] != "ebbtide":
        return False
    base = PACKAGE.parent.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imported(path: Path) -> list:
    """(line, dotted name) of every module ``path`` imports (``from x import y``: ``x``, and ``x.y`` where that is a
    module), relative imports resolved, plus string arguments of
    ``importlib.import_module`` / ``__import__`` and the ``module=`` of spawn calls (a worker is an import too)."""
    tree = ast.parse(path.read_text(), str(path))
    me = _module_of(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            out.append((node.lineno, target))
            out += [(node.lineno, f"{target}.{a.name}") for a in node.names if _is_module(f"{target}.{a.name}")]
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            strings = []
            if name in ("import_module", "__import__") and node.args:
                strings.append(node.args[0])
            strings += [k.value for k in node.keywords if k.arg == "module"]
            out += [(node.lineno, s.value) for s in strings
                    if isinstance(s, ast.Constant) and isinstance(s.value, str)]
    return out


def _private_bench(name: str) -> bool:
    parts = name.split(".")
    return parts[:2] == ["ebbtide", "bench"] and any(p.startswith("_") for p in parts[2:])


def test_the_scan_sees_imports_and_worker_modules(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from ebbtide.bench.suites import _memory_worker\nimport ebbtide.bench.suites._steady_worker\n"
                     "spawn.call('f', module='ebbtide.bench.suites._megatron_worker')\n"
                     "from ebbtide.bench.suites.comm import _rows\n")
    assert [n for _, n in imported(probe) if _private_bench(n)] == [
        "ebbtide.bench.suites._memory_worker", "ebbtide.bench.suites._steady_worker",
        "ebbtide.bench.suites._megatron_worker"]  # _rows: a function of a public module
    assert not _private_bench("ebbtide.bench.suites.comm") and not _private_bench("ebbtide.testing.spawn")
    assert ("ebbtide.bench.registry" in {n for _, n in imported(PACKAGE / "bench" / "suites" / "comm.py")})


# The bench's own tests: tests/bench (the suites) and tests/colocate (the colocation harness, ebbtide.bench.colocate).
BENCH_TESTS = ("bench", "colocate")


def test_no_test_imports_a_private_bench_module():
    tests = ROOT / "tests"
    bad = [f"{p.relative_to(ROOT)}:{line}: {name}" for p in _py_files(tests)
           if p.relative_to(tests).parts[0] not in BENCH_TESTS for line, name in imported(p) if _private_bench(name)]
    assert not bad, "tests share with the bench through ebbtide.testing, not its private modules:\n" + "\n".join(bad)


def test_testing_imports_nothing_from_the_bench():
    bad = [f"{p.relative_to(ROOT)}:{line}: {name}" for p in _py_files(PACKAGE / "testing")
           for line, name in imported(p) if name.split(".")[:2] == ["ebbtide", "bench"]]
    assert not bad, "ebbtide.testing must not depend on the bench:\n" + "\n".join(bad)


def test_the_library_imports_nothing_from_testing():
    library = [p for p in _py_files(PACKAGE) if _module_of(p).split(".")[1:2] not in (["bench"], ["testing"])]
    assert len(library) > 50  # the scan reads the library
    bad = [f"{p.relative_to(ROOT)}:{line}: {name}" for p in library
           for line, name in imported(p) if name.split(".")[:2] == ["ebbtide", "testing"]]
    assert not bad, "the library must not depend on test support:\n" + "\n".join(bad)


def _port_binds(path: Path) -> list:
    """Lines of ``<socket>.bind((host, 0))``: asking the kernel for a free port."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "bind"
                and node.args and isinstance(node.args[0], ast.Tuple) and len(node.args[0].elts) >= 2
                and isinstance(node.args[0].elts[1], ast.Constant) and node.args[0].elts[1].value == 0):
            out.append(node.lineno)
    return out


def test_one_free_port_helper():
    assert _port_binds(PORTS), "the scan must see ports.py's own bind"
    dirs = [ROOT / d for d in ("python", "tests", "examples", "scripts") if (ROOT / d).is_dir()]
    bad = [f"{p.relative_to(ROOT)}:{line}" for p in _py_files(*dirs) if p != PORTS for line in _port_binds(p)]
    assert not bad, "use ebbtide.testing.ports.free_port() instead of another copy:\n" + "\n".join(bad)
