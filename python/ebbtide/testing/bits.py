"""Bit-level comparison of tensors, for tests and for the benchmark's correctness checks.

``torch.equal`` compares values: ``-0.0 == 0.0`` and ``nan != nan``, so it can pass on different bits and fail
on identical ones. Exact round trips (offload/restore, weight sync, a quantized weight the rollout serves) are
claims about bits; these helpers compare the integer views of the same width instead, and say where and how
two tensors differ.

- :func:`bits`: the integer view of a tensor's bit patterns (fp8 → uint8, bf16/fp16 → int16, fp32 → int32,
  fp64 → int64; integer and bool tensors as they are).
- :func:`same_bits`: same shape, same dtype, same bit patterns.
- :func:`bits_equal`: the same, except that any NaN matches any NaN at the same position (torch's own NaN payloads
  depend on which of its kernels ran).
- :func:`assert_same_bits`: :func:`same_bits` as an assertion whose message counts the differing elements and shows
  the first few with their values and bit patterns.
- :func:`digests`: a sha256 per named tensor, to compare bits across processes.
"""
from __future__ import annotations

import hashlib

import torch

__all__ = ["bits", "same_bits", "bits_equal", "describe_mismatch", "assert_same_bits", "digests"]

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns as integers of the same width, same shape and device (contiguous)."""
    t = t.detach().contiguous()
    if not (t.is_floating_point() or t.is_complex()):
        return t
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view(_INT_OF_WIDTH[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` have the same shape, dtype and bit patterns (on one device; else both on the CPU)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.device != b.device:
        a, b = a.cpu(), b.cpu()
    return torch.equal(bits(a), bits(b))


def _nan_mask(t: torch.Tensor) -> torch.Tensor:
    return torch.isnan(t) if t.is_floating_point() else torch.zeros(t.shape, dtype=torch.bool, device=t.device)


def _differ(a: torch.Tensor, b: torch.Tensor, nan_equal: bool) -> torch.Tensor:
    """Mask of elements whose bits differ (any NaN matching any NaN where ``nan_equal``)."""
    if a.device != b.device:
        a, b = a.cpu(), b.cpu()
    d = bits(a) != bits(b)
    if d.dim() > a.dim():  # complex: real and imaginary part
        d = d.any(-1)
    if nan_equal and a.is_floating_point():
        d &= ~(_nan_mask(a) & _nan_mask(b))
    return d


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (shape and dtype too), except that any NaN matches any NaN at the same position."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return not bool(_differ(a, b, nan_equal=True).any())


def describe_mismatch(a: torch.Tensor, b: torch.Tensor, *, nan_equal: bool = True, first: int = 3) -> str:
    """How ``a`` and ``b`` differ: dtype or shape, else how many elements differ in their bits and the first
    ``first`` of them (index, values, bit patterns)."""
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} != {b.dtype}"
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    d = _differ(a, b, nan_equal)
    n = int(d.sum())
    if n == 0:
        return "same bits"
    idx = d.nonzero()[:first].tolist()
    ac, bc = a.detach().cpu(), b.detach().cpu()
    shown = []
    for i in idx:
        x, y = ac[tuple(i)], bc[tuple(i)]
        shown.append(f"{tuple(i)}: {x.item()!r} ({_hex(x)}) vs {y.item()!r} ({_hex(y)})")
    return f"{n} of {a.numel()} elements differ; " + "; ".join(shown)


def _hex(x: torch.Tensor) -> str:
    v = bits(x.reshape(1)).reshape(-1)
    width = 2 * x.element_size()
    return " ".join(f"0x{int(w) & ((1 << (4 * width)) - 1):0{width}x}" for w in v.tolist())


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str = "tensor") -> None:
    """Fail, saying where and how, unless ``got`` and ``want`` have the same shape, dtype and bits (NaN payloads
    included)."""
    if not same_bits(got, want):
        raise AssertionError(f"{what}: {describe_mismatch(got, want, nan_equal=False)}")


def digests(named: dict) -> dict:
    """``{name: sha256 of the tensor's bytes}`` in the dict's order: bitwise identity across processes."""
    return {n: hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
            for n, t in named.items()}
