"""The two memory examples at the top of docs/memory.md run as written (each in its own interpreter, on a GPU)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "memory.md"


def example(mode: str) -> str:
    m = re.search(rf"<!-- memory-example: {mode} -->\n```python\n(.*?)```", PAGE.read_text(), re.S)
    assert m, f"docs/memory.md lost its {mode} example"
    return m.group(1)


def test_examples_are_short_and_present():
    for mode in ("torch", "preload"):
        assert len(example(mode).strip().splitlines()) <= 14


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["torch", "preload"])
def test_readme_example_runs(mode, tmp_path):
    script = tmp_path / f"example_{mode}.py"
    script.write_text(example(mode))
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
