"""SGLang's own code for the sync tests (sglang==0.5.23, installed with --no-deps by .ci/run).

``available()`` says whether SGLang's serializer and flattened bucket import here (and why not). Some modules
pull SGLang's model-config registry at import, which needs torchvision built for the installed torch; where that
import fails, ``functions`` compiles the named pure-torch functions from the installed SGLang file itself (not a
copy kept in this repo), and ``struct_fields`` reads a request struct's fields from the installed io_struct.py.
"""
from __future__ import annotations

import __future__
import ast
import functools
import importlib
import pathlib


@functools.lru_cache(maxsize=None)
def available() -> tuple[bool, str]:
    try:
        import sglang  # noqa: F401
        from sglang.srt.utils import MultiprocessingSerializer  # noqa: F401
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket  # noqa: F401
    except Exception as e:  # noqa: BLE001 (any import failure means: skip, saying why)
        return False, f"sglang 0.5.23 is not importable here ({type(e).__name__}: {e}); .ci/run installs it"
    return True, ""


def _source(module: str) -> tuple[pathlib.Path, ast.Module]:
    import sglang

    path = pathlib.Path(sglang.__file__).parent.joinpath(*module.split(".")[1:]).with_suffix(".py")
    return path, ast.parse(path.read_text(), str(path))


def functions(module: str, names: tuple, extra: dict) -> dict:
    """{name: function} from ``module``: imported when the module imports here, else compiled from its file."""
    try:
        mod = importlib.import_module(module)
        return {n: getattr(mod, n) for n in names}
    except ImportError:
        pass
    path, tree = _source(module)
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = set(names) - {n.name for n in body}
    if missing:
        raise LookupError(f"{path} has no function(s) {sorted(missing)}")
    code = compile(ast.Module(body=body, type_ignores=[]), str(path), "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    ns = dict(extra)
    exec(code, ns)  # noqa: S102 (SGLang's own source, from the installed package)
    return {n: ns[n] for n in names}


def struct_fields(cls_name: str, module: str = "sglang.srt.managers.io_struct") -> tuple[set, set]:
    """(all fields, required fields) of a request struct, read from the installed source (its class body's
    annotated assignments, and those of its BaseReq parent)."""
    _, tree = _source(module)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    fields, required = set(), set()
    node = classes[cls_name]
    while node is not None:
        for st in node.body:
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                fields.add(st.target.id)
                if st.value is None:
                    required.add(st.target.id)
        base = node.bases[0].id if node.bases and isinstance(node.bases[0], ast.Name) else None
        node = classes.get(base)
    return fields, required
