"""The library's import path holds no harness: importing ebbtide.comm loads neither the process launcher nor the
multi-GPU scenario (both live in ebbtide.bench, for the tests and the benchmark)."""
import subprocess
import sys


def test_comm_does_not_import_the_harness():
    code = ("import sys, ebbtide.comm; "
            "print(sorted(m for m in sys.modules if m.startswith('ebbtide.bench') or m.endswith('scenarios')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
