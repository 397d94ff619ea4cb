"""The release report: after a pause, did the driver really get the memory back, and if not, where is it?

``release_report(report)`` compares the driver's view (``cuMemGetInfo`` free bytes before/after the pause, now;
NVML's per-process used memory when nvidia-ml-py is installed) with the bytes the pause released, and lists
what still holds device memory: other tags still active, PyTorch segments outside paused ranges (cached but
unpaused blocks, expandable segments), ``cudaMalloc`` calls the shim forwarded (memory that bypassed ebbtide),
NCCL, and the remainder (CUDA context, cuBLAS workspaces, libraries that allocate with the driver directly).
Nothing here changes state; every source that cannot be read says why (``notes``).
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Optional

from ._common import expandable_segments_requested, mem as _mem

__all__ = ["ReleaseReport", "release_report"]


@dataclasses.dataclass
class ReleaseReport:
    device: int
    bytes_paused: int                 # physical bytes the pause released (the engine's count)
    driver_freed: Optional[int]       # rise of the driver's free bytes across the pause (None: no pause report)
    driver_free_now: Optional[int]
    driver_total: Optional[int]
    nvml_process_used: Optional[int]  # NVML: this process's used device memory now (None: see notes)
    active_tags: dict                 # tag -> bytes still mapped on this device
    torch_unpaused_segments: list     # PyTorch segments outside paused memory: address, size, allocated, pool, ...
    torch_cached_unpaused: int        # bytes reserved by PyTorch outside paused memory but not allocated
    torch_allocated_unpaused: int     # bytes of live tensors outside paused memory
    expandable_segments: bool         # PYTORCH_CUDA_ALLOC_CONF asks for them (memory that bypasses cudaMalloc)
    forwarded_allocs: int             # cudaMalloc calls the shim forwarded (preload mode; since process start)
    forwarded_bytes: int
    shim_active: bool
    nccl: Optional[str]               # a NCCL process group is up (its buffers bypass PyTorch and the engine)
    other_bytes: Optional[int]        # used - (active tags + PyTorch outside paused memory): context, libraries
    notes: list
    pending_free: int = 0             # freed allocations still mapped inside coalesced mappings (this device)
    quarantined_ranges: int = 0       # freed ranges the driver refused to unmap: never reused (all devices)
    quarantined_bytes: int = 0

    @property
    def missing(self) -> Optional[int]:
        """Paused bytes the driver did not see come back (0 when everything returned)."""
        return None if self.driver_freed is None else max(0, self.bytes_paused - self.driver_freed)

    def __str__(self) -> str:
        g = lambda b: "n/a" if b is None else f"{b / 2**30:.3f} GiB"  # noqa: E731
        lines = [f"release report, device {self.device}: paused {g(self.bytes_paused)}, driver freed "
                 f"{g(self.driver_freed)}, missing {g(self.missing)}",
                 f"  driver free now {g(self.driver_free_now)} of {g(self.driver_total)}; NVML process used "
                 f"{g(self.nvml_process_used)}",
                 "  still active tags: " + (", ".join(f"{t}={g(b)}" for t, b in self.active_tags.items()) or "none"),
                 f"  PyTorch outside paused memory: {len(self.torch_unpaused_segments)} segments, allocated "
                 f"{g(self.torch_allocated_unpaused)}, cached-but-unpaused {g(self.torch_cached_unpaused)}",
                 f"  bypassed the runtime: {self.forwarded_allocs} forwarded cudaMalloc calls "
                 f"({g(self.forwarded_bytes)} since start; shim {'active' if self.shim_active else 'not loaded'}), "
                 f"expandable segments {'ON' if self.expandable_segments else 'off'}, NCCL {self.nccl or 'none'}",
                 f"  other (CUDA context, cuBLAS workspaces, driver-level allocations): {g(self.other_bytes)}"]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _nvml_process_used(torch, device: int, notes: list) -> Optional[int]:
    from .._nvml import Device  # noqa: PLC0415

    try:
        uuid = str(torch.cuda.get_device_properties(device).uuid)
    except Exception as e:  # noqa: BLE001
        notes.append(f"NVML per-process query failed: no device UUID from torch ({e})")
        return None
    nvml = Device(uuid=uuid)
    try:
        procs = nvml.processes()
        if procs is None:
            notes.append(f"NVML per-process memory unavailable: {nvml.why}")
            return None
        if os.getpid() not in procs:
            notes.append("NVML lists no compute process with this pid (containers hide host pids)")
        return procs.get(os.getpid())
    finally:
        nvml.close()


def _torch_segments(torch, device: int, paused: list) -> list:
    import bisect  # noqa: PLC0415

    from .._snapshot import segments  # noqa: PLC0415

    starts = [r[0] for r in paused]
    out = []
    for seg in segments(torch.cuda.memory_snapshot()):
        if (seg.device if seg.device is not None else device) != device:
            continue
        i = bisect.bisect_right(starts, seg.address) - 1
        if i >= 0 and seg.address < paused[i][0] + paused[i][1]:
            continue  # a paused segment: its memory went back
        out.append({"address": seg.address, "size": seg.size, "allocated": seg.allocated, "pool": seg.pool,
                    "type": seg.type, "expandable": seg.expandable})
    return out


def release_report(report=None, *, device: Optional[int] = None) -> ReleaseReport:
    """Explain a pause's effect on the driver. ``report``: the Report ``pause()`` returned (its device and
    driver free-memory delta are used); without one, the current state of ``device`` (default 0)."""
    mem = _mem()
    notes: list = []
    dev = report.device if report is not None and report.device >= 0 else (0 if device is None else device)
    paused_ranges = sorted(tuple(r) for r in mem.paused_ranges())
    rows = [r for r in mem.stats() if r["device"] == dev]
    if report is not None and report.tag is not None:
        bytes_paused = report.bytes
    else:
        bytes_paused = report.bytes if report is not None else sum(r["bytes_paused"] for r in rows)
    driver_freed = report.driver_delta if report is not None and not report.noop else None
    active = {r["tag"]: r["bytes_active"] for r in rows if r["bytes_active"]}
    g = mem.global_stats()
    torch = sys.modules.get("torch")
    free_now = total = nvml_used = None
    segs: list = []
    nccl = None
    if torch is not None and torch.cuda.is_available():
        torch.cuda.synchronize(dev)
        free_now, total = torch.cuda.mem_get_info(dev)
        nvml_used = _nvml_process_used(torch, dev, notes)
        segs = _torch_segments(torch, dev, paused_ranges)
        dist = getattr(torch, "distributed", None)
        try:
            if dist is not None and dist.is_available() and dist.is_initialized():
                backend = str(dist.get_backend())
                if "nccl" in backend:
                    nccl = f"process group up (backend {backend}): NCCL buffers are not pausable by the allocator"
        except Exception as e:  # noqa: BLE001
            notes.append(f"could not ask torch.distributed: {e}")
    else:
        notes.append("torch with CUDA not loaded: no driver view or PyTorch segments")
    pending = sum(r.get("bytes_pending_free", 0) for r in rows)
    if pending:
        notes.append(f"{pending} bytes of freed allocations are still mapped inside coalesced mappings: they go back "
                     "at their tag's next pause, or when the mapping's last allocation is freed")
    quarantined = int(g.get("quarantined_bytes", 0))
    if quarantined:
        notes.append(f"{quarantined} bytes in {g['quarantined_ranges']} freed ranges are quarantined: the driver "
                     "refused to unmap them (twice), so their memory may still be held; their addresses are never "
                     "reused")
    engine_active = sum(active.values()) + pending
    torch_reserved = sum(s["size"] for s in segs)
    # Engine allocations made through PyTorch are also PyTorch segments: count each byte once.
    engine_in_torch = 0
    for s in segs:
        try:
            paused = mem.lookup(s["address"])[3]
            if not paused:
                engine_in_torch += s["size"]
        except Exception:  # noqa: BLE001 (NotFoundError: a plain cudaMalloc segment)
            pass
    other = None
    if free_now is not None:
        other = max(0, (total - free_now) - torch_reserved - (engine_active - engine_in_torch))
    if driver_freed is not None and driver_freed < bytes_paused:
        notes.append(f"{bytes_paused - driver_freed} paused bytes did not show up as free: another process or "
                     "thread allocated meanwhile, or the driver kept them (see other_bytes)")
    if any(s["expandable"] for s in segs):
        notes.append("expandable segments hold memory outside the engine: it cannot be paused")
    return ReleaseReport(
        device=dev, bytes_paused=bytes_paused, driver_freed=driver_freed, driver_free_now=free_now,
        driver_total=total, nvml_process_used=nvml_used, active_tags=active, torch_unpaused_segments=segs,
        torch_cached_unpaused=sum(s["size"] - s["allocated"] for s in segs),
        torch_allocated_unpaused=sum(s["allocated"] for s in segs),
        expandable_segments=expandable_segments_requested(), forwarded_allocs=int(g["forwarded_allocs"]),
        forwarded_bytes=int(g["forwarded_bytes"]), shim_active=bool(mem.shim_active()), nccl=nccl,
        other_bytes=other, notes=notes, pending_free=pending, quarantined_ranges=int(g.get("quarantined_ranges", 0)),
        quarantined_bytes=quarantined)
