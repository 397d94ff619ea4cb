"""Suite `memory`: pause/resume of 16 GiB (2 GiB with --quick) with and without CPU backup, beside
torch_memory_saver (default and retain_cpu_backup=True) measured in the same run, and the pinned PCIe limits.

Drop-in rows (torch_memory_saver's semantics, through ebbtide.compat.torch_memory_saver): CPU-backed pause/resume
with no retention, every cycle making and giving back its host copy, beside torch_memory_saver's default and the
pinned limits; the host memory still held after the resume (RSS over its level before the pause) and how soon it
came back; the disk tier beside torch_memory_saver's disk backup and a direct-I/O probe of the same directory (16
GiB, fewer where the directory is too slow or small for that: the row says the size).
EBBTIDE_BENCH_MEMORY_ROWS picks "dropin" rows, "engine" rows (the rest) or "all" (default);
EBBTIDE_BENCH_DISK_DIR the directory (default: TMPDIR, /tmp or /var/tmp, the first not on tmpfs, else the working
directory).

Rows: CPU-backup pause/resume first cycle and warm cycles (GB/s of the tag's bytes, wall-clock around the call);
discard-mode pause/resume in 8, 64, 1024 and 16384 allocations (ms) with default settings and with
EBBTIDE_MEM_COALESCE=0, each with the engine's breakdown of where the time went; a trainer->rollout switch (pause
one tag while resuming another) sequential vs overlapped (aggregate GB/s against the bidirectional limit); the interposer's
cudaMalloc+cudaFree cost outside regions (us). Our side and the anchor each run in a fresh process
(ebbtide.bench.suites._memory_worker) so neither inherits the other's pools or pinned memory.
"""
from __future__ import annotations

import importlib.util
import os
import tempfile

from ... import settings
from ...testing import spawn
from ..registry import Row, Skip, suite

GB = 1e9
GiB = 1 << 30

ROWS = settings.declare("EBBTIDE_BENCH_MEMORY_ROWS", settings.parse_choice("all", "dropin", "engine"), "all",
                        "which rows `ebbtide bench memory` runs: all, dropin (torch_memory_saver's semantics and "
                        "the disk tier) or engine (the rest)")
DISK_DIR = settings.declare("EBBTIDE_BENCH_DISK_DIR", settings.parse_path, "",
                            "directory of the memory suite's disk-tier rows (default: TMPDIR, /tmp or /var/tmp, the "
                            "first not on tmpfs, else the working directory)")
DISK_SECONDS = 8.0  # a disk row's size is capped so one direction takes about this long at the probe's speed


def _worker(which: str, total: int, counts: tuple, log) -> tuple[dict | None, str]:
    # Default settings: the caller's EBBTIDE_MEM_COALESCE does not leak into the "default" rows.
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "EBBTIDE_MEM_COALESCE")}
    log(f"memory: running the {which} worker ({total / GiB:.0f} GiB) ...")
    try:
        return spawn.call("measure", which, total, list(counts), module="ebbtide.bench.suites._memory_worker",
                          env=env, timeout=1800, teardown=False), ""
    except spawn.WorkerFailed as e:
        return None, e.brief


def _ms(x: float) -> str:
    return f"{x * 1e3:.2f}"


def breakdown(op: str, wall: float, ph: dict) -> str:
    """Where one discard pause or resume spent its time (ms), from the engine's report of the median cycle: driver
    calls (with the cost per mapping), the drain, cuMemGetInfo, the engine's own bookkeeping (its total minus the
    named phases, plus the selection under the lock) and what lies outside the engine (Python and hooks: the
    wall-clock median minus the engine's time)."""
    if not ph or ph.get("total_s") is None:
        return ""
    g = {k: (v or 0) for k, v in ph.items()}
    n = max(g.get("mappings", 0), 1)
    if op == "pause":
        named = g["sync_s"] + g["meminfo_s"] + g["copy_s"] + g["unmap_s"]
        parts = [f"unmap {_ms(g['unmap_s'])} ({g['unmap_calls']} calls over {g['mappings']} mappings, "
                 f"{g['unmap_s'] / n * 1e6:.1f} us/mapping)", f"drain {_ms(g['sync_s'])}"]
    else:
        named = g["meminfo_s"] + g["map_s"] + g["copy_s"]
        parts = [f"create {_ms(g['create_s'])} ({g['mappings']} mappings, {g['create_s'] / n * 1e6:.1f} us each)",
                 f"map+release {_ms(g['map_call_s'])}", f"setaccess {_ms(g['access_s'])}"]
    if g.get("copy_s"):
        parts.append(f"copy {_ms(g['copy_s'])}")
    parts.append(f"meminfo {_ms(g['meminfo_s'])}")
    parts.append(f"bookkeeping {_ms(max(g['total_s'] - named, 0) + g['prepare_s'])}")
    parts.append(f"outside the engine {_ms(max(wall - g['total_s'] - g['prepare_s'], 0))}")
    return "ms: " + ", ".join(parts)


def _on_tmpfs(path: str) -> bool:
    best, kind = "", ""
    with open("/proc/mounts") as f:
        for line in f:
            mnt, fs = line.split()[1], line.split()[2]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, kind = mnt, fs
    return kind in ("tmpfs", "ramfs")


def _disk_dir() -> str:
    chosen = settings.get(DISK_DIR)
    if chosen:
        return os.path.abspath(chosen)
    for cand in (tempfile.gettempdir(), "/tmp", "/var/tmp"):
        if os.path.isdir(cand) and not _on_tmpfs(os.path.realpath(cand)):
            return cand
    return os.getcwd()


def _run_worker(which: str, args: list, log, what: str) -> tuple[dict | None, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD",) and not k.startswith("TMS_")}
    log(f"memory: {what} ...")
    try:
        return spawn.call("measure", which, *args, module="ebbtide.bench.suites._memory_worker", env=env,
                          timeout=1800, teardown=False), ""
    except spawn.WorkerFailed as e:
        return None, e.brief


def _dropin_rows(ctx, total: int, d2h: float, h2d: float):
    """CPU backup under torch_memory_saver's defaults (no retention), ours through the drop-in vs the real package."""
    size = f"{total / GiB:.0f} GiB"
    ours, why = _run_worker("dropin-ours", [total], ctx.progress, f"drop-in CPU backup, {size}, ebbtide")
    if ours is None:
        raise Skip(f"ebbtide drop-in worker: {why}")
    have_tms = importlib.util.find_spec("torch_memory_saver") is not None
    tms, tms_note = (_run_worker("dropin-tms", [total], ctx.progress, f"drop-in CPU backup, {size}, "
                                 "torch_memory_saver") if have_tms else (None, "not installed"))
    tms = tms or {}
    ph = ours.get("phases", {})
    p = {"bytes": total, "allocations": 8, "hook_mode": "torch", "retain_cpu_backup": False}

    def gbps(d, k):
        return total / d[k] / GB if d.get(k) else None

    yield Row("memory", f"pause, CPU backup, torch_memory_saver defaults (no retention), every cycle ({size})", "GB/s",
              gbps(ours, "pause"), anchor=gbps(tms, "pause"), anchor_name="torch_memory_saver default",
              anchor_note="" if tms.get("pause") else tms_note, limit=d2h, limit_name="pinned D2H", params=p,
              note=f"median of {ours.get('cycles')} cycles; fresh host memory populated and registered in pieces while "
                   f"the copies ran (copies waited {ph.get('pause_host_wait_s', 0) * 1e3:.0f} ms for pieces)")
    yield Row("memory", f"resume, CPU backup, torch_memory_saver defaults (no retention), every cycle ({size})",
              "GB/s", gbps(ours, "resume"), anchor=gbps(tms, "resume"), anchor_name="torch_memory_saver default",
              anchor_note="" if tms.get("resume") else tms_note, limit=h2d, limit_name="pinned H2D", params=p,
              note=f"host copy given back before the resume returned ({ph.get('resume_host_release_s', 0) * 1e3:.0f} "
                   "ms after the last copy landed)")

    def back(d):
        bs = d.get("back_s") or []
        if not bs:
            return "n/a"
        if any(b is None for b in bs):
            return "not back within 2 s of the resume returning"
        return f"back {max(bs) * 1e3:.0f} ms after the resume returned"

    held, a_held = ours.get("held_max"), tms.get("held_max")
    yield Row("memory", f"host memory still held after resume, CPU backup, no retention ({size})", "GiB",
              max(held, 0) / GiB if held is not None else None, higher_is_better=False,
              anchor=max(a_held, 0) / GiB if a_held is not None else None, anchor_name="torch_memory_saver default",
              anchor_note="" if a_held is not None else tms_note, params=p,
              note=f"RSS over its level before the pause, right after resume(): ebbtide {back(ours)}; "
                   f"torch_memory_saver {back(tms) if tms else tms_note}")


def _disk_rows(ctx, total: int):
    """The disk tier vs torch_memory_saver's disk backup vs a direct-I/O probe of the same directory."""
    directory = _disk_dir()
    if _on_tmpfs(os.path.realpath(directory)):
        raise Skip(f"disk rows: {directory} is on tmpfs (set EBBTIDE_BENCH_DISK_DIR to a directory on a disk)")
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    quick, why = _run_worker("disk-probe", [min(total, GiB), directory], ctx.progress,
                             f"sizing the disk rows (direct I/O in {directory})")
    if quick is None:
        raise Skip(f"disk probe in {directory}: {why}")
    slow = min(quick["bytes"] / quick["write_s"], quick["bytes"] / quick["read_s"])
    size_b = min(total, int(slow * DISK_SECONDS), free // 3)
    size_b = max(size_b // GiB, 1) * GiB
    if size_b * 3 > free:
        raise Skip(f"disk rows: {directory} has {free / GiB:.1f} GiB free, too little for a 1 GiB backup and its "
                   "anchor")
    why_smaller = "" if size_b == total else (f" (not {total / GiB:.0f} GiB: the directory writes/reads at "
                                              f"{slow / GB:.2f} GB/s and has {free / GiB:.0f} GiB free)")
    size = f"{size_b / GiB:.0f} GiB"
    probe, why = _run_worker("disk-probe", [size_b, directory], ctx.progress, f"direct-I/O probe, {size}")
    if probe is None:
        raise Skip(f"disk probe in {directory}: {why}")
    ours, why = _run_worker("disk-ours", [size_b, directory], ctx.progress, f"disk tier, {size}, ebbtide")
    if ours is None:
        raise Skip(f"ebbtide disk worker: {why}")
    have_tms = importlib.util.find_spec("torch_memory_saver") is not None
    tms, tms_note = (_run_worker("disk-tms", [size_b, directory], ctx.progress, f"disk backup, {size}, "
                                 "torch_memory_saver") if have_tms else (None, "not installed"))
    tms = tms or {}
    p = {"bytes": size_b, "allocations": 8, "dir": directory, "direct_io": ours.get("direct")}

    def gbps(d, k):
        return size_b / d[k] / GB if d.get(k) else None

    io = f"{probe['threads']} threads x {probe['chunk'] >> 20} MiB requests"
    for op, limit_key, lname in (("pause", "write_s", "O_DIRECT write"), ("resume", "read_s", "O_DIRECT read")):
        yield Row("memory", f"{op}, disk backup ({size}){why_smaller}", "GB/s", gbps(ours, op),
                  anchor=gbps(tms, op), anchor_name="torch_memory_saver disk backup",
                  anchor_note="" if tms.get(op) else tms_note, limit=probe["bytes"] / probe[limit_key] / GB,
                  limit_name=f"{lname} of {directory} ({io})", params=p,
                  note=("direct I/O" if ours.get("direct") else "buffered I/O (the filesystem refused O_DIRECT)")
                  + f", median of {ours.get('cycles')} cycles")


@suite("memory", needs="gpu", description="VMM pause/resume: CPU backup bandwidth, discard cost, overlap, hook cost")
def run(ctx):
    ctx.require_gpu()
    rows = settings.get(ROWS)
    total = (2 if ctx.quick else 16) * GiB
    if rows in ("all", "dropin"):
        yield from _dropin_rows(ctx, total, ctx.limits.d2h_gbps(), ctx.limits.h2d_gbps())
        try:
            yield from _disk_rows(ctx, (1 if ctx.quick else 16) * GiB)
        except Skip as e:
            ctx.note_skip("memory: disk tier rows", str(e))
    if rows == "dropin":
        return
    # 16 GiB in 8 .. 16384 tensors (1 MiB to 2 GiB; 1 MiB tensors share 2 MiB caching-allocator segments, so 16384
    # of them are 8192 driver allocations); --quick: 2 GiB, the same tensor sizes up to 2048 of them.
    counts = (8, 64, 1024, 16384) if not ctx.quick else (8, 64, 128, 2048)
    d2h, h2d, bidir = ctx.limits.d2h_gbps(), ctx.limits.h2d_gbps(), ctx.limits.bidir_gbps()
    ours, why = _worker("ours", total, counts, ctx.progress)
    if ours is None:
        raise Skip(f"ebbtide worker: {why}")
    if importlib.util.find_spec("torch_memory_saver") is None:
        tms, tms_note = {}, "not installed"
    else:
        tms, tms_note = _worker("tms", total, counts, ctx.progress)
        tms = tms or {}
    retain_note = tms.get("retain_error", "") or tms_note
    size = f"{total / GiB:.0f} GiB"
    p = {"bytes": total, "allocations": 8, "hook_mode": ours.get("mode")}

    def gbps(d: dict, key: str) -> float | None:
        return total / d[key] / GB if d.get(key) else None

    def row(name, key, anchor_key, anchor_name, note_if_missing, limit, limit_name, anchor_src=None, note=""):
        src = tms if anchor_src is None else anchor_src
        anchor = gbps(src, anchor_key) if anchor_key else None
        return Row("memory", name, "GB/s", gbps(ours, key), anchor=anchor, anchor_name=anchor_name,
                   anchor_note="" if anchor is not None else (note_if_missing or "n/a"), limit=limit,
                   limit_name=limit_name, params=p, note=note)

    reg, bg = ours.get("host_register_s", 0.0), ours.get("background_pinning_s", 0.0)
    wp, wr = ours.get("warm_pause_phases", {}), ours.get("warm_resume_phases", {})
    yield row(f"pause, CPU backup, first cycle ({size})", "cpu_first_pause", "cpu_default_pause",
              "torch_memory_saver default", tms_note, d2h, "pinned D2H",
              note=f"host blocks pinned in the background after allocation ({bg:.2f} s wait before timing)")
    yield row(f"resume, CPU backup, first cycle ({size})", "cpu_first_resume", "cpu_default_resume",
              "torch_memory_saver default", tms_note, h2d, "pinned H2D")
    yield row(f"pause, CPU backup, first cycle, no background pinning ({size})", "cpu_first_pause_nobg",
              "cpu_retain_first_pause", "torch_memory_saver retain_cpu_backup", retain_note, d2h, "pinned D2H",
              note=f"the pause pins its own host memory ({reg:.2f} s of touch + register)")
    yield row(f"pause, CPU backup, warm ({size})", "cpu_warm_pause", "cpu_retain_warm_pause",
              "torch_memory_saver retain_cpu_backup", retain_note, d2h, "pinned D2H",
              note=" ".join(f"{k[:-2]} {v * 1e3:.0f} ms" for k, v in wp.items()))
    yield row(f"resume, CPU backup, warm ({size})", "cpu_warm_resume", "cpu_retain_warm_resume",
              "torch_memory_saver retain_cpu_backup", retain_note, h2d, "pinned H2D",
              note=" ".join(f"{k[:-2]} {v * 1e3:.0f} ms" for k, v in wr.items()))

    for n in counts:
        for off in (False, True):
            label = f"d{n}_off" if off else f"d{n}"
            how = ", EBBTIDE_MEM_COALESCE=0" if off else ""
            for op in ("pause", "resume"):
                t = ours.get(f"{label}_{op}")
                a = tms.get(f"d{n}_{op}")  # the anchor: TMS, same tensors
                ph = (ours.get(f"{label}_phases") or {}).get(op) or {}
                note = f"{t / n * 1e6:.1f} us per allocation; " if t else ""
                worst, a_worst = ours.get(f"{label}_{op}_max"), tms.get(f"d{n}_{op}_max")
                if worst:
                    note += f"slowest cycle {_ms(worst)} ms"
                    note += f" (torch_memory_saver {_ms(a_worst)} ms); " if a_worst else "; "
                yield Row("memory", f"{op}, discard, {size} in {n} allocations{how}", "ms",
                          t * 1e3 if t else None, higher_is_better=False,
                          anchor=a * 1e3 if a else None, anchor_name="torch_memory_saver",
                          anchor_note="" if a else (tms_note or "n/a"),
                          params={"bytes": total, "allocations": n,
                                  "coalescing": (not off) and bool(ours.get("coalescing_default"))},
                          note=note + breakdown(op, t or 0.0, ph))

    seq, ovl = ours.get("switch_sequential"), ours.get("switch_overlapped")
    if seq and ovl:
        yield Row("memory", f"switch: pause {size} + resume {size}, overlapped", "GB/s", 2 * total / ovl / GB,
                  anchor=2 * total / seq / GB, anchor_name="same, sequential (ebbtide)", limit=bidir,
                  limit_name="pinned H2D + D2H at once", params=p,
                  note=f"overlapped/sequential time = {ovl / seq:.2f}; torch_memory_saver offers no async pause")
    hook, direct = ours.get("malloc_free_hook"), ours.get("malloc_free_direct")
    if hook and direct:
        yield Row("memory", "cudaMalloc+cudaFree 2 MiB outside regions, through the interposer", "us", hook * 1e6,
                  higher_is_better=False, anchor=direct * 1e6, anchor_name="libcudart directly",
                  note=f"interposer overhead {(hook - direct) * 1e6:+.2f} us (ctypes both ways)")
    else:
        ctx.note_skip("memory: interposer latency", "libcudart not loadable by name")
