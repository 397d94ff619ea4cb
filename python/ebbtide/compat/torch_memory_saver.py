"""The ``torch_memory_saver`` API (fzyzcjy/torch_memory_saver, as of 0.0.10) backed by ebbtide.memory.

Contract: the same names, signatures and call semantics as that package's public surface -- the singleton
``torch_memory_saver`` (``region``, ``cuda_graph``, ``disable``, ``pause``, ``resume``, ``hook_mode`` and
``memory_margin_bytes`` setters, ``retain_cpu_backup``, ``get_cpu_backup``, ``set_disk_backup_dir``, ``enabled``)
and the module-level ``configure_subprocess()`` -- so SGLang and slime switch by changing one import (see
ebbtide.compat for the sys.path switch). Its semantics by default:

- A CPU backup is transient: each pause copies into fresh host memory and the resume gives it back, so
  ``get_cpu_backup(t)`` is None after a resume and the process's RSS falls back, unless ``retain_cpu_backup = True``
  (then the copy stays, at the same address, until a resume without retention). ``cpu_backup_backend``: "pinned"
  (page-locked while held) or "mmap" (pageable while paused, unmapped at resume).
- ``enable_disk_backup`` writes to files in ``set_disk_backup_dir()`` / TMS_DISK_BACKUP_DIR (default /tmp), removed
  at resume; a directory on tmpfs is refused by name (that package documents it must be a real disk).
- TMS_INIT_ENABLE, TMS_INIT_ENABLE_CPU_BACKUP, TMS_INIT_CPU_BACKUP_BACKEND, TMS_INIT_ENABLE_DISK_BACKUP,
  TMS_RETAIN_CPU_BACKUP, TMS_DISK_BACKUP_DIR and TMS_DISK_BACKUP_CHUNK_MB mean what they mean there, with its
  spellings only (anything else is a SettingError naming the variable).
- The private surface other projects reach into is there too (slime's DeepEP patch turns capture off through
  ``torch_memory_saver._impl._binary_wrapper.cdll.tms_set_interesting_region``): ``_ensure_initialized()``, ``_impl``
  (None until first use) with ``_binary_wrapper.cdll`` (libebbtide.so, which exports that package's tms_* C
  functions with its signatures; cuda* names resolve in the process's CUDA runtime, as through that library's link
  to libcudart), ``_mem_pools`` (keyed as there) and ``_with_region_config``.

Differences, all deliberate:
- Errors are ebbtide's typed exceptions where the original aborts the process or asserts: an OOM at resume raises
  OutOfMemoryError and leaves the tag paused, retryable; a refused disk backup raises and leaves the tag resident
  (pause) or paused (resume); bad arguments raise InvalidArgumentError (a ValueError).
- ``hook_mode`` defaults to what the process allows ("preload" when libebbtide.so is preloaded, else "torch")
  instead of always "preload", and reads back; ``cuda_graph`` works in both hook modes.
- Pausing or resuming a tag no region ever named does nothing (as there); double pause/resume warn.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from typing import Optional

import ebbtide.memory as _em
from ebbtide import _native
from ebbtide.errors import InvalidArgumentError, NotFoundError, StateError, UnsupportedError
from ebbtide.memory import _hooks
from ebbtide.memory._common import backup_code, torch_cuda

__all__ = ["TorchMemorySaver", "torch_memory_saver", "configure_subprocess"]

logger = logging.getLogger(__name__)

_TAG_DEFAULT = "default"
_BACKENDS = ("pinned", "mmap")
_HOOK_MODES = ("preload", "torch")


def _code(enable_cpu_backup: bool, enable_disk_backup: bool, backend: str) -> int:
    """The native backup code of a region: a transient CPU copy (pageable with the "mmap" backend), a disk file,
    or nothing."""
    if enable_cpu_backup:
        return backup_code("cpu", "pageable" if backend == "mmap" else "transient")
    return backup_code("disk" if enable_disk_backup else "none")


def _validate(enable_cpu_backup: bool, enable_disk_backup: bool, cpu_backup_backend: Optional[str]) -> None:
    if cpu_backup_backend is not None:
        if cpu_backup_backend not in _BACKENDS:
            raise InvalidArgumentError(f"cpu_backup_backend must be one of {_BACKENDS} or None, not "
                                       f"{cpu_backup_backend!r}")
        if not enable_cpu_backup:
            raise InvalidArgumentError("cpu_backup_backend requires enable_cpu_backup=True")
    if enable_cpu_backup and enable_disk_backup:
        raise InvalidArgumentError("enable_cpu_backup and enable_disk_backup are mutually exclusive")


def _cuda_runtime():
    """The CUDA runtime this process uses (loaded by torch; found by soname)."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise UnsupportedError("no CUDA runtime (libcudart.so.13/12) is loadable in this process")


class _Library(ctypes.CDLL):
    """libebbtide.so as torch_memory_saver's binary wrapper exposes its library: its tms_* functions with their
    signatures, and names it does not define (cuda*) from the CUDA runtime the process uses, as the original
    library resolves them through its link dependency on libcudart."""

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if not name.startswith("cuda"):
                raise
        fn = getattr(_cuda_runtime(), name)
        setattr(self, name, fn)
        return fn


def _signatures(cdll) -> None:
    c = ctypes
    for name, args, res in (
            ("tms_set_current_tag", [c.c_char_p], None), ("tms_get_current_tag", [], c.c_char_p),
            ("tms_set_interesting_region", [c.c_bool], None), ("tms_get_interesting_region", [], c.c_bool),
            ("tms_set_enable_cpu_backup", [c.c_bool], None), ("tms_get_enable_cpu_backup", [], c.c_bool),
            ("tms_set_cpu_backup_backend", [c.c_char_p], None), ("tms_get_cpu_backup_backend", [], c.c_char_p),
            ("tms_set_enable_disk_backup", [c.c_bool], None), ("tms_get_enable_disk_backup", [], c.c_bool),
            ("tms_set_disk_backup_dir", [c.c_char_p], None), ("tms_pause", [c.c_char_p], c.c_int),
            ("tms_resume", [c.c_char_p], c.c_int), ("tms_set_retain_cpu_backup", [c.c_bool], None),
            ("tms_get_retain_cpu_backup", [], c.c_bool),
            ("tms_get_cpu_backup_pointer", [c.POINTER(c.c_uint8), c.c_uint64], c.POINTER(c.c_uint8))):
        fn = getattr(cdll, name)
        fn.argtypes, fn.restype = args, res


class _BinaryWrapper:
    """``_impl._binary_wrapper`` of the original: ``cdll`` and ``set_config``."""

    def __init__(self):
        self.cdll = _Library(_native.runtime_library_path())
        _signatures(self.cdll)

    def set_config(self, *, tag: str, interesting_region: bool, enable_cpu_backup: bool,
                   cpu_backup_backend: Optional[str] = None, enable_disk_backup: bool = False):
        self.cdll.tms_set_current_tag(tag.encode("utf-8"))
        self.cdll.tms_set_interesting_region(interesting_region)
        self.cdll.tms_set_enable_cpu_backup(enable_cpu_backup)
        if cpu_backup_backend is not None:
            self.cdll.tms_set_cpu_backup_backend(cpu_backup_backend.encode("utf-8"))
        self.cdll.tms_set_enable_disk_backup(enable_disk_backup)


class _PoolTable(dict):
    """MemPools keyed as the original keys them -- (tag, enable_cpu_backup, enable_disk_backup, resolved backend,
    device) -- made on first use with the hook mode's allocator. Dropping one (and the tensors in it) frees its
    memory, host copies included."""

    def __init__(self, mode: str):
        super().__init__()
        self._mode = mode

    def __missing__(self, key):
        import torch  # noqa: PLC0415

        pool = _hooks.new_pool(torch, self._mode, key[4])
        self[key] = pool
        return pool


class _Impl:
    """What ``torch_memory_saver._impl`` holds once initialised."""

    def __init__(self, hook_mode: Optional[str] = None):
        if hook_mode is not None:
            _em.set_hook_mode(hook_mode)
        self._hook_mode = _em.hook_mode()
        self._binary_wrapper = _BinaryWrapper()
        self._mem_pools = _PoolTable(self._hook_mode)

    def _backend(self) -> str:
        return self._binary_wrapper.cdll.tms_get_cpu_backup_backend().decode("utf-8")

    @contextlib.contextmanager
    def region(self, tag: str, enable_cpu_backup: bool, enable_disk_backup: bool,
               cpu_backup_backend: Optional[str]):
        backend = (cpu_backup_backend or self._backend()) if enable_cpu_backup else ""
        torch = torch_cuda()  # None without a CUDA device: native routing only, no pool
        pool = None
        if torch is not None:
            pool = self._mem_pools[(tag, enable_cpu_backup, enable_disk_backup, backend, torch.cuda.current_device())]
        with _hooks.region_with_code(tag, _code(enable_cpu_backup, enable_disk_backup, backend), pool=pool):
            yield

    @contextlib.contextmanager
    def _with_region_config(self, tag: str, enable_cpu_backup: bool, cpu_backup_backend: Optional[str],
                            enable_disk_backup: bool = False):
        """This thread's allocations land in ``tag`` with that backup, without a pool of their own."""
        backend = (cpu_backup_backend or self._backend()) if enable_cpu_backup else ""
        mem = _hooks._mem()
        token = mem.region_push(tag, _code(enable_cpu_backup, enable_disk_backup, backend))
        try:
            yield
        finally:
            mem.region_pop(token)


class TorchMemorySaver:
    """One per process (use the module's ``torch_memory_saver``)."""

    def __init__(self):
        self._impl_ctor_kwargs: Optional[dict] = {}
        self._impl: Optional[_Impl] = None

    @contextlib.contextmanager
    def region(self, tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False, enable_disk_backup: bool = False,
               cpu_backup_backend: Optional[str] = None):
        """Allocations made inside are pausable under ``tag``; ``enable_cpu_backup`` keeps their content in host
        memory while paused, ``enable_disk_backup`` in a file (mutually exclusive)."""
        _validate(enable_cpu_backup, enable_disk_backup, cpu_backup_backend)
        self._ensure_initialized()
        with self._impl.region(tag, enable_cpu_backup, enable_disk_backup, cpu_backup_backend):
            yield

    @contextlib.contextmanager
    def cuda_graph(self, cuda_graph, pool=None, stream=None, capture_error_mode="global",
                   tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False,
                   cpu_backup_backend: Optional[str] = None):
        """Like ``torch.cuda.graph``, with the graph's memory pausable under ``tag`` (both hook modes)."""
        _validate(enable_cpu_backup, False, cpu_backup_backend)
        self._ensure_initialized()
        backend = (cpu_backup_backend or self._impl._backend()) if enable_cpu_backup else ""
        host = ("pageable" if backend == "mmap" else "transient") if enable_cpu_backup else "arena"
        with _em.graph(cuda_graph, tag=tag, backup="cpu" if enable_cpu_backup else "none", host=host, pool=pool,
                       stream=stream, capture_error_mode=capture_error_mode):
            yield

    @contextlib.contextmanager
    def disable(self):
        """Allocations inside bypass the saver (plain memory from a fresh pool, given back on exit)."""
        self._ensure_initialized()
        with _em.disable(transient_pool=True):
            yield

    def pause(self, tag: Optional[str] = None):
        """Release the memory of ``tag`` (None: every tag), keeping addresses."""
        self._ensure_initialized()
        try:
            _em.pause(tag)
        except NotFoundError:
            logger.debug("pause(%r): no region ever used this tag; nothing to do", tag)

    def resume(self, tag: Optional[str] = None):
        """Map ``tag``'s memory back (None: every paused tag) and restore its backups; transient host copies are
        given back before this returns unless ``retain_cpu_backup``."""
        self._ensure_initialized()
        try:
            _em.resume(tag)
        except NotFoundError:
            logger.debug("resume(%r): no region ever used this tag; nothing to do", tag)

    @property
    def enabled(self):
        return True

    @property
    def hook_mode(self):
        return self._impl._hook_mode if self._impl is not None else _em.hook_mode()

    @hook_mode.setter
    def hook_mode(self, hook_mode: str):
        if hook_mode not in _HOOK_MODES:
            raise InvalidArgumentError(f"hook_mode must be one of {_HOOK_MODES}, not {hook_mode!r}")
        if self._impl is not None:
            if hook_mode != self._impl._hook_mode:
                raise StateError(f"hook_mode is {self._impl._hook_mode!r} since the saver was first used; set it "
                                 "before the first region")
            return
        self._impl_ctor_kwargs["hook_mode"] = hook_mode

    @property
    def memory_margin_bytes(self):
        return _em.memory_margin()

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int):
        _em.set_memory_margin(int(value))

    @property
    def retain_cpu_backup(self) -> bool:
        return _em.host_retention()

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool):
        _em.set_host_retention(bool(value))

    def get_cpu_backup(self, x, zero_copy: bool = False):
        """The host copy of a CUDA tensor in a CPU-backed region as a CPU tensor (None where there is none: not
        paused without retention, disk-backed, or not backed up)."""
        if not x.is_cuda:
            raise InvalidArgumentError(f"get_cpu_backup needs a CUDA tensor, not one on {x.device}")
        return _em.get_cpu_backup(x, zero_copy=zero_copy)

    def set_disk_backup_dir(self, path: str):
        """The directory disk backups are written to (created if needed; refused on tmpfs)."""
        self._ensure_initialized()
        os.makedirs(path, exist_ok=True)
        _em.set_disk_backup_dir(path)

    def configure_subprocess(self):
        """Same as the module-level configure_subprocess()."""
        return configure_subprocess()

    def _ensure_initialized(self):
        if self._impl is not None:
            return
        self._impl = _Impl(**self._impl_ctor_kwargs)
        self._impl_ctor_kwargs = None


def configure_subprocess():
    """Context manager: processes started inside run with libebbtide.so preloaded (preload hook mode);
    LD_PRELOAD entries already present are kept after ours, and the environment is restored on exit."""
    return _em.configure_subprocess()


torch_memory_saver = TorchMemorySaver()
