"""The native settings helper (csrc/param.h) as the logger and the driver loader use it: strict values, the
debug file opened safely. Each case runs in its own interpreter (native settings are read once per process)."""
from __future__ import annotations

import os
import stat

import pytest

from ebbtide.testing import spawn

LOG_CODE = "import ebbtide._native as n\ntry: n.load().host_triad_bandwidth(16, 1, 1)\nexcept Exception: pass"


@pytest.mark.parametrize("var,value,accepted", [
    ("EBBTIDE_DEBUG", "VERBOSE", "one of NONE, WARN, INFO, TRACE (any case)"),
    ("EBBTIDE_DEBUG_SUBSYS", "MEM,NET", "a comma list of INIT, MEM, SHIM"),
    ("EBBTIDE_DEBUG_SUBSYS", ",", "a comma list of INIT, MEM, SHIM"),
])
def test_bad_logging_setting_is_reported_and_log_get_fails(var, value, accepted):
    """The logger cannot fail the calls that log: a bad value keeps that setting's default, is said on stderr
    once, and ebt_log_get (the logger's configuration query) raises SettingError naming it."""
    p = spawn.python("""
        import ebbtide._native as n
        from ebbtide.errors import SettingError
        C = n.load()
        try:
            C.log_get()
        except SettingError as e:
            print(e.name, e.value)
        else:
            print("no error")
        C.log_configure(1, 0xffffffff)   # an explicit configuration still works
    """, extra_env={var: value})
    assert p.stdout.split() == [var, value]
    assert p.stderr.count(f"{var}='{value}' is not a valid setting: expected {accepted}") == 1


def test_logging_level_any_case_and_subsystems_with_blanks():
    p = spawn.python("import ebbtide._native as n; print(*n.load().log_get())",
                     extra_env={"EBBTIDE_DEBUG": "trace", "EBBTIDE_DEBUG_SUBSYS": " mem , shim "})
    assert p.stdout.split() == ["3", str((1 << 1) | (1 << 2))]


def test_debug_file_is_private_and_appended(tmp_path):
    log = tmp_path / "ebt.log"
    spawn.python(LOG_CODE, extra_env={"EBBTIDE_DEBUG": "INFO", "EBBTIDE_DEBUG_FILE": str(log)})
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    first = log.read_text()
    assert "bytes_per_array" in first
    spawn.python(LOG_CODE, extra_env={"EBBTIDE_DEBUG": "INFO", "EBBTIDE_DEBUG_FILE": str(log)})
    assert log.read_text().startswith(first) and len(log.read_text()) > len(first)


def test_debug_file_never_follows_a_symlink(tmp_path):
    """A symbolic link planted at the debug file's path is refused (O_NOFOLLOW): its target is not written and
    the lines go to stderr with the reason."""
    target = tmp_path / "victim.txt"
    target.write_text("precious\n")
    link = tmp_path / "ebt.log"
    os.symlink(target, link)
    p = spawn.python(LOG_CODE, extra_env={"EBBTIDE_DEBUG": "INFO", "EBBTIDE_DEBUG_FILE": str(link)})
    assert target.read_text() == "precious\n"
    assert "is a symbolic link (refused)" in p.stderr and "bytes_per_array" in p.stderr


def test_debug_file_unwritable_falls_back_to_stderr_with_reason(tmp_path):
    p = spawn.python(LOG_CODE,
                     extra_env={"EBBTIDE_DEBUG": "INFO", "EBBTIDE_DEBUG_FILE": str(tmp_path / "no" / "dir.log")})
    assert "cannot open" in p.stderr and "bytes_per_array" in p.stderr


def test_libcuda_hook_failure_names_the_path():
    p = spawn.python("""
        from ebbtide import _native
        st, why = _native.load().driver_status()
        print(st)
        print(why)
    """, extra_env={"EBBTIDE_LIBCUDA": "/nonexistent/libcuda-test-hook.so"})
    st, why = p.stdout.splitlines()[:2]
    assert st == "5" and "/nonexistent/libcuda-test-hook.so" in why


def test_adam_engine_refuses_an_unknown_isa_instead_of_running_scalar():
    p = spawn.python("""
        import ebbtide._native as n
        from ebbtide.errors import SettingError
        O = n.load().optim
        try:
            O.AdamEngine(1, "")
        except SettingError as e:
            print(e.name, e.value)
        print(O.AdamEngine(1, "scalar").isa)   # naming a kernel explicitly does not read the setting
    """, extra_env={"EBBTIDE_CPU_ISA": "avx1024"})
    assert p.stdout.split() == ["EBBTIDE_CPU_ISA", "avx1024", "scalar"]
