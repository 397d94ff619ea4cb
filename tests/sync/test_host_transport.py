"""Sender -> host buffer -> Receiver on the CPU: bits over many updates, versions, refusals, rollback."""
import pytest
import torch

from ebbtide.errors import InvalidArgumentError, StateError
from ebbtide.sync import (HostReceiver, HostSender, PartialUpdateError, Plan, PlanMismatchError, Receiver, Sender,
                          SharedHostBuffer, WeightVersionError, expected)
from ebbtide.testing import spawn
from ebbtide.testing.bits import same_bits

from sync_models import RULES, checkpoint


def _pair(scale="fp32", bucket_bytes=150_000):
    src = checkpoint(0)
    plan = Plan.of(src, rules=RULES, scale=scale, bucket_bytes=bucket_bytes)
    buf = SharedHostBuffer.create(SharedHostBuffer.size_for(plan), pin=False)
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    return src, plan, buf, Sender(src, HostSender(buf), plan=plan), Receiver(dst, plan), dst


@pytest.mark.parametrize("scale,updates", [("fp32", 20), ("ue8m0", 4)])  # the CPU reference is slow; GPU runs 20
def test_receiver_holds_the_reference_bit_for_bit_over_many_updates(scale, updates):
    src, plan, buf, sender, receiver, dst = _pair(scale)
    rx = HostReceiver(buf)
    try:
        for v in range(1, updates + 1):
            with torch.no_grad():  # the optimizer changes the weights between updates
                for t in src.values():
                    t.add_(torch.randn(t.shape, generator=torch.Generator().manual_seed(v)).to(t.dtype) * 0.01)
            sender.push(v)
            assert rx.receive(receiver, v) == v
            receiver.require(v)
            want = expected(plan, src)
            bad = [n for n in src if not same_bits(want[n], dst[n])]
            assert not bad, (v, bad)
    finally:
        buf.close()


def test_versions_only_grow_and_must_match():
    src, plan, buf, sender, receiver, dst = _pair()
    rx = HostReceiver(buf)
    try:
        with pytest.raises(PartialUpdateError, match="no update"):
            rx.receive(receiver)
        sender.push(3)
        with pytest.raises(WeightVersionError, match="expected 4"):
            rx.receive(receiver, 4)
        assert receiver.version is None  # nothing applied
        rx.receive(receiver, 3)
        with pytest.raises(WeightVersionError, match="not newer"):
            rx.receive(receiver)  # the same update twice
        sender.push(2)
        with pytest.raises(WeightVersionError, match="not newer"):
            rx.receive(receiver)
        with pytest.raises(WeightVersionError, match="holds version 3"):
            receiver.require(2)
    finally:
        buf.close()


def test_incomplete_update_keeps_the_last_version():
    src, plan, buf, sender, receiver, dst = _pair()
    rx = HostReceiver(buf)
    try:
        sender.push(1)
        rx.receive(receiver, 1)
        held = {n: t.clone() for n, t in dst.items()}
        # the sender dies after its first bucket: the header says "writing", the receiver refuses the update
        end = sender.transport
        end.begin(2, plan, "cpu")
        with pytest.raises(PartialUpdateError, match="incomplete"):
            rx.receive(receiver, 2)
        assert receiver.version == 1 and all(torch.equal(held[n], dst[n]) for n in dst)
    finally:
        buf.close()


def test_plan_mismatch_is_refused():
    src, plan, buf, sender, receiver, dst = _pair()
    try:
        sender.push(1)
        other = Plan.of(src, rules=RULES, bucket_bytes=1)
        with pytest.raises(PlanMismatchError, match="another plan"):
            HostReceiver(buf).receive(Receiver({n: torch.zeros_like(t) for n, t in src.items()}, other))
    finally:
        buf.close()


def test_receiver_refuses_unknown_names_shapes_and_dtypes():
    src = checkpoint()
    plan = Plan.of(src, rules=RULES)
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    del dst["lm_head.weight"]
    with pytest.raises(PlanMismatchError, match="lm_head.weight: not a parameter"):
        Receiver(dst, plan)
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    dst["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(256, 128, dtype=torch.bfloat16)
    with pytest.raises(PlanMismatchError, match="shape"):
        Receiver(dst, plan)
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    dst["model.layers.0.input_layernorm.weight"] = torch.zeros(256)
    with pytest.raises(PlanMismatchError, match="dtype"):
        Receiver(dst, plan)
    # an FP8 (or INT4) weight is dequantized to the trainer's dtype: an fp32 parameter for a bf16 one is refused
    for name in ("model.layers.0.self_attn.o_proj.weight", "model.layers.1.qat.down_proj.weight"):
        dst = {n: torch.zeros_like(t) for n, t in src.items()}
        dst[name] = dst[name].float()
        with pytest.raises(PlanMismatchError, match=f"{name}: receiver dtype torch.float32, sender bfloat16"):
            Receiver(dst, plan)


@pytest.mark.parametrize("bad", [-1, True, 1.0, "2"])
def test_receiver_apply_refuses_a_version_no_sender_sends(bad):
    src = checkpoint()
    plan = Plan.of(src, rules=RULES)
    params = {n: torch.zeros_like(t) for n, t in src.items()}
    r = Receiver(params, plan)
    with pytest.raises(WeightVersionError, match="version"):
        r.apply(bad)  # nothing staged, nothing applied
    assert r.version is None and all(not p.any() for p in params.values())


def test_sender_refuses_a_plan_that_does_not_fit():
    src = checkpoint()
    plan = Plan.of(src, rules=RULES)
    buf = SharedHostBuffer.create(64 << 10, pin=False)
    try:
        with pytest.raises(ValueError, match="the plan needs"):
            Sender(src, HostSender(buf), plan=plan).push(1)
        small = dict(src)
        small["lm_head.weight"] = torch.zeros(8, 8, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="lm_head.weight"):
            Sender(small, HostSender(buf), plan=plan)
    finally:
        buf.close()


def test_host_transport_between_two_processes():
    src, plan, buf, sender, _, _ = _pair()
    try:
        sender.push(7)
        code = f"""
            import sys, torch
            sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})
            from ebbtide.sync import HostReceiver, Plan, Receiver, SharedHostBuffer, expected
            from sync_models import RULES, checkpoint
            src = checkpoint(0)
            plan = Plan.of(src, rules=RULES, bucket_bytes=150_000)
            buf = SharedHostBuffer({buf.fd}, {buf.nbytes}, pin=False)
            dst = {{n: torch.zeros_like(t) for n, t in src.items()}}
            r = Receiver(dst, plan)
            assert HostReceiver(buf).receive(r, 7) == 7
            want = expected(plan, src)
            assert all(torch.equal(want[n].view(torch.uint8), dst[n].view(torch.uint8)) for n in src)
            print("ok")
            """
        p = spawn.python(code, pass_fds=(buf.fd,), timeout=300, check=False)
        assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr
    finally:
        buf.close()


def _served_zeros(plan) -> dict:
    """The served form's parameters of ``plan``: every output under its own name, zeros."""
    return {o.name: torch.zeros(o.shape, dtype=getattr(torch, o.dtype)) for it in plan.items for o in it.outputs}


def _assert_served(r, served, plan, tag=None):
    """Every output of ``plan`` in ``served`` equals its bytes in the receiver's staging."""
    for b in plan.buckets:
        region = r.region(b)
        for o in b.outputs:
            assert torch.equal(served[o.name].reshape(-1).view(torch.uint8),
                               o.view(region).reshape(-1).view(torch.uint8)), (tag, o.name)


def test_served_form_holds_the_quantized_outputs():
    src = checkpoint(2)
    plan = Plan.of(src, rules=RULES, bucket_bytes=150_000)
    buf = SharedHostBuffer.create(SharedHostBuffer.size_for(plan), pin=False)
    try:
        outs = {o.name: o for it in plan.items for o in it.outputs}
        served = _served_zeros(plan)
        r = Receiver(served, plan, form="served")
        Sender(src, HostSender(buf), plan=plan).push(1)
        HostReceiver(buf).receive(r, 1)
        staged = {}
        for b in plan.buckets:
            region = r.region(b)
            staged.update({o.name: o.view(region) for o in b.outputs})
        assert all(torch.equal(served[n].view(torch.uint8), staged[n].view(torch.uint8)) for n in outs)
        bad = dict(served)
        bad.pop("lm_head.weight")
        with pytest.raises(PlanMismatchError, match="lm_head.weight: receiver missing"):
            Receiver(bad, plan, form="served")
    finally:
        buf.close()


def test_served_form_follows_a_moved_parameter_and_both_copy_paths(monkeypatch):
    import ebbtide.sync.receiver as receiver_mod

    monkeypatch.setattr(receiver_mod, "_BIG_COPY", 4096)  # this model's larger outputs take the one-copy path
    src = checkpoint(3)
    plan = Plan.of(src, rules=RULES, bucket_bytes=150_000)
    buf = SharedHostBuffer.create(SharedHostBuffer.size_for(plan), pin=False)
    try:
        outs = {o.name: o for it in plan.items for o in it.outputs}
        assert any(o.nbytes >= 4096 for o in outs.values()) and any(o.nbytes < 4096 for o in outs.values())
        served = {n: torch.nn.Parameter(torch.zeros(o.shape, dtype=getattr(torch, o.dtype)), requires_grad=False)
                  for n, o in outs.items()}
        r = Receiver(served, plan, form="served")
        sender = Sender(src, HostSender(buf), plan=plan)

        sender.push(1)
        HostReceiver(buf).receive(r, 1)
        _assert_served(r, served, plan, 1)
        moved = next(iter(served))
        served[moved].data = torch.zeros_like(served[moved])  # the rollout re-pointed a parameter's storage
        with torch.no_grad():
            for t in src.values():
                t.mul_(2)
        sender.push(2)
        HostReceiver(buf).receive(r, 2)
        _assert_served(r, served, plan, 2)
    finally:
        buf.close()


def test_served_form_follows_a_moved_parameter_and_copies_a_non_contiguous_one():
    g = torch.Generator().manual_seed(6)
    src = {"m.norm.weight": torch.randn(64, generator=g).to(torch.bfloat16),
           "m.proj.weight": torch.randn(256, 128, generator=g).to(torch.bfloat16)}
    plan = Plan.of(src)
    served = _served_zeros(plan)
    buf = SharedHostBuffer.create(SharedHostBuffer.size_for(plan), pin=False)
    try:
        r = Receiver(served, plan, form="served")

        def push_and_check(version):
            Sender(src, HostSender(buf), plan=plan).push(version)
            HostReceiver(buf).receive(r, version)
            _assert_served(r, served, plan, version)

        push_and_check(1)
        first = r._copies[1]
        served["m.norm.weight"].data = torch.zeros(64, dtype=torch.bfloat16)  # the storage moved
        src["m.norm.weight"].mul_(2)
        push_and_check(2)
        assert r._copies[1] is not first and r._copies[1] is not None  # rebuilt for the new address
        w = served["m.proj.weight"]
        w.data = torch.zeros(w.shape[1], w.shape[0], dtype=w.dtype).t()  # same shape, not contiguous
        src["m.proj.weight"].mul_(2)
        push_and_check(3)
        assert r._copies[1] is None  # the per-output path
    finally:
        buf.close()


def test_served_form_with_parameters_sharing_storage():
    """Tied names (two outputs into one tensor, e.g. a state_dict's aliases) take the per-output path, in order."""
    g = torch.Generator().manual_seed(7)
    src = {"a.weight": torch.randn(64, generator=g).to(torch.bfloat16),
           "b.weight": torch.randn(64, generator=g).to(torch.bfloat16)}
    plan = Plan.of(src)
    shared = torch.zeros(64, dtype=torch.bfloat16)
    served = {"a.weight": shared, "b.weight": shared}
    buf = SharedHostBuffer.create(SharedHostBuffer.size_for(plan), pin=False)
    try:
        r = Receiver(served, plan, form="served")
        for v in (1, 2):
            Sender(src, HostSender(buf), plan=plan).push(v)
            HostReceiver(buf).receive(r, v)
            assert r.version == v and r._copies[1] is None
            last = [o for b in plan.buckets for o in b.outputs][-1]  # the later copy wins, as in order
            assert torch.equal(shared, src[last.name])
    finally:
        buf.close()


def test_served_form_copies_odd_sized_outputs_in_one_segment_copy():
    import ebbtide.sync.receiver as receiver_mod

    g = torch.Generator().manual_seed(5)
    src = {"m.norm.weight": torch.randn(3, generator=g).to(torch.bfloat16),       # 6 bytes
           "m.proj.bias": torch.randn(3, generator=g),                              # 12 bytes
           "m.gate.weight": torch.randn(5, generator=g).to(torch.bfloat16),         # 10 bytes
           "m.proj.weight": torch.randn(256, 128, generator=g).to(torch.bfloat16)}  # FP8 + scales
    plan = Plan.of(src)
    buf = SharedHostBuffer.create(SharedHostBuffer.size_for(plan), pin=False)
    try:
        outs = {o.name: o for it in plan.items for o in it.outputs}
        served = _served_zeros(plan)
        r = Receiver(served, plan, form="served")
        Sender(src, HostSender(buf), plan=plan).push(1)
        HostReceiver(buf).receive(r, 1)
        _assert_served(r, served, plan)
        big, small = r._copies[1]
        assert not big and small.count == len(outs)  # every output in the one batched copy
        assert small.nbytes == sum(o.nbytes for o in outs.values())
        assert receiver_mod._BIG_COPY > max(o.nbytes for o in outs.values())
    finally:
        buf.close()


def test_prepare_serves_one_apply_of_its_version(monkeypatch):
    """The transports check the served destinations ahead (prepare); only the apply of that version uses it."""
    from ebbtide.sync import fill_bucket

    g = torch.Generator().manual_seed(8)
    src = {"m.norm.weight": torch.randn(64, generator=g).to(torch.bfloat16),
           "m.proj.weight": torch.randn(256, 128, generator=g).to(torch.bfloat16)}
    plan = Plan.of(src)
    served = _served_zeros(plan)
    r = Receiver(served, plan, form="served")

    def stage():
        with torch.no_grad():
            for t in src.values():
                t.mul_(2)
        for b in plan.buckets:
            fill_bucket(plan, b, src, r.region(b))

    def move():  # the rollout re-points a parameter's storage
        served["m.norm.weight"].data = torch.zeros(64, dtype=torch.bfloat16)

    stage()
    r.prepare(1)
    r.apply(1)
    _assert_served(r, served, plan, 1)
    r.prepare(9)  # made for another version: apply(2) checks for itself and follows the move
    move()
    stage()
    r.apply(2)
    _assert_served(r, served, plan, 2)
    r.prepare(3)
    stage()
    r.apply(3)
    move()  # after the apply that used the prepare: the next apply checks for itself
    stage()
    r.apply(4)
    _assert_served(r, served, plan, 4)
    r.prepare(5)  # its apply only launches what prepare checked
    stage()
    monkeypatch.setattr(r, "_served_copies", lambda: pytest.fail("apply(5) checked the destinations again"))
    r.apply(5)
    _assert_served(r, served, plan, 5)
    assert r.version == 5


def test_a_cpu_receiver_has_no_stream_and_refuses_one():
    src, plan, buf, _, receiver, dst = _pair()
    try:
        assert receiver.stream is None
        with pytest.raises(InvalidArgumentError, match="torch.cuda.Stream"):
            Receiver(dst, plan, stream=object())
    finally:
        buf.close()


class _SlowBegin:
    """A transport wrapper whose begin takes a while and can fail, recording the order of the calls."""

    def __init__(self, inner, fail=False):
        self.inner, self.fail, self.calls = inner, fail, []

    def begin(self, version, plan, device):
        import time  # noqa: PLC0415

        time.sleep(0.05)
        self.calls.append(("begin", version))
        if self.fail:
            raise PartialUpdateError("the receiver went away")
        self.inner.begin(version, plan, device)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_open_begins_ahead_and_push_joins_it():
    src, plan, buf, _, receiver, dst = _pair()
    end = _SlowBegin(HostSender(buf))
    sender, rx = Sender(src, end, plan=plan), HostReceiver(buf)
    try:
        fut = sender.open(1, wait=False)
        with pytest.raises(StateError, match="already open"):
            sender.open(2)
        with pytest.raises(InvalidArgumentError, match="update 1 is open"):
            sender.push(2)  # refused without touching the open update
        rep = sender.push(1)
        assert fut.done() and rep["open_s"] >= 0.05 and end.calls == [("begin", 1)]  # begun once, by the open
        assert rx.receive(receiver, 1) == 1
        want = expected(plan, src)
        assert all(same_bits(want[n], dst[n]) for n in src)
        sender.open(2)  # wait=True: begun now
        assert end.calls[-1] == ("begin", 2) and "open_s" in sender.push(2) and rx.receive(receiver, 2) == 2
        assert "open_s" not in sender.push(3) and end.calls[-1] == ("begin", 3)  # no open: push begins itself
    finally:
        sender.close()
        buf.close()


def test_a_failed_open_raises_from_the_push_and_commits_nothing():
    src, plan, buf, _, receiver, dst = _pair()
    end = _SlowBegin(HostSender(buf), fail=True)
    sender, rx = Sender(src, end, plan=plan), HostReceiver(buf)
    try:
        sender.open(1, wait=False)
        with pytest.raises(PartialUpdateError, match="went away"):
            sender.push(1)
        with pytest.raises(PartialUpdateError):
            rx.receive(receiver, 1)  # nothing was written
        assert receiver.version is None
        end.fail = False
        sender.push(1)  # the failed open is gone: the next push begins afresh
        assert rx.receive(receiver, 1) == 1
    finally:
        sender.close()
        buf.close()


def test_abort_gives_an_open_update_up_and_the_receiver_keeps_its_version():
    src, plan, buf, _, receiver, dst = _pair()
    end = _SlowBegin(HostSender(buf))
    sender, rx = Sender(src, end, plan=plan), HostReceiver(buf)
    try:
        sender.push(1)
        assert rx.receive(receiver, 1) == 1
        sender.abort()  # nothing open: nothing happens
        sender.open(2, wait=False)
        sender.abort()  # waits for the begin, then closes the transport
        assert end.calls[-1] == ("begin", 2)
        with pytest.raises(PartialUpdateError):
            rx.receive(receiver, 2)  # begun, never committed
        assert receiver.version == 1
        sender.open(2)  # free to open again
        sender.push(2)
        assert rx.receive(receiver, 2) == 2
    finally:
        sender.close()
        buf.close()


def test_payload_is_the_shared_update_after_the_header():
    # what the sender writes is what payload() shows (a codec of the caller's own lays its bytes out there); its
    # size is bounded by the buffer after the header
    src, plan, buf, sender, receiver, dst = _pair()
    try:
        sender.push(1)
        whole = buf.payload()
        assert whole.dtype == torch.uint8 and whole.numel() == plan.nbytes  # size_for(plan): header + update
        data = buf.payload(plan.nbytes)
        offsets = plan.bucket_offsets()
        for b, o in zip(plan.buckets, offsets):
            for it in b.items:
                if it.kind == "raw":
                    assert same_bits(it.outputs[0].view(data[o:o + b.nbytes]), src[it.source])
        data[:8].fill_(7)  # a view of the shared mapping, not a copy
        assert torch.equal(buf.payload(8), torch.full((8,), 7, dtype=torch.uint8))
        for bad in (-1, plan.nbytes + 1, 1.5, True):
            with pytest.raises(InvalidArgumentError, match="payload size"):
                buf.payload(bad)
    finally:
        buf.close()
