"""CPUAdam beyond exact equality: fast-mode error bound, bf16 copy-out bits, state_dict interchange with torch,
schedulers and tensor lr, grad scaling and non-finite skipping, thread/ISA independence, and bad input."""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

import ebbtide  # noqa: E402
from ebbtide.optim import CPUAdam, available_isas  # noqa: E402
from ebbtide.optim._testing import grads_for  # noqa: E402
from ebbtide.testing.bits import bits_equal, describe_mismatch  # noqa: E402

# Fast mode, one step from the same fp32 state, against torch's float64 AdamW/Adam:
#   |p_fast - p64| <= FAST_ULPS * ulp32(p64) + FAST_LR_FRACTION * lr        (element-wise)
FAST_ULPS = 2.0
FAST_LR_FRACTION = 2.0**-12
# Over many steps fast mode must stay as close to float64 as torch's own fp32 step, within this factor.
FAST_VS_TORCH32 = 2.0


def ulp32(x64: torch.Tensor) -> torch.Tensor:
    a = x64.float().abs()
    return (torch.nextafter(a, torch.tensor(float("inf"))) - a).double()


@pytest.mark.parametrize("adamw,wd,amsgrad", [(True, 0.1, False), (False, 0.1, False), (True, 0.0, True)])
def test_fast_mode_single_step_bound(adamw, wd, amsgrad):
    n, lr = 50021, 1e-3
    gen = torch.Generator().manual_seed(3)
    for k in range(3):  # steps 1..3, each from a state both sides share exactly
        pf = torch.randn(n, generator=gen)
        p64 = pf.double().clone()
        cls = torch.optim.AdamW if adamw else torch.optim.Adam
        o64 = cls([p64], lr=lr, weight_decay=wd, amsgrad=amsgrad, foreach=False)
        of = CPUAdam([pf], lr=lr, weight_decay=wd, adamw=adamw, amsgrad=amsgrad, mode="fast")
        gs = grads_for(n, k + 1, 11 + k)
        for i, g in enumerate(gs):
            p64.grad, pf.grad = g.double(), g.clone()
            o64.step()
            of.step()
            if i + 1 < len(gs):  # resynchronize to the fp32 state
                p64.copy_(pf.double())
                for key, t in o64.state[p64].items():
                    if key != "step":
                        t.copy_(of.state[pf][key].double())
        err = (pf.double() - p64).abs()
        tol = FAST_ULPS * ulp32(p64) + FAST_LR_FRACTION * lr
        worst = (err / tol).max().item()
        assert worst <= 1.0, f"step {k + 1}: fast-mode error reaches {worst:.3f} of the bound"


def test_fast_mode_many_steps_as_accurate_as_torch_fp32():
    n, lr = 20011, 1e-3
    init = torch.randn(n, generator=torch.Generator().manual_seed(5))
    p64, p32, pf = init.double().clone(), init.clone(), init.clone()
    o64 = torch.optim.AdamW([p64], lr=lr, weight_decay=0.1, foreach=False)
    o32 = torch.optim.AdamW([p32], lr=lr, weight_decay=0.1, foreach=False)
    of = CPUAdam([pf], lr=lr, weight_decay=0.1, mode="fast")
    for g in grads_for(n, 60, 6):
        p64.grad, p32.grad, pf.grad = g.double(), g.clone(), g.clone()
        o64.step(), o32.step(), of.step()
    e_fast = (pf.double() - p64).abs().max().item()
    e_t32 = (p32.double() - p64).abs().max().item()
    assert e_fast <= FAST_VS_TORCH32 * e_t32, (e_fast, e_t32)


def _fast_run(isa, threads, n=70001, steps=5, bf16=False):
    p = torch.randn(n, generator=torch.Generator().manual_seed(8))
    opt = CPUAdam([p], lr=1e-2, weight_decay=0.1, amsgrad=True, mode="fast", isa=isa, threads=threads)
    for g in grads_for(n, steps, 9, special=True):
        opt.step(grads={p: g.to(torch.bfloat16) if bf16 else g})
    return p, opt.state[p]


def test_fast_mode_identical_across_isas_and_threads():
    ref_p, ref_s = _fast_run(available_isas()[-1], 1)
    for isa in available_isas():
        for threads in (1, 3):
            p, s = _fast_run(isa, threads)
            assert bits_equal(p, ref_p), f"{isa}/{threads}: {describe_mismatch(p, ref_p)}"
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                assert bits_equal(s[key], ref_s[key]), f"{isa}/{threads} {key}"


def test_bf16_grads_equal_widened_fp32_grads():
    p1, _ = _fast_run(None, 2, bf16=True)
    p = torch.randn(70001, generator=torch.Generator().manual_seed(8))
    opt = CPUAdam([p], lr=1e-2, weight_decay=0.1, amsgrad=True, mode="fast", threads=2)
    for g in grads_for(70001, 5, 9, special=True):
        opt.step(grads={p: g.to(torch.bfloat16).float()})
    assert bits_equal(p1, p)


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("mode", ["fast", "exact"])
@pytest.mark.parametrize("target_offset", [0, 1])  # aligned targets take the streaming-store path
def test_bf16_copy_out_bit_equal_to_torch(isa, mode, target_offset):
    # lr = 0 keeps p bit for bit, so every float32 pattern (NaN, Inf, subnormal, ties) reaches the conversion.
    gen = torch.Generator().manual_seed(10)
    n = 65536 + 13
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), generator=gen, dtype=torch.int64).to(torch.int32)
    bits[:8] = torch.tensor([0x7FC00000, -0x00400000, 0x00000001, -0x7F800001, 0x7F7FFFFF, 0x3F808000, 0x3F818000,
                             0x007FFFFF], dtype=torch.int32)
    p = bits.view(torch.float32).clone()
    out = torch.full((n + 64,), 7, dtype=torch.bfloat16)[target_offset:target_offset + n]
    opt = CPUAdam([p], lr=0.0, mode=mode, isa=isa, threads=3)
    opt.attach_bf16_copy(p, out)
    opt.step(grads={p: torch.zeros(n)})
    assert bits_equal(p, bits.view(torch.float32)), "lr=0 must leave p unchanged (signaling NaNs become quiet)"
    expect = p.to(torch.bfloat16)
    assert torch.equal(out.view(torch.int16), expect.view(torch.int16)), describe_mismatch(out.float(), expect.float())


def test_copy_out_follows_the_update():
    p = torch.randn(1000)
    out = torch.empty(1000, dtype=torch.bfloat16)
    opt = CPUAdam([p], lr=1e-2, mode="exact")
    opt.attach_bf16_copy(p, out)
    for g in grads_for(1000, 3, 12):
        opt.step(grads={p: g})
        assert torch.equal(out.view(torch.int16), p.to(torch.bfloat16).view(torch.int16))
    opt.attach_bf16_copy(p, None)
    before = out.clone()
    opt.step(grads={p: torch.ones(1000)})
    assert torch.equal(out.view(torch.int16), before.view(torch.int16))


def _train(opt, params, grads_list, sched=None):
    for grads in grads_list:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        if sched is not None:
            sched.step()


def _grads(shapes, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]


@pytest.mark.parametrize("direction", ["torch_to_ours", "ours_to_torch"])
def test_state_dict_interchange_with_torch(direction):
    shapes = [(33, 7), (129,), (5,)]
    init = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
    hyper = dict(lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05, amsgrad=True)
    a = [t.clone() for t in init]
    b = [t.clone() for t in init]
    ref = torch.optim.AdamW(a, foreach=False, **hyper)
    first = (torch.optim.AdamW(b, foreach=False, **hyper) if direction == "torch_to_ours"
             else CPUAdam(b, mode="exact", **hyper))
    g1, g2 = _grads(shapes, 4, 20), _grads(shapes, 4, 21)
    _train(ref, a, g1)
    _train(first, b, g1)
    sd = first.state_dict()
    second = (CPUAdam(b, mode="exact", **{**hyper, "lr": 1.0}) if direction == "torch_to_ours"
              else torch.optim.AdamW(b, foreach=False, **{**hyper, "lr": 1.0}))
    second.load_state_dict(sd)  # restores lr=2e-3 and the per-param state
    _train(ref, a, g2)
    _train(second, b, g2)
    for x, y in zip(a, b):
        assert bits_equal(x, y)
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"):
        for pa, pb in zip(a, b):
            assert bits_equal(ref.state[pa][key], second.state[pb][key]), key


def test_scheduler_and_tensor_lr_match_torch():
    for lr in (1e-3, torch.tensor(1e-3)):
        a, b = torch.randn(1000), None
        b = a.clone()
        ref = torch.optim.AdamW([a], lr=lr, weight_decay=0.1, foreach=False)
        ours = CPUAdam([b], lr=lr.clone() if isinstance(lr, torch.Tensor) else lr, weight_decay=0.1, mode="exact")
        s1 = torch.optim.lr_scheduler.StepLR(ref, step_size=2, gamma=0.5)
        s2 = torch.optim.lr_scheduler.StepLR(ours, step_size=2, gamma=0.5)
        g = _grads([(1000,)], 7, 30)
        _train(ref, [a], g, s1)
        _train(ours, [b], g, s2)
        assert bits_equal(a, b)


def test_param_groups_with_different_hyperparameters():
    a1, a2 = torch.randn(100), torch.randn(50)
    b1, b2 = a1.clone(), a2.clone()
    ref = torch.optim.AdamW([{"params": [a1]}, {"params": [a2], "lr": 1e-2, "weight_decay": 0.0}], lr=1e-3,
                            foreach=False)
    ours = CPUAdam([{"params": [b1]}, {"params": [b2], "lr": 1e-2, "weight_decay": 0.0}], lr=1e-3,
                   weight_decay=0.01, mode="exact")
    g = _grads([(100,), (50,)], 5, 31)
    _train(ref, [a1, a2], g)
    _train(ours, [b1, b2], g)
    assert bits_equal(a1, b1) and bits_equal(a2, b2)


def test_grad_scale_equals_prescaled_gradients():
    a = torch.randn(3001)
    b = a.clone()
    ref = torch.optim.AdamW([a], weight_decay=0.1, foreach=False)
    ours = CPUAdam([b], weight_decay=0.1, mode="exact")
    for g in grads_for(3001, 4, 40):
        a.grad = g * 0.125  # exact scaling in both
        ref.step()
        ours.step(grads={b: g}, grad_scale=0.125)
    assert bits_equal(a, b)


def test_skip_non_finite_changes_nothing():
    p = torch.randn(5000)
    q = torch.randn(300)
    opt = CPUAdam([p, q], mode="fast")
    opt.step(grads={p: torch.randn(5000), q: torch.randn(300)})
    snap = {k: v.clone() for k, v in opt.state[p].items()}
    p0, q0 = p.clone(), q.clone()
    bad = torch.randn(300)
    bad[17] = float("inf")
    opt.step(grads={p: torch.randn(5000), q: bad}, skip_non_finite=True)
    assert opt.last_step_applied == [False]
    assert torch.equal(p, p0) and torch.equal(q, q0)
    for k, v in snap.items():
        assert torch.equal(opt.state[p][k], v), k
    # A finite gradient that overflows once scaled is non-finite too.
    opt.step(grads={p: torch.full((5000,), 1e30), q: torch.randn(300)}, grad_scale=1e10, skip_non_finite=True)
    assert opt.last_step_applied == [False] and torch.equal(p, p0)
    opt.step(grads={p: torch.randn(5000), q: torch.randn(300)}, skip_non_finite=True)
    assert opt.last_step_applied == [True] and not torch.equal(p, p0)


def test_threads_come_from_the_api_not_omp():
    assert CPUAdam([torch.zeros(1)], threads=3).threads == 3
    assert CPUAdam([torch.zeros(1)]).threads == len(os.sched_getaffinity(0))
    torch.set_num_threads(1)  # torch's intra-op setting must not leak into our pool
    try:
        assert CPUAdam([torch.zeros(1)]).threads == len(os.sched_getaffinity(0))
    finally:
        torch.set_num_threads(os.cpu_count() or 1)


def test_bad_input_is_rejected_and_changes_nothing():
    E = ebbtide.InvalidArgumentError
    with pytest.raises(E, match="CPU"):
        CPUAdam([torch.empty(3, device="meta")])
    with pytest.raises(E, match="contiguous"):
        CPUAdam([torch.randn(4, 4).t()])
    with pytest.raises(E, match="float32"):
        CPUAdam([torch.randn(4, dtype=torch.float16)])
    with pytest.raises(E, match="mode"):
        CPUAdam([torch.zeros(2)], mode="sloppy")
    with pytest.raises(E):
        CPUAdam([torch.zeros(2)], lr=-1.0)
    with pytest.raises(E):
        CPUAdam([torch.zeros(2)], betas=(1.0, 0.9))
    with pytest.raises(E):
        CPUAdam([torch.zeros(2)], threads=0)
    with pytest.raises(E, match="isa"):
        CPUAdam([torch.zeros(2)], isa="sse9")
    good, bad = torch.randn(10), torch.randn(10)
    opt = CPUAdam([good, bad])
    g0 = good.clone()
    cases = [torch.randn(10, dtype=torch.float16), torch.randn(11), torch.randn(20)[::2], torch.empty(10, device="meta")]
    for g in cases:
        with pytest.raises(E):
            opt.step(grads={good: torch.randn(10), bad: g})
        assert torch.equal(good, g0) and len(opt.state) == 0
    with pytest.raises(E):
        opt.step(grads={good: torch.randn(10)}, grad_scale=float("nan"))
    t = torch.empty(10, dtype=torch.float32)
    with pytest.raises(E, match="bfloat16"):
        opt.attach_bf16_copy(good, t)
    with pytest.raises(E, match="not managed"):
        opt.attach_bf16_copy(torch.zeros(10), torch.empty(10, dtype=torch.bfloat16))


def test_the_default_pool_is_this_ranks_share_of_the_host(monkeypatch):
    from ebbtide.errors import InvalidArgumentError
    from ebbtide.optim.cpu_adam import default_threads

    cpus = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert default_threads() is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert default_threads() is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert default_threads() == max(1, cpus // 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(4 * cpus))
    assert default_threads() == 1
    for bad in ("two", "0", "-1", "1.5"):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", bad)
        with pytest.raises(InvalidArgumentError, match="LOCAL_WORLD_SIZE"):
            default_threads()
