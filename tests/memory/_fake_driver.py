"""What the fake-driver scenario programs (fake_*.py) share: the fake's controls and counters, the engine's
entry points, allocation through the torch-mode path, content helpers, and the end-of-scenario leak check.

Loaded only inside a scenario process: EBBTIDE_LIBCUDA points at the host-memory fake driver
(libebbtide_fake_cuda.so), whose device memory is host memory, so content is read and written with ctypes while
mapped. Every scenario ends with no leaked handle, mapping or host block (``assert_clean``).
"""
from __future__ import annotations

import ctypes
import os

import ebbtide.memory as em
from ebbtide import _native

MiB = 1 << 20
FAKE = ctypes.CDLL(os.environ["EBBTIDE_LIBCUDA"])
FAKE.ebt_fake_calls.restype = ctypes.c_long
FAKE.ebt_fake_call_threads.restype = ctypes.c_long
FAKE.ebt_fake_trace.restype = ctypes.c_size_t
NATIVE = _native.load().memory
RUNTIME = ctypes.CDLL(_native.runtime_library_path())
RUNTIME.ebt_torch_malloc.restype = ctypes.c_void_p
RUNTIME.ebt_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
RUNTIME.ebt_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]

CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2


def counters() -> dict:
    a = (ctypes.c_longlong * 8)()
    FAKE.ebt_fake_counters(a)
    keys = ["handles", "phys", "mappings", "reservations", "reserved", "registered", "registrations", "unpinned"]
    return dict(zip(keys, a))


def fault(name: str, nth: int = 1, err: int = CUDA_ERROR_INVALID_VALUE) -> None:
    FAKE.ebt_fake_set_fault(name.encode(), nth, err)


def trace(clear: bool = True) -> list:
    buf = ctypes.create_string_buffer(1 << 16)
    FAKE.ebt_fake_trace(buf, len(buf), 1 if clear else 0)
    return buf.value.decode().split(",") if buf.value else []


def alloc(size: int, tag: str, backup: str = "none") -> int:
    """An allocation through the pluggable-allocator entry point inside a region (the torch-mode path)."""
    with em.region(tag, backup):
        p = RUNTIME.ebt_torch_malloc(size, 0, None)
    assert p, f"ebt_torch_malloc({size}) failed: {_native.load().last_error()}"
    return p


def free(p: int) -> None:
    assert NATIVE.free(p), hex(p)


def fill(p: int, size: int, seed: int) -> bytes:
    data = bytes((seed + i * 7) & 0xFF for i in range(256)) * (size // 256) + bytes(size % 256)
    ctypes.memmove(p, data, size)
    return data


def read(p: int, size: int) -> bytes:
    return ctypes.string_at(p, size)


def expect_failure(fn, exc, *fragments: str) -> BaseException:
    """fn() must raise `exc` with every fragment in its message (a refusal that let the call through is the bug);
    returns the exception."""
    try:
        fn()
    except exc as e:
        missing = [f for f in fragments if f not in str(e)]
        assert not missing, f"{type(e).__name__} lacks {missing}: {e}"
        return e
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {exc.__name__}")


def tag_row(tag: str) -> dict:
    rows = [r for r in em.stats()["tags"] if r["tag"] == tag]
    assert rows, tag
    return rows[0]


DELIBERATE_SUBRANGE_UNMAPS = 0  # sub-range unmaps a scenario made itself (to check that the fake refuses them)


def assert_clean() -> None:
    """After freeing everything: no handle, mapping or host block left; arena releasable to zero; the engine never
    tried to unmap or grant access to part of a mapping."""
    assert FAKE.ebt_fake_calls(b"cuMemUnmap:subrange") == DELIBERATE_SUBRANGE_UNMAPS
    assert FAKE.ebt_fake_calls(b"cuMemSetAccess:subrange") == 0
    em.wait_background_pinning()
    c = counters()
    assert c["handles"] == 0 and c["mappings"] == 0 and c["phys"] == 0, c
    g = em.stats()["global"]
    assert g["host_used"] == g["disk_staging"], g  # the disk tier's staging is kept between ops (released below)
    em.release_host_memory()
    c = counters()
    assert c["registered"] == 0 and c["registrations"] == 0, c
    assert c["unpinned"] == 0, f"copies from unregistered host memory: {c}"
    NATIVE.reset_for_testing()
    c = counters()
    assert c["reservations"] == 0, c

