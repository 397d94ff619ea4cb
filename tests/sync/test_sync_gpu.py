"""ebbtide.sync on the GPU: bits against the CPU reference quantizer over 20 updates, CUDA IPC between two
processes on one GPU (bits, versions, a receiver dying mid-update), NCCL between two GPUs."""
import multiprocessing as mp

import pytest
import torch

from ebbtide.errors import InvalidArgumentError, StateError
from ebbtide.sync import (HostReceiver, HostSender, IpcSender, Plan, Receiver, Sender, SharedHostBuffer,
                          WeightVersionError, expected)
from ebbtide.testing.bits import digests
from ebbtide.testing.ports import free_port

import sync_workers
from sync_models import RULES, checkpoint

pytestmark = pytest.mark.gpu
PLAN_KW = {"rules": RULES, "bucket_bytes": 150_000}


def _cpu_digests(plan, src):
    return digests(expected(plan, {n: t.cpu() for n, t in src.items()}))


def _step(src, v):
    with torch.no_grad():
        for t in src.values():
            t.add_(torch.randn(t.shape, generator=torch.Generator().manual_seed(v)).to(t.device, t.dtype) * 0.01)


@pytest.mark.parametrize("scale", ["fp32", "ue8m0"])
def test_host_path_on_gpu_equals_the_cpu_reference_over_20_updates(scale):
    src = checkpoint(0, "cuda")
    plan = Plan.of(src, scale=scale, **PLAN_KW)
    buf = SharedHostBuffer.create(SharedHostBuffer.size_for(plan), pin=True)
    try:
        params = {n: torch.zeros_like(t) for n, t in src.items()}
        sender, receiver = Sender(src, HostSender(buf), plan=plan), Receiver(params, plan)
        for v in range(1, 21):
            _step(src, v)
            sender.push(v)
            HostReceiver(buf).receive(receiver, v)
            assert digests(params) == _cpu_digests(plan, src), v
        with pytest.raises(WeightVersionError):
            HostReceiver(buf).receive(receiver, 20)
    finally:
        buf.close()


def test_receiver_runs_on_the_callers_stream_unless_given_one():
    """No private stream by default (Note [One compute stream in a rollout]): the receive runs on whatever stream
    is current at the call, and ``stream=`` pins one; the bits are the reference's either way."""
    src = checkpoint(0, "cuda")
    plan = Plan.of(src, **PLAN_KW)
    buf = SharedHostBuffer.create(SharedHostBuffer.size_for(plan), pin=True)
    try:
        sender = Sender(src, HostSender(buf), plan=plan)
        params = {n: torch.zeros_like(t) for n, t in src.items()}
        receiver = Receiver(params, plan)
        assert receiver.stream == torch.cuda.current_stream()
        side, pinned = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(side):
            assert receiver.stream == side
        given = Receiver({n: torch.zeros_like(t) for n, t in src.items()}, plan, stream=pinned)
        for v, caller in ((1, torch.cuda.current_stream()), (2, side)):
            _step(src, v)
            sender.push(v)
            with torch.cuda.stream(caller):
                # a write queued on the caller's stream behind a long kernel: a receive ordered after it (on the
                # caller's stream) wins; one on any other stream would be overwritten by the late zeros
                torch.cuda._sleep(100_000_000)
                for t in params.values():
                    t.zero_()
                HostReceiver(buf).receive(receiver, v)
                assert given.stream == pinned
                HostReceiver(buf).receive(given, v)
            torch.cuda.synchronize()
            want = _cpu_digests(plan, src)
            assert digests(params) == want, v
            assert digests(given.params) == want, v
        with pytest.raises(InvalidArgumentError, match="torch.cuda.Stream"):
            Receiver(params, plan, stream="side")
    finally:
        buf.close()


def _ipc(expect, versions, die_on=None):
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    res_r, res_w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=sync_workers.ipc_receiver, args=(b, res_w, PLAN_KW, expect, die_on))
    p.start()
    b.close()  # the receiver's end lives in the receiver only: its death closes the connection at once
    src = checkpoint(0, "cuda")
    plan = Plan.of(src, **PLAN_KW)
    sender = Sender(src, IpcSender(a, timeout=120), plan=plan)
    out = []
    try:
        for v in versions:
            _step(src, v)
            want = _cpu_digests(plan, src)
            try:
                sender.push(v)
            except Exception as e:  # noqa: BLE001 (the test reads it)
                out.append(("sender", type(e).__name__, str(e)))
                break
            out.append(("pushed", v, want))
            out.append(res_r.recv())
        else:
            sender.close()
    finally:
        p.join(120)
        if p.is_alive():
            p.kill()
    return out, p.exitcode, res_r


def test_ipc_two_processes_one_gpu_bits_over_20_updates():
    out, code, _ = _ipc([None] * 20, range(1, 21))
    pairs = list(zip(out[::2], out[1::2]))
    assert len(pairs) == 20
    for (kind, v, want), got in pairs:
        assert got[0] == "ok" and got[1] == v, got[:3]
        assert got[2] == want, v
    assert code == 0


def test_ipc_version_mismatch_is_refused_on_both_sides_and_keeps_the_last_version():
    out, code, res = _ipc([1, 5], [1, 2])
    (_, _, want1), got1 = out[0], out[1]
    assert got1[:2] == ("ok", 1) and got1[2] == want1
    assert out[2][0] == "sender" and "expected 5" in out[2][2]
    child = res.recv()
    assert child[0] == "error" and child[1] == "WeightVersionError"
    assert child[3] == want1  # still version 1, bit for bit


def test_ipc_receiver_dying_mid_update_raises_on_the_sender():
    out, code, _ = _ipc([None], [1], die_on="commit")
    assert out[0][0] == "sender" and out[0][1] == "PartialUpdateError", out
    assert "went away" in out[0][2], out  # seen when the connection closed, not at the 120 s timeout
    assert code == 3


def test_ipc_sender_dying_mid_update_keeps_the_last_version():
    """The sender writes part of version 2 into the receiver's staging and goes away: the receiver raises and its
    parameters still hold version 1, bit for bit."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    res_r, res_w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=sync_workers.ipc_receiver, args=(b, res_w, PLAN_KW, [None, None], None))
    p.start()
    try:
        src = checkpoint(0, "cuda")
        plan = Plan.of(src, **PLAN_KW)
        sender = Sender(src, IpcSender(a, timeout=120), plan=plan)
        _step(src, 1)
        want1 = _cpu_digests(plan, src)
        sender.push(1)
        assert res_r.recv()[:2] == ("ok", 1)
        t = sender.transport
        t.begin(2, plan, src[next(iter(src))].device)
        t.buffer(plan.buckets[0], torch.cuda.current_stream()).fill_(0x7F)  # half an update in the staging
        torch.cuda.synchronize()
        a.close()
        got = res_r.recv()
        assert got[:2] == ("error", "PartialUpdateError"), got[:3]
        assert got[3] == want1
    finally:
        p.join(120)
        if p.is_alive():
            p.kill()


@pytest.mark.parametrize("shareable", [True, False])
def test_ipc_into_a_staging_in_ebbtide_region_memory(shareable):
    """A rollout's staging in a region (VMM): shared by its fd every update, paused between updates, bits equal
    over 5 updates; a region that is not shareable is refused on both sides with the way out, nothing applied."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    res_r, res_w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=sync_workers.ipc_receiver_region, args=(b, res_w, PLAN_KW, 5, shareable))
    p.start()
    try:
        src = checkpoint(0, "cuda")
        plan = Plan.of(src, **PLAN_KW)
        sender = Sender(src, IpcSender(a, timeout=120), plan=plan)
        for v in range(1, 6):
            _step(src, v)
            want = _cpu_digests(plan, src)
            if not shareable:
                with pytest.raises(StateError, match="shareable=True"):
                    sender.push(v)
                got = res_r.recv()
                assert got[:2] == ("error", "StateError") and "shareable=True" in got[2]
                assert got[3] == digests({n: torch.zeros_like(t) for n, t in src.items()})
                break
            sender.push(v)
            got = res_r.recv()
            assert got[:2] == ("ok", v) and got[2] == want, got[:3]
        sender.close()
    finally:
        p.join(120)
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0


@pytest.mark.multigpu
def test_nccl_broadcast_between_two_gpus():
    port = free_port()
    ctx = mp.get_context("spawn")
    r, w = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=sync_workers.nccl_rank, args=(k, port, PLAN_KW, 5, w)) for k in range(2)]
    for p in procs:
        p.start()
    try:
        ref = checkpoint(0)
        for v in range(1, 6):
            assert r.poll(300), "rank 1 reported nothing"
            got_v, got = r.recv()
            with torch.no_grad():  # what rank 0 did before pushing v (bf16 x 1.25 rounds the same on CPU and GPU)
                for t in ref.values():
                    t.mul_(1.25)
            assert got_v == v and got == _cpu_digests(Plan.of(ref, **PLAN_KW), ref), v
    finally:
        for p in procs:
            p.join(300)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]


@pytest.mark.parametrize("release_first", [True, False], ids=["engine-releases-then-answers", "answers-first"])
def test_sglang_sender_frees_buckets_only_after_the_engines_copies(release_first):
    """The tensor sender drops each bucket when it is answered, while the engine's copies still wait behind a
    long kernel: the bytes the engine copies are the version it was sent, bit for bit, over 3 updates whose
    buckets reuse the same blocks; when the engine releases before answering (as SGLang does), the sender holds
    at most two buckets at a time."""
    from ebbtide.integrations import sglang as S
    from ebbtide.sync import fill_bucket

    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=sync_workers.sglang_consumer, args=(b, release_first, 200_000_000))
    p.start()
    b.close()
    src = checkpoint(0, "cuda")
    plan = Plan.of(src, **PLAN_KW)
    biggest = max(bk.nbytes for bk in plan.buckets)
    peaks, replies, base = [], {}, [0]

    def post(endpoint, req):
        if endpoint == "update_weights_from_tensor":
            peaks.append(torch.cuda.memory_allocated() - base[0])
        a.send((endpoint, req))
        replies[endpoint] = a.recv()
        return replies[endpoint]

    try:
        sender = Sender(src, S.SGLangTensorSender(post), plan=plan)
        for v in (1, 2, 3):
            _step(src, v)
            want = {}
            for bk in plan.buckets:  # the reference bytes of every output, filled apart
                buf = torch.empty(bk.nbytes, dtype=torch.uint8, device="cuda")
                fill_bucket(plan, bk, src, buf)
                want.update({o.name: buf[o.offset:o.offset + o.nbytes] for o in bk.outputs})
            want = digests(want)
            del buf
            torch.cuda.synchronize()
            base[0] = torch.cuda.memory_allocated()
            sender.push(v)
            assert replies["end_weight_update"]["digests"] == want, v
        if release_first:
            assert max(peaks) <= 2 * biggest + (1 << 20), (peaks, biggest)
    finally:
        a.send(("exit", None))
        p.join(60)
        if p.is_alive():
            p.kill()
