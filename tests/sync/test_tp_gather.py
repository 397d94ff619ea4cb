"""Tensor parallel on the CPU (Gloo): shards are gathered per bucket, TP rank 0 sends the full tensors."""
import multiprocessing as mp
import os
import socket

import torch

import sync_workers


def test_tp_shards_are_gathered_and_rank0_sends():
    from ebbtide.sync import HostReceiver, Plan, Receiver, SharedHostBuffer, expected
    from sync_models import checkpoint

    full = checkpoint(0)
    plan = Plan.of(full, bucket_bytes=150_000)
    buf = SharedHostBuffer.create(SharedHostBuffer.size_for(plan), pin=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    path = f"/proc/{os.getpid()}/fd/{buf.fd}"  # a spawned child opens the memfd by its path
    procs = [ctx.Process(target=sync_workers.tp_rank, args=(k, port, path, buf.nbytes, q)) for k in range(2)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(180)
        assert [p.exitcode for p in procs] == [0, 0]
        got = sorted(q.get(timeout=10) for _ in range(2))
        assert [g[1] for g in got] == [True, False] and {g[2] for g in got} == {plan.signature}
        dst = {n: torch.zeros_like(t) for n, t in full.items()}
        HostReceiver(buf).receive(Receiver(dst, plan), 1)
        want = expected(plan, full)
        assert all(torch.equal(want[n].view(torch.uint8), dst[n].view(torch.uint8)) for n in full)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        buf.close()
