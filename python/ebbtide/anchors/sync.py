"""Weight updates from trainer to rollout as users move them today, over an ``ebbtide.sync`` plan (the same names,
kinds and byte layout ebbtide's sender uses), so the benchmarks and the colocated loop run the anchor beside it:
- slime's update by CUDA IPC on one GPU (``slime_update``), and the rollout's side of it (``slime_load``: views
  rebuilt, each weight dequantized and copied into its parameter, as a serving engine's ``load_weights`` does);
  split tensors gathered one at a time over the tensor-parallel group as slime gathers them (``GatheredEach``);
- the torch formula per tensor with plain copies through a host buffer (``torch_pack`` / ``torch_load``);
- ``torch_reference``: what a rollout holds after either (dequant(quant(w)) by the torch formula).
Importing this module imports no torch (the benchmark suites that name these import without it)."""
from __future__ import annotations

__all__ = ["slime_update", "slime_load", "GatheredEach", "torch_pack", "torch_load", "torch_reference"]


def slime_update(plan, src, conn) -> None:
    """slime's update path over the same plan: per bucket, one quant launch per tensor, the pieces flattened into a
    new producer buffer, its CUDA IPC handle sent over ``conn`` (a multiprocessing connection) and the consumer's
    answer awaited, then the buffer dropped (``ipc_collect`` + ``empty_cache``). ``src``: {source name: bf16
    tensor}. The consumer side is the benchmark's (``ebbtide.bench.suites.sync.consumer``) or the colocated
    rollout's (``slime_load``)."""
    import torch

    import ebbtide.quant as Q

    for b in plan.buckets:
        flats, meta, off = [], [], 0
        for it in b.items:
            w = src[it.source]
            if it.kind == "fp8":
                q, s = Q.fp8_block_quant(w)  # one launch per tensor
                pieces = [(it.outputs[0], q), (it.outputs[1], s)]
            else:
                pieces = [(it.outputs[0], w)]
            for o, t in pieces:
                f = t.reshape(-1).view(torch.uint8)
                flats.append(f)
                meta.append((o.name, o.dtype, o.shape, off, off + f.numel()))
                off += f.numel()
        flat = torch.cat(flats)  # the flattening copy, a new producer buffer every bucket
        torch.cuda.current_stream().synchronize()
        conn.send(("bucket", flat, meta))  # the CUDA IPC handle, pickled
        if conn.recv()[0] != "ok":
            raise RuntimeError("consumer failed")
        del flat, flats
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
    conn.send(("done",))
    conn.recv()


def slime_load(plan, params: dict, conn) -> int:
    """The rollout's side of one ``slime_update``: every bucket's views rebuilt from its metadata, each weight
    dequantized with one launch and copied into its parameter (``params``: {source name: tensor}), the answer sent
    once those copies completed (SGLang answers after enqueuing them; here the sender frees the bucket right after
    the answer). Returns the plan's wire bytes."""
    import torch
    import torch.multiprocessing  # noqa: F401 (CUDA tensors arrive as IPC handles)

    items = {o.name: (it, i) for it in plan.items for i, o in enumerate(it.outputs)}
    while True:
        msg = conn.recv()
        if msg[0] == "done":
            torch.cuda.synchronize()
            conn.send(("done",))
            return plan.nbytes
        _load_bucket(msg[1], msg[2], items, params)
        # every reference to the bucket is gone (the sender's ipc_collect can free it): answer
        del msg
        conn.send(("ok",))


def _load_bucket(flat, meta, items: dict, params: dict) -> None:
    """One slime-style bucket: views rebuilt from ``meta``, each weight dequantized and copied into its parameter;
    returns once the copies completed (nothing of ``flat`` outlives this frame)."""
    import torch

    from ..quant import fp8_block_dequant

    views = {name: flat[a:b].view(getattr(torch, dt)).view(shape) for name, dt, shape, a, b in meta}
    with torch.no_grad():
        for name, v in views.items():
            it, i = items[name]
            if i == 0:
                p = params[it.source]
                p.copy_(fp8_block_dequant(v, views[it.outputs[1].name]) if it.kind == "fp8" else v)
    torch.cuda.current_stream().synchronize()


class GatheredEach:
    """``{name: full tensor}`` read one tensor at a time: a split tensor is all-gathered over the tensor-parallel
    group when it is read (one gather per tensor, as slime's update does; every TP rank reads the same names in the
    same order). ``local``: this rank's shards; ``dims``: {name: split dim}."""

    def __init__(self, local: dict, dims: dict, group):
        self.local, self.dims, self.group = local, dims, group

    def __getitem__(self, name: str):
        if name not in self.dims:
            return self.local[name]
        from ..integrations.megatron import gather_along

        return gather_along(self.local[name], self.dims[name], self.group)


def _regions(plan, data):
    """(item, output views) of every tensor in ``data`` (the whole update, laid out as the plan's buckets)."""
    for b, o in zip(plan.buckets, plan.bucket_offsets()):
        region = data[o:o + b.nbytes]
        for it in b.items:
            yield it, [out.view(region) for out in it.outputs]


def torch_pack(plan, named: dict, data) -> None:
    """The torch formula per tensor, each result copied plainly (synchronously) into ``data`` (uint8, the plan's
    bytes: e.g. a shared host buffer's payload) at the plan's offsets."""
    import torch

    from .quant import torch_block_quant

    with torch.no_grad():
        for it, views in _regions(plan, data):
            w = named[it.source].detach()
            if it.kind == "fp8":
                q, s = torch_block_quant(w)
                views[0].view(torch.uint8).copy_(q.view(torch.uint8))
                views[1].copy_(s)
            else:
                views[0].copy_(w)


def torch_load(plan, named: dict, staging, data) -> None:
    """``data`` (what ``torch_pack`` wrote) copied into ``staging`` (device, the plan's bytes) with one copy, then
    each weight dequantized by the torch formula into its parameter (``named``: {source name: tensor})."""
    import torch

    from .quant import torch_block_dequant

    with torch.no_grad():
        staging.copy_(data, non_blocking=True)
        for it, views in _regions(plan, staging):
            named[it.source].copy_(torch_block_dequant(*views) if it.kind == "fp8" else views[0])


def torch_reference(plan, named: dict) -> dict:
    """{name: what a rollout holds after ``torch_pack`` + ``torch_load``}: the torch formula's dequant(quant(w))
    for FP8 items, the tensor itself for raw ones (``named``: {source name: detached tensor})."""
    from .quant import torch_block_dequant, torch_block_quant

    return {it.source: torch_block_dequant(*torch_block_quant(named[it.source])) if it.kind == "fp8"
            else named[it.source].clone() for it in plan.items}
