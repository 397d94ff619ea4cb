"""Input generators shared by the optim tests (bitwise comparison: ebbtide.testing.bits)."""
from __future__ import annotations

import torch


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
