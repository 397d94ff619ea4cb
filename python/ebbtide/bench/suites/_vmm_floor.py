"""The floor of any allocator that maps its own physical memory: the CUDA driver's virtual-memory calls alone.

An allocation that can be paused at a stable address (ebbtide's engine, torch_memory_saver) is its own physical
allocation mapped at a reserved VA: ``cuMemCreate`` + ``cuMemMap`` + ``cuMemSetAccess`` (+ ``cuMemRelease`` of the
handle, which the mapping keeps alive). This times exactly that sequence through ctypes on ``libcuda`` in the
current context, on a VA reserved once, so the steady suite's allocation rows can show how much of the engine's
per-call time is the driver's and how much is the engine's own. Freed with ``cuMemUnmap`` (untimed).
"""
from __future__ import annotations

import ctypes
import statistics
import time

__all__ = ["vmm_floor_us", "torch_segment_bytes"]

_MiB = 1 << 20


def torch_segment_bytes(size: int) -> int:
    """The segment PyTorch's CUDA caching allocator asks the allocator below it for, for a ``size``-byte request
    with nothing cached: 2 MiB for requests up to 1 MiB (small pool), 20 MiB below 10 MiB, else rounded up to
    2 MiB."""
    if size <= _MiB:
        return 2 * _MiB
    if size < 10 * _MiB:
        return 20 * _MiB
    return -(-size // (2 * _MiB)) * 2 * _MiB

_PINNED, _LOC_DEVICE, _RW, _GRAN_MIN = 1, 1, 3, 0


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _Access(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


def _check(r: int, what: str) -> None:
    if r != 0:
        raise RuntimeError(f"{what} failed with CUresult {r}")


def vmm_floor_us(sizes, reps: int = 9) -> dict:
    """{size: {"total_us", "create_us", "map_us", "access_us", "release_us"}} (medians of ``reps``) on the
    current device of the current (already initialised) CUDA context."""
    cu = ctypes.CDLL("libcuda.so.1")
    dev = ctypes.c_int()
    _check(cu.cuCtxGetDevice(ctypes.byref(dev)), "cuCtxGetDevice")
    prop = _Prop()
    prop.type, prop.location.type, prop.location.id = _PINNED, _LOC_DEVICE, dev.value
    gran = ctypes.c_size_t()
    _check(cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), _GRAN_MIN), "granularity")
    access = _Access(_Location(_LOC_DEVICE, dev.value), _RW)
    aligned = {s: -(-s // gran.value) * gran.value for s in sizes}
    span = max(aligned.values())
    va = ctypes.c_uint64()
    _check(cu.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(span), ctypes.c_size_t(gran.value),
                                  ctypes.c_uint64(0), ctypes.c_uint64(0)), "cuMemAddressReserve")
    out = {}
    try:
        for size in sizes:
            n = ctypes.c_size_t(aligned[size])
            steps = {"create_us": [], "map_us": [], "access_us": [], "release_us": [], "total_us": []}
            for _ in range(reps):
                h = ctypes.c_uint64()
                t0 = time.perf_counter()
                _check(cu.cuMemCreate(ctypes.byref(h), n, ctypes.byref(prop), ctypes.c_uint64(0)), "cuMemCreate")
                t1 = time.perf_counter()
                _check(cu.cuMemMap(va, n, ctypes.c_size_t(0), h, ctypes.c_uint64(0)), "cuMemMap")
                t2 = time.perf_counter()
                _check(cu.cuMemSetAccess(va, n, ctypes.byref(access), ctypes.c_size_t(1)), "cuMemSetAccess")
                t3 = time.perf_counter()
                _check(cu.cuMemRelease(h), "cuMemRelease")
                t4 = time.perf_counter()
                _check(cu.cuMemUnmap(va, n), "cuMemUnmap")
                for k, v in (("create_us", t1 - t0), ("map_us", t2 - t1), ("access_us", t3 - t2),
                             ("release_us", t4 - t3), ("total_us", t4 - t0)):
                    steps[k].append(v * 1e6)
            out[size] = {k: statistics.median(v) for k, v in steps.items()}
    finally:
        cu.cuMemAddressFree(va, ctypes.c_size_t(span))
    return out
