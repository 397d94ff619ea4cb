"""Routing allocations into the engine: ``region()``, ``disable()``, the two hook modes, child-process setup.

Hook modes (same Python API):
- ``"preload"``: libebbtide.so is in ``LD_PRELOAD`` and interposes ``cudaMalloc``/``cudaFree`` for the whole
  process. A region also enters a plain ``torch.cuda.MemPool`` per (tag, device), so the caching allocator never
  hands one tag's cached block to another tag or to untracked code.
- ``"torch"``: no environment needed: a region enters a ``MemPool`` per (tag, device) whose allocator is
  ``CUDAPluggableAllocator(libebbtide.so, "ebt_torch_malloc", "ebt_torch_free")``.
The mode is chosen at first use: "preload" when the shim is active, else "torch" (``set_hook_mode`` overrides).

Which threads a region captures: ``region()`` is thread-scoped (torch >= 2.8 routes ``use_mem_pool`` per thread;
the native region stack is thread-local). Allocations that other threads make on your behalf -- autograd's device
threads allocate gradients during backward -- are captured only by a process-wide default region
(``set_default_region`` or ``EBBTIDE_MEM_DEFAULT_TAG`` in preload mode). In torch mode those threads allocate from
the default pool, outside the engine.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Optional

from .. import _native
from ..errors import InvalidArgumentError, UnsupportedError
from ._engine import backup_code, check_tag

__all__ = ["region", "disable", "hook_mode", "set_hook_mode", "set_default_region", "preload_env",
           "configure_subprocess", "check_paused_blocks"]

_lock = threading.Lock()           # guards the state below
_mode: Optional[str] = None        # "preload" | "torch", fixed at first use
_pools: dict = {}                  # (kind, tag, device) -> MemPool; kept alive for the process (torch #146431)
_pluggable = None                  # the CUDAPluggableAllocator (torch mode), created once


def _mem():
    return _native.load().memory


def hook_mode() -> str:
    """"preload" if this process resolves cudaMalloc to ebbtide's shim, else "torch" (unless set_hook_mode)."""
    global _mode
    with _lock:
        if _mode is None:
            _mode = "preload" if _mem().shim_active() else "torch"
        return _mode


def set_hook_mode(mode: str) -> None:
    """Force "preload" or "torch" before the first region (preload needs the shim loaded via LD_PRELOAD)."""
    global _mode
    if mode not in ("preload", "torch"):
        raise InvalidArgumentError(f"hook mode must be 'preload' or 'torch', not {mode!r}")
    if mode == "preload" and not _mem().shim_active():
        raise UnsupportedError("preload mode needs libebbtide.so in LD_PRELOAD (see ebbtide.memory.preload_env())")
    with _lock:
        if _pools and _mode != mode:
            raise InvalidArgumentError(f"hook mode is already {_mode!r} and regions have been used")
        _mode = mode


def _torch_cuda():
    """torch, if the program imported it and it sees a GPU; else None (native routing only: a program that never
    imported torch has no caching allocator to route, and importing it here would cost seconds)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    return torch if torch.cuda.is_available() else None


def _expandable_segments_requested() -> bool:
    conf = (os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", ""))
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def _pool(torch, kind: str, tag: str, device: int):
    global _pluggable
    key = (kind, tag, device)
    with _lock:
        pool = _pools.get(key)
        if pool is not None:
            return pool
        if kind == "torch":
            if _pluggable is None:
                _pluggable = torch.cuda.memory.CUDAPluggableAllocator(
                    _native.runtime_library_path(), "ebt_torch_malloc", "ebt_torch_free")
            with torch.cuda.device(device):
                pool = torch.cuda.MemPool(allocator=_pluggable.allocator())
        else:
            with torch.cuda.device(device):
                pool = torch.cuda.MemPool()
        _pools[key] = pool
        return pool


@contextlib.contextmanager
def region(tag: str = "default", backup: str = "none", *, device: Optional[int] = None):
    """Allocations this thread makes inside land in ``tag`` and become pausable. ``backup="cpu"`` keeps their
    content across pause/resume (pinned host copy); ``"none"`` discards it. Regions nest. ``device`` picks the
    CUDA device whose pool to use (default: current)."""
    check_tag(tag, allow_none=False)
    code = backup_code(backup)
    mode = hook_mode()
    if mode == "preload" and _expandable_segments_requested():
        raise UnsupportedError(
            "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True: its memory bypasses cudaMalloc, so the preload "
            "shim would silently miss it. Turn it off, or use the torch hook mode (ebbtide.memory.set_hook_mode).")
    mem = _mem()
    token = mem.region_push(tag, code)
    try:
        torch = _torch_cuda()
        if torch is None:
            yield
            return
        dev = torch.cuda.current_device() if device is None else int(device)
        pool = _pool(torch, mode, tag, dev)
        with torch.cuda.use_mem_pool(pool, device=dev):
            yield
    finally:
        mem.region_pop(token)


@contextlib.contextmanager
def disable(*, device: Optional[int] = None):
    """Allocations this thread makes inside bypass ebbtide (plain cudaMalloc memory, e.g. for CUDA IPC), even
    inside a region. They come from a separate pool, never from a region's cached blocks."""
    mem = _mem()
    prev = mem.set_disabled(1)
    mem.set_disabled(prev + 1)
    try:
        torch = _torch_cuda()
        if torch is None:
            yield
            return
        dev = torch.cuda.current_device() if device is None else int(device)
        pool = _pool(torch, "disabled", "", dev)
        with torch.cuda.use_mem_pool(pool, device=dev):
            yield
    finally:
        mem.set_disabled(prev)


def set_default_region(tag: Optional[str], backup: str = "none") -> None:
    """Process-wide region for threads that have none (autograd and NCCL threads); None clears it. Preload mode
    captures every such cudaMalloc; in torch mode it only applies to ebt_torch_malloc calls."""
    if tag is None:
        _mem().set_default_region(None, 0)
        return
    check_tag(tag, allow_none=False)
    _mem().set_default_region(tag, backup_code(backup))


def preload_env(env: Optional[dict] = None, *, default_tag: Optional[str] = None,
                default_backup: str = "none") -> dict:
    """A copy of ``env`` (default os.environ) whose LD_PRELOAD starts with libebbtide.so (once), for a child
    process that should run in preload mode. ``default_tag`` makes every allocation of the child pausable from its
    start (EBBTIDE_MEM_DEFAULT_TAG / EBBTIDE_MEM_DEFAULT_BACKUP), like a trainer launched under the shim."""
    out = dict(os.environ if env is None else env)
    lib = _native.runtime_library_path()
    rest = [p for p in out.get("LD_PRELOAD", "").replace(" ", ":").split(":")
            if p and os.path.basename(p) != os.path.basename(lib)]
    out["LD_PRELOAD"] = ":".join([lib, *rest])
    if default_tag is not None:
        check_tag(default_tag, allow_none=False)
        backup_code(default_backup)
        out["EBBTIDE_MEM_DEFAULT_TAG"] = default_tag
        out["EBBTIDE_MEM_DEFAULT_BACKUP"] = default_backup
    return out


@contextlib.contextmanager
def configure_subprocess(**kwargs):
    """Inside, os.environ carries preload_env(**kwargs), so processes started here (subprocess,
    multiprocessing "spawn") run in preload mode. The parent's environment is restored on exit."""
    saved = dict(os.environ)
    os.environ.update(preload_env(**kwargs))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def check_paused_blocks() -> list:
    """Live caching-allocator blocks that lie inside paused ranges (a bug: something allocated through a paused
    pool). Walks torch.cuda.memory_snapshot(); returns dicts with address, size, state, segment pool id."""
    torch = _torch_cuda()
    if torch is None:
        return []
    ranges = sorted(_mem().paused_ranges())
    if not ranges:
        return []
    import bisect  # noqa: PLC0415

    starts = [r[0] for r in ranges]
    bad = []
    for seg in torch.cuda.memory_snapshot():
        addr = seg["address"]
        for blk in seg.get("blocks", []):
            if blk.get("state") != "active_allocated":
                continue
            i = bisect.bisect_right(starts, addr) - 1
            if i >= 0 and addr < ranges[i][0] + ranges[i][1]:
                bad.append({"address": addr, "size": blk["size"], "state": blk["state"],
                            "segment_pool_id": seg.get("segment_pool_id")})
            addr += blk["size"]
    return bad
