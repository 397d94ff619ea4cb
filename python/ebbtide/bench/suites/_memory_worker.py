"""Measurement worker of the `memory` suite: ``measure(which, total_bytes, arg)``, run by
``ebbtide.testing.spawn.call`` in a process of its own, returns a dict of timings (seconds): ``ours`` / ``tms`` (arg:
the allocation counts of the discard rows), ``dropin-ours`` / ``dropin-tms`` (CPU backup under torch_memory_saver's
defaults), ``disk-ours`` / ``disk-tms`` / ``disk-probe`` (arg: the directory; the disk tier, and the direct-I/O probe
of the same directory).

Each side runs in its own process so neither inherits the other's GPU pools, pinned host memory or caches; both
follow the same order (discard tags first and left paused, then CPU-backed tags), time wall-clock around the
synchronous Python calls after a torch.cuda.synchronize(), and touch the data first.
"""
from __future__ import annotations

import ctypes
import os
import statistics
import time

import torch

WARM = 3  # warm cycles of the CPU-backed rows (median)
DISCARD_CYCLES = 7  # discard cycles are milliseconds: more of them, so a driver spike neither sets the median
#                    nor hides (each row also reports its slowest cycle)


def _tensors(region, n: int, total: int):
    with region:
        ts = [torch.empty(total // n, dtype=torch.uint8, device="cuda") for _ in range(n)]
    for t in ts:
        t.fill_(7)
    torch.cuda.synchronize()
    return ts


def _t(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _cycles(pause, resume, n: int) -> tuple[list, list]:
    ps, rs = [], []
    for _ in range(n):
        ps.append(_t(pause))
        rs.append(_t(resume))
    return ps, rs


def median_index(xs: list) -> int:
    """Index of the median element of an odd-length list (the cycle whose time the row reports)."""
    order = sorted(range(len(xs)), key=xs.__getitem__)
    return order[len(xs) // 2]


def _discard(out: dict, region_fn, pause, resume, total: int, labels, phases=None, check=None) -> list:
    """Discard pause/resume of `total` bytes in n equal tensors, per (label, n): median and slowest of
    DISCARD_CYCLES cycles after a warm-up cycle, and (``phases``) the engine's breakdown of the median cycle itself;
    each tag is left paused so its GPU memory is free for what follows. ``check(label)`` runs once, untimed, before
    the first pause."""
    keep = []
    for label, n in labels:
        keep.append(_tensors(region_fn(label, False), n, total))
        if check:
            check(label)
        pause(label)
        resume(label)  # warm-up (first map of fresh pools, streams)
        times = {"pause": [], "resume": []}
        reports = {"pause": [], "resume": []}
        for _ in range(DISCARD_CYCLES):
            for op, fn in (("pause", pause), ("resume", resume)):
                times[op].append(_t(lambda: fn(label)))
                if phases:
                    reports[op].append(phases(label)[op])
        for op, ts in times.items():
            i = median_index(ts)
            out[f"{label}_{op}"], out[f"{label}_{op}_max"] = ts[i], max(ts)
            if phases:
                out.setdefault(f"{label}_phases", {})[op] = reports[op][i]
        pause(label)
    return keep


def _captured(em, tag: str, total: int):
    """A figure is only meaningful if the region really took the memory: refuse to time an empty pause."""
    held = sum(r["bytes_active"] + r["bytes_paused"] for r in em.stats()["tags"] if r["tag"] == tag)
    if held < 0.99 * total:  # n equal tensors of total // n bytes
        raise RuntimeError(f"region {tag!r} holds {held} of the {total} bytes allocated in it (hook mode "
                           f"{em.hook_mode()!r}): the allocations bypassed ebbtide, nothing to measure")


# Report fields of the engine's breakdown (memory/ebbtide_memory.h ebt_mem_report_t), per op.
PAUSE_PHASES = ("prepare_s", "sync_s", "meminfo_s", "copy_s", "unmap_s", "total_s", "unmap_calls", "mappings",
                "allocations")
RESUME_PHASES = ("prepare_s", "meminfo_s", "create_s", "map_call_s", "access_s", "map_s", "copy_s", "total_s",
                 "mappings", "allocations")


def ours(total: int, counts: list) -> dict:
    import ebbtide.memory as em  # noqa: PLC0415

    out: dict = {"mode": em.hook_mode(), "coalescing_default": em.coalescing()}

    def region(tag, cpu):
        return em.region(tag, backup="cpu" if cpu else "none")

    def captured(tag):
        _captured(em, tag, total)

    def phases(tag):
        row = [r for r in em.stats()["tags"] if r["tag"] == tag][0]
        return {"pause": {k: row["last_pause"].get(k) for k in PAUSE_PHASES},
                "resume": {k: row["last_resume"].get(k) for k in RESUME_PHASES}}

    # Default settings first (coalesced resume on), then the per-allocation path (EBBTIDE_MEM_COALESCE=0's).
    keep = _discard(out, region, em.pause, em.resume, total, [(f"d{n}", n) for n in counts], phases, captured)
    em.set_coalescing(False)
    keep += _discard(out, region, em.pause, em.resume, total, [(f"d{n}_off", n) for n in counts], phases, captured)
    em.set_coalescing(out["coalescing_default"])
    # First cycle with the pause pinning its own host memory (background pinning off) ...
    em.set_background_pinning(False)
    keep.append(_tensors(em.region("w0", backup="cpu"), 8, total))
    _captured(em, "w0", total)
    out["cpu_first_pause_nobg"] = _t(lambda: em.pause("w0"))
    out["cpu_first_resume_nobg"] = _t(lambda: em.resume("w0"))
    out["host_register_s"] = em.stats()["global"]["host_register_s"]
    # ... and the default: blocks pinned on the runtime thread after allocation, off the critical path.
    em.set_background_pinning(True)
    keep.append(_tensors(em.region("w", backup="cpu"), 8, total))
    _captured(em, "w", total)
    out["background_pinning_s"] = _t(em.wait_background_pinning)
    out["cpu_first_pause"] = _t(lambda: em.pause("w"))
    out["cpu_first_resume"] = _t(lambda: em.resume("w"))
    ps, rs = _cycles(lambda: em.pause("w"), lambda: em.resume("w"), WARM)
    out["cpu_warm_pause"], out["cpu_warm_resume"] = statistics.median(ps), statistics.median(rs)
    last = [r for r in em.stats()["tags"] if r["tag"] == "w"][0]
    out["warm_pause_phases"] = {k: last["last_pause"][k] for k in ("sync_s", "copy_s", "unmap_s", "total_s")}
    out["warm_resume_phases"] = {k: last["last_resume"][k] for k in ("map_s", "copy_s", "total_s")}
    # Trainer -> rollout switch: pause one tag (w0, "trainer") while resuming another (w, "rollout").
    em.pause("w")
    seq, ovl = [], []
    for _ in range(WARM):
        seq.append(_t(lambda: (em.pause("w0"), em.resume("w"))))
        em.pause("w")
        em.resume("w0")

        def overlapped():
            h1, h2 = em.pause_async("w0"), em.resume_async("w")
            h1.wait()
            h2.wait()

        ovl.append(_t(overlapped))
        em.pause("w")
        em.resume("w0")
    out["switch_sequential"], out["switch_overlapped"] = statistics.median(seq), statistics.median(ovl)
    out.update(_hook_latency())
    return out


def _hook_latency() -> dict:
    """cudaMalloc+cudaFree of 2 MiB outside any region through libebbtide.so's interposer vs libcudart directly
    (ctypes both ways, so the difference is the interposer's own cost)."""
    from ebbtide import _native  # noqa: PLC0415

    shim = ctypes.CDLL(_native.runtime_library_path())
    cudart = None
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            cudart = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if cudart is None:
        return {}
    # Interleaved, order alternating every iteration, so drift in the driver's own cost (its first allocations
    # are slower) lands on both sides instead of on whichever ran first.
    libs = {"hook": shim, "direct": cudart}
    times: dict = {"hook": [], "direct": []}
    p = ctypes.c_void_p()
    for i in range(2000):
        for label in (("hook", "direct") if i % 2 else ("direct", "hook")):
            lib = libs[label]
            t0 = time.perf_counter()
            if lib.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(2 << 20)) != 0:
                return {}
            lib.cudaFree(p)
            if i >= 100:
                times[label].append(time.perf_counter() - t0)
    return {f"malloc_free_{label}": statistics.median(ts) for label, ts in times.items()}


def tms(total: int, counts: list) -> dict:
    from torch_memory_saver import torch_memory_saver as saver  # noqa: PLC0415

    saver.hook_mode = "torch"
    out: dict = {"mode": "torch"}
    keep = _discard(out, lambda tag, cpu: saver.region(tag=tag, enable_cpu_backup=cpu), saver.pause, saver.resume,
                    total, [(f"d{n}", n) for n in counts])
    keep.append(_tensors(saver.region(tag="w", enable_cpu_backup=True), 8, total))
    ps, rs = _cycles(lambda: saver.pause("w"), lambda: saver.resume("w"), 2)  # default: pins afresh every cycle
    out["cpu_default_pause"], out["cpu_default_resume"] = statistics.median(ps), statistics.median(rs)
    try:
        saver.retain_cpu_backup = True
    except (AttributeError, NotImplementedError) as e:
        out["retain_error"] = f"{type(e).__name__}: {e}"
        return out
    keep.append(_tensors(saver.region(tag="r", enable_cpu_backup=True), 8, total))
    out["cpu_retain_first_pause"] = _t(lambda: saver.pause("r"))
    out["cpu_retain_first_resume"] = _t(lambda: saver.resume("r"))
    ps, rs = _cycles(lambda: saver.pause("r"), lambda: saver.resume("r"), WARM)
    out["cpu_retain_warm_pause"], out["cpu_retain_warm_resume"] = statistics.median(ps), statistics.median(rs)
    return out


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _held_after_resume(rss0: int, total: int, wait_s: float = 2.0) -> tuple[int, float | None]:
    """RSS above its level before the pause right after a resume returned, and how long after the return it
    fell back to within 1% of the tensors' bytes of that level (None: not within ``wait_s``)."""
    t0 = time.perf_counter()
    held = _rss() - rss0
    while True:
        now = _rss() - rss0
        if now <= 0.01 * total:
            return held, time.perf_counter() - t0
        if time.perf_counter() - t0 > wait_s:
            return held, None
        time.sleep(0.01)


def _dropin_cycles(saver, total: int, cycles: int) -> dict:
    """CPU-backed pause/resume of `total` bytes in 8 tensors under torch_memory_saver's defaults (no retention, so
    every cycle makes and gives back its host copy), timed around the calls; the host memory left held after each
    resume and when it came back."""
    saver.hook_mode = "torch"
    keep = _tensors(saver.region(tag="w", enable_cpu_backup=True), 8, total)
    out: dict = {"pause": [], "resume": [], "held": [], "back_s": []}
    for _ in range(cycles):
        torch.cuda.synchronize()
        rss0 = _rss()
        out["pause"].append(_t(lambda: saver.pause("w")))
        out["resume"].append(_t(lambda: saver.resume("w")))
        held, back = _held_after_resume(rss0, total)
        out["held"].append(held)
        out["back_s"].append(back)
    assert all(bool((t == 7).all()) for t in keep[:1]), "content lost across the cycles"
    return {"pause": statistics.median(out["pause"]), "resume": statistics.median(out["resume"]),
            "held_max": max(out["held"]), "back_s": out["back_s"], "cycles": cycles}


def dropin_ours(total: int) -> dict:
    import ebbtide.memory as em  # noqa: PLC0415
    from ebbtide.compat.torch_memory_saver import torch_memory_saver as saver  # noqa: PLC0415

    r = _dropin_cycles(saver, total, 3)
    row = [x for x in em.stats()["tags"] if x["tag"] == "w"][0]
    r["phases"] = {"pause_copy_s": row["last_pause"]["copy_s"], "pause_host_wait_s": row["last_pause"]["host_wait_s"],
                   "resume_copy_s": row["last_resume"]["copy_s"],
                   "resume_host_release_s": row["last_resume"]["host_release_s"]}
    r["host_now"] = em.host_memory().held
    return r


def dropin_tms(total: int) -> dict:
    from torch_memory_saver import torch_memory_saver as saver  # noqa: PLC0415

    return _dropin_cycles(saver, total, 2)  # seconds per cycle: two


def _disk_cycles(saver, total: int, directory: str, cycles: int) -> dict:
    saver.hook_mode = "torch"
    saver.set_disk_backup_dir(directory)
    keep = _tensors(saver.region(tag="d", enable_disk_backup=True), 8, total)
    ps, rs = _cycles(lambda: saver.pause("d"), lambda: saver.resume("d"), cycles)
    assert bool((keep[0] == 7).all()) and bool((keep[-1] == 7).all()), "content lost across the disk cycles"
    return {"pause": statistics.median(ps), "resume": statistics.median(rs), "cycles": cycles}


def disk_ours(total: int, directory: str) -> dict:
    import ebbtide.memory as em  # noqa: PLC0415
    from ebbtide.compat.torch_memory_saver import torch_memory_saver as saver  # noqa: PLC0415

    r = _disk_cycles(saver, total, directory, 1)  # no warm cycle: each pause writes anew
    row = [x for x in em.stats()["tags"] if x["tag"] == "d"][0]
    r["direct"] = em.host_memory().disk_direct
    r["phases"] = {"pause_disk_s": row["last_pause"]["disk_s"], "resume_disk_s": row["last_resume"]["disk_s"]}
    return r


def disk_tms(total: int, directory: str) -> dict:
    from torch_memory_saver import torch_memory_saver as saver  # noqa: PLC0415

    return _disk_cycles(saver, total, directory, 1)


def disk_probe(total: int, directory: str, chunk: int = 64 << 20, threads: int = 2) -> dict:
    """The directory's own sequential bandwidth: `total` bytes written then read with O_DIRECT in `chunk`-byte
    requests from `threads` threads (each keeps one request in flight), file allocated first; page-aligned
    buffers of random bytes."""
    import mmap  # noqa: PLC0415
    import threading  # noqa: PLC0415

    path = os.path.join(directory, f"ebbtide-probe-{os.getpid()}.bin")
    n = max(1, total // chunk)
    bufs = []
    for _ in range(threads):
        b = mmap.mmap(-1, chunk)
        b.write(os.urandom(1 << 20) * (chunk >> 20))
        bufs.append(b)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    try:
        os.posix_fallocate(fd, 0, n * chunk)

        def run(op):
            errs = []

            def work(w):
                try:
                    for i in range(w, n, threads):
                        done = op(fd, [bufs[w]], i * chunk)
                        if done != chunk:
                            raise OSError(f"short transfer {done} of {chunk}")
                except OSError as e:
                    errs.append(e)

            ts = [threading.Thread(target=work, args=(w,)) for w in range(threads)]
            t0 = time.perf_counter()
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            if errs:
                raise errs[0]
            return time.perf_counter() - t0

        w = run(os.pwritev)
        r = run(os.preadv)
    finally:
        os.close(fd)
        os.unlink(path)
    return {"bytes": n * chunk, "write_s": w, "read_s": r, "chunk": chunk, "threads": threads}


def measure(which: str, total: int, arg=None) -> dict:
    """One side's timings (see the module note). Run it with ``teardown=False``: pools and pinned memory go back
    with the process."""
    if which == "disk-probe":  # no GPU needed
        return disk_probe(total, arg)
    torch.cuda.init()
    if which.startswith("dropin-"):
        return {"dropin-ours": dropin_ours, "dropin-tms": dropin_tms}[which](total)
    if which.startswith("disk-"):
        return {"disk-ours": disk_ours, "disk-tms": disk_tms}[which](total, arg)
    return {"ours": ours, "tms": tms}[which](total, arg)
