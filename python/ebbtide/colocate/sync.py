"""Weight sync from trainer to rollout: FP8 block quant on the trainer, one shared pinned host buffer, dequant on
the rollout.

Policies:
- The layout is a pure function of the model's ``(name, shape)`` list, so both processes compute it and nothing but
  bytes crosses the buffer. Sections, each 256-byte aligned: every 2-D weight's e4m3 bytes (16-byte aligned per
  tensor, exactly ``fp8_block_quant_list``'s bucket layout, so the bucket is copied in one D2H), every 2-D weight's
  fp32 block scales (the bucket's scale buffer), every 1-D param as raw bf16.
- The buffer is a memfd shared mapping (not /dev/shm: containers often cap it at 64 MiB) that both processes
  register with ``cudaHostRegister``, so D2H and H2D are DMA at PCIe speed and the rollout needs no CUDA IPC of
  the trainer's region memory.
- Two codecs, same layout: "ebbtide" (``ebbtide.quant`` kernels, one launch for the whole list) and "torch" (the
  anchor: the DeepGEMM / slime torch formula per tensor, plain per-tensor copies). Each side's reference for the
  correctness check is ``dequant(quant(w))`` of its own codec.
"""
from __future__ import annotations

import dataclasses
import mmap
import os

import torch

from ..errors import InvalidArgumentError
from ..quant.layout import Fp8BucketLayout, block_grid
from .model import QUANT_BLOCK

__all__ = ["SyncLayout", "SharedHostBuffer", "pack", "unpack", "reference_weights", "torch_block_quant",
           "torch_block_dequant"]

_SECTION_ALIGN = 256


def _up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclasses.dataclass(frozen=True)
class _Entry:
    name: str
    shape: tuple
    offset: int  # bytes from the start of its section
    scale_offset: int = 0  # fp32 elements into the scale section (2-D only)


@dataclasses.dataclass(frozen=True)
class SyncLayout:
    quant: tuple  # _Entry per 2-D weight
    raw: tuple  # _Entry per 1-D param
    q_bytes: int
    scale_count: int
    raw_bytes: int

    @classmethod
    def of(cls, named_shapes) -> "SyncLayout":
        named, raw, ro = [], [], 0
        for name, shape in named_shapes:
            shape = tuple(int(s) for s in shape)
            if len(shape) == 2:
                N, K = shape
                if N % QUANT_BLOCK or K % QUANT_BLOCK:
                    raise InvalidArgumentError(f"{name}: shape {shape} is not a multiple of {QUANT_BLOCK}")
                named.append((name, shape))
            elif len(shape) == 1:
                raw.append(_Entry(name, shape, ro))
                ro += _up(2 * shape[0], 16)
            else:
                raise InvalidArgumentError(f"{name}: only 1-D and 2-D params can be synced, got shape {shape}")
        if not named:
            raise InvalidArgumentError("nothing to quantize: the model has no 2-D weights")
        fp8 = Fp8BucketLayout.packed([shape for _, shape in named])  # the quant section is fp8_block_quant_list's
        quant = [_Entry(name, shape, a, b // 4) for (name, shape), (a, b, _, _) in zip(named, fp8.entries)]
        return cls(tuple(quant), tuple(raw), fp8.q_bytes, fp8.scale_bytes // 4, ro)

    @classmethod
    def of_model(cls, model) -> "SyncLayout":
        return cls.of((n, p.shape) for n, p in model.named_parameters())

    @property
    def scale_start(self) -> int:
        return _up(self.q_bytes, _SECTION_ALIGN)

    @property
    def raw_start(self) -> int:
        return _up(self.scale_start + 4 * self.scale_count, _SECTION_ALIGN)

    @property
    def nbytes(self) -> int:
        return _up(self.raw_start + self.raw_bytes, _SECTION_ALIGN)

    def bf16_bytes(self) -> int:
        """What the same weights would move as plain bf16 (for the bytes-moved column)."""
        return sum(2 * e.shape[0] * e.shape[1] for e in self.quant) + sum(2 * e.shape[0] for e in self.raw)


class SharedHostBuffer:
    """``nbytes`` of shared host memory behind a memfd, optionally registered (pinned) with CUDA.
    ``SharedHostBuffer.create(n)`` in the trainer; ``SharedHostBuffer(fd, n)`` in the child that inherited ``fd``."""

    def __init__(self, fd: int, nbytes: int, *, pin: bool):
        if nbytes <= 0:
            raise InvalidArgumentError(f"shared buffer size must be positive, got {nbytes}")
        self.fd, self.nbytes = fd, nbytes
        self._mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.pinned = False
        if pin:
            cudart = torch.cuda.cudart()
            torch.cuda.check_error(cudart.cudaHostRegister(self.tensor.data_ptr(), nbytes, 0))
            self.pinned = True

    @classmethod
    def create(cls, nbytes: int, *, pin: bool) -> "SharedHostBuffer":
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidArgumentError(f"shared buffer size must be a positive int, got {nbytes!r}")
        fd = os.memfd_create("ebbtide-colocate-sync", 0)  # no MFD_CLOEXEC: the rollout inherits it (pass_fds)
        os.ftruncate(fd, nbytes)
        return cls(fd, nbytes, pin=pin)

    def close(self):
        if self.pinned:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr()))
            self.pinned = False
        self.tensor = None
        try:
            self._mm.close()
        except BufferError:  # a view still references it; the mapping goes with the process
            pass


# ---- the torch formula (the anchor codec) ---------------------------------------------------------------------
def torch_block_quant(x: torch.Tensor, eps: float = 1e-4):
    """DeepGEMM's per_block_cast_to_fp8 for [N, K] with N, K multiples of 128 (what slime's weight sync runs)."""
    n, k = x.shape
    xv = x.view(n // 128, 128, k // 128, 128)
    amax = xv.abs().float().amax(dim=(1, 3), keepdim=True).clamp(eps)
    sf = amax / 448.0
    q = (xv * (1.0 / sf)).to(torch.float8_e4m3fn).view(n, k)
    return q, sf.view(n // 128, k // 128)


def torch_block_dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (q.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)).to(torch.bfloat16)


def _codec(codec: str):
    if codec == "ebbtide":
        import ebbtide.quant as Q  # noqa: PLC0415

        return Q.fp8_block_quant, Q.fp8_block_dequant
    if codec == "torch":
        return torch_block_quant, torch_block_dequant
    raise InvalidArgumentError(f"codec must be 'ebbtide' or 'torch', got {codec!r}")


def _params(model, layout: SyncLayout):
    named = dict(model.named_parameters())
    missing = [e.name for e in layout.quant + layout.raw if e.name not in named]
    if missing:
        raise InvalidArgumentError(f"model lacks params named in the layout: {missing[:4]}")
    return named


# ---- trainer side --------------------------------------------------------------------------------------------
@torch.no_grad()
def pack(model, layout: SyncLayout, host: torch.Tensor, codec: str) -> int:
    """Quantize the model's weights and write them into ``host`` (uint8, layout.nbytes). Returns bytes written.
    Synchronous: the host buffer is complete when it returns."""
    named = _params(model, layout)
    if host.numel() < layout.nbytes:
        raise InvalidArgumentError(f"host buffer has {host.numel()} bytes, the layout needs {layout.nbytes}")
    ss, rs = layout.scale_start, layout.raw_start
    if codec == "ebbtide":
        import ebbtide.quant as Q  # noqa: PLC0415

        bucket = Q.fp8_block_quant_list([named[e.name].detach() for e in layout.quant])
        if bucket.q_buffer.numel() != layout.q_bytes or bucket.scale_buffer.numel() != layout.scale_count:
            raise InvalidArgumentError(f"bucket layout ({bucket.q_buffer.numel()} q bytes, "
                                       f"{bucket.scale_buffer.numel()} scales) differs from the sync layout "
                                       f"({layout.q_bytes}, {layout.scale_count})")
        raw = [named[e.name].detach().view(torch.uint8) for e in layout.raw]
        host[:layout.q_bytes].copy_(bucket.q_buffer, non_blocking=True)
        host[ss:ss + 4 * layout.scale_count].copy_(bucket.scale_buffer.view(torch.uint8), non_blocking=True)
        for e, r in zip(layout.raw, raw):
            host[rs + e.offset:rs + e.offset + r.numel()].copy_(r, non_blocking=True)
        if bucket.q_buffer.is_cuda:
            torch.cuda.current_stream(bucket.q_buffer.device).synchronize()
    elif codec == "torch":
        for e in layout.quant:  # per tensor, plain (synchronous) copies
            q, s = torch_block_quant(named[e.name].detach())
            host[e.offset:e.offset + q.numel()].copy_(q.view(torch.uint8).reshape(-1))
            o = ss + 4 * e.scale_offset
            host[o:o + 4 * s.numel()].copy_(s.reshape(-1).view(torch.uint8))
        for e in layout.raw:
            r = named[e.name].detach().view(torch.uint8)
            host[rs + e.offset:rs + e.offset + r.numel()].copy_(r)
    else:
        _codec(codec)
    return layout.nbytes


# ---- rollout side --------------------------------------------------------------------------------------------
def _views(buf: torch.Tensor, layout: SyncLayout, e: _Entry):
    N, K = e.shape
    nb, kb = block_grid(N, K)
    q = buf[e.offset:e.offset + N * K].view(torch.float8_e4m3fn).view(N, K)
    o = layout.scale_start + 4 * e.scale_offset
    s = buf[o:o + 4 * nb * kb].view(torch.float32).view(nb, kb)
    return q, s


@torch.no_grad()
def unpack(model, layout: SyncLayout, host: torch.Tensor, codec: str, staging: torch.Tensor | None = None) -> int:
    """Load ``host`` into the model's params: one H2D of the whole buffer into ``staging`` (uint8 on the model's
    device; allocated here if None), then dequant each weight in place. Returns bytes moved host -> device."""
    named = _params(model, layout)
    _, dequant = _codec(codec)
    dev = next(iter(named.values())).device
    if staging is None:
        staging = torch.empty(layout.nbytes, dtype=torch.uint8, device=dev)
    staging.copy_(host[:layout.nbytes], non_blocking=True)
    for e in layout.quant:
        named[e.name].copy_(dequant(*_views(staging, layout, e)))
    rs = layout.raw_start
    for e in layout.raw:
        p = named[e.name]
        p.copy_(staging[rs + e.offset:rs + e.offset + 2 * e.shape[0]].view(torch.bfloat16))
    return layout.nbytes


@torch.no_grad()
def reference_weights(model, layout: SyncLayout, codec: str) -> dict:
    """{name: dequant(quant(w))} for 2-D weights and the bf16 value for 1-D params, on the model's device: what
    the rollout must hold after a sync (the correctness check compares against this)."""
    quant, dequant = _codec(codec)
    named = _params(model, layout)
    out = {e.name: dequant(*quant(named[e.name].detach())) for e in layout.quant}
    out.update({e.name: named[e.name].detach().clone() for e in layout.raw})
    return out
