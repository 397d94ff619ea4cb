"""Installing ebbtide never changes the user's torch: the package requires nothing (torch only behind the `torch`
extra, as a lower bound), the build needs no torch, and the wheel's metadata, as setuptools writes it from this
tree, says the same (built without compiling anything)."""
from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest

from ebbtide.testing import spawn

ROOT = Path(__file__).resolve().parents[2]


def pyproject() -> dict:
    try:
        import tomllib  # noqa: PLC0415
    except ImportError:  # Python < 3.11
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def names_torch(requirement: str) -> bool:
    return re.match(r"\s*torch\s*($|[\[<>=!~;\s])", requirement) is not None


def test_pyproject_requires_no_torch_and_bounds_it_only_from_below():
    p = pyproject()
    assert not any(names_torch(r) for r in p["project"]["dependencies"]), p["project"]["dependencies"]
    assert not any(names_torch(r) for r in p["build-system"]["requires"]), p["build-system"]["requires"]
    extras = p["project"]["optional-dependencies"]
    torch_reqs = [r for reqs in extras.values() for r in reqs if names_torch(r)]
    assert torch_reqs, "the `torch` extra names torch"
    for r in torch_reqs:
        assert re.fullmatch(r"torch>=[0-9.]+", r.replace(" ", "")), f"{r!r}: only a lower bound on torch"


def test_setup_py_adds_no_requirements():
    text = (ROOT / "setup.py").read_text()
    assert "install_requires" not in text and "requires=" not in text


def test_wheel_metadata_requires_torch_only_in_the_extra(tmp_path):
    """setuptools' own metadata step (what `pip wheel .` writes into the wheel), on a copy of the tree's packaging
    files and Python sources: no Requires-Dist names torch outside `extra == "torch"`."""
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "python", src / "python", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    out = tmp_path / "meta"
    out.mkdir()
    code = ("import sys; from setuptools import build_meta as b; "
            "print(b.prepare_metadata_for_build_wheel(sys.argv[1]))")
    r = spawn.command([sys.executable, "-c", code, out], cwd=src, timeout=300, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    meta = (out / r.stdout.strip().splitlines()[-1] / "METADATA").read_text()
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    torch_lines = [q for q in requires if names_torch(q)]
    assert torch_lines, requires
    for q in torch_lines:
        assert re.search(r"""extra\s*==\s*["']torch["']""", q), f"torch required outside the torch extra: {q}"
        assert not re.search(r"==|<|~=", q.split(";")[0]), f"torch pinned or capped: {q}"
    assert "Requires-Python: >=3.9" in meta
