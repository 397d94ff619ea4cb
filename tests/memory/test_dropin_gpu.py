"""GPU tests of torch_memory_saver's semantics in the engine: transient host copies (pinned and pageable) with RSS
given back, host retention, the disk tier, and its C functions in a preloaded process (tests/memory/
dropin_scenarios.py, one interpreter each, both hook modes). torch_memory_saver's own suite runs against the drop-in
through scripts/tms-suite. Skipped without a GPU (conftest)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _scenario_runner as runner  # noqa: E402


def run(scenario: str, mode: str, *args: str, extra_env: dict | None = None) -> None:
    from ebbtide.memory import preload_env  # noqa: PLC0415

    env = runner.clean_env()
    if mode == "preload":
        env = preload_env(env)
    env.update(extra_env or {})
    runner.run(HERE / "dropin_scenarios.py", scenario, mode, *args, env=env, timeout=300,
               what=f"{scenario} [{mode}] {args}")


def _real_disk_dir(tmp_path) -> str:
    with open("/proc/mounts") as f:
        ram = [line.split()[1] for line in f if line.split()[2] in ("tmpfs", "ramfs")]
    d = tmp_path / "disk"
    if any(str(d).startswith(m.rstrip("/") + "/") for m in ram if m != "/"):
        d = HERE.parent.parent / "build" / f"disk-gpu-{os.getpid()}"
    d.mkdir(parents=True, exist_ok=True)
    return str(d)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["torch", "preload"])
@pytest.mark.parametrize("host", ["transient", "pageable"])
def test_gpu_transient_host_copies(mode, host):
    run("transient", mode, host)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["torch", "preload"])
def test_gpu_disk_tier(mode, tmp_path):
    run("disk", mode, _real_disk_dir(tmp_path))


@pytest.mark.gpu
def test_gpu_tms_c_functions_in_the_global_scope():
    run("tms_c_functions", "preload", extra_env={"TMS_INIT_ENABLE": "1"})
