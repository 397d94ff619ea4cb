"""GPU tests of the memory engine: each scenario in its own interpreter, in both hook modes
(tests/memory/gpu_scenarios.py). Skipped loudly without a GPU (conftest)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _scenario_runner as runner  # noqa: E402

SCENARIOS = ["basic", "multi_tag", "caching_allocator", "oom_at_resume", "async_overlap", "backward_default_region",
             "unmap_runs"]


def run(scenario: str, mode: str, extra_env: dict | None = None) -> None:
    from ebbtide.memory import preload_env  # noqa: PLC0415

    env = preload_env() if mode == "preload" else {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env.update(extra_env or {})
    runner.run(HERE / "gpu_scenarios.py", scenario, mode, env=env, timeout=300, what=f"{scenario} [{mode}]")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["torch", "preload"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_gpu_scenario(scenario, mode):
    run(scenario, mode)


@pytest.mark.gpu
@pytest.mark.parametrize("scenario", ["basic", "oom_at_resume", "unmap_runs"])
def test_gpu_create_ahead(scenario):
    # Resume's cuMemCreate calls on a helper thread (EBBTIDE_MEM_CREATE_AHEAD=1: every resume).
    run(scenario, "torch", {"EBBTIDE_MEM_CREATE_AHEAD": "1"})


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["torch", "preload"])
def test_gpu_coalesced_discard(mode):
    # Coalesced resume (the default): 1024 x 16 MiB round trip, frees of members while active (zombies) and paused.
    run("coalesced_discard", mode)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["torch", "preload"])
def test_gpu_zombie_reclaim(mode):
    # GPU full, zombies holding memory, a tensor allocated through the hooks: the reclaim makes room.
    run("zombie_reclaim", mode)


@pytest.mark.gpu
@pytest.mark.parametrize("scenario", ["basic", "multi_tag", "caching_allocator", "oom_at_resume", "unmap_runs"])
def test_gpu_scenario_per_allocation(scenario):
    # The general scenarios on the per-allocation path (EBBTIDE_MEM_COALESCE=0).
    run(scenario, "torch", {"EBBTIDE_MEM_COALESCE": "0"})
