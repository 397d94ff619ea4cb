"""GPU tests of the torch_memory_saver surface: tests/memory/compat_scenarios.py, one process per (implementation,
scenario, hook mode). "ebbtide" serves ``import torch_memory_saver`` from ebbtide.compat.shim_path() (the sys.path
switch users make); "tms" from the real package's wheel (EBBTIDE_TMS_WHEEL or <repo>/.whl/torch_memory_saver-*.whl,
unpacked, nothing installed), so the same scenario code proves the surfaces agree. Skipped without a GPU."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from ebbtide.testing import spawn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _scenario_runner as runner  # noqa: E402
import tms_reference  # noqa: E402

BOTH = ("torch", "preload")
TMS_EXIT_BUG = "only support interesting region"  # torch_memory_saver's message before its exit(1)
SCENARIOS = {
    "simple": BOTH,
    "cpu_backup": BOTH,
    "multiple_tags": BOTH,
    "cuda_graph": BOTH,
    "training_engine": ("preload",),
    "unaligned_free_while_paused": ("preload",),
    "nested_region": ("preload",),
    "subprocess_configuration": ("preload",),
}
# Process-wide capture, as torch_memory_saver's own tests set it (read by the preload library at load).
PROCESS_WIDE = {
    "training_engine": {"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1",
                        # the scenario fills 60% of the GPU with CPU-backed memory it never pauses: do not pin
                        # host memory for it ahead of time (host RAM is smaller than that on some machines)
                        "EBBTIDE_MEM_PREPIN": "0"},
    "unaligned_free_while_paused": {"TMS_INIT_ENABLE": "1"},
    "nested_region": {"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"},
}


@pytest.fixture(scope="module")
def tms_root(tmp_path_factory):
    return tms_reference.unpack(tmp_path_factory.mktemp("tms_wheel"))


def _env(impl: str, mode: str, scenario: str, tms_root) -> dict:
    import torch  # noqa: PLC0415

    import ebbtide.compat  # noqa: PLC0415
    from ebbtide import _native  # noqa: PLC0415

    env = runner.clean_env()
    if impl == "tms":
        if tms_root is None:
            pytest.skip("torch_memory_saver wheel not found (EBBTIDE_TMS_WHEEL or <repo>/.whl)")
        first = str(tms_root)
        preload = str(tms_reference.preload_library(tms_root, int(torch.version.cuda.split(".")[0])))
    else:
        first = ebbtide.compat.shim_path()
        preload = _native.runtime_library_path()
    env["PYTHONPATH"] = os.pathsep.join([first, str(_native.PACKAGE_DIR.parent), env.get("PYTHONPATH", "")])
    if mode == "preload" and scenario != "subprocess_configuration":  # that one's parent must not be preloaded
        env["LD_PRELOAD"] = preload
    env.update(PROCESS_WIDE.get(scenario, {}))
    return env


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["ebbtide", "tms"])
@pytest.mark.parametrize("scenario,mode", [(s, m) for s, modes in SCENARIOS.items() for m in modes])
def test_torch_memory_saver_scenario(impl, scenario, mode, tms_root):
    try:
        runner.run(HERE / "compat_scenarios.py", scenario, mode, env=_env(impl, mode, scenario, tms_root),
                   timeout=420, what=f"{impl} {scenario} [{mode}]")
    except spawn.WorkerFailed as e:
        w = e.outcomes[0]
        if impl == "tms" and mode == "torch" and w.ok and w.exitcode != 0 and TMS_EXIT_BUG in w.output():
            # The scenario passed; the anchor then fails at interpreter shutdown (observed with 0.0.10 on H200,
            # torch 2.11): torch frees a block its pluggable allocator never saw and tms_torch_free exits the process.
            pytest.xfail(f"torch_memory_saver's torch mode exits {w.exitcode} at shutdown: {TMS_EXIT_BUG!r}")
        raise
