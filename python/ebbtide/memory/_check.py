"""The paused-block checker: live PyTorch blocks inside paused memory that were not live when it was paused.

A caching-allocator block handed out inside a paused (unmapped) segment faults on first touch. The region pools
prevent that (see ``_hooks.pool_epoch``); this module finds it when something bypasses them. While checking is on,
every ``pause()`` first records the addresses of the live PyTorch blocks (one ``torch.cuda.memory_snapshot()``
per pause); ``check()`` then reports blocks inside paused ranges that are not among them. Pauses made through the
C API directly are not recorded, so their tensors would be reported.
"""
from __future__ import annotations

import bisect

from .. import settings
from ..errors import StateError
from ._common import mem, torch_cuda

__all__ = ["check_paused_blocks", "check", "set_checking", "record_pause_baseline"]

CHECK = settings.declare("EBBTIDE_MEM_CHECK", settings.parse_bool, False,
                         "record live PyTorch blocks at each pause so ebbtide.memory.check() can judge (debug)")

_checking: bool | None = None  # None: not decided yet (EBBTIDE_MEM_CHECK at first use); set_checking overrides
_baseline: set = set()          # addresses of blocks live when a pause was requested


def _enabled() -> bool:
    global _checking
    if _checking is None:
        _checking = bool(settings.get(CHECK))
    return _checking


def check_paused_blocks() -> list:
    """Live caching-allocator blocks that lie inside paused ranges (a bug: something allocated through a paused
    pool). Walks torch.cuda.memory_snapshot(); returns dicts with address, size, state, segment pool id."""
    torch = torch_cuda()
    if torch is None:
        return []
    ranges = sorted(mem().paused_ranges())
    if not ranges:
        return []
    starts = [r[0] for r in ranges]
    bad = []
    for seg, blk in _live_blocks(torch):
        i = bisect.bisect_right(starts, blk.address) - 1
        if i >= 0 and blk.address < ranges[i][0] + ranges[i][1]:
            bad.append({"address": blk.address, "size": blk.size, "state": blk.state,
                        "segment_pool_id": seg.pool})
    return bad


def _live_blocks(torch):
    """(segment, block) of every active_allocated block in torch.cuda.memory_snapshot() (``ebbtide._snapshot``)."""
    from .._snapshot import segments  # noqa: PLC0415

    for seg in segments(torch.cuda.memory_snapshot()):
        for blk in seg.live:
            yield seg, blk


def set_checking(enabled: bool) -> None:
    """Debug: from now on every ``pause()`` records the live PyTorch blocks (one memory_snapshot per pause), so
    ``check()`` can tell a paused tensor (live at its pause: expected) from a block handed out after the pause
    inside paused memory (the bug). EBBTIDE_MEM_CHECK=1 turns it on from the start."""
    global _checking
    _checking = bool(enabled)


def record_pause_baseline() -> None:
    """Called by pause()/pause_async() before pausing (only while checking is on)."""
    if not _enabled():
        return
    torch = torch_cuda()
    if torch is None:
        return
    _baseline.update(blk.address for _, blk in _live_blocks(torch))


def check(*, raise_on_error: bool = False) -> list:
    """The paused-block checker: live PyTorch blocks inside paused memory that were not live when their memory
    was paused -- an allocation the caching allocator placed in a paused segment, which faults on first touch.
    Each is a dict (address, size, state, segment_pool_id); empty when all is well. Needs checking on before the
    pauses it judges (``set_checking(True)`` or EBBTIDE_MEM_CHECK=1); pauses made through the C API directly are
    not recorded, so their tensors would be reported. ``raise_on_error=True`` raises StateError instead."""
    if not _enabled():
        raise StateError("ebbtide.memory.check() needs checking on before pausing: call "
                         "ebbtide.memory.set_checking(True) (or set EBBTIDE_MEM_CHECK=1)")
    live_now = check_paused_blocks()
    bad = [b for b in live_now if b["address"] not in _baseline]
    if bad and raise_on_error:
        lines = ", ".join(f"{b['size']} B at {b['address']:#x}" for b in bad[:8])
        raise StateError(f"{len(bad)} block(s) allocated inside paused memory: {lines}")
    return bad
