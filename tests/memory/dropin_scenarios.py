"""GPU scenarios of torch_memory_saver's semantics in the engine (transient host copies, host retention, the disk
tier, its C functions), one per process: ``python dropin_scenarios.py <scenario> <preload|torch> [args]``
(test_dropin_gpu.py starts each; preload mode: with ebbtide.memory.preload_env()). Prints "OK".
"""
from __future__ import annotations

import ctypes
import os

import torch

import ebbtide.memory as em

from _scenario_runner import GiB, MiB, check_mode, free_bytes, main, tag_bytes


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _tensors(tag: str, backup: str, host: str = "arena"):
    with em.region(tag, backup=backup, host=host):
        ts = [torch.randn(256 * MiB // 4, device="cuda") for _ in range(3)]
        ts.append(torch.arange(4099, dtype=torch.int64, device="cuda"))  # a small one, in a 2 MiB segment
    return ts, [t.cpu() for t in ts], [t.data_ptr() for t in ts]


def _same(ts, refs, ptrs):
    assert [t.data_ptr() for t in ts] == ptrs, "an address changed"
    for t, r in zip(ts, refs):
        assert torch.equal(t.cpu(), r), "content not restored bitwise"


def transient(mode: str, host: str):
    """host="transient" / "pageable": the pause's host copy exists only while paused. The driver gets the device
    memory back, RSS grows by about the copy while paused and falls back when resume() returns, nothing is pinned
    after it, get_cpu_backup is None; with retention the copy stays at the same address."""
    check_mode(mode)
    ts, refs, ptrs = _tensors("w", "cpu", host)
    nbytes = sum(t.numel() * t.element_size() for t in ts)
    for cycle in range(2):
        torch.cuda.synchronize()
        rss0, f0 = _rss(), free_bytes()
        rep = em.pause("w")
        f1, rss1 = free_bytes(), _rss()
        assert f1 - f0 >= 0.99 * tag_bytes("w", "bytes_paused"), (f0, f1)
        assert rss1 - rss0 >= 0.9 * nbytes, f"cycle {cycle}: RSS grew {(rss1 - rss0) / MiB:.0f} MiB while paused"
        h = em.host_memory()
        assert h.transient_copies >= 4 and h.transient_pinned == (0 if host == "pageable" else h.transient_mapped), h
        b = em.get_cpu_backup(ts[-1])
        assert b is not None and torch.equal(b, refs[-1])
        r = em.resume("w")
        rss2 = _rss()
        _same(ts, refs, ptrs)
        h = em.host_memory()
        assert h.transient_copies == 0 and h.transient_mapped == 0 and h.transient_pinned == 0, h
        assert rss2 - rss0 < 64 * MiB, f"cycle {cycle}: RSS {(rss2 - rss0) / MiB:.0f} MiB over its level before pause"
        assert em.get_cpu_backup(ts[0]) is None
        print(f"cycle {cycle}: pause {nbytes / rep.total_s / 1e9:.1f} GB/s (waited {rep.host_wait_s * 1e3:.0f} ms for "
              f"host pieces), resume {nbytes / r.total_s / 1e9:.1f} GB/s (host back {r.host_release_s * 1e3:.0f} ms "
              "after the last copy)", flush=True)
    em.set_host_retention(True)
    em.pause("w")
    addr = em.get_cpu_backup_address(ptrs[0])[0]
    em.resume("w")
    assert em.get_cpu_backup_address(ptrs[0])[0] == addr and em.host_memory().transient_retained >= nbytes
    ts[0].add_(1)
    refs[0] = ts[0].cpu()
    em.pause("w")
    assert em.get_cpu_backup_address(ptrs[0])[0] == addr
    em.set_host_retention(False)
    em.resume("w")
    _same(ts, refs, ptrs)
    assert em.host_memory().transient_copies == 0


def disk(mode: str, directory: str):
    """backup="disk": a file per allocation while paused, the device memory given back, every byte restored, the
    files gone after the resume; mixed with a CPU-backed tag in one pause()."""
    check_mode(mode)
    em.set_disk_backup_dir(directory)
    ts, refs, ptrs = _tensors("d", "disk")
    cs, crefs, cptrs = _tensors("c", "cpu", "transient")
    for _ in range(2):
        f0 = free_bytes()
        rep = em.pause()
        files = os.listdir(directory)
        assert len(files) == tag_bytes("d", "allocations") and all(f.endswith(".bak") for f in files), files
        assert free_bytes() - f0 >= 0.99 * (tag_bytes("d", "bytes_paused") + tag_bytes("c", "bytes_paused"))
        assert em.get_cpu_backup(ts[0]) is None
        r = em.resume()
        _same(ts, refs, ptrs)
        _same(cs, crefs, cptrs)
        assert os.listdir(directory) == []
        h = em.host_memory()
        print(f"disk: wrote {rep.bytes_disk / GiB:.2f} GiB in {rep.disk_s:.2f} s, read in {r.disk_s:.2f} s "
              f"({'direct' if h.disk_direct else 'buffered'} I/O, staging {h.disk_staging / MiB:.0f} MiB)", flush=True)


def tms_c_functions(mode: str):
    """Preload mode, TMS_INIT_ENABLE=1 (set by the test): raw cudaMalloc of 6,912 bytes and tms_pause /
    tms_resume reached through ctypes.CDLL(None), as torch_memory_saver's own suite calls them."""
    check_mode(mode)
    api = ctypes.CDLL(None)
    for name, args, res in (("cudaMalloc", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t], ctypes.c_int),
                            ("cudaMemcpy", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int],
                             ctypes.c_int),
                            ("cudaFree", [ctypes.c_void_p], ctypes.c_int),
                            ("tms_pause", [ctypes.c_char_p], ctypes.c_int),
                            ("tms_resume", [ctypes.c_char_p], ctypes.c_int)):
        fn = getattr(api, name)
        fn.argtypes, fn.restype = args, res
    p = ctypes.c_void_p()
    assert api.cudaMalloc(ctypes.byref(p), 6912) == 0 and p.value
    assert em.stats()["global"]["live_allocations"] >= 1
    src = ctypes.c_ubyte(0xA5)
    dst = ctypes.c_ubyte(0)
    assert api.cudaMemcpy(p, ctypes.byref(src), 1, 1) == 0
    assert api.tms_pause(None) == 0 and api.tms_resume(None) == 0
    assert api.cudaMemcpy(p, ctypes.byref(src), 1, 1) == 0 and api.cudaMemcpy(ctypes.byref(dst), p, 1, 2) == 0
    assert dst.value == 0xA5
    assert api.tms_pause(None) == 0
    assert api.cudaFree(p) == 0  # freed while paused
    assert api.tms_resume(None) == 0


if __name__ == "__main__":
    main(globals())
