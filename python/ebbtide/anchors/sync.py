"""slime's weight update from trainer to rollout, re-implemented over an ``ebbtide.sync`` plan so the benchmarks and the
colocated example run the same anchor beside ebbtide's sender."""
from __future__ import annotations

__all__ = ["slime_update"]


def slime_update(plan, src, conn) -> None:
    """slime's update path over the same plan: per bucket, one quant launch per tensor, the pieces flattened into a
    new producer buffer, its CUDA IPC handle sent over ``conn`` (a multiprocessing connection) and the consumer's
    answer awaited, then the buffer dropped (``ipc_collect`` + ``empty_cache``). ``src``: {source name: bf16
    tensor}. The consumer side is the benchmark's (``ebbtide.bench.suites.sync.consumer``) or the colocated
    rollout's."""
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
