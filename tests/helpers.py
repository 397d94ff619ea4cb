"""Test utilities shared across components (importable as `helpers` from tests/)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def run_python(code: str, *, env: dict | None = None, timeout: float = 120, check: bool = True):
    """Run `code` in a fresh interpreter (tests that set LD_PRELOAD, env knobs or install hooks must not share a
    process). Returns the CompletedProcess; with check=True a non-zero exit fails with both streams shown."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       env=full_env, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"subprocess failed ({p.returncode})\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}")
    return p


def native_or_skip():
    """The native extension module, or a pytest skip saying why it is not built here."""
    import pytest  # noqa: PLC0415

    from ebbtide import _native  # noqa: PLC0415

    try:
        return _native.load()
    except ImportError as e:
        pytest.skip(f"native extension not built here: {e}")
