"""Rank bodies for ebbtide.comm's DeepEP support: ``standin`` on Gloo with the CPU stand-in of ``deep_ep``
(tests/comm/standin), ``real`` on NCCL with DeepEP built by scripts/build-deepep (one rank per GPU)."""
from __future__ import annotations

import datetime
import gc
import os
import sys

import torch
import torch.distributed as dist

import ebbtide.comm as comm
from ebbtide.testing.spawn import join_store
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
    """Ranks sharing a group but holding different DeepEP buffers on it: release() refuses on every rank before
    anything is freed. A buffer on a group only some ranks belong to (a pipeline stage with MoE layers) is fine."""
    comm.install(timeout=30)
    sys.path.insert(0, STANDIN)
    import deep_ep  # noqa: PLC0415

    dist.init_process_group("gloo", store=join_store(init), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    first = dist.new_group([0])
    pair = dist.new_group(list(range(world)))
    only_first = deep_ep.Buffer(first, 2048, 0) if rank == 0 else None
    comm.release(include_world=True)  # rank 1 holds no buffer of group [0]: agreed
    comm.reload()
    assert only_first is None or only_first.runtime.is_available()
    buf = deep_ep.Buffer(pair, 4096 * (rank + 1), 0)
    try:
        comm.release(include_world=True)
        msg = ""
    except StateError as e:
        msg = str(e)
    assert "different DeepEP buffers" in msg, msg
    assert buf.runtime.is_available() and len(deep_ep.LIVE) == (2 if rank == 0 else 1)
    dist.all_reduce(torch.ones(1))  # the groups were put back
    return {"msg": msg}


# ---- the real DeepEP, one rank per GPU: the benchmark's scenario (ebbtide.testing.scenarios.deepep) ----------------
def real(rank, world, init, **kw):
    from ebbtide.testing.scenarios.deepep import deepep_cycles  # noqa: PLC0415

    return deepep_cycles(rank, world, init, **kw)
