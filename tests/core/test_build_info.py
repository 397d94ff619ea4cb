"""`ebbtide info` and the build tell the truth about this machine."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ebbtide
from ebbtide import _native
from ebbtide.testing import spawn

C = _native.load()


def test_versions_agree():
    code = sum(int(x) * m for x, m in zip(ebbtide.__version__.split("."), (10000, 100, 1)))
    assert C.runtime_version() == code == C.EXTENSION_VERSION_CODE
    assert C.build_info()["version"] == ebbtide.__version__


def test_runtime_library_is_installed_beside_the_extension():
    path = Path(_native.runtime_library_path())
    assert path.name == "libebbtide.so" and path.exists()
    out = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True)
    if out.returncode == 0:  # binutils present: the export list is exactly the C API + interposers + tms_*
        names = {line.split()[-1] for line in out.stdout.splitlines() if line.strip()}
        assert {"cudaMalloc", "cudaFree", "ebt_status_string", "ebt_driver_get", "tms_pause"} <= names
        assert all(n.startswith(("ebt_", "tms_")) or n in ("cudaMalloc", "cudaFree") for n in names), names


@pytest.mark.skipif(shutil.which("nvcc") is None and not os.path.exists("/usr/local/cuda/bin/nvcc"),
                    reason="no nvcc on this machine: the CPU-only build is expected")
def test_cuda_sources_were_compiled_where_nvcc_exists():
    info = C.build_info()
    assert info["cuda"] is True
    assert "90-real" in info["cuda_archs"] and "90-virtual" in info["cuda_archs"]


def test_cpu_features_match_proc_cpuinfo():
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    if not flags:
        pytest.skip("no x86 flags line in /proc/cpuinfo")
    feats = C.cpu_features()
    assert feats["avx2"] == ("avx2" in flags)
    assert feats["avx512f"] == ("avx512f" in flags)
    assert feats["avx512_bf16"] == ("avx512_bf16" in flags)
    assert C.cpu_affinity_count() == len(os.sched_getaffinity(0))


def test_cpu_isa_can_be_lowered_but_not_raised():
    best = C.cpu_isa()
    p = spawn.python("import ebbtide._native as n; print(n.load().cpu_isa())", extra_env={"EBBTIDE_CPU_ISA": "scalar"})
    assert p.stdout.strip() == "scalar"
    p = spawn.python("import ebbtide._native as n; print(n.load().cpu_isa())", extra_env={"EBBTIDE_CPU_ISA": "SCALAR"})
    assert p.stdout.strip() == "scalar"  # any case
    if not C.cpu_features()["avx512f"]:
        p = spawn.python("import ebbtide._native as n; print(n.load().cpu_isa())",
                         extra_env={"EBBTIDE_CPU_ISA": "avx512"})
        assert p.stdout.strip() == best and "not supported" in p.stderr


def test_unknown_cpu_isa_is_a_setting_error_not_a_fallback():
    p = spawn.python("""
        import ebbtide._native as n
        from ebbtide.errors import SettingError
        try:
            n.load().cpu_isa()
        except SettingError as e:
            print(e.name, e.value)
            print(e)
    """, extra_env={"EBBTIDE_CPU_ISA": "avx-512"})
    first, message = p.stdout.splitlines()[:2]
    assert first == "EBBTIDE_CPU_ISA avx-512"
    assert "one of avx512_bf16, avx512, avx2, neon, scalar" in message


def test_driver_missing_is_reported_not_raised_at_import(tmp_path):
    p = spawn.python("""
        import ebbtide._native as n
        C = n.load()
        st, why = C.driver_status()
        print(st, C.device_count())
        print(why)
        try:
            C.driver_version()
        except Exception as e:
            print(type(e).__name__)
    """, extra_env={"EBBTIDE_LIBCUDA": str(tmp_path / "libcuda-missing.so")})
    status, count, why, exc = p.stdout.splitlines()[0].split()[0], p.stdout.split()[1], *p.stdout.splitlines()[1:3]
    assert status == "5" and count == "0"
    assert "libcuda-missing.so" in why
    assert exc == "DriverNotFoundError"


def test_driver_library_without_symbols_is_refused():
    p = spawn.python("import ebbtide._native as n; print(n.load().driver_status()[1])",
                     extra_env={"EBBTIDE_LIBCUDA": "libm.so.6"})
    assert "lacks the required symbol cuInit" in p.stdout


def test_info_command_is_truthful():
    p = subprocess.run([sys.executable, "-m", "ebbtide", "info", "--json"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert data["build"]["cuda"] == C.build_info()["cuda"]
    assert data["runtime_library"] == _native.runtime_library_path()
    has_driver = C.driver_status()[0] == 0
    assert data["driver"]["found"] == has_driver
    text = subprocess.run([sys.executable, "-m", "ebbtide", "info"], capture_output=True, text=True).stdout
    assert "CUDA kernels" in text and "CPU ISA" in text and "shim / runtime" in text
    if not has_driver:
        assert "CUDA driver      : not found" in text


def test_logging_levels_subsystems_file_and_python_sink(tmp_path):
    # An error at INFO level is logged with its subsystem; WARN (the default) stays quiet.
    code = "import ebbtide._native as n\ntry: n.load().host_triad_bandwidth(16, 1, 1)\nexcept Exception: pass"
    quiet = spawn.python(code)
    assert "ebbtide" not in quiet.stderr
    loud = spawn.python(code, extra_env={"EBBTIDE_DEBUG": "INFO"})
    assert "INFO" in loud.stderr and "bytes_per_array must be >= 4096" in loud.stderr
    log = tmp_path / "log-%p.txt"
    spawn.python(code, extra_env={"EBBTIDE_DEBUG": "INFO", "EBBTIDE_DEBUG_FILE": str(log)})
    files = list(tmp_path.glob("log-*.txt"))
    assert len(files) == 1 and "bytes_per_array" in files[0].read_text()
    for spec, mask in (("COMM", 1 << 3), ("mem,shim", (1 << 1) | (1 << 2)), ("^COMM", 0xffffffff & ~(1 << 3))):
        p = spawn.python("import ebbtide._native as n; print(*n.load().log_get())",
                         extra_env={"EBBTIDE_DEBUG": "TRACE", "EBBTIDE_DEBUG_SUBSYS": spec})
        assert p.stdout.split() == ["3", str(mask)], spec
    p = spawn.python("""
        import ebbtide._native as n
        C = n.load()
        lines = []
        C.set_log_sink(lambda level, subsys, line: lines.append((level, line)))
        C.log_configure(2, 0xffffffff)
        try: C.host_triad_bandwidth(16, 1, 1)
        except Exception: pass
        C.set_log_sink(None)
        print(len(lines), lines[0][0], "bytes_per_array" in lines[0][1])
    """)
    count, level, found = p.stdout.split()
    assert int(count) >= 1 and level == "2" and found == "True"


def test_shim_without_a_cuda_runtime_returns_an_error_not_a_crash():
    p = spawn.python("""
        import ctypes, ebbtide._native as n
        lib = ctypes.CDLL(n.runtime_library_path())
        ptr = ctypes.c_void_p()
        print(lib.cudaMalloc(ctypes.byref(ptr), 16), lib.cudaFree(None))
    """)
    assert p.stdout.split() == ["3", "3"]


def test_host_triad_probe_reports_plausible_bandwidth():
    bw = C.host_triad_bandwidth(16 << 20, 0, 2)
    assert 1e8 < bw < 5e12  # between 0.1 GB/s and 5 TB/s: a real measurement, not a constant
