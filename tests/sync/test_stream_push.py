"""Sender.streamed on the CPU: the update filled from OffloadedAdam's bucket hook while it steps, bit-equal to a plain
push of the same weights; refusals, overlapping ranges and aborts commit nothing."""
import pytest
import torch

from ebbtide.errors import InvalidArgumentError, StateError
from ebbtide.optim import OffloadedAdam
from ebbtide.sync import (HostReceiver, HostSender, PartialUpdateError, Plan, Receiver, Sender, SharedHostBuffer,
                          expected)
from ebbtide.sync.transport import HEADER_BYTES
from ebbtide.testing.bits import same_bits

from sync_models import RULES, checkpoint


class _Setup:
    """A checkpoint's tensors as params of one OffloadedAdam (views of its flat buffer), a sender over the host
    buffer and a receiver of zeros."""

    def __init__(self, bucket_numel=20_000, extra=None):
        src = checkpoint(0)
        self.params = {n: torch.nn.Parameter(t.clone()) for n, t in src.items()}
        self.opt = OffloadedAdam(list(self.params.values()), lr=1e-2, threads=1, bucket_numel=bucket_numel)
        self.extra = dict(extra or {})  # tensors the optimizer does not own (no range ever covers them)
        self.named = lambda: {**{n: p.detach() for n, p in self.params.items()}, **self.extra}
        self.plan = Plan.of(self.named(), rules=RULES, bucket_bytes=150_000)
        self.buf = SharedHostBuffer.create(SharedHostBuffer.size_for(self.plan), pin=False)
        self.sender = Sender(self.named, HostSender(self.buf), plan=self.plan)
        self.dst = {n: torch.zeros_like(t) for n, t in self.named().items()}
        self.receiver, self.rx = Receiver(self.dst, self.plan), HostReceiver(self.buf)

    def grads(self, seed):
        g = torch.Generator().manual_seed(seed)
        for p in self.params.values():
            p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)

    def wire(self):
        return self.buf.tensor[HEADER_BYTES:HEADER_BYTES + self.plan.nbytes].clone()

    def close(self):
        self.sender.close()
        self.buf.close()


def test_bucket_hook_reports_every_bucket_once_in_address_order():
    s = _Setup()
    try:
        seen = []
        h = s.opt.add_bucket_hook(lambda a, b, ev: seen.append((a, b, ev)))
        s.grads(1)
        s.opt.step()
        flat = s.opt.flat_params
        base, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
        assert len(seen) == len(s.opt.buckets) > 3 and all(ev is None for *_, ev in seen)  # CPU: no events
        assert seen[0][0] == base and seen[-1][1] == end
        assert all(seen[i][1] == seen[i + 1][0] for i in range(len(seen) - 1))  # contiguous, ascending, once
        h.remove()
        h.remove()  # twice is harmless
        s.grads(2)
        s.opt.step()
        assert len(seen) == len(s.opt.buckets)
        with pytest.raises(InvalidArgumentError, match="callable"):
            s.opt.add_bucket_hook(3)
    finally:
        s.close()


def test_streamed_update_equals_a_push_bit_for_bit_over_updates():
    s = _Setup()
    try:
        for v in range(1, 4):
            s.grads(v)
            st = s.sender.streamed(v)
            h = s.opt.add_bucket_hook(st)
            s.opt.step()
            h.remove()
            rep = st.finish()
            # filled during the step in parts of 1/8 of the update or more; a last smaller part at the finish
            assert len(s.plan.items) * 5 // 8 <= rep["streamed"] <= len(s.plan.items), rep
            streamed = s.wire()
            assert s.rx.receive(s.receiver, v) == v
            want = expected(s.plan, s.named())
            assert not [n for n in want if not same_bits(want[n], s.dst[n])], v
            s.sender.push(v + 100)  # the same weights by a plain push: the same bytes on the wire
            assert torch.equal(s.wire(), streamed), v
            s.receiver.version = v  # the receiver did not take the plain push (its version stays the stream's)
    finally:
        s.close()


def test_sources_no_range_covers_are_filled_at_the_finish():
    s = _Setup(extra={"model.extra.weight": torch.randn(128, 128).to(torch.bfloat16)})
    try:
        s.grads(1)
        st = s.sender.streamed(1)
        h = s.opt.add_bucket_hook(st)
        s.opt.step()
        h.remove()
        rep = st.finish()
        assert 0 < rep["streamed"] <= len(s.plan.items) - 1  # the extra tensor: filled by the finish
        s.rx.receive(s.receiver, 1)
        want = expected(s.plan, s.named())
        assert not [n for n in want if not same_bits(want[n], s.dst[n])]
    finally:
        s.close()


def test_overlapping_ranges_and_aborts_commit_nothing():
    s = _Setup()
    try:
        s.sender.push(1)
        s.rx.receive(s.receiver, 1)
        st = s.sender.streamed(2)
        flat = s.opt.flat_params
        st.ready(flat.data_ptr(), flat.data_ptr() + 4096)
        st.ready(flat.data_ptr() + 2048, flat.data_ptr() + 8192)  # overlaps: an error, raised by finish
        with pytest.raises(InvalidArgumentError, match="overlaps"):
            st.finish()
        with pytest.raises(PartialUpdateError, match="incomplete"):
            s.rx.receive(s.receiver, 2)
        assert s.receiver.version == 1
        st = s.sender.streamed(2)
        with pytest.raises(StateError, match="in progress"):
            s.sender.push(2)
        with pytest.raises(StateError, match="in progress"):
            s.sender.open(2)
        st.ready(flat.data_ptr(), flat.data_ptr() + 4096)
        st.abort()  # the producer failed
        st.abort()
        with pytest.raises(StateError, match="already finished or aborted"):
            st.finish()
        with pytest.raises(PartialUpdateError, match="incomplete"):
            s.rx.receive(s.receiver, 2)
        s.sender.push(2)  # the sender works on
        s.rx.receive(s.receiver, 2)
    finally:
        s.close()


def test_a_transport_that_needs_plan_order_is_refused():
    class InOrder:  # a transport without streams(): buckets in plan order only
        def begin(self, *a):
            pass

    src = checkpoint(0)
    sender = Sender(src, InOrder(), plan=Plan.of(src, rules=RULES))
    with pytest.raises(InvalidArgumentError, match="cannot take a streamed push"):
        sender.streamed(1)
    with pytest.raises(InvalidArgumentError, match="version"):
        sender.streamed(-1)
    assert sender._streaming is None and sender._open is None  # nothing begun
