"""torch_memory_saver's C functions (tms_*) exported by libebbtide.so: the names its Python wrapper and its own suite
call, reachable in a preloaded process's global scope (ctypes.CDLL(None)), with its argument conventions; and the
per-thread configuration they show, against the host-memory fake driver."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ebbtide import _native
from ebbtide.testing import spawn


HERE = Path(__file__).resolve().parent
PKG = _native.PACKAGE_DIR
FAKE_DRIVER = PKG / "libebbtide_fake_cuda.so"
FAKE_CUDART = PKG / "libebbtide_fake_cudart.so"
CC = shutil.which("cc") or shutil.which("gcc")

# What torch_memory_saver 0.0.10's binary wrapper binds (its _setup_function_signatures), minus the XPU-only names
# and set_memory_margin_bytes (ebbtide's margin is ebt_mem_set_memory_margin; the compat module calls that).
TMS_NAMES = ["tms_set_current_tag", "tms_get_current_tag", "tms_set_interesting_region", "tms_get_interesting_region",
             "tms_set_enable_cpu_backup", "tms_get_enable_cpu_backup", "tms_set_cpu_backup_backend",
             "tms_get_cpu_backup_backend", "tms_set_enable_disk_backup", "tms_get_enable_disk_backup",
             "tms_set_disk_backup_dir", "tms_pause", "tms_resume", "tms_set_retain_cpu_backup",
             "tms_get_retain_cpu_backup", "tms_get_cpu_backup_pointer"]


def test_every_name_is_exported():
    lib = ctypes.CDLL(str(PKG / "libebbtide.so"))
    missing = [n for n in TMS_NAMES if not hasattr(lib, n)]
    assert not missing, missing


@pytest.mark.skipif(not (FAKE_DRIVER.exists() and FAKE_CUDART.exists()), reason="test fakes not built")
@pytest.mark.skipif(CC is None, reason="no C compiler to build the test program")
@pytest.mark.parametrize("backup", ["none", "cpu"])
def test_suite_calling_convention_under_preload(tmp_path, backup):
    prog = tmp_path / "tms_abi_prog"
    subprocess.run([CC, "-O1", "-o", str(prog), str(HERE / "tms_abi_prog.c"), str(FAKE_CUDART), "-ldl",
                    f"-Wl,-rpath,{PKG}"], check=True, capture_output=True, text=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TMS_", "EBBTIDE_MEM_"))}
    env.update({"LD_PRELOAD": str(PKG / "libebbtide.so"), "EBBTIDE_LIBCUDA": str(FAKE_DRIVER), "TMS_INIT_ENABLE": "1",
                "TMS_INIT_ENABLE_CPU_BACKUP": "1" if backup == "cpu" else "0"})
    p = spawn.command([prog, backup], env=env, timeout=60, check=False)
    assert p.returncode == 0 and p.stdout.strip() == "OK", p.stdout + p.stderr


@pytest.mark.skipif(not FAKE_DRIVER.exists(), reason="fake driver not built")
def test_configuration_view_and_setters():
    """The getters show this thread's routing: a region (nested, restored), the thread's own configuration set
    through the setters, the process default; a bad backend name changes nothing."""
    spawn.python("""
        import ctypes
        import ebbtide.memory as em
        from ebbtide import _native
        from ebbtide.compat.torch_memory_saver import torch_memory_saver as t
        N = _native.load().memory
        t._ensure_initialized()
        c = t._impl._binary_wrapper.cdll
        assert (c.tms_get_interesting_region(), c.tms_get_current_tag(), c.tms_get_enable_cpu_backup(),
                c.tms_get_cpu_backup_backend(), c.tms_get_enable_disk_backup()) == (False, b"default", False,
                                                                                  b"pinned", False)
        with t.region("w", enable_cpu_backup=True):
            assert c.tms_get_interesting_region() and c.tms_get_current_tag() == b"w" and c.tms_get_enable_cpu_backup()
            assert N.current_region()[1] == N.BACKUP_CPU | N.HOST_TRANSIENT
            with t.region("g"):
                assert c.tms_get_current_tag() == b"g" and not c.tms_get_enable_cpu_backup()
                assert c.tms_get_cpu_backup_backend() == b"pinned"
            with t.region("m", enable_cpu_backup=True, cpu_backup_backend="mmap"):
                assert c.tms_get_cpu_backup_backend() == b"mmap"
                assert N.current_region()[1] == N.BACKUP_CPU | N.HOST_TRANSIENT | N.HOST_PAGEABLE
                with t.region("inner"):  # a region without a CPU copy keeps the backend it finds
                    assert c.tms_get_cpu_backup_backend() == b"mmap"
            with t._impl._with_region_config(tag="x", enable_cpu_backup=True, cpu_backup_backend="mmap"):
                assert c.tms_get_current_tag() == b"x" and c.tms_get_cpu_backup_backend() == b"mmap"
            assert c.tms_get_current_tag() == b"w" and c.tms_get_cpu_backup_backend() == b"pinned"
            c.tms_set_interesting_region(False)
            assert not c.tms_get_interesting_region() and N.current_region()[2] == 1
            c.tms_set_interesting_region(True)
            assert c.tms_get_interesting_region()
            c.tms_set_cpu_backup_backend(b"rdma")  # refused with a warning: unchanged
            assert c.tms_get_cpu_backup_backend() == b"pinned"
        with t.region("d", enable_disk_backup=True):
            assert c.tms_get_enable_disk_backup() and not c.tms_get_enable_cpu_backup()
        # no region: the setters make this thread's own configuration, as torch_memory_saver's TLS config does
        t._impl._binary_wrapper.set_config(tag="own", interesting_region=True, enable_cpu_backup=True,
                                           cpu_backup_backend="mmap")
        assert c.tms_get_interesting_region() and c.tms_get_current_tag() == b"own"
        assert N.current_region()[:2] == ("own", N.BACKUP_CPU | N.HOST_TRANSIENT | N.HOST_PAGEABLE)
        c.tms_set_interesting_region(False)
        assert N.current_region()[0] == "own" and not c.tms_get_interesting_region()
        assert c.tms_pause(b"own") == 0 and c.tms_resume(b"own") == 0 and c.tms_pause(b"never") == 0
        assert c.tms_get_retain_cpu_backup() is False
        t.retain_cpu_backup = True
        assert c.tms_get_retain_cpu_backup() is True and em.host_retention()
    """, extra_env={"EBBTIDE_LIBCUDA": str(FAKE_DRIVER)})
