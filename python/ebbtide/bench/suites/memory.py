"""Suite `memory`: pause/resume of 16 GiB (2 GiB with --quick) with and without CPU backup, beside
torch_memory_saver (default and retain_cpu_backup=True) measured in the same run, and the pinned PCIe limits.

Rows: CPU-backup pause/resume first cycle and warm cycles (GB/s of the tag's bytes, wall-clock around the call);
discard-mode pause/resume in 8 and in many allocations (ms); a trainer->rollout switch (pause one tag while
resuming another) sequential vs overlapped (aggregate GB/s against the bidirectional limit); the interposer's
cudaMalloc+cudaFree cost outside regions (us). Our side and the anchor each run in a fresh process
(ebbtide.bench.suites._memory_worker) so neither inherits the other's pools or pinned memory.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

from ..registry import Row, Skip, suite

GB = 1e9
GiB = 1 << 30


def _worker(which: str, total: int, small: int, log) -> tuple[dict | None, str]:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    cmd = [sys.executable, "-m", "ebbtide.bench.suites._memory_worker", which, str(total), str(small)]
    log(f"memory: running the {which} worker ({total / GiB:.0f} GiB) ...")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    except subprocess.TimeoutExpired:
        return None, "timed out"
    lines = [ln for ln in p.stdout.strip().splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        return None, f"worker failed ({p.returncode}): {' | '.join(tail)}"
    return json.loads(lines[-1]), ""


def _discard_note(ours: dict, label: str, op: str, n: int) -> str:
    """Per-allocation cost plus the engine's own breakdown of the last cycle (ms; the rest is Python + sync)."""
    t = ours.get(f"{label}_{op}")
    if not t:
        return ""
    note = f"{t / n * 1e6:.1f} us per allocation"
    ph = (ours.get(f"{label}_phases") or {}).get(op) or {}
    parts = [f"{k[:-2]} {v * 1e3:.2f}" for k, v in ph.items() if k.endswith("_s") and v is not None]
    if parts:
        note += "; engine ms: " + " ".join(parts)
    if ph.get("unmap_calls") is not None:
        note += f"; {ph['unmap_calls']} unmap calls"
    if ph.get("mappings") is not None:
        note += f"; {ph['mappings']} mappings"
    return note


@suite("memory", needs="gpu", description="VMM pause/resume: CPU backup bandwidth, discard cost, overlap, hook cost")
def run(ctx):
    ctx.require_gpu()
    total = (2 if ctx.quick else 16) * GiB
    small = 128 if ctx.quick else 1024  # 16 MiB tensors either way: each is its own caching-allocator segment
    d2h, h2d, bidir = ctx.limits.d2h_gbps(), ctx.limits.h2d_gbps(), ctx.limits.bidir_gbps()
    ours, why = _worker("ours", total, small, ctx.progress)
    if ours is None:
        raise Skip(f"ebbtide worker: {why}")
    if importlib.util.find_spec("torch_memory_saver") is None:
        tms, tms_note = {}, "not installed"
    else:
        tms, tms_note = _worker("tms", total, small, ctx.progress)
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

    for label, n in (("d8", 8), ("dmany", small), ("dmany_coalesced", small)):
        for op in ("pause", "resume"):
            key = f"{label}_{op}"
            a = tms.get(f"{label.removesuffix('_coalesced')}_{op}")  # the anchor: TMS, same allocations
            how = ", coalesced resume (opt-in)" if label.endswith("_coalesced") else ""
            yield Row("memory", f"{op}, discard, {size} in {n} allocations{how}", "ms",
                      ours[key] * 1e3 if ours.get(key) else None, higher_is_better=False,
                      anchor=a * 1e3 if a else None, anchor_name="torch_memory_saver",
                      anchor_note="" if a else (tms_note or "n/a"), params={"bytes": total, "allocations": n},
                      note=_discard_note(ours, label, op, n))

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
