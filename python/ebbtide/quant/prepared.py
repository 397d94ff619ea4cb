"""Launches prepared once and replayed: the same tensors, every weight update.

A weight update sends the same tensors at the same addresses every time, and an MoE layer has thousands of them:
building a launch table per call (a row per tensor, checks, a host-to-device copy) costs more host time than the
GPU spends on the bytes. These objects build their table on the first call, keep it (on the device where the kernel
reads it from there) and rebuild it only when an address, shape or stride changed, running the full argument checks
with every rebuild.

- ``Fp8BucketQuant(layout, scale, eps)``: ``fp8_block_quant_into`` for one bucket; per call an address, stride,
  element count and dtype compare per tensor (~0.25 µs) instead of the checks and table row (~2-8 µs).
- ``SegmentCopy(dsts, srcs)``: byte copies ``dsts[i] <- srcs[i]`` (contiguous tensors of equal byte size) in one
  launch on CUDA (``sm90_copy_segments``), a ``copy_`` each on the CPU. The table is fixed at construction: the
  caller makes a new one when an address changes.

Both enqueue on the current stream and return at once. A table that changes is replaced by a new allocation (the
old one is released stream-ordered), never written while a launch may read it.
"""
from __future__ import annotations

import torch

from ..errors import InvalidArgumentError
from .layout import Fp8BucketLayout

__all__ = ["Fp8BucketQuant", "SegmentCopy"]

_PTR, _STRIDE, _NUMEL, _BF16 = torch.Tensor.data_ptr, torch.Tensor.stride, torch.Tensor.numel, torch.bfloat16


class _DeviceTable:
    """A device copy of a host table, made on the stream current at construction (pinned, so the copy is
    asynchronous and torch's host allocator keeps the pinned block until it completed); ``ready()`` makes the
    current stream wait for the copy (a no-op wait once it completed), so a launch on any stream reads it whole."""

    def __init__(self, host: torch.Tensor, device):
        with torch.cuda.device(device):
            self.tensor = host.pin_memory().to(device, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def ready(self) -> torch.Tensor:
        torch.cuda.current_stream(self.tensor.device).wait_event(self.event)
        self.tensor.record_stream(torch.cuda.current_stream(self.tensor.device))
        return self.tensor


class Fp8BucketQuant:
    """``fp8_block_quant_into(tensors, layout, q_buffer, scale_buffer, scale, eps)`` with its launch table kept."""

    def __init__(self, layout: Fp8BucketLayout, scale: str = "fp32", eps: float = 1e-4):
        from . import api  # noqa: PLC0415  (api imports this module's users)

        if not isinstance(layout, Fp8BucketLayout):
            raise InvalidArgumentError(f"layout must be an Fp8BucketLayout, got {layout!r}")
        api._check_fixed(scale, "scale (packed UE8M0 has no flat bucket layout)", ("fp32", "ue8m0"))
        self.layout, self.scale, self.eps = layout, scale, api._check_eps(eps)
        self._shapes = [(N, K) for _, _, N, K in layout.entries]
        self._key = None  # what the table was built for (_key_of)
        self._rows_contiguous = False
        self._host = self._dev = None

    @staticmethod
    def _key_of(tensors, where: tuple) -> tuple:
        """(addresses, strides, element counts, the buffers' addresses and sizes): with the dtype and, for rows that are not
        contiguous, the shape, this pins every table row (a contiguous row's stride (K, 1) gives K, its element
        count N)."""
        return (list(map(_PTR, tensors)), list(map(_STRIDE, tensors)), list(map(_NUMEL, tensors)), where)

    def _remember(self, tensors, where: tuple) -> None:
        self._key = self._key_of(tensors, where)
        self._rows_contiguous = all(t.stride() == (K, 1) for t, (_, K) in zip(tensors, self._shapes))

    def _matches(self, tensors, where: tuple) -> bool:
        key = self._key
        if key is None or key[3] != where or len(tensors) != len(self._shapes):
            return False
        if self._key_of(tensors, where) != key or not all(t.dtype is _BF16 for t in tensors):
            return False
        return self._rows_contiguous or all(t.shape == s for t, s in zip(tensors, self._shapes))

    @torch.no_grad()
    def __call__(self, tensors, q_buffer: torch.Tensor, scale_buffer: torch.Tensor) -> None:
        from . import _cuda, api  # noqa: PLC0415

        tensors = tensors if isinstance(tensors, list) else list(tensors)
        if not tensors or tensors[0].device.type != "cuda":
            api.fp8_block_quant_into(tensors, self.layout, q_buffer, scale_buffer, self.scale, self.eps)
            return
        qp, sp = q_buffer.data_ptr(), scale_buffer.data_ptr()
        where = (qp, q_buffer.nbytes, sp, scale_buffer.nbytes)
        if not self._matches(tensors, where):
            self._host = self._dev = self._key = None
            api.fp8_block_quant_into(tensors, self.layout, q_buffer, scale_buffer, self.scale, self.eps)  # checks
            self._host = _cuda.list_table(tensors, self.layout, qp, sp, self.scale)
            if len(tensors) > _cuda.PARAM_ENTRIES:
                self._dev = _DeviceTable(self._host, tensors[0].device)
            self._remember(tensors, where)
            return
        _cuda.launch_list(self._host, None if self._dev is None else self._dev.ready(), len(tensors), self.eps,
                          tensors[0])


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
        self.device, self.count = device, len(dsts)
        self._dsts, self._srcs = dsts, srcs  # kept: the table holds their addresses
        self.nbytes = sum(d.numel() * d.element_size() for d in dsts)
        self._host = self._dev = None
        if device.type == "cuda":
            from . import _cuda  # noqa: PLC0415

            self._host = _cuda.segment_table(dsts, srcs)
            self._dev = _DeviceTable(self._host, device)

    @torch.no_grad()
    def __call__(self) -> None:
        if self._host is None:
            for d, s in zip(self._dsts, self._srcs):
                d.reshape(-1).view(torch.uint8).copy_(s.reshape(-1).view(torch.uint8))
            return
        from . import _cuda  # noqa: PLC0415

        _cuda.launch_segments(self._host, self._dev.ready(), self.count, self.device)
