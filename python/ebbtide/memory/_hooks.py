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
import threading
from typing import Optional

from .. import _native
from ..errors import InvalidArgumentError, UnsupportedError
from ._common import backup_code, check_tag, expandable_segments_requested, mem as _mem, torch_cuda as _torch_cuda

__all__ = ["region", "disable", "graph", "hook_mode", "set_hook_mode", "set_default_region", "preload_env",
           "configure_subprocess", "region_with_code", "new_pool"]

_lock = threading.Lock()           # guards the state below
_mode: Optional[str] = None        # "preload" | "torch", fixed at first use
# (kind, tag, device, epoch) -> MemPool, kept alive for the process: a tensor that outlives its MemPool is freed
# by PyTorch with the default allocator's cudaFree instead of the pool's allocator (ebt_torch_free).
_pools: dict = {}
_pluggable = None                  # the CUDAPluggableAllocator (torch mode), created once


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


def pool_epoch(tag: str):
    """Which pool generation a region of ``tag`` uses now (the paused-block guard).

    A tag's pool caches free blocks inside the tag's segments; while the tag is paused those segments are unmapped,
    and the caching allocator would hand such a block to a new allocation (a crash on first touch). So while the
    tag is paused (or an op owns it), its regions use a pool of that pause's own: ("paused", n) for the n-th
    pause, which holds no paused block until the tag is paused again, when n moves on. n counts pauses begun, so
    a region opened while pause n+1 is still running (pause_async) already gets the fresh pool n+1, never pool n
    whose blocks that pause is unmapping. An active tag uses its main pool ("main"), whose blocks are all mapped
    again after the resume."""
    state, pauses = _mem().tag_state(tag)
    if state == "active":
        return "main"
    return ("paused", pauses)


def region_pool_kind(mode: str, code: int) -> str:
    """Regions of one tag with different backup policies (or shareability) use different pools: a cached block of
    a CPU-backed segment must never serve a discard-mode tensor or the other way round (the segment's policy
    decides what a pause keeps). ``code`` is the native backup code (base and flags)."""
    return f"{mode}/{code:#x}"


def new_pool(torch, mode: str, device: int):
    """A MemPool on ``device`` for regions in hook mode ``mode``: its allocator is ebbtide's pluggable one in torch
    mode (plain in preload mode, where the shim takes the pool's cudaMalloc calls)."""
    global _pluggable
    with torch.cuda.device(device):
        if mode != "torch":
            return torch.cuda.MemPool()
        with _lock:
            if _pluggable is None:
                _pluggable = torch.cuda.memory.CUDAPluggableAllocator(
                    _native.runtime_library_path(), "ebt_torch_malloc", "ebt_torch_free")
        return torch.cuda.MemPool(allocator=_pluggable.allocator())


def _pool(torch, kind: str, tag: str, device: int, epoch="main"):
    key = (kind, tag, device, epoch)
    with _lock:
        pool = _pools.get(key)
        if pool is not None:
            return pool
    mode = "torch" if kind.startswith(("torch", "graph-torch")) else "preload"
    pool = new_pool(torch, mode, device)
    with _lock:
        return _pools.setdefault(key, pool)


@contextlib.contextmanager
def region_with_code(tag: str, code: int, *, device: Optional[int] = None, pool=None):
    """The body of region(): allocations of this thread land in ``tag`` with native backup ``code``. ``pool``:
    the MemPool to use while the tag is active (the caller keeps it alive); while the tag is paused the region
    uses a pool of that pause's own either way (the paused-block guard, ``pool_epoch``)."""
    check_tag(tag, allow_none=False)
    mode = hook_mode()
    _refuse_expandable_segments(mode)
    mem = _mem()
    token = mem.region_push(tag, code)
    try:
        torch = _torch_cuda()
        if torch is None:
            yield
            return
        dev = torch.cuda.current_device() if device is None else int(device)
        epoch = pool_epoch(tag)
        if pool is None or epoch != "main":
            pool = _pool(torch, region_pool_kind(mode, code), tag, dev, epoch)
        with torch.cuda.use_mem_pool(pool, device=dev):
            yield
    finally:
        mem.region_pop(token)


@contextlib.contextmanager
def region(tag: str = "default", backup: str = "none", *, host: str = "arena", device: Optional[int] = None,
           shareable: bool = False):
    """Allocations this thread makes inside land in ``tag`` and become pausable. ``backup``: "none" discards their
    content at pause; "cpu" keeps it in host memory; "disk" writes it to a file in the disk-backup directory
    (``set_disk_backup_dir``) and reads it back at resume. ``host`` (with "cpu"): "arena" (the default, ebbtide's
    fastest: a persistent pinned arena, so its host memory stays held while the tensor is active; see
    ``host_memory()`` and ``release_host_memory()``), "transient" (torch_memory_saver's semantics: a host copy made
    by each pause and given back by the resume, unless ``set_host_retention(True)``) or "pageable" (transient, and
    pageable while paused). Regions nest. ``device`` picks the CUDA device whose pool to use (default: current).
    ``shareable=True`` makes the memory exportable to other processes (``ebbtide.memory.export_tensor``); it comes
    from a pool of its own."""
    code = backup_code(backup, host) | (_mem().SHAREABLE if shareable else 0)
    with region_with_code(tag, code, device=device):
        yield


def _refuse_expandable_segments(mode: str) -> None:
    if mode == "preload" and expandable_segments_requested():
        raise UnsupportedError(
            "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True: its memory bypasses cudaMalloc, so the preload "
            "shim would silently miss it. Turn it off, or use the torch hook mode (ebbtide.memory.set_hook_mode).")


@contextlib.contextmanager
def graph(cuda_graph, *, tag: str = "graph", backup: str = "none", host: str = "arena", pool=None, stream=None,
          capture_error_mode: str = "global", device: Optional[int] = None):
    """``torch.cuda.graph(cuda_graph, ...)`` whose private memory is pausable: the capture allocates from a
    graph pool of ``tag`` (engine memory in both hook modes), so ``pause(tag)`` releases the graph's buffers and
    ``resume(tag)`` maps them back at the same addresses; replay after resume then works as before. With
    ``backup="none"`` the graph's intermediate buffers are scratch (their content is recomputed by replay).

    ``pool``: preload mode uses it as given (graphs sharing a pool share memory; the shim routes the capture's
    cudaMalloc calls into ``tag``). Torch mode needs a pool whose allocator is ebbtide's, so every capture with the
    same tag and device shares the tag's graph pool instead, and a given ``pool`` is ignored with a warning."""
    torch = _torch_cuda()
    if torch is None:
        raise UnsupportedError("ebbtide.memory.graph needs torch with a CUDA device")
    check_tag(tag, allow_none=False)
    code = backup_code(backup, host)
    mode = hook_mode()
    _refuse_expandable_segments(mode)
    dev = torch.cuda.current_device() if device is None else int(device)
    if pool is not None and mode == "torch":
        import warnings  # noqa: PLC0415

        warnings.warn("ebbtide.memory.graph: torch hook mode captures into the tag's own graph pool; the pool "
                      "argument is ignored (graphs of one tag share that pool)", stacklevel=3)
        pool = None
    mem = _mem()
    mem.wait_background_pinning()  # no host registration in flight when the capture starts
    token = mem.region_push(tag, code)
    try:
        if pool is None:
            pool = _pool(torch, "graph-" + region_pool_kind(mode, code), tag, dev, pool_epoch(tag)).id
        with torch.cuda.device(dev), torch.cuda.graph(cuda_graph, pool=pool, stream=stream,
                                                     capture_error_mode=capture_error_mode):
            yield
    finally:
        mem.region_pop(token)


@contextlib.contextmanager
def disable(*, device: Optional[int] = None, transient_pool: bool = False):
    """Allocations this thread makes inside bypass ebbtide (plain cudaMalloc memory, e.g. for CUDA IPC), even
    inside a region. They come from a separate pool, never from a region's cached blocks. ``transient_pool=True``
    uses a fresh pool that is dropped on exit, so its cached memory goes back to the driver (tensors made inside
    must not outlive the block; torch_memory_saver's disable() behaves this way)."""
    mem = _mem()
    # The native flag is a per-thread nesting depth set absolutely: read the depth, then store depth + 1.
    prev = mem.set_disabled(1)
    mem.set_disabled(prev + 1)
    try:
        torch = _torch_cuda()
        if torch is None:
            yield
            return
        dev = torch.cuda.current_device() if device is None else int(device)
        if transient_pool:
            with torch.cuda.device(dev):
                pool = torch.cuda.MemPool()
        else:
            pool = _pool(torch, "disabled", "", dev)
        with torch.cuda.use_mem_pool(pool, device=dev):
            yield
        del pool  # transient: ~MemPool gives its cached blocks back (the persistent one stays in _pools)
    finally:
        mem.set_disabled(prev)


def set_default_region(tag: Optional[str], backup: str = "none", host: str = "arena") -> None:
    """Process-wide region for threads that have none (autograd and NCCL threads); None clears it. Preload mode
    captures every such cudaMalloc; in torch mode it only applies to ebt_torch_malloc calls. ``backup`` and
    ``host`` as for region()."""
    if tag is None:
        _mem().set_default_region(None, 0)
        return
    check_tag(tag, allow_none=False)
    _refuse_expandable_segments(hook_mode())
    _mem().set_default_region(tag, backup_code(backup, host))


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
