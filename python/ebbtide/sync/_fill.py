"""Writing one bucket (the sender) and reading it back into live parameters (the receiver), per the plan.

A bucket is filled by one FP8 launch for all its FP8 weights (``fp8_block_quant_into`` at the plan's offsets,
experts of a stacked weight one entry each), one INT4 pack per INT4 weight and one copy per raw tensor; on CUDA
everything is queued on the current stream. CPU tensors take ``ebbtide.quant``'s reference: the same bits.
A sender keeps a ``BucketFill`` per bucket: the FP8 launch table (``Fp8BucketQuant``) and the bucket's FP8 source
names in layout order, so a push reads each tensor once and does no other per-tensor work in Python.
"""
from __future__ import annotations

import torch

from .. import quant as Q
from ..quant.layout import Fp8BucketLayout
from ..quant.prepared import Fp8BucketQuant
from .plan import BucketPlan, Plan, fp8_entries

__all__ = ["BucketFill", "fill_bucket", "load_bucket", "expected"]


class BucketFill:
    """One bucket's fill, prepared once per sender (see the module docstring); with ``items`` (some of the bucket's
    items, placed as the plan placed them) only theirs: a streamed push fills a bucket in parts."""

    def __init__(self, plan: Plan, bucket: BucketPlan, items=None):
        self.plan, self.bucket = plan, bucket
        items = bucket.items if items is None else tuple(items)
        fp8 = [it for it in items if it.kind == "fp8"]
        self.fp8_names = [it.source for it in fp8]
        self.stacked = [len(it.shape) == 3 for it in fp8]  # 3-D weights: one layout entry per expert
        layout = bucket.fp8 if items is bucket.items else (Fp8BucketLayout.at(fp8_entries(fp8)) if fp8 else None)
        self.quant = Fp8BucketQuant(layout, plan.scale, plan.eps) if layout is not None else None
        self.others = [it for it in items if it.kind != "fp8"]

    def fp8_sources(self, sources) -> list:
        """The tensors of the bucket's FP8 layout entries, in order (``sources``: name -> full tensor)."""
        if not any(self.stacked):
            return list(map(sources.__getitem__, self.fp8_names))
        out = []
        for name, stacked in zip(self.fp8_names, self.stacked):
            t = sources[name]
            out.extend(t.unbind(0) if stacked else (t,))
        return out

    @torch.no_grad()
    def __call__(self, sources, buf: torch.Tensor) -> None:
        """Write the bucket's outputs from ``sources`` (name -> full tensor, on ``buf``'s device) into ``buf``
        (uint8, at least ``bucket.nbytes``)."""
        if self.quant is not None:
            self.quant(self.fp8_sources(sources), buf, buf)
        _fill_others(self.plan, self.others, sources, buf)


def _fill_others(plan: Plan, items, sources, buf: torch.Tensor) -> None:
    for it in items:
        if it.kind == "raw":
            it.outputs[0].view(buf).copy_(sources[it.source])
        elif it.kind == "int4":
            p = Q.int4_pack(sources[it.source], group=plan.int4_group)
            packed, scale, shape = it.outputs
            packed.view(buf).copy_(p["weight_packed"])
            scale.view(buf).copy_(p["weight_scale"])
            shape.view(buf).copy_(p["weight_shape"], non_blocking=True)


@torch.no_grad()
def fill_bucket(plan: Plan, bucket: BucketPlan, sources, buf: torch.Tensor) -> None:
    """A one-off fill of ``bucket`` (a fresh launch table): what ``BucketFill`` does for a sender."""
    BucketFill(plan, bucket)(sources, buf)


@torch.no_grad()
def load_bucket(bucket: BucketPlan, buf: torch.Tensor, params, *, served: bool = False) -> None:
    """Dequantize/copy ``bucket``'s outputs in ``buf`` into ``params`` (source name -> live tensor) in place; with
    ``served``, copy every output into ``params[output name]`` as it is."""
    if served:
        for o in bucket.outputs:
            params[o.name].copy_(o.view(buf))
        return
    for it in bucket.items:
        p = params[it.source]
        if it.kind == "fp8":
            q, s = it.outputs[0].view(buf), it.outputs[1].view(buf)
            if p.dtype == torch.bfloat16 and p.device == q.device and (p.is_contiguous() or p.device.type == "cpu"):
                Q.fp8_block_dequant(q, s, out=p)  # straight into the parameter: no temporary, one kernel
            else:
                p.copy_(Q.fp8_block_dequant(q, s))
        elif it.kind == "int4":
            packed, scale, _ = it.outputs
            p.copy_(Q.int4_unpack(packed.view(buf), scale.view(buf), it.shape))
        else:
            p.copy_(it.outputs[0].view(buf))


@torch.no_grad()
def expected(plan: Plan, sources) -> dict:
    """{source name: what a receiver must hold}: ``dequant(quant(w))`` by ``ebbtide.quant``'s per-tensor calls for
    FP8 and INT4 weights, the tensor itself for raw ones, on each tensor's device (CPU tensors run the reference,
    the oracle; CUDA tensors the kernels, which match it bit for bit). Pass CPU copies for an independent check."""
    out = {}
    for it in plan.items:
        w = sources[it.source].detach()
        if it.kind == "fp8":
            q, s = Q.fp8_block_quant(w, scale=plan.scale, eps=plan.eps)
            out[it.source] = Q.fp8_block_dequant(q, s)
        elif it.kind == "int4":
            out[it.source] = Q.int4_unpack(Q.int4_pack(w, group=plan.int4_group))
        else:
            out[it.source] = w.clone()
    return out
