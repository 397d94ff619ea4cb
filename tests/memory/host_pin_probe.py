"""Ways to get, pin and give back host memory for a transient CPU copy, each measured on a GPU (not a test: a probe
for the H100/H200; memory/NOTES.md "Transient host copies" records its figures).

    python tests/memory/host_pin_probe.py [--gib 4] [--piece-mib 32] [--threads 1,4,8]

Prints one JSON line per measurement (GB/s of host bytes):
  hostalloc            cuMemHostAlloc + cuMemFreeHost in 64 MiB pieces (what torch_memory_saver's pinned default pays)
  touch+register       fresh mmap, touched by one thread, registered by one thread
  populate+register/T  fresh mmap (huge pages advised), MADV_POPULATE_WRITE + cuMemHostRegister per piece, T threads
  register-only/T      fresh mmap, cuMemHostRegister faulting the pages in itself, T threads
  release/T            cuMemHostUnregister + munmap per piece, T threads
  d2h-alone / d2h-while-registering   D2H into pinned memory, alone and while 8 threads register other fresh memory
  h2d-alone / h2d-while-releasing     H2D from pinned memory, alone and while 8 threads unregister and unmap other memory
  unregister-during-copy              one piece's unregister while a long H2D from another piece runs (ms): whether
                                      unregistering waits for copies in flight
"""
from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import threading
import time

MiB = 1 << 20
MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23
PORTABLE = 1

cu = ctypes.CDLL("libcuda.so.1")
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
cu.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
cu.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
cu.cuMemHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
cu.cuMemFreeHost.argtypes = [ctypes.c_void_p]
cu.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
cu.cuMemcpyDtoHAsync_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
cu.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
cu.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
cu.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]


def ok(r, what):
    if r != 0:
        raise RuntimeError(f"{what} failed: CUresult {r}")


ok(cu.cuInit(0), "cuInit")
DEV = ctypes.c_int()
ok(cu.cuDeviceGet(ctypes.byref(DEV), 0), "cuDeviceGet")
CTX = ctypes.c_void_p()
ok(cu.cuDevicePrimaryCtxRetain(ctypes.byref(CTX), DEV), "cuDevicePrimaryCtxRetain")
ok(cu.cuCtxSetCurrent(CTX), "cuCtxSetCurrent")


def fresh(n: int) -> int:
    p = libc.mmap(None, n + 2 * MiB, 3, 0x22 | 0x4000, -1, 0)  # RW, PRIVATE|ANONYMOUS|NORESERVE
    base = (p + 2 * MiB - 1) // (2 * MiB) * (2 * MiB)
    libc.madvise(base, n, MADV_HUGEPAGE)
    return base


def parallel(n_items: int, threads: int, fn) -> float:
    nxt = [0]
    lock = threading.Lock()

    def work():
        cu.cuCtxSetCurrent(CTX)
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= n_items:
                return
            fn(i)

    ts = [threading.Thread(target=work) for _ in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def emit(name, nbytes, secs, **kw):
    print(json.dumps({"what": name, "gbps": round(nbytes / secs / 1e9, 2), "seconds": round(secs, 4),
                      "bytes": nbytes, **kw}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=4)
    ap.add_argument("--piece-mib", type=int, default=32)
    ap.add_argument("--threads", default="1,4,8")
    a = ap.parse_args()
    n = int(a.gib * (1 << 30)) // (64 * MiB) * (64 * MiB)
    piece = a.piece_mib * MiB
    pieces = n // piece
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        print(json.dumps({"what": "thp", "setting": f.read().strip()}), flush=True)

    ptrs = []
    t0 = time.perf_counter()
    for _ in range(n // (64 * MiB)):
        p = ctypes.c_void_p()
        ok(cu.cuMemHostAlloc(ctypes.byref(p), 64 * MiB, 0), "cuMemHostAlloc")
        ptrs.append(p.value)
    t_alloc = time.perf_counter() - t0
    t0 = time.perf_counter()
    for p in ptrs:
        cu.cuMemFreeHost(p)
    emit("hostalloc", n, t_alloc, free_gbps=round(n / (time.perf_counter() - t0) / 1e9, 2))

    base = fresh(n)
    t0 = time.perf_counter()
    ctypes.memset(base, 0, n)
    t_touch = time.perf_counter() - t0
    t0 = time.perf_counter()
    for k in range(pieces):
        ok(cu.cuMemHostRegister_v2(base + k * piece, piece, PORTABLE), "register")
    emit("touch+register", n, t_touch + time.perf_counter() - t0, touch_s=round(t_touch, 4))
    for k in range(pieces):
        cu.cuMemHostUnregister(base + k * piece)
    libc.munmap(base, n)

    for threads in (int(x) for x in a.threads.split(",")):
        for name, populate in (("populate+register", True), ("register-only", False)):
            base = fresh(n)

            def prep(k, base=base, populate=populate):
                if populate:
                    libc.madvise(base + k * piece, piece, MADV_POPULATE_WRITE)
                ok(cu.cuMemHostRegister_v2(base + k * piece, piece, PORTABLE), "register")

            emit(f"{name}/{threads}", n, parallel(pieces, threads, prep), piece=piece)

            def release(k, base=base):
                cu.cuMemHostUnregister(base + k * piece)
                libc.munmap(base + k * piece, piece)

            emit(f"release/{threads}", n, parallel(pieces, threads, release), piece=piece)

    # Copies beside the host work (does pinning or giving back slow the copy engine, or wait for it?).
    dev = ctypes.c_uint64()
    ok(cu.cuMemAlloc_v2(ctypes.byref(dev), n), "cuMemAlloc")
    stream = ctypes.c_void_p()
    ok(cu.cuStreamCreate(ctypes.byref(stream), 1), "cuStreamCreate")
    pinned = fresh(n)
    prep_all = parallel(pieces, 8, lambda k: (libc.madvise(pinned + k * piece, piece, MADV_POPULATE_WRITE),
                                             ok(cu.cuMemHostRegister_v2(pinned + k * piece, piece, PORTABLE), "r")))

    def copies(d2h: bool) -> float:
        t0 = time.perf_counter()
        for k in range(pieces):
            if d2h:
                cu.cuMemcpyDtoHAsync_v2(pinned + k * piece, dev.value + k * piece, piece, stream)
            else:
                cu.cuMemcpyHtoDAsync_v2(dev.value + k * piece, pinned + k * piece, piece, stream)
        ok(cu.cuStreamSynchronize(stream), "sync")
        return time.perf_counter() - t0

    copies(True)
    emit("d2h-alone", n, copies(True), prep_s=round(prep_all, 4))
    other = fresh(n)
    bg = threading.Thread(target=parallel, args=(pieces, 8, lambda k: (
        libc.madvise(other + k * piece, piece, MADV_POPULATE_WRITE),
        cu.cuMemHostRegister_v2(other + k * piece, piece, PORTABLE))))
    bg.start()
    emit("d2h-while-registering", n, copies(True))
    bg.join()
    emit("h2d-alone", n, copies(False))
    bg = threading.Thread(target=parallel, args=(pieces, 8, lambda k: (
        cu.cuMemHostUnregister(other + k * piece), libc.munmap(other + k * piece, piece))))
    bg.start()
    emit("h2d-while-releasing", n, copies(False))
    bg.join()
    # One long H2D from the first half, then unregister a piece of the second half while it runs.
    half = pieces // 2
    t0 = time.perf_counter()
    cu.cuMemcpyHtoDAsync_v2(dev.value, pinned, half * piece, stream)
    t_issue = time.perf_counter()
    cu.cuMemHostUnregister(pinned + (pieces - 1) * piece)
    t_unreg = time.perf_counter()
    ok(cu.cuStreamSynchronize(stream), "sync")
    t_done = time.perf_counter()
    print(json.dumps({"what": "unregister-during-copy", "unregister_ms": round((t_unreg - t_issue) * 1e3, 3),
                      "copy_ms": round((t_done - t0) * 1e3, 3),
                      "waited_for_copy": (t_unreg - t_issue) > 0.5 * (t_done - t0)}), flush=True)


if __name__ == "__main__":
    main()
