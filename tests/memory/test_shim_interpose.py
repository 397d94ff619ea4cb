"""The LD_PRELOAD interposers against a fake libcudart: a small C program (tests/memory/shim_prog.c) linked
against libebbtide_fake_cudart.so runs with LD_PRELOAD=libebbtide.so and the fake driver; calls outside a region
must reach the fake runtime, calls inside must reach the engine, a forked child must forward everything."""
from __future__ import annotations

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

pytestmark = [
    pytest.mark.skipif(not (FAKE_DRIVER.exists() and FAKE_CUDART.exists()), reason="test fakes not built"),
    pytest.mark.skipif(CC is None, reason="no C compiler to build the test program"),
]


@pytest.fixture(scope="module")
def prog(tmp_path_factory):
    out = tmp_path_factory.mktemp("shim") / "shim_prog"
    subprocess.run([CC, "-O1", "-o", str(out), str(HERE / "shim_prog.c"), str(FAKE_CUDART), "-ldl",
                    f"-Wl,-rpath,{PKG}"], check=True, capture_output=True, text=True)
    return out


def run(prog, **extra):
    env = dict(os.environ)
    env.update({"LD_PRELOAD": str(PKG / "libebbtide.so"), "EBBTIDE_LIBCUDA": str(FAKE_DRIVER), **extra})
    return spawn.command([prog], env=env, timeout=60, check=False)


def test_interposition(prog):
    p = run(prog)
    assert p.returncode == 0 and p.stdout.strip() == "OK", p.stdout + p.stderr


def test_program_fails_without_the_shim(prog):
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    p = spawn.command([prog], env=env, timeout=60, check=False)
    assert p.returncode != 0 and "is libebbtide.so preloaded" in p.stderr  # the check can fail


def test_default_tag_from_environment(prog, tmp_path):
    """EBBTIDE_MEM_DEFAULT_TAG captures allocations made outside any region: the first cudaMalloc is no longer
    forwarded, so the program's own first check (forwarded count == 1) fails."""
    p = run(prog, EBBTIDE_MEM_DEFAULT_TAG="everything")
    assert p.returncode == 1 and "m == 1" in p.stderr, p.stdout + p.stderr


def test_one_engine_per_process_under_preload():
    """Preloaded into Python, the interposer and the Python API reach the same engine: a cudaMalloc resolved
    through the process's global scope inside a region is visible to _C.memory, and pausable from it."""
    code = r"""
import ctypes
import ebbtide.memory as em
from ebbtide import _native
assert em.hook_mode() == "preload", em.hook_mode()
libc_scope = ctypes.CDLL(None)  # global scope: the preloaded interposer comes first
p = ctypes.c_void_p()
with em.region("w", "cpu"):
    assert libc_scope.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(3 << 20)) == 0
ctypes.memset(p.value, 0x3C, 3 << 20)
base, size, tag, paused = _native.load().memory.lookup(p.value)
assert (base, size, tag, paused) == (p.value, 3 << 20, "w", False)
em.pause("w")
assert _native.load().memory.lookup(p.value)[3]
em.resume("w")
assert ctypes.string_at(p.value, 8) == b"\x3c" * 8
assert libc_scope.cudaFree(p) == 0
assert em.stats()["global"]["live_allocations"] == 0
print("OK")
"""
    env = dict(os.environ)
    env.update({"LD_PRELOAD": str(PKG / "libebbtide.so"), "EBBTIDE_LIBCUDA": str(FAKE_DRIVER)})
    p = spawn.python(code, env=env, timeout=60, check=False)
    assert p.returncode == 0 and p.stdout.strip() == "OK", p.stdout + p.stderr


@pytest.mark.parametrize("preloaded", [False, True])
def test_hook_mode_detection_with_a_global_cuda_runtime(preloaded):
    """torch's CUDA build puts libcudart in the global scope before ebbtide loads: without a preload the mode must
    still read "torch". Comparing dlsym(RTLD_DEFAULT) with &cudaMalloc cannot tell: both name libcudart's
    definition there, which would read as "preload"."""
    code = f"""
import ctypes, os
ctypes.CDLL({str(FAKE_CUDART)!r}, mode=os.RTLD_NOW | os.RTLD_GLOBAL)   # what importing torch does
from ebbtide import _native
print(_native.load().memory.shim_active())
"""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env["EBBTIDE_LIBCUDA"] = str(FAKE_DRIVER)
    if preloaded:
        env["LD_PRELOAD"] = str(PKG / "libebbtide.so")
    p = spawn.python(code, env=env, timeout=60, check=False)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == str(preloaded)


@pytest.fixture(scope="module")
def process_wide_prog(tmp_path_factory):
    out = tmp_path_factory.mktemp("shim") / "process_wide_prog"
    subprocess.run([CC, "-O1", "-o", str(out), str(HERE / "process_wide_prog.c"), str(FAKE_CUDART), "-ldl",
                    f"-Wl,-rpath,{PKG}"], check=True, capture_output=True, text=True)
    return out


def _run_args(prog, args, **extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("EBBTIDE_MEM_", "TMS_", "PYTORCH_CUDA_ALLOC", "PYTORCH_ALLOC"))}
    env.update({"LD_PRELOAD": str(PKG / "libebbtide.so"), "EBBTIDE_LIBCUDA": str(FAKE_DRIVER), **extra})
    return spawn.command([prog, *args], env=env, timeout=60, check=False)


def test_process_wide_mode_pause_resume_through_the_c_api(process_wide_prog):
    p = _run_args(process_wide_prog, ["trainer"], EBBTIDE_MEM_DEFAULT_TAG="trainer", EBBTIDE_MEM_DEFAULT_BACKUP="cpu")
    assert p.returncode == 0 and p.stdout.strip() == "OK", p.stdout + p.stderr


def test_process_wide_mode_from_torch_memory_saver_environment(process_wide_prog):
    """A launcher written for torch_memory_saver (TMS_INIT_ENABLE=1, TMS_INIT_ENABLE_CPU_BACKUP=1) gets tag
    "default" with CPU backup."""
    p = _run_args(process_wide_prog, ["default"], TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1")
    assert p.returncode == 0 and p.stdout.strip() == "OK", p.stdout + p.stderr


def test_process_wide_mode_without_backup_loses_content(process_wide_prog):
    """The content check can fail: without CPU backup the resumed memory is fresh."""
    p = _run_args(process_wide_prog, ["default"], TMS_INIT_ENABLE="1", EBBTIDE_MEM_POISON="1")
    assert p.returncode == 1 and "bufs[i][k] ==" in p.stderr, p.stdout + p.stderr


@pytest.mark.parametrize("conf_var", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_process_wide_mode_refused_with_expandable_segments(process_wide_prog, conf_var):
    p = _run_args(process_wide_prog, ["trainer"], EBBTIDE_MEM_DEFAULT_TAG="trainer",
                  **{conf_var: "expandable_segments:True"})
    assert p.returncode == 1 and "expandable" in p.stderr, p.stdout + p.stderr
