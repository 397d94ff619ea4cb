"""CUDA IPC of region memory through POSIX file descriptors.

A region entered with ``shareable=True`` creates its physical memory exportable. ``export_tensor(t)`` gives a
:class:`SharedHandle` (an fd the caller sends to another process, e.g. with ``socket.send_fds``, plus the offset,
size, shape, dtype); the other process calls ``import_tensor(handle, fd)`` and gets a CUDA tensor over the same
memory (writes are visible to both). The physical memory of a paused tensor is released only when every importer
has closed its mapping, and a resume creates new memory: importers close before the exporter pauses and import
again after it resumes. The legacy ``cudaIpcGetMemHandle`` path (``tensor.share_memory_()``, torch.multiprocessing
CUDA sharing) does not work on VMM memory; use this one for region tensors, or allocate inside ``disable()``.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

from .. import _native
from ..errors import InvalidArgumentError

__all__ = ["SharedHandle", "ImportedTensor", "export_tensor", "import_tensor"]


def _mem():
    return _native.load().memory


@dataclasses.dataclass(frozen=True)
class SharedHandle:
    """What an importer needs besides the fd (picklable)."""

    offset: int     # bytes from the allocation's base to the tensor's first element
    size: int       # the allocation's mapped size (import_fd maps all of it)
    nbytes: int     # the tensor's bytes
    shape: tuple
    dtype: str      # torch dtype name, e.g. "float32"
    device: int     # the exporter's device ordinal (the importer maps on its own device of the same GPU)


def export_tensor(tensor) -> tuple:
    """(fd, SharedHandle) for a contiguous CUDA tensor in a shareable region. The caller owns fd (close it after
    sending it)."""
    if not tensor.is_cuda or not tensor.is_contiguous():
        raise InvalidArgumentError("export_tensor needs a contiguous CUDA tensor")
    fd, offset, size = _mem().export_fd(tensor.data_ptr())
    h = SharedHandle(offset=int(offset), size=int(size), nbytes=tensor.numel() * tensor.element_size(),
                     shape=tuple(tensor.shape), dtype=str(tensor.dtype).replace("torch.", ""),
                     device=tensor.device.index or 0)
    return fd, h


class ImportedTensor:
    """A mapping of another process's memory; ``tensor`` views it. ``close()`` (or leaving a with-block) drains
    the device and unmaps; the tensor must not be used afterwards."""

    def __init__(self, handle: SharedHandle, fd: int, device: Optional[int] = None):
        import torch  # noqa: PLC0415

        dev = handle.device if device is None else int(device)
        self._base = _mem().import_fd(fd, handle.size, dev)
        addr = self._base + handle.offset
        dtype = getattr(torch, handle.dtype)
        typestr = {torch.float32: "<f4", torch.float16: "<f2", torch.bfloat16: "<i2", torch.int32: "<i4",
                   torch.int64: "<i8", torch.uint8: "|u1", torch.int8: "|i1", torch.float64: "<f8"}.get(dtype)
        if typestr is None:
            _mem().close_import(self._base)
            raise InvalidArgumentError(f"import_tensor: dtype {handle.dtype} not supported")

        class _Iface:  # __cuda_array_interface__ v3 over the mapping (no copy)
            __cuda_array_interface__ = {"shape": handle.shape or (1,), "typestr": typestr, "data": (addr, False),
                                        "version": 3, "strides": None}

        with torch.cuda.device(dev):
            t = torch.as_tensor(_Iface(), device=f"cuda:{dev}")
        if dtype == torch.bfloat16:
            t = t.view(torch.bfloat16)
        self.tensor = t.reshape(handle.shape)
        self._open = True

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
