"""Pause/resume, reports, stats and host-arena control over the native engine (``ebbtide._C.memory``).

Every call here reaches the one engine inside libebbtide.so, whichever hook mode captured the allocations.
Errors are the typed ``ebbtide`` exceptions; an out-of-memory resume raises :class:`ebbtide.OutOfMemoryError`
with ``needed``, ``free`` and ``holders`` (bytes per tag on that device, plus ``"<untracked>"``) and leaves the
tag paused, ready to retry.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Optional

from ..errors import InvalidArgumentError, OutOfMemoryError, WaitTimeoutError
from ._check import record_pause_baseline
from ._common import check_tag, mem as _mem

__all__ = [
    "Report", "Pending", "pause", "resume", "pause_async", "resume_async", "mark_clean", "stats",
    "release_host_memory", "reserve_host_memory", "get_cpu_backup_address", "paused_ranges",
    "set_background_pinning", "wait_background_pinning", "get_cpu_backup", "set_memory_margin", "memory_margin",
    "set_coalescing", "coalescing",
]


@dataclasses.dataclass(frozen=True)
class Report:
    """What one pause or resume did (seconds, bytes). ``gbps`` is the copy bandwidth (bytes_copied / copy_s);
    ``driver_delta`` is how much the driver's free memory changed on ``device`` (positive after a pause that
    gave memory back)."""

    kind: str
    tag: Optional[str]
    noop: bool
    device: int
    allocations: int
    bytes: int
    bytes_copied: int
    bytes_skipped_clean: int
    sync_s: float
    copy_s: float
    unmap_s: float
    map_s: float
    total_s: float
    driver_free_before: int
    driver_free_after: int
    create_s: float = 0.0  # resume: cuMemCreate time (inside map_s)
    access_s: float = 0.0  # resume: cuMemSetAccess time (inside map_s)
    unmap_calls: int = 0   # pause: driver unmap calls (one per VA-contiguous run where the driver accepts it)
    mappings: int = 0      # driver mappings unmapped/created (= allocations unless resume coalesced runs of them)
    bytes_pending_freed: int = 0  # pause: freed members of coalesced mappings given back (not in ``bytes``)
    meminfo_s: float = 0.0   # cuMemGetInfo calls (resume pre-flight, driver_free_* figures)
    map_call_s: float = 0.0  # resume: cuMemMap + cuMemRelease time (inside map_s)
    prepare_s: float = 0.0   # selection under the engine lock before the op ran (not inside total_s)
    host_wait_s: float = 0.0     # pause: time the copies waited for fresh host pieces (transient copies)
    host_release_s: float = 0.0  # resume: time spent giving transient host pieces back
    disk_s: float = 0.0          # disk tier: file writes (pause) or reads (resume)
    bytes_disk: int = 0          # disk tier: bytes written (pause) or read (resume)

    @classmethod
    def from_native(cls, kind: str, tag: Optional[str], d: dict) -> "Report":
        fields = {f.name for f in dataclasses.fields(cls)} - {"kind", "tag"}
        return cls(kind=kind, tag=tag, **{k: d[k] for k in fields if k in d})

    @property
    def gbps(self) -> Optional[float]:
        return self.bytes_copied / self.copy_s / 1e9 if self.copy_s > 0 and self.bytes_copied else None

    @property
    def driver_delta(self) -> int:
        return self.driver_free_after - self.driver_free_before


def _holders(device: int) -> dict:
    held: dict = {}
    for row in _mem().stats():
        b = row["bytes_active"] + row.get("bytes_pending_free", 0)  # freed but still mapped (coalesced)
        if row["device"] == device and b:
            held[row["tag"]] = held.get(row["tag"], 0) + b
    return held


def _raise_typed(e: Exception, kind: str, tag: Optional[str]):
    """Attach needed/free/holders to an out-of-memory error (native report fields)."""
    if isinstance(e, OutOfMemoryError):
        rep = getattr(e, "report", None) or {}
        dev = rep.get("oom_device", -1)
        holders = _holders(dev) if dev is not None and dev >= 0 else {}
        err = type(e)(str(e), needed=rep.get("oom_needed") or None, free=rep.get("oom_free"),
                      holders=holders)  # HostOutOfMemoryError stays one
        err.report = rep
        err.device = dev
        raise err from None
    raise e


def _finish(kind: str, tag: Optional[str], d: dict) -> Report:
    rep = Report.from_native(kind, tag, d)
    if rep.noop and tag is not None:
        state = "paused" if kind == "pause" else "active"
        warnings.warn(f"ebbtide.memory.{kind}({tag!r}): the tag is already {state}; nothing done", stacklevel=3)
    return rep


def pause(tag: Optional[str] = None, *, wait: bool = True):
    """Release the GPU memory of ``tag`` (None: every tag), keeping every address. CPU-backed allocations are
    copied to the pinned host arena first. Returns a :class:`Report` (or a :class:`Pending` with wait=False).
    Pausing a paused tag warns and does nothing."""
    if not wait:
        return pause_async(tag)
    check_tag(tag, allow_none=True)
    record_pause_baseline()
    try:
        return _finish("pause", tag, _mem().pause(tag))
    except OutOfMemoryError as e:
        _raise_typed(e, "pause", tag)


def resume(tag: Optional[str] = None, *, wait: bool = True):
    """Map memory back at the same addresses for ``tag`` (None: every paused tag) and restore CPU backups.
    Raises OutOfMemoryError (tag stays paused, retry later) when the device lacks room."""
    if not wait:
        return resume_async(tag)
    check_tag(tag, allow_none=True)
    try:
        return _finish("resume", tag, _mem().resume(tag))
    except OutOfMemoryError as e:
        _raise_typed(e, "resume", tag)


class Pending:
    """An asynchronous pause or resume. ``wait()`` returns its Report (or raises its error); ``done()`` polls."""

    def __init__(self, op, kind: str, tag: Optional[str]):
        self._op = op
        self.kind = kind
        self.tag = tag
        self._report: Optional[Report] = None
        self._error: Optional[BaseException] = None

    def wait(self, timeout: Optional[float] = None) -> Report:
        if self._report is not None:
            return self._report
        if self._error is not None:
            raise self._error
        try:
            d = self._op.wait(-1.0 if timeout is None else float(timeout))
        except WaitTimeoutError:
            raise
        except OutOfMemoryError as e:
            try:
                _raise_typed(e, self.kind, self.tag)
            except BaseException as typed:  # noqa: BLE001 (remember and re-raise the typed error)
                self._error = typed
                raise
        except BaseException as e:  # noqa: BLE001
            self._error = e
            raise
        self._report = _finish(self.kind, self.tag, d)
        return self._report

    def done(self) -> bool:
        if self._report is not None or self._error is not None:
            return True
        try:
            self._op.wait(0.0)
        except WaitTimeoutError:
            return False
        except Exception:  # noqa: BLE001 (finished with an error: wait() will raise it)
            return True
        return True


def pause_async(tag: Optional[str] = None) -> Pending:
    """Start a pause on a runtime thread and return at once. A pause and a resume of different tags (or
    processes) overlap: D2H and H2D run on separate copy streams."""
    check_tag(tag, allow_none=True)
    record_pause_baseline()
    return Pending(_mem().pause_async(tag), "pause", tag)


def resume_async(tag: Optional[str] = None) -> Pending:
    """Start a resume on a runtime thread. The tag's tensors must not be touched before ``wait()`` returns."""
    check_tag(tag, allow_none=True)
    return Pending(_mem().resume_async(tag), "resume", tag)


def mark_clean(tag: str) -> None:
    """Promise that ``tag``'s CPU-backed tensors were not modified since they were restored (e.g. rollout weights
    between updates): the next pause skips their copies."""
    check_tag(tag, allow_none=False)
    _mem().mark_clean(tag)


def stats() -> dict:
    """``{"tags": [row per (tag, device)], "global": {...}}``. A row has state, allocations, handles (driver
    mappings: a coalesced run counts once), bytes_requested/active/paused/backed_up, bytes_pending_free (freed but
    still mapped inside a coalesced run, see set_coalescing) and the last pause/resume reports; "global" has the
    host arena (reserved/used/segments/register seconds), the shim's forwarded (untracked) allocations and engine
    counters (coalesced_mappings, bytes_pending_free among them)."""
    m = _mem()
    return {"tags": list(m.stats()), "global": dict(m.global_stats())}


def release_host_memory() -> int:
    """Give pinned host memory back to the OS: backups of active tensors are dropped (their next pause copies
    again) and empty arena segments are unregistered. Paused content is never dropped. Returns bytes released."""
    return int(_mem().release_host_memory())


def reserve_host_memory(nbytes: int) -> None:
    """Pin ``nbytes`` of host arena now (pre-touched, registered by several threads) so the first CPU-backed
    pause does not pay for pinning. Blocking; run it in a thread to pin in the background."""
    if not isinstance(nbytes, int) or nbytes <= 0:
        raise InvalidArgumentError(f"nbytes must be a positive int, not {nbytes!r}")
    _mem().reserve_host_memory(nbytes)


def set_background_pinning(enabled: bool) -> None:
    """Pin the host blocks of CPU-backed allocations on a runtime thread soon after they are made (default on;
    EBBTIDE_MEM_PREPIN=0 starts with it off), so the first pause only copies. Off: the first pause pins."""
    _mem().set_background_pinning(bool(enabled))


def wait_background_pinning() -> None:
    """Block until queued background pinning is done (e.g. before timing a first pause)."""
    _mem().wait_background_pinning()


def get_cpu_backup_address(ptr: int) -> tuple:
    """(host address or 0, bytes to the backup's end) of the engine allocation containing device address
    ``ptr``. The backup is current while the tensor is paused. O(log n)."""
    return tuple(_mem().get_cpu_backup(int(ptr)))


def get_cpu_backup(tensor, *, zero_copy: bool = False):
    """The host backup of a contiguous CUDA tensor in a CPU-backed region, as a CPU tensor of the same dtype and
    shape (None if it has no host copy yet). ``zero_copy=True`` returns a view of the pinned arena (valid until
    the tensor is freed or release_host_memory() runs; current while the tensor is paused); otherwise a copy."""
    import ctypes  # noqa: PLC0415

    import torch  # noqa: PLC0415

    if not tensor.is_contiguous():
        raise InvalidArgumentError("get_cpu_backup needs a contiguous tensor")
    nbytes = tensor.numel() * tensor.element_size()
    host, avail = get_cpu_backup_address(tensor.data_ptr())
    if not host:
        return None
    if avail < nbytes:
        raise InvalidArgumentError(f"tensor spans {nbytes} bytes but its allocation's backup has {avail} from there")
    if nbytes == 0:
        return torch.empty(tensor.shape, dtype=tensor.dtype)
    raw = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(host), dtype=torch.uint8)
    view = raw.view(tensor.dtype).view(tensor.shape)
    return view if zero_copy else view.clone()


def set_memory_margin(nbytes: int) -> None:
    """Keep ``nbytes`` of device memory free: an allocation into a region that would leave less fails as out of
    memory (PyTorch then frees its cache and retries, then raises torch.OutOfMemoryError), and a resume that would
    leave less raises OutOfMemoryError before touching anything (the tag stays paused). 0 turns it off.
    EBBTIDE_MEM_MARGIN_BYTES sets it at process start."""
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise InvalidArgumentError(f"margin must be a non-negative int (bytes), not {nbytes!r}")
    _mem().set_memory_margin(nbytes)


def memory_margin() -> int:
    """The memory margin in bytes (0: off)."""
    return int(_mem().memory_margin())


def set_coalescing(enabled: bool) -> None:
    """Coalesced resume (on by default; EBBTIDE_MEM_COALESCE=0 turns it off at process start): a resume maps each
    VA-contiguous run of a tag's allocations on one device (at most EBBTIDE_MEM_COALESCE_MAX_BYTES, default 4 GiB;
    shareable ones excepted) as ONE physical allocation, and the next pause unmaps it with one call. The driver's
    pause/resume cost is per mapping, so many small allocations get much cheaper. An allocation of such a run freed
    while active vanishes from lookups and stats at once, but its memory stays mapped (``stats()``
    ``bytes_pending_free``) until the run is unmapped: the tag's next pause, the run's last free, or an allocation
    or resume on that device that runs short, which rebuilds the run without it at the same addresses (global
    stats ``zombie_reclaims``; docs/memory.md "Coalesced mappings")."""
    if not isinstance(enabled, bool):
        raise InvalidArgumentError(f"enabled must be a bool, not {enabled!r}")
    _mem().set_coalescing(enabled)


def coalescing() -> bool:
    """Whether resume coalesces VA-contiguous runs into one mapping (see set_coalescing)."""
    return bool(_mem().coalescing())


def paused_ranges() -> list:
    """(start, length) of every paused allocation's VA range."""
    return [tuple(r) for r in _mem().paused_ranges()]
