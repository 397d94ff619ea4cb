"""Flat homes for many small tensors: one buffer per dtype inside an ebbtide.memory tag, every tensor re-pointed at
its slice.

What holds:
- ``pack(entries, factory, tag, backup)``: ``entries`` are ``(get, put)`` pairs, ``get()`` returning the current
  1-D-or-ND tensor and ``put(view)`` installing a view of the same shape, strides and dtype in the owner's place
  (FSDP's ``_sharded_param_data`` / a DTensor's ``_local_tensor``). Per dtype, one buffer of the summed sizes
  (each slice aligned to 256 bytes) comes from ``factory(tag, backup, numel, dtype, device)``; content is copied in,
  then every ``put`` runs. The old storages lose their last reference there and go back to the caching allocator.
  A factory that fails, or returns a tensor of the wrong size, dtype or device, changes nothing: no ``put`` ran.
- Views are made with ``as_strided`` from the buffer (never ``set_`` on the old tensor: a view's ``_base`` would
  keep the old storage alive), so a view's ``_base`` is the buffer and the buffer lives as long as any view.
- ``Flat.owns(t)``: whether ``t``'s bytes lie inside one of the buffers (the check that a tensor was not replaced).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ...errors import InvalidArgumentError

__all__ = ["Flat", "pack", "ALIGN_BYTES"]

ALIGN_BYTES = 256


@dataclasses.dataclass
class Flat:
    """The buffers of one ``pack`` call (one per dtype) and the byte ranges they cover."""
    tag: str
    buffers: list  # 1-D tensors
    nbytes: int = 0

    def owns(self, t: torch.Tensor) -> bool:
        if t.numel() == 0:
            return any(t.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for b in self.buffers)
        lo = t.data_ptr()
        hi = lo + t.numel() * t.element_size()
        return any(b.data_ptr() <= lo and hi <= b.data_ptr() + b.numel() * b.element_size() for b in self.buffers)


def _aligned(numel: int, dtype: torch.dtype) -> int:
    per = max(1, ALIGN_BYTES // torch.empty(0, dtype=dtype).element_size())
    return -(-numel // per) * per


@torch.no_grad()
def pack(entries: list, factory: Callable, tag: str, backup: str) -> Flat:
    """Move every entry's tensor into flat buffers of ``tag`` (see the module doc)."""
    by_dtype: dict = {}
    for get, put in entries:
        t = get()
        if not t.is_contiguous():
            raise InvalidArgumentError(f"pack: a {tuple(t.shape)} tensor with strides {t.stride()} is not contiguous")
        by_dtype.setdefault((t.dtype, t.device), []).append((t, put))
    flat = Flat(tag, [])
    staged = []
    for (dtype, device), items in by_dtype.items():
        total = sum(_aligned(t.numel(), dtype) for t, _ in items)
        buf = factory(tag, backup, max(total, 1), dtype, device)
        if (not isinstance(buf, torch.Tensor) or buf.dim() != 1 or buf.numel() < total or buf.dtype != dtype
                or buf.device != device or not buf.is_contiguous()):
            got = (f"{tuple(buf.shape)} {buf.dtype} on {buf.device}" if isinstance(buf, torch.Tensor)
                   else type(buf).__name__)
            raise InvalidArgumentError(f"buffer_factory must return a contiguous 1-D {dtype} tensor of >= {total} "
                                       f"elements on {device}; it returned {got}")
        flat.buffers.append(buf)
        flat.nbytes += buf.numel() * buf.element_size()
        at = 0
        for t, put in items:
            view = buf.as_strided(t.shape, t.stride(), at if t.numel() else 0)
            view.copy_(t)
            staged.append((put, view))
            at += _aligned(t.numel(), dtype)
    for put, view in staged:  # only once every buffer exists and holds its content
        put(view)
    return flat
