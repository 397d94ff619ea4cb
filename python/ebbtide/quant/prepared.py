"""Launches prepared once and replayed: the same tensors, every weight update.

A weight update sends the same tensors at the same addresses every time, and an MoE layer has thousands of them:
building a launch table per call (a row per tensor, checks) costs more host time than the GPU spends on the bytes.
These objects build their table once, keep it in pinned host memory, and reuse it while the tensors stay where they
are; the full argument checks run with every (re)build.

- ``Fp8BucketQuant(layout, scale, eps)``: ``fp8_block_quant_into`` for one bucket. Per call it compares, for every
  tensor, the address, strides, element count, column count and dtype with the ones the table was built for (the
  strides and the column count fix the row pitch and K, the element count then fixes N) and the two buffers'
  addresses, sizes, dimensions and contiguity (five C-level reads per tensor instead of the checks and the table
  row, several times cheaper); any difference rebuilds the table.
- ``SegmentCopy(dsts, srcs)``: byte copies ``dsts[i] <- srcs[i]`` (contiguous tensors of equal byte size, any
  dtypes, on one device) in one launch on CUDA (``portable_copy_segments``), a ``copy_`` each on the CPU or where
  the kernels were not built or cannot run on the GPU. Destinations must not overlap each other or any source
  (checked at construction). The table is fixed at construction: the caller makes a new one when an address
  changes.

Both enqueue on the current stream and return at once. A table longer than what travels inside the launch is
uploaded from its pinned copy on the current stream at every call (a few KB, asynchronous): a device copy kept
between calls could sit in memory that a pause discards.
"""
from __future__ import annotations

import bisect
import itertools

import torch

from ..errors import InvalidArgumentError, UnsupportedError
from .layout import Fp8BucketLayout

__all__ = ["Fp8BucketQuant", "SegmentCopy"]

_PTR, _STRIDE, _NUMEL, _SIZE = torch.Tensor.data_ptr, torch.Tensor.stride, torch.Tensor.numel, torch.Tensor.size
_DTYPE = torch.Tensor.dtype.__get__  # C-level getters mapped over the list: the cheapest read of each per tensor


class Fp8BucketQuant:
    """``fp8_block_quant_into(tensors, layout, q_buffer, scale_buffer, scale, eps)`` with its launch table kept."""

    def __init__(self, layout: Fp8BucketLayout, scale: str = "fp32", eps: float = 1e-4):
        from . import api  # noqa: PLC0415  (api imports this module's users)

        if not isinstance(layout, Fp8BucketLayout):
            raise InvalidArgumentError(f"layout must be an Fp8BucketLayout, got {layout!r}")
        api._check_fixed(scale, "scale (packed UE8M0 has no flat bucket layout)", ("fp32", "ue8m0"))
        self.layout, self.scale, self.eps = layout, scale, api._check_eps(eps)
        self._key = None  # what the table was built for (_key_of)
        self._table = None  # pinned int64 [count, 8] (host copy: validated natively at every launch)

    @staticmethod
    def _key_of(tensors, where: tuple) -> tuple:
        return (list(map(_PTR, tensors)), list(map(_STRIDE, tensors)), list(map(_NUMEL, tensors)),
                list(map(_SIZE, tensors, itertools.repeat(-1))), list(map(_DTYPE, tensors)), where)

    def _remember(self, tensors, where: tuple) -> None:
        self._key = self._key_of(tensors, where)

    def _matches(self, tensors, where: tuple) -> bool:
        key = self._key
        if key is None or key[5] != where or len(tensors) != len(key[0]):
            return False
        try:  # the dtypes were bf16 when the table was built: equal dtypes are bf16
            return self._key_of(tensors, where) == key
        except (TypeError, AttributeError, IndexError, RuntimeError):  # not tensors, or not 2-D: the checks say why
            return False

    @torch.no_grad()
    def __call__(self, tensors, q_buffer: torch.Tensor, scale_buffer: torch.Tensor) -> None:
        from . import _cuda, api  # noqa: PLC0415

        if not isinstance(tensors, (list, tuple)):
            raise InvalidArgumentError(f"tensors must be a list of bf16 2-D tensors, got {type(tensors).__name__}")
        if not tensors or not isinstance(tensors[0], torch.Tensor) or tensors[0].device.type != "cuda":
            api.fp8_block_quant_into(tensors, self.layout, q_buffer, scale_buffer, self.scale, self.eps)
            return
        if not (isinstance(q_buffer, torch.Tensor) and isinstance(scale_buffer, torch.Tensor)):
            api.check_into(tensors, self.layout, q_buffer, scale_buffer, self.scale, self.eps)  # raises the reason
        where = tuple(x for b in (q_buffer, scale_buffer) for x in (b.data_ptr(), b.nbytes, b.dim(),
                                                                    b.is_contiguous()))
        if not self._matches(tensors, where):
            self._key = self._table = None
            tensors, _ = api.check_into(tensors, self.layout, q_buffer, scale_buffer, self.scale, self.eps)
            self._table = _cuda.list_table(tensors, self.layout, where[0], where[4], self.scale).pin_memory()
            self._remember(tensors, where)
        dev = _cuda.upload(self._table, tensors[0].device) if len(tensors) > _cuda.PARAM_ENTRIES else None
        _cuda.launch_list(self._table, dev, len(tensors), self.eps, tensors[0])


def _check_disjoint(dsts, srcs) -> None:
    """Raise unless no destination overlaps another destination or any source (byte ranges by address)."""
    spans = sorted((d.data_ptr(), d.data_ptr() + d.numel() * d.element_size(), i) for i, d in enumerate(dsts))
    for (a0, a1, i), (b0, _, j) in zip(spans, spans[1:]):
        if b0 < a1:
            raise InvalidArgumentError(f"segments {i} and {j}: the destinations overlap")
    starts = [a for a, _, _ in spans]
    for j, s in enumerate(srcs):
        s0, s1 = s.data_ptr(), s.data_ptr() + s.numel() * s.element_size()
        k = bisect.bisect_right(starts, s0) - 1  # the last destination starting at or before s0, then the next
        for a0, a1, i in spans[max(k, 0):k + 2]:
            if a0 < s1 and s0 < a1:
                raise InvalidArgumentError(f"segment {i}'s destination overlaps segment {j}'s source")


class SegmentCopy:
    """Byte copies ``dsts[i] <- srcs[i]`` in one launch (see the module policies)."""

    def __init__(self, dsts, srcs):
        dsts, srcs = list(dsts), list(srcs)
        if len(dsts) != len(srcs) or not dsts:
            raise InvalidArgumentError(f"SegmentCopy needs equally many destinations and sources (at least one); "
                                       f"got {len(dsts)} and {len(srcs)}")
        for i, (d, s) in enumerate(zip(dsts, srcs)):
            if not (isinstance(d, torch.Tensor) and isinstance(s, torch.Tensor)):
                raise InvalidArgumentError(f"segment {i}: destinations and sources must be tensors")
        device = dsts[0].device
        for i, (d, s) in enumerate(zip(dsts, srcs)):
            if d.device != device or s.device != device:
                raise InvalidArgumentError(f"segment {i}: on {d.device} <- {s.device}; every segment lives on "
                                           f"{device}")
            if not (d.is_contiguous() and s.is_contiguous()):
                raise InvalidArgumentError(f"segment {i}: destination and source must be contiguous")
            nd, ns = d.numel() * d.element_size(), s.numel() * s.element_size()
            if nd != ns or nd == 0:
                raise InvalidArgumentError(f"segment {i}: {nd} destination bytes, {ns} source bytes (equal, >= 1)")
        _check_disjoint(dsts, srcs)
        self.device, self.count = device, len(dsts)
        self._dsts, self._srcs = dsts, srcs  # kept: the table holds their addresses
        self.nbytes = sum(d.numel() * d.element_size() for d in dsts)
        self._table = None  # pinned int64 [count, 4]; None: copy_ each
        if device.type == "cuda":
            from . import _cuda  # noqa: PLC0415

            try:
                self._table = _cuda.segment_table(dsts, srcs).pin_memory()
                _cuda.check_segments(device)
            except UnsupportedError:  # no CUDA kernels in the build, or none for this GPU: one copy_ per segment
                self._table = None

    @torch.no_grad()
    def __call__(self) -> None:
        if self._table is None:
            for d, s in zip(self._dsts, self._srcs):
                d.reshape(-1).view(torch.uint8).copy_(s.reshape(-1).view(torch.uint8))
            return
        from . import _cuda  # noqa: PLC0415

        _cuda.launch_segments(self._table, _cuda.upload(self._table, self.device), self.count, self.device)
