"""Independent oracles for the quant golden tests: exact rational / float64 arithmetic and table search, written
without the reference's bit tricks, so agreement between the two is evidence rather than a tautology.
Also the shared input generators (tests and the GPU tests draw from the same ones)."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import torch

E4M3_POS = np.array([v for v in (
    [m * 2.0 ** -9 for m in range(8)] +
    [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8)]
) if v <= 448.0], dtype=np.float64)  # codes 0x00..0x7E in order, value == code index
assert len(E4M3_POS) == 127


def rn32_fraction(r: Fraction) -> np.float32:
    """Round an exact rational to the nearest fp32 (ties to even), normal range only."""
    if r == 0:
        return np.float32(0.0)
    sign = -1 if r < 0 else 1
    r = abs(r)
    e = r.numerator.bit_length() - r.denominator.bit_length()
    if Fraction(2) ** e > r:
        e -= 1
    scaled = r / Fraction(2) ** (e - 23)  # in [2^23, 2^24)
    q, rem = divmod(scaled.numerator, scaled.denominator)
    twice = 2 * rem
    if twice > scaled.denominator or (twice == scaled.denominator and q % 2 == 1):
        q += 1
    return np.float32(sign * q * 2.0 ** (e - 23))


def e4m3_nearest(y: np.ndarray) -> np.ndarray:
    """Byte of the e4m3 value nearest to y (|y| <= 448), ties to the even code, by table search."""
    y = np.asarray(y, dtype=np.float64)
    a = np.abs(y)
    hi = np.clip(np.searchsorted(E4M3_POS, a, side="left"), 0, 126)
    lo = np.clip(hi - 1, 0, 126)
    dlo, dhi = a - E4M3_POS[lo], E4M3_POS[hi] - a
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    pick = np.where(a == E4M3_POS[hi], hi, pick)
    return (pick | np.where(np.signbit(y), 0x80, 0)).astype(np.uint8)


def all_finite_bf16_f32() -> np.ndarray:
    u = np.arange(65536, dtype=np.uint32)
    u = u[(u & 0x7F80) != 0x7F80]
    return (u << 16).view(np.float32)


def every_finite_bf16_in_groups(seed: int = 0):
    """All 65,280 finite bf16 values as [-1, 128] tensors (zero-padded): sorted (narrow ranges per group) and
    shuffled (wide ranges)."""
    u = np.arange(1 << 16, dtype=np.uint32)
    u = u[(u & 0x7F80) != 0x7F80].astype(np.uint16)
    u = np.concatenate([u, np.zeros((-u.size) % 128, np.uint16)])
    for arr in (u, np.random.default_rng(seed).permutation(u)):
        yield torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16).reshape(-1, 128)


def positive_finite_bf16_bits() -> np.ndarray:
    return np.arange(1, 0x7F80, dtype=np.uint16)


def heavy_tailed(shape, seed: int, spread=(-12, 4), block: int = 128) -> torch.Tensor:
    """N(0,1) x per-block 2^U[spread] x occasional outliers, in bf16 (the shape of real weights)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if len(shape) >= 2:
        nb = [-(-s // block) for s in shape[-2:]]
        blk = torch.exp2(torch.empty(nb).uniform_(*spread, generator=g))
        rows = torch.arange(shape[-2]) // block
        cols = torch.arange(shape[-1]) // block
        x = x * blk[rows][:, cols]
    out = x * torch.where(torch.rand(shape, generator=g) < 1e-3, 50.0, 1.0)
    return out.to(torch.bfloat16)


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def bf16_f64(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy().astype(np.float64)
