"""Where the FP8 block kernels put each tensor's e4m3 bytes and fp32 block scales: the one definition of the bucket
layout that ``fp8_block_quant_list`` (CUDA and CPU), its views (``Fp8Bucket``) and weight sync all use.

- A block-quantized weight [N, K] has ``N * K`` e4m3 bytes (row-major) and ``ceil(N/128) * ceil(K/128)`` fp32
  scales (row-major over the block grid; HF ``weight_scale_inv``).
- ``Fp8BucketLayout.packed(shapes)`` is ``fp8_block_quant_list``'s own layout: two buffers; tensor i's e4m3 bytes
  start at a 16-byte aligned offset of the q buffer, its scales follow tensor i-1's in the scale buffer.
- ``Fp8BucketLayout.at(entries)`` places each tensor anywhere (byte offsets into the q buffer and the scale
  buffer, which may be one and the same uint8 buffer): weight sync writes straight into its transfer bucket.
- ``entries[i] = (q_offset, scale_offset, N, K)``, both offsets in bytes. Scale offsets are 4-byte aligned.
- The kernel walks tiles in entry order: tile ``t`` of tensor i is number ``tile_begin[i] + t`` of the launch.
"""
from __future__ import annotations

import functools

from ..errors import InvalidArgumentError

__all__ = ["BLOCK", "Q_ALIGN", "block_grid", "scale_shape", "Fp8BucketLayout"]

BLOCK = 128  # the block edge of block quantization (rows and columns)
Q_ALIGN = 16  # byte alignment of every tensor's e4m3 bytes in a packed layout


def block_grid(N: int, K: int) -> tuple[int, int]:
    """(ceil(N/128), ceil(K/128)): the shape of a [N, K] weight's scale matrix."""
    return -(-N // BLOCK), -(-K // BLOCK)


def scale_shape(shape) -> tuple:
    """The fp32 scale shape of a block-quantized weight of ``shape`` ([N, K] or [E, N, K])."""
    *lead, N, K = (int(s) for s in shape)
    return (*lead, *block_grid(N, K))


class Fp8BucketLayout:
    """Offsets of every tensor of one FP8 bucket. Immutable; equal shapes give equal layouts."""

    __slots__ = ("entries", "q_bytes", "scale_bytes", "tile_begin", "tiles")

    def __init__(self, entries, q_bytes: int, scale_bytes: int):
        self.entries = tuple(entries)  # (q_offset bytes, scale_offset bytes, N, K)
        self.q_bytes = q_bytes  # bytes of the q buffer the entries need (at least 1)
        self.scale_bytes = scale_bytes  # bytes of the scale buffer the entries need (at least 4)
        begin, t = [], 0
        for _, _, N, K in self.entries:
            begin.append(t)
            t += ((N + 127) >> 7) * ((K + 127) >> 7)
        self.tile_begin = tuple(begin)  # first tile number of each entry
        self.tiles = t  # tiles of the whole launch (= fp32 scales written)

    @classmethod
    def packed(cls, shapes, align: int = Q_ALIGN) -> "Fp8BucketLayout":
        """The two-buffer layout of ``fp8_block_quant_list``: q offsets ``align``-byte aligned, scales back to
        back. ``shapes`` is a sequence of (N, K)."""
        return _packed(tuple((int(N), int(K)) for N, K in shapes), int(align))

    @classmethod
    def at(cls, entries) -> "Fp8BucketLayout":
        """Explicit placement: ``entries`` of (q_offset, scale_offset, N, K) in bytes (scale offsets 4-aligned)."""
        entries = tuple((int(a), int(b), int(N), int(K)) for a, b, N, K in entries)
        qb = sb = 0
        for a, b, N, K in entries:
            if a < 0 or b < 0 or N <= 0 or K <= 0:
                raise InvalidArgumentError(f"bad FP8 layout entry {(a, b, N, K)}: offsets >= 0, N and K > 0")
            if b % 4:
                raise InvalidArgumentError(f"scale offset {b} is not 4-byte aligned (fp32 scales)")
            nb, kb = block_grid(N, K)
            qb, sb = max(qb, a + N * K), max(sb, b + 4 * nb * kb)
        return cls(entries, max(qb, 1), max(sb, 4))

    def __len__(self) -> int:
        return len(self.entries)

    def __eq__(self, other) -> bool:
        return isinstance(other, Fp8BucketLayout) and self.entries == other.entries

    def __hash__(self) -> int:
        return hash(self.entries)

    def __repr__(self) -> str:
        return f"Fp8BucketLayout({len(self.entries)} tensors, q {self.q_bytes} B, scales {self.scale_bytes} B)"

    def views(self, q_buffer, scale_buffer) -> tuple[list, list]:
        """Per-tensor (q float8_e4m3fn [N, K], scale float32 [ceil(N/128), ceil(K/128)]) views of the buffers
        (any dtype; they are read as bytes)."""
        import torch  # noqa: PLC0415

        qb, sb = q_buffer.view(torch.uint8), scale_buffer.view(torch.uint8)
        qs, ss = [], []
        for a, b, N, K in self.entries:
            nb, kb = ((N + 127) >> 7), ((K + 127) >> 7)
            qs.append(qb[a:a + N * K].view(torch.float8_e4m3fn).view(N, K))
            ss.append(sb[b:b + 4 * nb * kb].view(torch.float32).view(nb, kb))
        return qs, ss


@functools.lru_cache(maxsize=256)
def _packed(shapes: tuple, align: int) -> Fp8BucketLayout:
    # Weight sync quantizes the same shapes every update: the layout is computed once per shape list.
    if align <= 0 or align & (align - 1):
        raise InvalidArgumentError(f"align must be a power of two, got {align}")
    entries, qo, so = [], 0, 0
    for N, K in shapes:
        if N <= 0 or K <= 0:
            raise InvalidArgumentError(f"FP8 bucket shapes must be positive, got {(N, K)}")
        entries.append((qo, so, N, K))
        qo += (N * K + align - 1) // align * align
        so += 4 * ((N + 127) >> 7) * ((K + 127) >> 7)
    return Fp8BucketLayout(entries, max(qo, 1), max(so, 4))
