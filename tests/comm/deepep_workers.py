"""Rank bodies for ebbtide.comm's DeepEP support: ``standin`` on Gloo with the CPU stand-in of ``deep_ep``
(tests/comm/standin), ``real`` on NCCL with DeepEP built by scripts/build-deepep (one rank per GPU)."""
from __future__ import annotations

import datetime
import gc
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import ebbtide.comm as comm
from ebbtide.bench._spawn import join_store, progress
from ebbtide.errors import StateError, UnsupportedError

STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin")


def _expect_state_error(fn, what):
    try:
        fn()
    except StateError as e:
        assert "released" in str(e) and "reload()" in str(e), e
        return
    raise AssertionError(f"{what} did not raise StateError while released")


def standin(rank, world, init, cycles=3):
    """Tracking through the import hook, release/reload in place, the guard, the finalizer, the refusals."""
    comm.install(timeout=60)
    sys.path.insert(0, STANDIN)
    import deep_ep  # noqa: PLC0415  (after install: through the import hook)

    dist.init_process_group("gloo", store=join_store(init), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    ep = dist.new_group(list(range(world)))
    megatron_style = deep_ep.Buffer(ep, 1 << 20, 0)  # explicitly_destroy=False, as Megatron's fused_a2a builds it
    explicit = deep_ep.Buffer(ep, 1 << 16, 0, explicitly_destroy=True)
    assert megatron_style.explicitly_destroy is False and explicit.explicitly_destroy is True
    x = torch.arange(8, dtype=torch.float32) + rank
    want = megatron_style.dispatch(x).clone()
    built = deep_ep.CONSTRUCTED[0]
    rows = []
    for c in range(cycles):
        rt = megatron_style.runtime
        rep = comm.release(include_world=True)
        deep = [g for g in rep.groups if g.desc == "DeepEP buffer"]
        assert len(deep) == 2 and deep[0].bytes == 1 << 20, deep
        assert rt.destroyed and not deep_ep.LIVE, deep_ep.LIVE
        _expect_state_error(lambda: megatron_style.dispatch(x), "dispatch on a released buffer")
        rep2 = comm.reload()
        assert sum(g.desc == "DeepEP buffer" for g in rep2.groups) == 2, rep2.groups
        assert megatron_style.runtime is not rt and len(deep_ep.LIVE) == 2
        assert megatron_style.explicitly_destroy is False and explicit.explicitly_destroy is True
        assert torch.equal(megatron_style.dispatch(x), want)
        rows.append([deep[0].seconds, [g.seconds for g in rep2.groups if g.desc == "DeepEP buffer"][0]])
    assert deep_ep.CONSTRUCTED[0] == built + 2 * cycles
    # The caller's own destroy() of an explicit buffer: not released again, not rebuilt.
    explicit.destroy()
    comm.release(include_world=True)
    comm.reload()
    assert explicit.runtime is None and len(deep_ep.LIVE) == 1
    # A collected Megatron-style buffer is destroyed once (DeepEP's destructor rule), never twice.
    del megatron_style
    gc.collect()
    assert not deep_ep.LIVE and not deep_ep.ERRORS, (deep_ep.LIVE, deep_ep.ERRORS)
    # A buffer built before install() with explicitly_destroy=False cannot be tracked.
    comm.uninstall()
    try:
        refused = ""
        untracked = deep_ep.Buffer.__init__.__dict__.get("_ebbtide_original")
        b = object.__new__(deep_ep.Buffer)
        untracked(b, ep, 1024, 0)
        comm.track_deepep(b)
    except UnsupportedError as e:
        refused = str(e)
    assert "explicitly_destroy=False" in refused, refused
    b.runtime.destroy()
    b.runtime.explicitly_destroy = True
    dist.barrier()
    return {"cycles": rows}


def standin_disagreement(rank, world, init):
    """Ranks holding different DeepEP buffers: release() refuses on every rank before anything is freed."""
    comm.install(timeout=30)
    sys.path.insert(0, STANDIN)
    import deep_ep  # noqa: PLC0415

    dist.init_process_group("gloo", store=join_store(init), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    solo = [dist.new_group([r]) for r in range(world)]
    buf = deep_ep.Buffer(solo[rank], 4096 * (rank + 1), 0)
    try:
        comm.release(include_world=True)
        msg = ""
    except StateError as e:
        msg = str(e)
    assert "different DeepEP buffers" in msg, msg
    assert buf.runtime.is_available() and len(deep_ep.LIVE) == 1
    dist.all_reduce(torch.ones(1))  # the groups were put back
    return {"msg": msg}


# ---- the real DeepEP, one rank per GPU ------------------------------------------------------------------------
def _moe_inputs(rank, tokens, hidden, experts, topk):
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda", generator=g)
    scores = torch.randn(tokens, experts, device="cuda", generator=g)
    idx = scores.topk(topk, dim=-1).indices
    w = torch.softmax(scores.gather(1, idx), -1).float()
    return x, idx, w


def _dispatch_combine(buf, deep_ep, x, idx, w, experts):
    import deep_ep as de  # noqa: PLC0415

    n = buf.group_size
    cd, cc = de.Buffer.get_dispatch_config(n), de.Buffer.get_combine_config(n)
    n_rank, _, n_exp, in_rank, _ = buf.get_dispatch_layout(idx.to(de.topk_idx_t), experts)
    recv_x, recv_idx, recv_w, _per_exp, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_exp,
        topk_idx=idx.to(de.topk_idx_t), topk_weights=w, config=cd)
    out, _out_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w, config=cc)
    return recv_x, out


def _throughput(fn, iters):
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


def real(rank, world, init, cycles=3, tokens=4096, hidden=4096, experts=16, topk=4, iters=20):
    """Megatron's own get_buffer makes the buffer (its fused_a2a global); release/reload cycles keep the object:
    dispatch+combine bitwise equal after each cycle, NVLink bytes freed, restore time beside DeepEP's own Buffer
    construction, dispatch+combine time before and after."""
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    comm.install(timeout=120)
    dist.init_process_group("nccl", store=join_store(init), rank=rank, world_size=world, device_id=dev,
                            timeout=datetime.timedelta(seconds=120))
    import deep_ep  # noqa: PLC0415
    from megatron.core.transformer.moe import fused_a2a  # noqa: PLC0415

    assert fused_a2a.HAVE_DEEP_EP, "megatron's fused_a2a did not find deep_ep"
    ep = dist.new_group(list(range(world)))
    dist.barrier(group=ep)
    x, idx, w = _moe_inputs(rank, tokens, hidden, experts, topk)
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    t = time.perf_counter()
    buf = fused_a2a.get_buffer(ep, hidden * 2)
    torch.cuda.synchronize()
    ctor_s = time.perf_counter() - t
    free1 = torch.cuda.mem_get_info()[0]
    progress(f"rank {rank}: Megatron's DeepEP buffer: {buf.num_nvl_bytes / 2**20:.0f} MiB NVLink, "
             f"built in {ctor_s * 1e3:.1f} ms, device free -{(free0 - free1) / 2**20:.0f} MiB")
    want_recv, want_out = (t.clone() for t in _dispatch_combine(buf, deep_ep, x, idx, w, experts))
    before_s = _throughput(lambda: _dispatch_combine(buf, deep_ep, x, idx, w, experts), iters)
    rows = []
    for c in range(cycles):
        torch.cuda.synchronize()
        f_live = torch.cuda.mem_get_info()[0]
        rep = comm.release(include_world=True)
        f_rel = torch.cuda.mem_get_info()[0]
        _expect_state_error(lambda: _dispatch_combine(buf, deep_ep, x, idx, w, experts), "dispatch")
        rep2 = comm.reload()
        assert fused_a2a._buffer is buf and fused_a2a.get_buffer(ep, hidden * 2) is buf
        recv, out = _dispatch_combine(buf, deep_ep, x, idx, w, experts)
        assert torch.equal(recv, want_recv) and torch.equal(out, want_out), f"cycle {c}: results differ"
        d_rel = [g.seconds for g in rep.groups if g.desc == "DeepEP buffer"]
        d_rel2 = [g.seconds for g in rep2.groups if g.desc == "DeepEP buffer"]
        rows.append({"freed_mib": (f_rel - f_live) / 2**20, "release_s": rep.seconds, "reload_s": rep2.seconds,
                     "deepep_release_s": d_rel[0], "deepep_restore_s": d_rel2[0]})
        progress(f"rank {rank}: cycle {c}: {rows[-1]}")
    after_s = _throughput(lambda: _dispatch_combine(buf, deep_ep, x, idx, w, experts), iters)
    return {"nvl_bytes": buf.num_nvl_bytes, "ctor_s": ctor_s, "ctor_freed_mib": (free0 - free1) / 2**20,
            "cycles": rows, "before_s": before_s, "after_s": after_s}
