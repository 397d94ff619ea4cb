"""The CPU optimizer a plain torch user writes for bf16 weights on the GPU: torch's fused AdamW over fp32 master
copies in host memory, gradients and parameters moved with plain copies (``.float().cpu()`` down, ``copy_`` up), and
a data-parallel gradient all-reduce over one flattened buffer."""
from __future__ import annotations

__all__ = ["TorchCpuAdamW"]


class TorchCpuAdamW:
    LABEL = "torch.optim.AdamW(fused=True) on CPU fp32 masters, plain copies"

    def __init__(self, params, *, lr: float, weight_decay: float):
        import torch

        self.torch = torch
        self.params = list(params)
        self.masters = [p.detach().float().cpu().requires_grad_(True) for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, lr=lr, weight_decay=weight_decay, fused=True)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def all_reduce_grads(self, all_reduce, world: int) -> None:
        """The gradients averaged over ``world`` ranks through one flat buffer (``all_reduce(tensor)``: a sum)."""
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        grads = [p.grad for p in self.params]
        flat = _flatten_dense_tensors(grads)
        all_reduce(flat)
        flat.div_(world)
        for g, f in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(f)

    def step(self) -> None:
        """Gradients down, the CPU step, bf16 parameters up; the GPU gradients are dropped."""
        torch = self.torch
        for m, p in zip(self.masters, self.params):
            m.grad = p.grad.float().cpu()
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m.detach().to(torch.bfloat16))
                p.grad = None
