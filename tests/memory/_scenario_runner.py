"""One scenario per process: the program side and the test side, shared by every memory scenario program.

Test side: ``run(program, scenario, *args, env=..., timeout=..., what=...)`` runs ``scenario(*args)`` of the program
(a module of this folder: ``fake_*.py``, ``gpu_scenarios.py``, ``adopt_scenarios.py``, ``compat_scenarios.py``,
``cupy_prog.py``) in a fresh interpreter through ebbtide.testing.spawn.call: a scenario that raises ``Skip`` makes the
test skip with its reason; a failure raises with the traceback, the engine's stats and release report (printed by
``diagnostics`` after a failure, where ebbtide.memory was imported) and the tail of the output. Arguments are text,
as on a command line.

Program side: the helpers below, ``Skip``, and ``main(globals())`` at the end of each program, which runs
``python <program> <scenario> [args...]`` by hand (and the programs' own helper children: ``_ipc_child``) and prints
"OK" or "SKIP: <why>". What a program needs before every scenario (``torch.cuda.init()``) runs at its import. Nothing
here imports torch or the engine at import time: the fake-driver programs must not pay for torch, and cupy_prog must
not load it.
"""
from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

from ebbtide.testing import spawn
from ebbtide.testing.spawn import Skip  # raised by a scenario the implementation or hook mode does not offer

HERE = Path(__file__).resolve().parent
GiB = 1 << 30
MiB = 1 << 20


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


spawn.on_failure(diagnostics)  # inside a scenario process: after a scenario raised, before its report


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


def run(program: str | Path, scenario: str, *args: str, env: dict | None = None, timeout: float = 300,
        what: str | None = None):
    """``scenario(*args)`` of ``program`` in a fresh interpreter with the environment ``env`` (default: this one's);
    returns what the scenario returned."""
    program = Path(program)
    return spawn.call(scenario, *(str(a) for a in args), module=program.stem, path=[str(program.parent)], env=env,
                      timeout=timeout, what=what or f"{program.name} {scenario} {' '.join(map(str, args))}".strip())
