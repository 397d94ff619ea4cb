"""One scenario per process: the program side and the test side, shared by every memory scenario program.

Program side (``fake_*.py``, ``gpu_scenarios.py``, ``adopt_scenarios.py``, ``compat_scenarios.py``): the module ends
with ``main(globals())``, which runs ``python <program> <scenario> [args...]`` as ``scenario(*args)`` and prints
"OK". A scenario that raises ``Skip`` prints "SKIP: <why>" and exits 0; any other failure prints its traceback and,
where ebbtide.memory was imported, the engine's stats and release report, and exits 1. Nothing here imports torch
or the engine at import time: the fake-driver programs must not pay for torch, and cupy_prog must not load it.

Test side: ``run(program, *args, env=..., timeout=..., what=...)`` starts the program in a fresh interpreter, turns a
"SKIP:" last line into a pytest skip, and fails with the tails of both streams unless the output ends with "OK".
"""
from __future__ import annotations

import os
import subprocess
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
GiB = 1 << 30
MiB = 1 << 20


class Skip(Exception):
    """Raised by a scenario that the implementation or hook mode under test does not offer."""


# ---- program side -----------------------------------------------------------------------------------------------

def used() -> int:
    """Device memory in use on the current device, after the device is idle (the driver's view)."""
    import torch  # noqa: PLC0415

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def free_bytes() -> int:
    """The driver's free device memory on the current device, after the device is idle."""
    import torch  # noqa: PLC0415

    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def say(label: str, who: str) -> int:
    """Print the device memory in use under a label (one run's log then explains a failure); returns it."""
    u = used()
    print(f"{who} {label}: device memory used {u / GiB:.3f} GiB", flush=True)
    return u


def check_mode(mode: str) -> None:
    import ebbtide.memory as em  # noqa: PLC0415

    assert em.hook_mode() == mode, (em.hook_mode(), mode)


def tag_bytes(tag: str, key: str) -> int:
    """A stats field summed over a tag's rows (one row per device)."""
    import ebbtide.memory as em  # noqa: PLC0415

    return sum(r[key] for r in em.stats()["tags"] if r["tag"] == tag)


def diagnostics() -> None:
    """The engine's stats and release report, when this process uses the engine (never loads it itself)."""
    em = sys.modules.get("ebbtide.memory")
    if em is None:
        return
    try:
        print("--- ebbtide stats:", em.stats(), sep="\n")
        print("--- release report:", em.release_report(), sep="\n")
    except Exception as e:  # noqa: BLE001
        print(f"(diagnostics failed: {e})")


def main(scenarios: dict, argv: list | None = None) -> None:
    """Run ``argv[1](*argv[2:])`` from the program's namespace; print "OK", "SKIP: <why>", or fail with diagnostics."""
    argv = sys.argv if argv is None else argv
    try:
        scenarios[argv[1]](*argv[2:])
    except Skip as s:
        print(f"SKIP: {s}")
        sys.exit(0)
    except BaseException:
        traceback.print_exc()
        diagnostics()
        sys.exit(1)
    print("OK")


# ---- test side --------------------------------------------------------------------------------------------------

def clean_env(drop_prefixes: tuple = ("EBBTIDE_MEM_", "TMS_", "PYTORCH_CUDA_ALLOC_CONF")) -> dict:
    """This process's environment without LD_PRELOAD and without the settings a scenario sets for itself."""
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith(drop_prefixes)}


def start(program: str | Path, *args: str, env: dict | None = None,
          timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(program), *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def check(p: subprocess.CompletedProcess, what: str, out_tail: int = 6000, err_tail: int = 8000) -> None:
    """Skip on a "SKIP:" last line; otherwise the program must have exited 0 with "OK" last."""
    out = p.stdout.strip()
    if p.returncode == 0 and out.splitlines() and out.splitlines()[-1].startswith("SKIP:"):
        import pytest  # noqa: PLC0415

        pytest.skip(out.splitlines()[-1][5:].strip())
    assert p.returncode == 0 and out.endswith("OK"), (
        f"{what} failed ({p.returncode})\n--- stdout\n{p.stdout[-out_tail:]}\n--- stderr\n{p.stderr[-err_tail:]}")


def run(program: str | Path, *args: str, env: dict | None = None, timeout: float = 300, what: str | None = None,
        out_tail: int = 6000, err_tail: int = 8000) -> subprocess.CompletedProcess:
    p = start(program, *args, env=env, timeout=timeout)
    check(p, what or f"{Path(program).name} {' '.join(args)}", out_tail, err_tail)
    return p
