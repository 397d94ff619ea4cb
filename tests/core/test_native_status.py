"""The status contract of csrc/status.h: every failing status carries its own message, a successful call leaves the
last message as it was, and a driver failure ignored on purpose (EBT_CU_IGNORE) is logged with its reason and
changes neither the outcome nor the last message."""
from __future__ import annotations

import pytest

from ebbtide import _native
from ebbtide.errors import InvalidArgumentError
from ebbtide.testing import spawn

C = _native.load()
FAKE = _native.PACKAGE_DIR / "libebbtide_fake_cuda.so"


def test_the_logger_calls_record_their_own_message():
    # Without a message of their own, the Python error would show whatever failed last on this thread.
    with pytest.raises(InvalidArgumentError, match=r"level 9 is not in \[0, 3\]"):
        C.log_configure(9, 0xffffffff)
    assert "level 9" in C.last_error()
    level, mask = C.log_get()  # a success: the message stays for whoever reads it after the failure
    C.log_configure(level, mask)
    assert "level 9" in C.last_error()


@pytest.mark.skipif(not FAKE.exists(), reason=f"{FAKE.name} not built (EBBTIDE_TEST_FAKES=OFF)")
def test_an_ignored_driver_failure_is_logged_with_its_reason(tmp_path):
    log = tmp_path / "native.log"
    spawn.python("""
        import ctypes, os
        import ebbtide.memory as em
        from ebbtide import _native
        C = _native.load()
        fake = ctypes.CDLL(os.environ["EBBTIDE_LIBCUDA"])
        rt = ctypes.CDLL(_native.runtime_library_path())
        rt.ebt_torch_malloc.restype = ctypes.c_void_p
        rt.ebt_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        with em.region("t", "none"):
            p = rt.ebt_torch_malloc(1 << 20, 0, None)
        assert p, C.last_error()
        try:
            C.log_configure(9, 0xffffffff)
        except Exception:
            pass
        before = C.last_error()
        assert "level 9" in before, before
        fake.ebt_fake_set_fault(b"cuMemGetInfo", 1, 1)  # the pause's first probe, a report figure only
        em.pause("t")
        assert C.last_error() == before, C.last_error()
        em.resume("t")
        assert C.memory.free(p)
        print("OK")
    """, extra_env={"EBBTIDE_LIBCUDA": str(FAKE), "EBT_FAKE_DEVICE_BYTES": str(64 << 20), "EBBTIDE_DEBUG": "INFO",
                    "EBBTIDE_DEBUG_FILE": str(log), "LD_PRELOAD": ""})
    lines = [x for x in log.read_text().splitlines() if "ignored:" in x]
    assert len(lines) == 1, lines
    assert "cuMemGetInfo" in lines[0] and "CUDA_ERROR_INVALID_VALUE" in lines[0], lines
    assert "a report figure only" in lines[0] and "engine_pause.cc" in lines[0], lines
