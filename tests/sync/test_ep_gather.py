"""Expert parallel on the CPU (Gloo): each EP rank holds half the experts, and every rank sends the whole model
(experts gathered per bucket over the group, one collective per dtype) into its own buffer, bitwise what the
full model's plan expects."""
import multiprocessing as mp
import os

import pytest
import torch

import sync_workers
from ebbtide.testing.ports import free_port


def test_experts_are_gathered_per_bucket_and_every_rank_sends_the_whole_model(tmp_path):
    from ebbtide.sync import HostReceiver, Plan, Receiver, SharedHostBuffer, expected

    full = sync_workers.moe_checkpoint()
    plan = Plan.of(dict(sorted(full.items())), rules=[(r"linear_fc1\.weight$", "fp8")], bucket_bytes=100_000)
    assert len(plan.buckets) >= 4  # the experts of one layer span buckets
    bufs = [SharedHostBuffer.create(SharedHostBuffer.size_for(plan), pin=False) for _ in range(2)]
    links = []
    for k, b in enumerate(bufs):  # one path pattern for both ranks: a symlink per rank to the memfd
        link = tmp_path / f"buf{k}"
        os.symlink(f"/proc/{os.getpid()}/fd/{b.fd}", link)
        links.append(link)
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=sync_workers.ep_rank, args=(k, port, str(tmp_path / "buf%d"), bufs[0].nbytes, q))
             for k in range(2)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(180)
        assert [p.exitcode for p in procs] == [0, 0]
        got = sorted(q.get(timeout=10) for _ in range(2))
        want = expected(plan, full)
        # without a plan: the rank's other tensors in their order, then the experts in ep_sources' order
        _, sources = sync_workers.ep_split(full, 2, 0)
        order = {**{n: t for n, t in full.items() if n not in sources}, **{g: full[g] for g in sources}}
        implicit_plan = Plan.of(order, rules=[(r"linear_fc1\.weight$", "fp8")], bucket_bytes=100_000)
        for rank, signature, implicit, refused in got:
            assert signature == plan.signature and implicit == implicit_plan.signature
            assert "EP rank < 2" in refused[0] and "does not have" in refused[1], refused
            assert "no global name for some EP rank" in refused[2], refused
        for b in bufs:
            dst = {n: torch.zeros_like(t) for n, t in full.items()}
            HostReceiver(b).receive(Receiver(dst, plan), 1)
            assert all(torch.equal(want[n].view(torch.uint8), dst[n].view(torch.uint8)) for n in full)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for b in bufs:
            b.close()


def test_an_ep_rank_dying_fails_the_next_push_within_seconds_and_the_receiver_keeps_its_version(tmp_path):
    from ebbtide.sync import HostReceiver, PartialUpdateError, Plan, Receiver, SharedHostBuffer

    full = sync_workers.moe_checkpoint()
    plan = Plan.of(dict(sorted(full.items())), rules=[(r"linear_fc1\.weight$", "fp8")], bucket_bytes=100_000)
    buf = SharedHostBuffer.create(SharedHostBuffer.size_for(plan), pin=False)
    os.symlink(f"/proc/{os.getpid()}/fd/{buf.fd}", tmp_path / "buf0")
    other = SharedHostBuffer.create(SharedHostBuffer.size_for(plan), pin=False)
    os.symlink(f"/proc/{os.getpid()}/fd/{other.fd}", tmp_path / "buf1")
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=sync_workers.ep_rank, args=(k, port, str(tmp_path / "buf%d"), buf.nbytes, q, True))
             for k in range(2)]
    try:
        for p in procs:
            p.start()
        first = [q.get(timeout=120) for _ in range(2)]
        assert sorted(f[0] for f in first) == [0, 1]
        _, err, msg, took = q.get(timeout=120)
        assert err == "PartialUpdateError" and "expert-parallel gather" in msg, (err, msg)
        assert took < 60, took  # bounded by the group's timeout (20 s here), often at once
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0, 0]
        dst = {n: torch.full_like(t, 3) for n, t in full.items()}
        receiver = Receiver(dst, plan)
        before = {n: t.clone() for n, t in dst.items()}
        with pytest.raises(PartialUpdateError, match="incomplete"):  # version 2 never completed in the buffer
            HostReceiver(buf).receive(receiver, 2)
        assert all(torch.equal(before[n], dst[n]) for n in dst)  # the receiver took nothing of it
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        buf.close()
        other.close()


def test_expert_arguments_come_together():
    from ebbtide.errors import InvalidArgumentError
    from ebbtide.sync import HostSender, Plan, Sender, SharedHostBuffer

    full = sync_workers.moe_checkpoint(layers=1)
    plan = Plan.of(full)
    buf = SharedHostBuffer.create(SharedHostBuffer.size_for(plan), pin=False)
    try:
        with pytest.raises(InvalidArgumentError, match="needs an ep_group"):
            Sender(full, HostSender(buf), ep_sources={"x": ("y", 0)})
        with pytest.raises(InvalidArgumentError, match="ep_group needs ep_sources"):
            Sender(full, HostSender(buf), ep_group=object())
    finally:
        buf.close()
