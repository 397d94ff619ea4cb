"""The DeepEP scenario of ``ebbtide bench comm`` and its GPU test, one rank per GPU: Megatron-core's own
``fused_a2a.get_buffer`` builds the DeepEP buffer (its module global, the object Megatron's flex dispatcher keeps),
then release/reload cycles of every group, WORLD included:
- the buffer stays the same object, and dispatch + combine of a fixed MoE batch give bitwise the same results after
  every cycle;
- device memory freed by each release (cudaMemGetInfo, after release's trailing barrier);
- the restore time split as ebbtide.comm reports it: the group's first collective (NCCL connects a rebuilt
  communicator on first use) and DeepEP's own rebuild (allocation, IPC handle exchange), beside Megatron's
  ``get_buffer`` (DeepEP's ``Buffer`` construction) on a connected group;
- dispatch + combine time (median of ``iters``) before the first cycle and after the last.
Needs deep_ep (scripts/build-deepep) and megatron-core."""
from __future__ import annotations

import datetime
import statistics
import time

import torch
import torch.distributed as dist

import ebbtide.comm as comm
from ebbtide.comm import _deepep
from ebbtide.errors import StateError

from ..bits import same_bits
from ..spawn import join_store, progress


def _inputs(rank, tokens, hidden, experts, topk):
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda", generator=g)
    scores = torch.randn(tokens, experts, device="cuda", generator=g)
    idx = scores.topk(topk, dim=-1).indices
    w = torch.softmax(scores.gather(1, idx), -1).float()
    return x, idx, w


def dispatch_combine(buf, x, idx, w, experts):
    """One intranode dispatch + combine with DeepEP's recommended configs (no expert compute between)."""
    import deep_ep  # noqa: PLC0415

    n = buf.group_size
    cd, cc = deep_ep.Buffer.get_dispatch_config(n), deep_ep.Buffer.get_combine_config(n)
    idx = idx.to(deep_ep.topk_idx_t)
    n_rank, _, n_exp, in_rank, _ = buf.get_dispatch_layout(idx, experts)
    recv_x, _recv_idx, recv_w, _per_exp, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_exp, topk_idx=idx,
        topk_weights=w, config=cd)
    out, _out_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w, config=cc)
    return recv_x, out


def _median_time(fn, iters):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def deepep_cycles(rank, world, init, cycles=3, tokens=4096, hidden=4096, experts=16, topk=4, iters=20):
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    comm.install(timeout=120)
    dist.init_process_group("nccl", store=join_store(init), rank=rank, world_size=world, device_id=dev,
                            timeout=datetime.timedelta(seconds=120))
    from megatron.core.transformer.moe import fused_a2a  # noqa: PLC0415

    if not fused_a2a.HAVE_DEEP_EP:
        raise RuntimeError("megatron's fused_a2a did not import deep_ep")
    ep = dist.new_group(list(range(world)))
    dist.barrier(group=ep)  # connected, as in training by the time the dispatcher first runs
    x, idx, w = _inputs(rank, tokens, hidden, experts, topk)
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    t = time.perf_counter()
    buf = fused_a2a.get_buffer(ep, hidden * 2)
    torch.cuda.synchronize()
    ctor_s = time.perf_counter() - t
    ctor_bytes = free0 - torch.cuda.mem_get_info()[0]
    progress(f"rank {rank}: Megatron's DeepEP buffer: {buf.num_nvl_bytes / 2**20:.0f} MiB NVLink, built in "
             f"{ctor_s * 1e3:.1f} ms, device -{ctor_bytes / 2**20:.0f} MiB")
    want = [t.clone() for t in dispatch_combine(buf, x, idx, w, experts)]
    before_s = _median_time(lambda: dispatch_combine(buf, x, idx, w, experts), iters)
    rows = []
    for c in range(cycles):
        torch.cuda.synchronize()
        f_live = torch.cuda.mem_get_info()[0]
        rep = comm.release(include_world=True)
        f_rel = torch.cuda.mem_get_info()[0]
        try:
            dispatch_combine(buf, x, idx, w, experts)
            raise AssertionError("dispatch on a released DeepEP buffer did not raise")
        except StateError:
            pass
        rep2 = comm.reload()
        if fused_a2a._buffer is not buf or fused_a2a.get_buffer(ep, hidden * 2) is not buf:
            raise AssertionError("Megatron's DeepEP buffer object changed across the cycle")
        got = dispatch_combine(buf, x, idx, w, experts)
        if not all(same_bits(a, b) for a, b in zip(got, want)):
            raise AssertionError(f"cycle {c}: dispatch/combine results differ from before the first release")
        d_rel = [g.seconds for g in rep.groups if g.desc == "DeepEP buffer"][0]
        rows.append({"freed_bytes": f_rel - f_live, "release_s": rep.seconds, "reload_s": rep2.seconds,
                     "deepep_release_s": d_rel, **_deepep.timings(buf)})
        progress(f"rank {rank}: cycle {c}: {rows[-1]}")
    after_s = _median_time(lambda: dispatch_combine(buf, x, idx, w, experts), iters)
    return {"world": world, "nvl_bytes": buf.num_nvl_bytes, "ctor_s": ctor_s, "ctor_bytes": ctor_bytes,
            "cycles": rows, "before_s": before_s, "after_s": after_s, "shape": [tokens, hidden, experts, topk]}
