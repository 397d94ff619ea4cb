"""Input generators and bitwise comparison shared by the optim tests and the optim bench suite."""
from __future__ import annotations

import torch


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two float tensors, except that any NaN matches any NaN at the same position (torch's
    own NaN payloads depend on which of its kernels ran)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    na, nb = torch.isnan(a), torch.isnan(b)
    if not torch.equal(na, nb):
        return False
    ia = a.view(torch.int32 if a.dtype == torch.float32 else torch.int16)
    ib = b.view(torch.int32 if b.dtype == torch.float32 else torch.int16)
    return torch.equal(ia[~na], ib[~nb])


def describe_mismatch(a: torch.Tensor, b: torch.Tensor) -> str:
    diff = (a != b) & ~(torch.isnan(a) & torch.isnan(b))
    idx = diff.nonzero()[:3].flatten().tolist()
    return f"{int(diff.sum())} of {a.numel()} differ; first at {idx}: {a.flatten()[idx].tolist()} vs {b.flatten()[idx].tolist()}"


def offset_view(n: int, offset: int, dtype=torch.float32, fill=None, gen=None) -> torch.Tensor:
    """A contiguous length-n view starting `offset` elements into a larger buffer (misaligned for offset % 16)."""
    buf = torch.empty(n + offset + 5, dtype=dtype)
    v = buf[offset:offset + n]
    if fill is not None:
        v.copy_(fill)
    return v


def grads_for(n: int, steps: int, seed: int, *, special: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(steps):
        x = torch.randn(n, generator=g) * (10.0 ** float(torch.randint(-4, 2, (1,), generator=g)))
        if special and n >= 8 and s == steps // 2:
            x[1] = float("nan")
            x[3] = float("inf")
            x[5] = float("-inf")
            x[7] = 1e-40  # subnormal
        out.append(x)
    return out


def round_moments_to_bf16(opt: torch.optim.Optimizer) -> None:
    """The bf16-moments reference step's last part: after a torch Adam/AdamW step on fp32 copies of bf16 moments,
    round every ``exp_avg``/``exp_avg_sq`` to bf16 (``.to(torch.bfloat16)``: round to nearest even) and keep the
    fp32 value of that bf16, in place. A torch optimizer run this way, step after step, is the pure-torch
    reference for ``moments_dtype=torch.bfloat16``: its moments hold exactly the bf16 values, and each step
    upcasts them (exactly), computes in fp32, and rounds the new moments."""
    for st in opt.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            st[key].copy_(st[key].to(torch.bfloat16))
