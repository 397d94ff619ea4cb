"""GPU tests of the adoption features (tests/memory/adopt_scenarios.py, tests/memory/cupy_prog.py), one process
each, in both hook modes where the feature has both. Skipped without a GPU."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SCENARIOS = ["graph_replay", "paused_block_guard", "poison", "memory_margin", "release_report",
             "expandable_segments", "shareable_ipc"]
EXTRA_ENV = {"poison": {"EBBTIDE_MEM_POISON": "1"},
             "expandable_segments": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}


def _env(mode: str, **kwargs) -> dict:
    from ebbtide.memory import preload_env  # noqa: PLC0415

    base = {k: v for k, v in os.environ.items()
            if k != "LD_PRELOAD" and not k.startswith(("EBBTIDE_MEM_", "TMS_", "PYTORCH_CUDA_ALLOC_CONF"))}
    return preload_env(base, **kwargs) if mode == "preload" else base


def _run(args: list, env: dict, what: str) -> None:
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300)
    out = p.stdout.strip()
    if p.returncode == 0 and out.splitlines() and out.splitlines()[-1].startswith("SKIP:"):
        pytest.skip(out.splitlines()[-1][5:].strip())
    assert p.returncode == 0 and out.endswith("OK"), (
        f"{what} failed ({p.returncode})\n--- stdout\n{p.stdout[-6000:]}\n--- stderr\n{p.stderr[-8000:]}")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["torch", "preload"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_adopt_scenario(scenario, mode):
    env = _env(mode)
    env.update(EXTRA_ENV.get(scenario, {}))
    _run([str(HERE / "adopt_scenarios.py"), scenario, mode], env, f"{scenario} [{mode}]")


@pytest.mark.gpu
def test_cupy_program_under_the_shim_keeps_its_data():
    _run([str(HERE / "cupy_prog.py")], _env("preload", default_tag="cupy", default_backup="cpu"), "cupy program")


@pytest.mark.gpu
def test_colocation_example_takes_turns():
    """The colocation demo of docs/memory.md: two processes whose working sets cannot fit at once take turns."""
    p = subprocess.run([sys.executable, "-m", "ebbtide.memory.colocate", "--steps", "2"], capture_output=True,
                       text=True, env=_env("torch"), timeout=300)
    print(p.stdout)
    assert p.returncode == 0 and "colocation: OK" in p.stdout, p.stdout[-6000:] + p.stderr[-6000:]
    assert p.stdout.count(": running, free") == 4, p.stdout
