"""Flat homes for many small tensors: one buffer per dtype inside an ebbtide.memory tag, every tensor re-backed in
place by its slice.

What holds:
- ``pack(groups, factory, tag, backup)``: each group is a list of tensors over one storage, the first covering it
  whole (FSDP's padded ``_sharded_param_data``, then the DTensor's ``_local_tensor`` viewing its front; an optimizer
  state tensor alone). Per dtype, one buffer of the groups' summed sizes (each slot aligned to ``ALIGN_BYTES``, so
  shards whose sizes are multiples of it lie back to back, one copy each way for an optimizer bucket) comes from
  ``factory(tag, backup, numel, dtype, device)``; content is copied in, then every tensor is re-pointed at its slot
  with ``set_`` (the tensor objects stay: a DTensor, an optimizer's param groups or anyone else holding them keeps
  seeing the new address) and the old storage is released (``resize_(0)``). A factory that fails or returns a
  tensor of the wrong size, dtype or device, or a group whose first tensor does not cover its storage, changes
  nothing: no tensor is re-pointed before every buffer holds its content.
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
    """The buffers of one ``pack`` call (one per dtype) and the bytes they hold."""
    tag: str
    buffers: list  # 1-D tensors
    nbytes: int = 0

    def owns(self, t: torch.Tensor) -> bool:
        st = t.untyped_storage()
        return any(st.data_ptr() == b.untyped_storage().data_ptr() for b in self.buffers)


def _aligned(numel: int, dtype: torch.dtype) -> int:
    per = max(1, ALIGN_BYTES // torch.empty(0, dtype=dtype).element_size())
    return -(-numel // per) * per


def _check_group(tensors: list) -> None:
    first = tensors[0]
    whole = first.untyped_storage().nbytes()
    if first.storage_offset() != 0 or not first.is_contiguous() or first.numel() * first.element_size() != whole:
        raise InvalidArgumentError(f"pack: a {tuple(first.shape)} {first.dtype} tensor does not cover its storage "
                                   f"({whole} bytes, offset {first.storage_offset()}): it cannot be re-backed")
    for t in tensors[1:]:
        if t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or t.dtype != first.dtype:
            raise InvalidArgumentError("pack: the tensors of a group must be views of its first tensor's storage")


@torch.no_grad()
def pack(groups: list, factory: Callable, tag: str, backup: str) -> Flat:
    """Re-back every group's storage by a slot of a flat buffer of ``tag`` (see the module doc)."""
    by_dtype: dict = {}
    for tensors in groups:
        _check_group(tensors)
        first = tensors[0]
        by_dtype.setdefault((first.dtype, first.device), []).append(tensors)
    flat = Flat(tag, [])
    staged = []
    for (dtype, device), items in by_dtype.items():
        total = sum(_aligned(ts[0].numel(), dtype) for ts in items)
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
        for ts in items:
            n = ts[0].numel()
            buf.narrow(0, at, n).copy_(ts[0].reshape(-1))
            staged.append((ts, buf, at))
            at += _aligned(n, dtype)
    for ts, buf, at in staged:  # only once every buffer exists and holds its content
        old = ts[0].untyped_storage()
        storage = buf.untyped_storage()
        for t in ts:
            t.set_(storage, buf.storage_offset() + at + t.storage_offset(), t.shape, t.stride())
        old.resize_(0)  # the previous home goes back to its allocator
    return flat
