"""The library's import path holds no harness: importing ebbtide.comm loads neither the process launcher nor the
multi-GPU scenarios (both live in ebbtide.testing, for the tests and the benchmark), nor the benchmark."""
from ebbtide.testing import spawn


def test_comm_does_not_import_the_harness():
    code = ("import sys, ebbtide.comm; "
            "print(sorted(m for m in sys.modules if m.startswith(('ebbtide.bench', 'ebbtide.testing'))))")
    out = spawn.python(code, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout
