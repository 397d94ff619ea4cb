"""The ``torch_memory_saver`` API (fzyzcjy/torch_memory_saver, as of 0.0.10) backed by ebbtide.memory.

Contract: the same names, signatures and call semantics as that package's public surface -- the singleton
``torch_memory_saver`` (``region``, ``cuda_graph``, ``disable``, ``pause``, ``resume``, ``hook_mode`` and
``memory_margin_bytes`` setters, ``retain_cpu_backup``, ``get_cpu_backup``, ``enabled``) and the module-level
``configure_subprocess()`` -- so SGLang and slime switch by changing one import (see ebbtide.compat for the
sys.path switch). Differences, all deliberate:
- Errors are ebbtide's typed exceptions (an OOM at resume raises OutOfMemoryError and leaves the tag paused,
  retryable, where the original aborts the process).
- ``hook_mode`` defaults to what the process allows ("preload" when libebbtide.so is preloaded, else "torch")
  instead of always "preload"; ``cuda_graph`` works in both modes.
- CPU backups live in ebbtide's persistent pinned arena: ``cpu_backup_backend`` "pinned" and "mmap" both use it;
  ``retain_cpu_backup=False`` gives the arena back to the OS after every resume.
- Disk backup (``enable_disk_backup``, ``set_disk_backup_dir``) is not supported: UnsupportedError.
- Pausing or resuming a tag no region ever named does nothing (as there); double pause/resume warn.
- ``TMS_INIT_ENABLE=1`` (+ ``TMS_INIT_ENABLE_CPU_BACKUP=1``) in a preloaded process makes every allocation land in
  tag "default", as there (read by libebbtide.so at load; EBBTIDE_MEM_DEFAULT_TAG takes precedence).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Optional

import ebbtide.memory as _em
from ebbtide.errors import InvalidArgumentError, NotFoundError, UnsupportedError

__all__ = ["TorchMemorySaver", "torch_memory_saver", "configure_subprocess"]

logger = logging.getLogger(__name__)

_TAG_DEFAULT = "default"
_BACKENDS = (None, "pinned", "mmap")


def _backup(enable_cpu_backup: bool, cpu_backup_backend: Optional[str]) -> str:
    if cpu_backup_backend not in _BACKENDS:
        raise InvalidArgumentError(f"cpu_backup_backend must be one of {_BACKENDS}, not {cpu_backup_backend!r}")
    if cpu_backup_backend is not None and not enable_cpu_backup:
        raise InvalidArgumentError("cpu_backup_backend requires enable_cpu_backup=True")
    return "cpu" if enable_cpu_backup else "none"


class TorchMemorySaver:
    """One per process (use the module's ``torch_memory_saver``)."""

    def __init__(self):
        self._retain_cpu_backup = True

    @contextlib.contextmanager
    def region(self, tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False, enable_disk_backup: bool = False,
               cpu_backup_backend: Optional[str] = None):
        """Allocations made inside are pausable under ``tag``; ``enable_cpu_backup`` keeps their content."""
        if enable_disk_backup:
            raise UnsupportedError("disk backup is not supported by ebbtide; use enable_cpu_backup=True")
        with _em.region(tag, _backup(enable_cpu_backup, cpu_backup_backend)):
            yield

    @contextlib.contextmanager
    def cuda_graph(self, cuda_graph, pool=None, stream=None, capture_error_mode="global",
                   tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False,
                   cpu_backup_backend: Optional[str] = None):
        """Like ``torch.cuda.graph``, with the graph's memory pausable under ``tag`` (both hook modes)."""
        with _em.graph(cuda_graph, tag=tag, backup=_backup(enable_cpu_backup, cpu_backup_backend), pool=pool,
                       stream=stream, capture_error_mode=capture_error_mode):
            yield

    @contextlib.contextmanager
    def disable(self):
        """Allocations inside bypass the saver (plain memory from a fresh pool, given back on exit)."""
        with _em.disable(transient_pool=True):
            yield

    def pause(self, tag: Optional[str] = None):
        """Release the memory of ``tag`` (None: every tag), keeping addresses."""
        try:
            _em.pause(tag)
        except NotFoundError:
            logger.debug("pause(%r): no region ever used this tag; nothing to do", tag)

    def resume(self, tag: Optional[str] = None):
        """Map ``tag``'s memory back (None: every paused tag) and restore CPU backups."""
        try:
            _em.resume(tag)
        except NotFoundError:
            logger.debug("resume(%r): no region ever used this tag; nothing to do", tag)
            return
        if not self._retain_cpu_backup:
            _em.release_host_memory()

    @property
    def enabled(self):
        return True

    @property
    def hook_mode(self):
        return _em.hook_mode()

    @hook_mode.setter
    def hook_mode(self, hook_mode: str):
        _em.set_hook_mode(hook_mode)

    @property
    def memory_margin_bytes(self):
        return _em.memory_margin()

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int):
        _em.set_memory_margin(int(value))

    @property
    def retain_cpu_backup(self) -> bool:
        return self._retain_cpu_backup

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool):
        self._retain_cpu_backup = bool(value)

    def get_cpu_backup(self, x, zero_copy: bool = False):
        """The host copy of a CUDA tensor in a CPU-backed region (None if it has none), as a CPU tensor."""
        if not x.is_cuda:
            raise InvalidArgumentError(f"get_cpu_backup needs a CUDA tensor, not one on {x.device}")
        return _em.get_cpu_backup(x, zero_copy=zero_copy)

    def set_disk_backup_dir(self, path: str):
        raise UnsupportedError("disk backup is not supported by ebbtide; use enable_cpu_backup=True")

    def configure_subprocess(self):
        """Same as the module-level configure_subprocess()."""
        return configure_subprocess()

    def _ensure_initialized(self):
        """Kept for callers of the original's private initializer; nothing to do here."""


def configure_subprocess():
    """Context manager: processes started inside run with libebbtide.so preloaded (preload hook mode);
    LD_PRELOAD entries already present are kept after ours, and the environment is restored on exit."""
    return _em.configure_subprocess()


torch_memory_saver = TorchMemorySaver()
