"""Tensor parallel on the CPU (Gloo): shards are gathered per bucket, TP rank 0 sends the full tensors; a TP rank
that dies fails the others' next push within a bound."""
import contextlib
import multiprocessing as mp
import os

import pytest
import torch

import sync_workers
from ebbtide.testing.ports import free_port


@contextlib.contextmanager
def _two_ranks(die: bool = False):
    """Two TP ranks (sync_workers.tp_rank) pushing into one host buffer; yields (full tensors, plan, buffer,
    processes, result queue). Kills what is left and closes the buffer on the way out."""
    from ebbtide.sync import Plan, SharedHostBuffer
    from sync_models import checkpoint

    full = checkpoint(0)
    plan = Plan.of(full, bucket_bytes=150_000)
    buf = SharedHostBuffer.create(SharedHostBuffer.size_for(plan), pin=False)
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    path = f"/proc/{os.getpid()}/fd/{buf.fd}"  # a spawned child opens the memfd by its path
    procs = [ctx.Process(target=sync_workers.tp_rank, args=(k, port, path, buf.nbytes, q, die)) for k in range(2)]
    try:
        for p in procs:
            p.start()
        yield full, plan, buf, procs, q
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        buf.close()


def test_tp_shards_are_gathered_and_rank0_sends():
    from ebbtide.sync import HostReceiver, Receiver, expected

    with _two_ranks() as (full, plan, buf, procs, q):
        for p in procs:
            p.join(180)
        assert [p.exitcode for p in procs] == [0, 0]
        got = sorted(q.get(timeout=10) for _ in range(2))
        assert [g[1] for g in got] == [True, False] and {g[2] for g in got} == {plan.signature}
        dst = {n: torch.zeros_like(t) for n, t in full.items()}
        HostReceiver(buf).receive(Receiver(dst, plan), 1)
        want = expected(plan, full)
        assert all(torch.equal(want[n].view(torch.uint8), dst[n].view(torch.uint8)) for n in full)


def test_a_tp_rank_dying_fails_the_next_push_within_seconds_and_the_receiver_keeps_its_version():
    from ebbtide.sync import HostReceiver, PartialUpdateError, Receiver

    with _two_ranks(die=True) as (full, plan, buf, procs, q):
        dst = {n: torch.zeros_like(t) for n, t in full.items()}
        receiver = Receiver(dst, plan)
        first = [q.get(timeout=120) for _ in range(2)]
        assert sorted(f[0] for f in first) == [0, 1]
        _, err, msg, took = q.get(timeout=120)
        assert err == "PartialUpdateError" and "tensor-parallel gather" in msg, (err, msg)
        assert took < 60, took  # bounded by the group's timeout (20 s here), often at once
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0, 0]
        before = {n: t.clone() for n, t in dst.items()}
        with pytest.raises(PartialUpdateError):  # version 2 never completed in the buffer
            HostReceiver(buf).receive(receiver, 2)
        assert all(torch.equal(before[n], dst[n]) for n in dst)
