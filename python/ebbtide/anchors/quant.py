"""The torch formulas users run today for FP8 and INT4 (DeepGEMM's reference casts, slime's weight sync and its
Megatron fake-quant), the anchor of ebbtide's quant kernels in the ``quant`` suite and of its weight sync in the
colocated loop. Plain torch on whatever device the tensor is on."""
from __future__ import annotations

import torch

__all__ = ["torch_block_quant", "torch_block_dequant", "torch_group_quant", "torch_int4"]


def torch_block_quant(x: torch.Tensor, eps: float = 1e-4):
    """DeepGEMM's ``per_block_cast_to_fp8`` (what slime's weight sync runs): e4m3 with one fp32 scale per 128x128
    block, batched over leading dims; ragged N, K are padded with zeros as it does. Returns (q [..., N, K],
    scales [..., ceil(N/128), ceil(K/128)])."""
    *lead, n0, k0 = x.shape
    n, k = -(-n0 // 128) * 128, -(-k0 // 128) * 128
    if (n, k) != (n0, k0):
        x = torch.nn.functional.pad(x, (0, k - k0, 0, n - n0))
    xv = x.view(*lead, n // 128, 128, k // 128, 128)
    amax = xv.abs().float().amax(dim=(-3, -1), keepdim=True).clamp(eps)
    sf = amax / 448.0
    q = (xv * (1.0 / sf)).to(torch.float8_e4m3fn).view(x.shape)[..., :n0, :k0]
    return q, sf.view(*lead, n // 128, k // 128)


def torch_block_dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """float(q) times its block's scale, in bf16 ([N, K] with N, K multiples of 128)."""
    return (q.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)).to(torch.bfloat16)


def torch_group_quant(x: torch.Tensor, eps: float = 1e-10, mn_major: bool = False):
    """DeepGEMM's ``per_token_cast_to_fp8``: one fp32 scale per 1x128 group of a row (+ the MN-major transpose copy
    of the scales when asked)."""
    m, k = x.shape
    xv = x.view(m, -1, 128)
    amax = xv.abs().float().amax(dim=2).clamp(eps)
    q = (xv * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(m, k)
    s = amax / 448.0
    if mn_major:
        s = s.t().contiguous().t()
    return q, s


def torch_int4(w: torch.Tensor, group: int = 128, pack: bool = False):
    """slime's Megatron INT4 fake-quant (amax/7, round, clamp, q*s) and, with ``pack``, its compressed-tensors
    packer (eight 4-bit values per int32, offset 8; bf16 scales)."""
    n, k = w.shape
    x = w.view(n, -1, group).float()
    s = (x.abs().amax(dim=2, keepdim=True) / 7).clamp(min=1e-5)
    q = torch.round(x / s).clamp(-7, 7)
    if not pack:
        return (q * s).view(n, k).to(torch.bfloat16)
    u = (q.view(n, k // 8, 8).to(torch.int32) + 8) << torch.arange(0, 32, 4, device=w.device, dtype=torch.int32)
    return u.sum(dim=-1, dtype=torch.int32), s.view(n, -1).to(torch.bfloat16)
