"""CUDA IPC of region memory through POSIX file descriptors.

A region entered with ``shareable=True`` creates its physical memory exportable. ``export_tensor(t)`` gives a
:class:`SharedHandle` (an fd the caller sends to another process, e.g. with ``socket.send_fds``, plus the offset,
size, shape, dtype); the other process calls ``import_tensor(handle, fd)`` and gets a CUDA tensor over the same
memory (writes are visible to both). The physical memory of a paused tensor is released only when every importer
has closed its mapping, and a resume creates new memory: importers close before the exporter pauses and import
again after it resumes. The legacy ``cudaIpcGetMemHandle`` path (``tensor.share_memory_()``, torch.multiprocessing
CUDA sharing) does not work on VMM memory; use this one for region tensors, or allocate inside ``disable()``.

The handle comes from another process and is not trusted: ``import_tensor`` checks it (``check_handle``) before
mapping anything, so the tensor it returns lies inside the mapping, is aligned for its dtype, and its shape, dtype
and byte count agree. The mapping itself is ``size`` bytes of the fd's memory; a size beyond the exported memory
is refused by the driver when it maps.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

from ..errors import InvalidArgumentError
from ._common import mem as _mem

__all__ = ["SharedHandle", "ImportedTensor", "export_tensor", "import_tensor", "check_handle"]

# dtype name -> (__cuda_array_interface__ typestr, itemsize). bfloat16 has no typestr: it travels as int16 and is
# viewed back.
DTYPES = {"float64": ("<f8", 8), "float32": ("<f4", 4), "float16": ("<f2", 2), "bfloat16": ("<i2", 2),
          "int64": ("<i8", 8), "int32": ("<i4", 4), "int8": ("|i1", 1), "uint8": ("|u1", 1)}


@dataclasses.dataclass(frozen=True)
class SharedHandle:
    """What an importer needs besides the fd (picklable)."""

    offset: int     # bytes from the allocation's base to the tensor's first element
    size: int       # the allocation's mapped size (import_fd maps all of it)
    nbytes: int     # the tensor's bytes
    shape: tuple
    dtype: str      # torch dtype name, e.g. "float32"
    device: int     # the exporter's device ordinal (the importer maps on its own device of the same GPU)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_handle(handle: SharedHandle) -> None:
    """Raise InvalidArgumentError unless ``handle`` describes a tensor that lies inside its allocation's mapping:
    non-negative integer fields, a dtype import_tensor knows, ``offset`` aligned to the dtype, ``offset + nbytes
    <= size`` and ``prod(shape) * itemsize == nbytes``. ``import_tensor`` runs it before mapping; a process that
    receives handles can run it first to refuse a bad one without touching the fd."""
    if not isinstance(handle, SharedHandle):
        raise InvalidArgumentError(f"handle must be an ebbtide.memory.SharedHandle, not {type(handle).__name__}")
    for field in ("offset", "size", "nbytes", "device"):
        v = getattr(handle, field)
        if not _is_int(v) or v < 0:
            raise InvalidArgumentError(f"SharedHandle.{field} must be a non-negative int, not {v!r}")
    if handle.size == 0:
        raise InvalidArgumentError("SharedHandle.size must be > 0 (the exporter's mapped size)")
    if handle.dtype not in DTYPES:
        raise InvalidArgumentError(f"SharedHandle.dtype {handle.dtype!r} is not one of {sorted(DTYPES)}")
    shape = handle.shape
    if not isinstance(shape, tuple) or not all(_is_int(n) and n >= 0 for n in shape):
        raise InvalidArgumentError(f"SharedHandle.shape must be a tuple of non-negative ints, not {shape!r}")
    itemsize = DTYPES[handle.dtype][1]
    elements = 1
    for n in shape:
        elements *= n
    if elements * itemsize != handle.nbytes:
        raise InvalidArgumentError(f"SharedHandle.nbytes {handle.nbytes} does not match shape {shape} of "
                                   f"{handle.dtype} ({elements * itemsize} bytes)")
    if handle.offset % itemsize:
        raise InvalidArgumentError(f"SharedHandle.offset {handle.offset} is not aligned to {handle.dtype} "
                                   f"({itemsize} bytes)")
    if handle.offset + handle.nbytes > handle.size:
        raise InvalidArgumentError(f"SharedHandle: offset {handle.offset} + nbytes {handle.nbytes} lies beyond the "
                                   f"mapped size {handle.size}")


def export_tensor(tensor) -> tuple:
    """(fd, SharedHandle) for a contiguous CUDA tensor in a shareable region. The caller owns fd (close it after
    sending it)."""
    if not tensor.is_cuda or not tensor.is_contiguous():
        raise InvalidArgumentError("export_tensor needs a contiguous CUDA tensor")
    dtype = str(tensor.dtype).replace("torch.", "")
    if dtype not in DTYPES:
        raise InvalidArgumentError(f"export_tensor: dtype {dtype} cannot be imported (one of {sorted(DTYPES)})")
    fd, offset, size = _mem().export_fd(tensor.data_ptr())
    h = SharedHandle(offset=int(offset), size=int(size), nbytes=tensor.numel() * tensor.element_size(),
                     shape=tuple(tensor.shape), dtype=dtype, device=tensor.device.index or 0)
    return fd, h


class ImportedTensor:
    """A mapping of another process's memory; ``tensor`` views it. ``close()`` (or leaving a with-block) drains
    the device and unmaps; the tensor must not be used afterwards."""

    def __init__(self, handle: SharedHandle, fd: int, device: Optional[int] = None):
        check_handle(handle)  # before mapping: a bad handle maps nothing
        if device is not None and (not _is_int(device) or device < 0):
            raise InvalidArgumentError(f"device must be a non-negative int, not {device!r}")
        import torch  # noqa: PLC0415

        dev = handle.device if device is None else device
        typestr = DTYPES[handle.dtype][0]
        self._open = False
        self._base = _mem().import_fd(fd, handle.size, dev)
        self._open = True
        try:
            addr = self._base + handle.offset

            class _Iface:  # __cuda_array_interface__ v3 over the mapping (no copy)
                __cuda_array_interface__ = {"shape": handle.shape or (1,), "typestr": typestr,
                                            "data": (addr, False), "version": 3, "strides": None}

            with torch.cuda.device(dev):
                t = torch.as_tensor(_Iface(), device=f"cuda:{dev}")
            if handle.dtype == "bfloat16":
                t = t.view(torch.bfloat16)
            self.tensor = t.reshape(handle.shape)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._open:
            self._open = False
            self.tensor = None
            _mem().close_import(self._base)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def import_tensor(handle: SharedHandle, fd: int, *, device: Optional[int] = None,
                  close_fd: bool = True) -> ImportedTensor:
    """Map the exporter's memory behind ``fd`` and view it as a tensor of the exported shape and dtype. The fd is
    closed afterwards unless ``close_fd=False`` (the mapping keeps the memory)."""
    try:
        return ImportedTensor(handle, fd, device)
    finally:
        if close_fd:
            os.close(fd)
