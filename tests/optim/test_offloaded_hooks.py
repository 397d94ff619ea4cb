"""OffloadedAdam's public placement and gradient hooks on CPU params: buffer_factory, rebind_buffers, the flat
views, and attach_grads=False (gradients written into flat_grad by the caller), each against the default path."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import ebbtide  # noqa: E402
from ebbtide.optim import OffloadedAdam  # noqa: E402
from ebbtide.testing.bits import bits_equal  # noqa: E402
from test_offloaded_cpu import batch, make_model  # noqa: E402


def _loss(model, step):
    x, y = batch(step)
    return torch.nn.functional.mse_loss(model(x).float(), y.float())


def test_buffer_factory_and_views():
    made = []

    def factory(kind, numel, dtype, device):
        made.append((kind, numel, dtype, device.type))
        return torch.full((numel,), 7.0, dtype=dtype, device=device)  # garbage: the optimizer must overwrite it

    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = OffloadedAdam(model.parameters(), lr=1e-2, mode="exact", bucket_numel=128, buffer_factory=factory)
    assert [m[0] for m in made] == ["params", "grads"]
    assert all(m[1] == opt.numel and m[2] == torch.bfloat16 for m in made)
    assert not opt.flat_grad.any()  # zeroed, not the factory's garbage
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)
        v = opt.param_view(p)
        assert v.data_ptr() == p.data_ptr() and opt.grad_view(p).data_ptr() == p.grad.data_ptr()
    offs = opt.param_offsets
    assert len(offs) == len(before) and all(o % 64 == 0 for _, o in offs)
    for p, o in offs:
        assert opt.flat_params.data_ptr() + 2 * o == p.data_ptr()
    with pytest.raises(ebbtide.InvalidArgumentError, match="not a param"):
        opt.grad_view(torch.zeros(3, dtype=torch.bfloat16))


def test_rebind_keeps_training_bit_identical():
    a, b = make_model(), make_model()
    oa = OffloadedAdam(a.parameters(), lr=1e-2, mode="exact", bucket_numel=128)
    ob = OffloadedAdam(b.parameters(), lr=1e-2, mode="exact", bucket_numel=128)
    for step in range(4):
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            _loss(m, step).backward()
            o.step()
        if step == 1:
            old = ob.flat_params.data_ptr()
            ob.rebind_buffers(lambda kind, n, dt, dev: torch.empty(n, dtype=dt, device=dev))
            assert ob.flat_params.data_ptr() != old
            assert all(p.data_ptr() == ob.param_view(p).data_ptr() for p in b.parameters())
    for p, q in zip(a.parameters(), b.parameters()):
        assert bits_equal(p.detach(), q.detach())
    # A factory returning the wrong thing changes nothing.
    ptr = ob.flat_params.data_ptr()
    with pytest.raises(ebbtide.InvalidArgumentError, match="buffer_factory"):
        ob.rebind_buffers(lambda kind, n, dt, dev: torch.empty(n + 1, dtype=dt, device=dev))
    with pytest.raises(ebbtide.InvalidArgumentError, match="buffer_factory"):
        ob.rebind_buffers(lambda kind, n, dt, dev: torch.empty(n, dtype=torch.float32, device=dev))
    assert ob.flat_params.data_ptr() == ptr


def test_external_grads_match_attached():
    a, b = make_model(), make_model()
    oa = OffloadedAdam(a.parameters(), lr=1e-2, weight_decay=0.1, mode="exact", bucket_numel=192)
    ob = OffloadedAdam(b.parameters(), lr=1e-2, weight_decay=0.1, mode="exact", bucket_numel=192,
                       attach_grads=False)
    assert all(p.grad is None for p in b.parameters())
    for step in range(4):
        oa.zero_grad()
        _loss(a, step).backward()
        oa.step()
        grads = torch.autograd.grad(_loss(b, step), list(b.parameters()))
        assert all(p.grad is None for p in b.parameters())  # nothing attached
        for p, g in zip(b.parameters(), grads):
            ob.grad_view(p).copy_(g)
        ob.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert bits_equal(p.detach(), q.detach())
    with pytest.raises(ebbtide.InvalidArgumentError, match="attach_grads"):
        OffloadedAdam(make_model().parameters(), attach_grads=False, overlap_with_backward=True)
    with pytest.raises(ebbtide.InvalidArgumentError, match="callable"):
        OffloadedAdam(make_model().parameters(), buffer_factory=3)
