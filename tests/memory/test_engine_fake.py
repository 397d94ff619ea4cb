"""The memory engine's logic on CPU, against the host-memory fake driver (libebbtide_fake_cuda.so).

Each scenario runs in its own interpreter (the fake_<topic>.py program that defines it) with EBBTIDE_LIBCUDA
pointing at the fake: the driver table is loaded once per process, and fault injection must not leak into other
tests.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from ebbtide import _native

HERE = Path(__file__).resolve().parent
FAKE = _native.PACKAGE_DIR / "libebbtide_fake_cuda.so"

pytestmark = pytest.mark.skipif(not FAKE.exists(), reason=f"{FAKE.name} not built (EBBTIDE_TEST_FAKES=OFF)")

sys.path.insert(0, str(HERE))
import _scenario_runner as runner  # noqa: E402
import fake_scenarios_spec as spec  # noqa: E402


def run(scenario: str, *args: str, env: dict | None = None) -> None:
    full = dict(os.environ)
    full.update({"EBBTIDE_LIBCUDA": str(FAKE), "EBT_FAKE_DEVICE_BYTES": str(64 << 20)})
    full.pop("LD_PRELOAD", None)
    full.update(env or {})
    runner.run(HERE / spec.PROGRAM[scenario], scenario, *args, env=full, timeout=120, what=f"{scenario} {args}")


def test_every_scenario_is_run():
    # A scenario defined in a program but named by no test would never run.
    run_by_tests = (set(spec.SIMPLE) | set(spec.COALESCE) | set(spec.RECLAIM) | set(spec.OWN_TESTS)
                    | set(spec.TRANSIENT) | set(spec.DISK))
    assert set(spec.PROGRAM) == run_by_tests, (set(spec.PROGRAM) ^ run_by_tests)


# Coalescing is on by default; EBBTIDE_MEM_COALESCE=0 is the per-allocation path (every mapping its own).
COALESCE_OFF = {"EBBTIDE_MEM_COALESCE": "0"}


@pytest.mark.parametrize("scenario", spec.SIMPLE)
def test_scenario(scenario):
    # Scenarios that count one driver call per allocation run with coalescing off only.
    run(scenario, env=COALESCE_OFF if scenario in spec.PER_ALLOCATION_COUNTS else None)


@pytest.mark.parametrize("scenario", spec.COALESCED_SIMPLE)
def test_scenario_per_allocation(scenario):
    run(scenario, env=COALESCE_OFF)


def test_poison_discarded_pages():
    run("va_stability_and_roundtrip", env={"EBBTIDE_MEM_POISON": "1"})


@pytest.mark.parametrize("value", ["1", "on"])
def test_check_setting(value):
    run("check_setting", "on", env={"EBBTIDE_MEM_CHECK": value})


@pytest.mark.parametrize("value", ["2", "maybe"])
def test_a_bad_check_setting_fails_at_import(value):
    # parsed strictly, and where the component is imported: before anything could be allocated or paused
    from ebbtide.testing import spawn  # noqa: PLC0415

    p = spawn.python("import ebbtide.memory", extra_env={"EBBTIDE_MEM_CHECK": value}, timeout=60, check=False)
    last = (p.stderr.strip().splitlines() or [""])[-1]
    assert p.returncode != 0 and last.startswith(f"ebbtide.errors.SettingError: EBBTIDE_MEM_CHECK='{value}' "), last


def test_chunked_copies_exact_host_sizes():
    run("host_arena_exact_and_chunked", env={"EBBTIDE_MEM_CHUNK_BYTES": str(1 << 20)})


@pytest.mark.parametrize("op,fault", [(op, f) for op, fs in spec.FAULTS.items() for f in fs])
def test_fault_injection_rolls_back(op, fault):
    # Background pinning off: the pause itself must meet the injected registration failure. The nth-call specs
    # count per-allocation calls (the coalesced ones: test_coalesce_fault_injection_rolls_back).
    run("fault_injection", op, fault, env={"EBBTIDE_MEM_PREPIN": "0", **COALESCE_OFF})


def test_unmap_runs_close_at_copy_bytes():
    run("unmap_runs_and_handle_release", env={"EBBTIDE_MEM_UNMAP_RUN_BYTES": str(4 << 20), **COALESCE_OFF})


@pytest.mark.parametrize("op,fault", [("resume", f) for f in spec.FAULTS["resume"]])
def test_fault_injection_create_ahead(op, fault):
    # Creates on the helper thread (EBBTIDE_MEM_CREATE_AHEAD=1: every resume): same rollback guarantees.
    run("fault_injection", op, fault,
        env={"EBBTIDE_MEM_PREPIN": "0", "EBBTIDE_MEM_CREATE_AHEAD": "1", **COALESCE_OFF})


@pytest.mark.parametrize("scenario", ["unmap_runs_and_handle_release", "oom_at_resume", "multi_device", "soak"])
def test_create_ahead(scenario):
    run(scenario, env={"EBBTIDE_MEM_CREATE_AHEAD": "1", "EBT_FAKE_DEVICES": "2", **COALESCE_OFF})


@pytest.mark.parametrize("coalesce", ["default", "0"])
def test_multi_device(coalesce):
    run("multi_device", env={"EBT_FAKE_DEVICES": "2", **(COALESCE_OFF if coalesce == "0" else {})})


@pytest.mark.parametrize("coalesce", ["default", "0"])
def test_soak_100_cycles_no_leaks(coalesce):
    run("soak", "100", env=COALESCE_OFF if coalesce == "0" else None)


@pytest.mark.parametrize("scenario", spec.COALESCE)
def test_coalesce(scenario):
    run(scenario)


def test_coalesce_explicit_on():
    # EBBTIDE_MEM_COALESCE=1 is still accepted (the same as the default).
    run("coalesce_runs_and_zombies", env={"EBBTIDE_MEM_COALESCE": "1"})


@pytest.mark.parametrize("op,fault", [(op, f) for op, fs in spec.COALESCE_FAULTS.items() for f in fs])
def test_coalesce_fault_injection_rolls_back(op, fault):
    run("coalesce_fault_injection", op, fault,
        env={"EBBTIDE_MEM_COALESCE_MAX_BYTES": str(8 << 20), "EBBTIDE_MEM_PREPIN": "0"})


def test_coalesce_poison():
    run("va_stability_and_roundtrip", env={"EBBTIDE_MEM_POISON": "1"})


@pytest.mark.parametrize("scenario", spec.RECLAIM)
def test_reclaim(scenario):
    run(scenario, env={"EBBTIDE_MEM_PREPIN": "0"})


@pytest.mark.parametrize("fault", spec.RECLAIM_FAULTS)
def test_reclaim_fault_injection_rolls_back(fault):
    run("reclaim_fault_injection", fault, env={"EBBTIDE_MEM_PREPIN": "0"})


@pytest.mark.parametrize("fault", spec.RECLAIM_DEVICE_FAULTS)
def test_reclaim_on_device(fault):
    run("reclaim_on_device", fault, env={"EBBTIDE_MEM_PREPIN": "0"})


@pytest.mark.parametrize("args", [("coalesce_runs_and_zombies",),
                                  ("coalesce_fault_injection", "resume", "cuMemCreate:2"),
                                  ("coalesce_fault_injection", "resume", "cuMemMap:2")])
def test_coalesce_create_ahead(args):
    # Creates of the coalesced runs on the helper thread: same mappings, same rollback.
    env = {"EBBTIDE_MEM_CREATE_AHEAD": "1", "EBBTIDE_MEM_PREPIN": "0"}
    if args[0] == "coalesce_fault_injection":
        env["EBBTIDE_MEM_COALESCE_MAX_BYTES"] = str(8 << 20)
    run(*args, env=env)
