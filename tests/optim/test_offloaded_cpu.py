"""OffloadedAdam's pipeline logic with bf16 params on the CPU (synchronous copies): buckets, slot reuse, param
groups, grad hooks, state_dict, and exact equality with torch AdamW stepping fp32 masters. The CUDA path (streams,
pinned slots, overlap, the upload race) is covered by test_offloaded_gpu.py."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import ebbtide  # noqa: E402
from ebbtide.optim import OffloadedAdam  # noqa: E402
from ebbtide.optim._testing import round_moments_to_bf16  # noqa: E402
from ebbtide.testing.bits import bits_equal  # noqa: E402


def make_model(seed=0, device="cpu"):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(37, 64), torch.nn.GELU(), torch.nn.Linear(64, 19)).to(
        device=device, dtype=torch.bfloat16)


def batch(step, device="cpu"):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 37, generator=g).to(device, torch.bfloat16), torch.randn(16, 19, generator=g).to(
        device, torch.bfloat16)


class Reference:
    """torch AdamW (foreach=False) over fp32 CPU masters, fed the bf16 gradients our model produced."""

    def __init__(self, model, groups_kw, **hyper):
        self.params = list(model.parameters())
        self.masters = [p.detach().float().cpu().clone() for p in self.params]
        groups = [{"params": [self.masters[i] for i in idx], **kw} for idx, kw in groups_kw]
        hyper.setdefault("weight_decay", 0.0)  # OffloadedAdam's default (torch AdamW's is 0.01)
        self.opt = torch.optim.AdamW(groups, foreach=False, **hyper)

    def step(self):
        for m, p in zip(self.masters, self.params):
            m.grad = p.grad.detach().float().cpu()
        self.opt.step()

    def check(self, opt):
        for m, p in zip(self.masters, self.params):
            assert bits_equal(opt.state[p]["master_param"], m)
            assert bits_equal(p.detach().cpu(), m.to(torch.bfloat16))


def train_step(model, opt, step, ref=None, zero=True):
    x, y = batch(step, next(model.parameters()).device)
    if zero:
        opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
    loss.backward()
    if ref is not None:
        ref.step()
    opt.step()


@pytest.mark.parametrize("bucket_numel,slots,overlap", [(256, 1, False), (192, 2, True), (10**6, 3, False)])
def test_matches_torch_adamw_on_fp32_masters(bucket_numel, slots, overlap):
    model = make_model()
    params = list(model.parameters())
    groups = [([0, 1], {}), ([2, 3], {"lr": 3e-3, "weight_decay": 0.0})]
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    ref = Reference(model, groups, **hyper)
    opt = OffloadedAdam([{"params": [params[i] for i in idx], **kw} for idx, kw in groups], mode="exact",
                        bucket_numel=bucket_numel, slots=slots, overlap_with_backward=overlap, threads=2, **hyper)
    if bucket_numel < 10**6:
        assert len(opt.buckets) > slots  # slots are reused
    assert opt.last_step_times == {}
    for step in range(6):
        train_step(model, opt, step, ref)
        ref.check(opt)
        times = opt.last_step_times  # where the step went: the whole pipeline holds the kernel and the waits
        assert times["elements"] == opt.numel and 0 < times["kernel_s"] <= times["seconds"], times
        assert 0 <= times["wait_s"] <= times["seconds"], times


def test_grads_set_to_none_by_the_model_are_repaired():
    model = make_model(1)
    ref = Reference(model, [([0, 1, 2, 3], {})], lr=1e-2)
    opt = OffloadedAdam(model.parameters(), lr=1e-2, mode="exact", bucket_numel=128, slots=2)
    for step in range(3):
        model.zero_grad(set_to_none=True)
        train_step(model, opt, step, ref, zero=False)
        ref.check(opt)


def test_state_dict_round_trip_and_resume():
    a, b = make_model(2), make_model(2)
    oa = OffloadedAdam(a.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=True, mode="exact", bucket_numel=256)
    ob = OffloadedAdam(b.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=True, mode="exact", bucket_numel=512)
    for step in range(3):
        train_step(a, oa, step)
        train_step(b, ob, step)
    sd = oa.state_dict()
    assert set(sd["state"][0]) >= {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param"}
    assert float(sd["state"][0]["step"]) == 3.0
    c = make_model(9)
    c.load_state_dict(a.state_dict())
    oc = OffloadedAdam(c.parameters(), lr=0.5, amsgrad=True, mode="exact", bucket_numel=128)
    oc.load_state_dict(sd)
    assert oc.param_groups[0]["lr"] == 1e-2
    for step in range(3, 6):
        train_step(a, oa, step)
        train_step(c, oc, step)
    for p, q in zip(a.parameters(), c.parameters()):
        assert bits_equal(p.detach(), q.detach())
        assert bits_equal(oa.state[p]["master_param"], oc.state[q]["master_param"])


def test_load_without_optimizer_state_takes_masters_from_the_model():
    model = make_model(3)
    opt = OffloadedAdam(model.parameters(), lr=1e-2, mode="exact")
    train_step(model, opt, 0)
    # New weights arrive (a checkpoint without optimizer state): masters must follow them, not stay stale.
    fresh = make_model(4)
    model.load_state_dict(fresh.state_dict())
    empty = {"state": {}, "param_groups": opt.state_dict()["param_groups"]}
    opt.load_state_dict(empty)
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert bits_equal(opt.state[p]["master_param"], q.detach().float())
        assert torch.count_nonzero(opt.state[p]["exp_avg"]) == 0
    ref = Reference(model, [([0, 1, 2, 3], {})], lr=1e-2)
    train_step(model, opt, 1, ref)
    ref.check(opt)


def test_load_torch_adamw_state_dict():
    model = make_model(5)
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    t = torch.optim.AdamW(masters, lr=1e-2, foreach=False)
    for m in masters:
        m.grad = torch.randn_like(m)
    t.step()
    opt = OffloadedAdam(model.parameters(), lr=1.0, mode="exact")
    opt.load_state_dict(t.state_dict())
    for p, m in zip(model.parameters(), masters):
        assert bits_equal(opt.state[p]["exp_avg"], t.state[m]["exp_avg"])
        assert float(opt.state_dict()["state"][0]["step"]) == 1.0


def test_skip_non_finite_and_bad_input():
    model = make_model(6)
    opt = OffloadedAdam(model.parameters(), lr=1e-2)
    train_step(model, opt, 0)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batch(1)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x).float(), y.float()).backward()
    next(model.parameters()).grad[0, 0] = float("nan")
    opt.step(skip_non_finite=True)
    assert opt.last_step_applied is False
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p.detach(), q)
    E = ebbtide.InvalidArgumentError
    opt.param_groups[0]["lr"] = -1.0  # e.g. a broken scheduler: refused natively before any bucket changes
    with pytest.raises(E, match="lr"):
        opt.step()
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p.detach(), q)
    assert float(opt.state_dict()["state"][0]["step"]) == 1.0
    opt.param_groups[0]["lr"] = 1e-2
    with pytest.raises(E, match="bfloat16"):
        OffloadedAdam([torch.zeros(4, requires_grad=True)])
    with pytest.raises(E):
        OffloadedAdam(make_model().parameters(), bucket_numel=3)
    with pytest.raises(E):
        OffloadedAdam(make_model().parameters(), slots=0)
    with pytest.raises(E, match="mode"):
        OffloadedAdam(make_model().parameters(), mode="quick")
    bad = opt.state_dict()
    bad["state"][0]["step"] = torch.tensor(7.0)
    with pytest.raises(E, match="steps differ"):
        opt.load_state_dict(bad)


class RoundedReference(Reference):
    """The bf16-moments reference: torch AdamW on fp32 copies of the moments, rounded to bf16 after every step."""

    def step(self):
        super().step()
        round_moments_to_bf16(self.opt)

    def check(self, opt):
        super().check(opt)
        for m, p in zip(self.masters, self.params):
            for key in ("exp_avg", "exp_avg_sq"):
                assert opt.state[p][key].dtype == torch.bfloat16
                assert bits_equal(opt.state[p][key], self.opt.state[m][key].to(torch.bfloat16))


@pytest.mark.parametrize("bucket_numel,slots", [(192, 2), (10**6, 3)])
def test_bf16_moments_match_torch_adamw_with_rounded_moments(bucket_numel, slots):
    model = make_model(7)
    params = list(model.parameters())
    groups = [([0, 1], {}), ([2, 3], {"lr": 3e-3, "weight_decay": 0.0})]
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    ref = RoundedReference(model, groups, **hyper)
    opt = OffloadedAdam([{"params": [params[i] for i in idx], **kw} for idx, kw in groups], mode="exact",
                        bucket_numel=bucket_numel, slots=slots, threads=2, moments_dtype=torch.bfloat16, **hyper)
    assert opt.moments_dtype == torch.bfloat16
    for step in range(5):
        train_step(model, opt, step, ref)
        ref.check(opt)


def test_bf16_moments_state_dict_round_trip_and_fp32_load():
    a, c = make_model(8), make_model(9)
    oa = OffloadedAdam(a.parameters(), lr=1e-2, mode="exact", bucket_numel=256, moments_dtype=torch.bfloat16)
    for step in range(3):
        train_step(a, oa, step)
    sd = oa.state_dict()
    assert sd["state"][0]["exp_avg"].dtype == torch.bfloat16 and sd["state"][0]["master_param"].dtype == torch.float32
    c.load_state_dict(a.state_dict())
    oc = OffloadedAdam(c.parameters(), lr=0.5, mode="exact", bucket_numel=128, moments_dtype=torch.bfloat16)
    oc.load_state_dict(sd)
    for step in range(3, 5):
        train_step(a, oa, step)
        train_step(c, oc, step)
    for p, q in zip(a.parameters(), c.parameters()):
        assert bits_equal(p.detach(), q.detach())
        assert bits_equal(oa.state[p]["exp_avg_sq"], oc.state[q]["exp_avg_sq"])
    # fp32 moments (the default OffloadedAdam's) load rounded to nearest even, and the other way exactly
    f = OffloadedAdam(make_model(8).parameters(), lr=1e-2, mode="exact")
    f.load_state_dict(oa.state_dict())
    fp = next(iter(f.state.values()))
    assert fp["exp_avg"].dtype == torch.float32
    assert bits_equal(fp["exp_avg"], next(iter(oa.state.values()))["exp_avg"].float())
    fp["exp_avg"].add_(1e-3)
    oa.load_state_dict(f.state_dict())
    assert bits_equal(next(iter(oa.state.values()))["exp_avg"], fp["exp_avg"].to(torch.bfloat16))
    with pytest.raises(ebbtide.InvalidArgumentError, match="amsgrad"):
        OffloadedAdam(make_model().parameters(), amsgrad=True, moments_dtype=torch.bfloat16)
    with pytest.raises(ebbtide.InvalidArgumentError, match="moments_dtype"):
        OffloadedAdam(make_model().parameters(), moments_dtype=torch.float16)


def test_param_mirror_follows_every_step_and_rebuilds_the_params():
    """The host mirror equals the params after each step (the kernel writes it), leaves the numerics unchanged,
    follows sync_master_from_params, and writes the params back."""
    plain, mirrored = make_model(), make_model()
    o1 = OffloadedAdam(plain.parameters(), lr=1e-2, mode="exact", bucket_numel=256, slots=2)
    o2 = OffloadedAdam(mirrored.parameters(), lr=1e-2, mode="exact", bucket_numel=256, slots=2)
    with pytest.raises(ebbtide.StateError, match="not enabled"):
        o2.upload_params_from_mirror()
    assert o2.param_mirror is None
    mirror = o2.enable_param_mirror()
    assert o2.enable_param_mirror() is mirror and torch.equal(mirror, o2.flat_params)
    for step in range(4):
        for model, opt in ((plain, o1), (mirrored, o2)):
            x, y = batch(step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x).float(), y.float()).backward()
            opt.step()
        assert torch.equal(o1.flat_params, o2.flat_params)
        assert torch.equal(mirror, o2.flat_params)
    want = o2.flat_params.clone()
    with torch.no_grad():
        o2.flat_params.zero_()  # what a discarded, re-mapped buffer holds
    o2.upload_params_from_mirror()
    assert torch.equal(o2.flat_params, want)
    with torch.no_grad():
        o2.flat_params.zero_()
    spans = o2.upload_params_from_mirror(wait=False)  # per bucket (start, end, event): events are None on a CPU
    assert torch.equal(o2.flat_params, want)
    assert [(a, b) for a, b, _ in spans] == o2.buckets
    assert spans[0][0] == 0 and spans[-1][1] == o2.flat_params.numel() and all(e is None for *_, e in spans)
    with torch.no_grad():
        next(mirrored.parameters()).add_(1.0)  # a write outside the optimizer...
    o2.sync_master_from_params()  # ...reaches the mirror through the documented call
    assert torch.equal(mirror, o2.flat_params)


def test_transport_waits_before_any_step_are_timed_without_error():
    """A grad-hook download waited before the first pipeline ran (a skipped first step, repaired grad views)."""
    from ebbtide.optim.offloaded import _Transport

    class _Event:
        def synchronize(self):
            pass

    t = _Transport(torch.device("cpu"))
    t.wait(_Event())  # before any begin()
    t.begin()
    t.wait(_Event())
    t.end(7)
    assert t.times["elements"] == 7 and t.times["wait_s"] <= t.times["seconds"]
