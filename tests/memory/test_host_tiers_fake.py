"""Transient host copies (torch_memory_saver's CPU-backup semantics) and the disk tier, against the host-memory
fake driver: each scenario (fake_transient.py, fake_disk.py) in its own interpreter, the disk ones with a real
directory on disk."""
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


def run(scenario: str, *args: str, env: dict | None = None):
    full = runner.clean_env()
    full.update({"EBBTIDE_LIBCUDA": str(FAKE), "EBT_FAKE_DEVICE_BYTES": str(128 << 20)})
    full.update(env or {})
    return runner.run(HERE / spec.PROGRAM[scenario], scenario, *args, env=full, timeout=180,
                      what=f"{scenario} {args}")


@pytest.fixture
def disk_dir(tmp_path):
    """A directory on a real disk: pytest's tmp_path where that is not tmpfs, else one under the build tree."""
    d = tmp_path / "disk"
    with open("/proc/mounts") as f:
        tmpfs = [line.split()[1] for line in f if line.split()[2] in ("tmpfs", "ramfs")]
    if any(str(tmp_path).startswith(m.rstrip("/") + "/") for m in tmpfs if m != "/"):
        d = HERE.parent.parent / "build" / f"disk-test-{os.getpid()}-{tmp_path.name}"
    d.mkdir(parents=True)
    yield str(d)
    import shutil  # noqa: PLC0415

    shutil.rmtree(d, ignore_errors=True)


PIPELINE = {"EBBTIDE_MEM_SHADOW_PIECE_BYTES": str(2 << 20), "EBBTIDE_MEM_REGISTER_THREADS": "4"}


@pytest.mark.parametrize("scenario", [s for s in spec.TRANSIENT if s != "register_failure_rolls_back"])
def test_transient(scenario):
    run(scenario, env=PIPELINE if scenario == "pieces_pipelined_on_threads" else None)


@pytest.mark.parametrize("nth", ["1", "3", "5"])
def test_transient_register_failure(nth):
    # 2 MiB pieces: the 1st fails before any copy, the 3rd and 5th after copies of the first allocation landed.
    run("register_failure_rolls_back", nth, env=PIPELINE)


@pytest.mark.parametrize("coalesce", ["default", "0"])
def test_transient_coalescing(coalesce):
    run("roundtrip_gives_host_back", env={"EBBTIDE_MEM_COALESCE": "0"} if coalesce == "0" else None)


@pytest.mark.parametrize("scenario", [s for s in spec.DISK if s != "exit_while_paused"])
def test_disk(scenario, disk_dir):
    run(scenario, env={"EBT_TEST_DISK_DIR": disk_dir, "EBBTIDE_MEM_DISK_CHUNK_BYTES": str(1 << 20),
                       "EBBTIDE_MEM_DISK_THREADS": "3"})


def test_disk_default_chunk_and_tms_variables(disk_dir):
    # torch_memory_saver's names for the same settings: TMS_DISK_BACKUP_DIR, TMS_DISK_BACKUP_CHUNK_MB.
    run("roundtrip_and_files", env={"EBT_TEST_DISK_DIR": disk_dir, "TMS_DISK_BACKUP_DIR": disk_dir,
                                    "TMS_DISK_BACKUP_CHUNK_MB": "2"})


def test_disk_files_removed_at_exit(disk_dir):
    assert run("exit_while_paused", env={"EBT_TEST_DISK_DIR": disk_dir}) == {"paused": 2}
    assert os.listdir(disk_dir) == [], os.listdir(disk_dir)
