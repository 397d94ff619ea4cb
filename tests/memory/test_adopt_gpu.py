"""GPU tests of the adoption features (tests/memory/adopt_scenarios.py, tests/memory/cupy_prog.py), one process
each, in both hook modes where the feature has both. Skipped without a GPU."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ebbtide.testing import spawn

HERE = Path(__file__).resolve().parent
DEMO = HERE.parents[1] / "examples" / "colocate" / "memory_handoff_demo.py"
sys.path.insert(0, str(HERE))
import _scenario_runner as runner  # noqa: E402

SCENARIOS = ["graph_replay", "paused_block_guard", "poison", "memory_margin", "release_report",
             "expandable_segments", "shareable_ipc"]
EXTRA_ENV = {"poison": {"EBBTIDE_MEM_POISON": "1"},
             "expandable_segments": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}


def _env(mode: str, **kwargs) -> dict:
    from ebbtide.memory import preload_env  # noqa: PLC0415

    base = runner.clean_env()
    return preload_env(base, **kwargs) if mode == "preload" else base


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["torch", "preload"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_adopt_scenario(scenario, mode):
    env = _env(mode)
    env.update(EXTRA_ENV.get(scenario, {}))
    runner.run(HERE / "adopt_scenarios.py", scenario, mode, env=env, what=f"{scenario} [{mode}]")


@pytest.mark.gpu
def test_cupy_program_under_the_shim_keeps_its_data():
    env = _env("preload", default_tag="cupy", default_backup="cpu")
    runner.run(HERE / "cupy_prog.py", "main", env=env, what="cupy program")


@pytest.mark.gpu
def test_memory_handoff_demo_takes_turns():
    """examples/colocate/memory_handoff_demo.py: two processes whose working sets cannot fit at once take turns."""
    p = spawn.command([sys.executable, DEMO, "--steps", "2"], env=_env("torch"), what="memory hand-off demo")
    print(p.stdout)
    assert p.stdout.strip().endswith("OK") and p.stdout.count(": running, free") == 4, p.stdout
