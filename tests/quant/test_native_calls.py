"""The Python side's calls into the native quant module (ebbtide._C.quant) against the bindings this build has: every
kernel is called in quant/_cuda.py alone (where _dispatch picks its variant), with exactly the keyword arguments its
binding declares. A GPU-only path that missed an argument would otherwise fail only where a GPU runs it. Reads the
bindings' signatures, so it runs on a CPU machine whose build has the CUDA kernels."""
import ast
import pathlib
import re

import pytest

import ebbtide

PKG = pathlib.Path(ebbtide.__file__).parent
CUDA_PY = PKG / "quant" / "_cuda.py"


def _native():
    from ebbtide.errors import UnsupportedError
    from ebbtide.quant import _dispatch

    try:
        return _dispatch.native()
    except UnsupportedError as e:
        pytest.skip(f"this build has no CUDA quant kernels: {e}")


def binding_params(fn) -> list:
    """Parameter names from a pybind11 signature line: ``name(a: T, b: list[tuple[int, int]] = 0) -> R``."""
    doc = (fn.__doc__ or "").splitlines()[0]
    inner = doc[doc.index("(") + 1:doc.rindex(") ->")]
    names, depth, start = [], 0, 0
    for i, ch in enumerate(inner + ","):
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        elif ch == "," and depth == 0:
            part = inner[start:i].strip()
            if part not in ("", "*", "/"):
                names.append(re.match(r"\*{0,2}(\w+)", part).group(1))
            start = i + 1
    return names


def _is_q_call(v) -> bool:
    """``_q()`` or ``<module>._q()``."""
    if not isinstance(v, ast.Call):
        return False
    f = v.func
    return (isinstance(f, ast.Name) and f.id == "_q") or (isinstance(f, ast.Attribute) and f.attr == "_q")


def native_calls(path: pathlib.Path, alias: str | None = None) -> list:
    """(line, kernel, keyword names, positional count) of every ``_q().k(...)`` and, with ``alias``, every
    ``alias.k(...)`` (_cuda.py binds ``Q = _q()``)."""
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        v = node.func.value
        if _is_q_call(v) or (alias and isinstance(v, ast.Name) and v.id == alias):
            out.append((node.lineno, node.func.attr, [k.arg for k in node.keywords], len(node.args)))
    return out


def native_imports(path: pathlib.Path) -> list:
    """Lines that import the native module's accessors (``_q``, ``native``) from ebbtide.quant."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] in ("_cuda", "_dispatch"):
            out += [node.lineno for a in node.names if a.name in ("_q", "native")]
    return out


def test_the_signature_parser_reads_nested_types():
    class F:
        __doc__ = "f(a: typing.SupportsInt | typing.SupportsIndex, b: list[tuple[int, int]], *, c: str = 'x') -> None"

    assert binding_params(F) == ["a", "b", "c"]


def test_every_kernel_call_passes_exactly_the_bindings_arguments():
    Q = _native()
    calls = native_calls(CUDA_PY, alias="Q")
    assert len(calls) >= 7, calls  # the FP8, INT4, segment-copy and encode launchers
    bad = []
    for line, kernel, kws, npos in calls:
        want = binding_params(getattr(Q, kernel))
        if npos or sorted(kws) != sorted(want):
            bad.append(f"_cuda.py:{line} {kernel}: passes {sorted(kws)} (+{npos} positional), "
                       f"the binding takes {want}")
    assert not bad, "\n".join(bad)


def test_no_module_outside_quant_launches_a_native_kernel():
    offenders = []
    for path in sorted(PKG.rglob("*.py")):
        if path.parent == PKG / "quant":
            continue
        rel = path.relative_to(PKG)
        offenders += [f"{rel}:{line} {kernel}" for line, kernel, _, _ in native_calls(path)]
        offenders += [f"{rel}:{line} imports the native module" for line in native_imports(path)]
    assert not offenders, "launch through ebbtide.quant._cuda (it picks the kernel variant): " + ", ".join(offenders)
