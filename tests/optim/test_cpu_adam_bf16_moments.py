"""CPUAdam with bf16 moments (``moments_dtype=torch.bfloat16``), bitwise against its pure-torch reference.

The statement tested (optim/adam_kernel.h Note [bf16 moments]): in exact mode, one step with bf16 exp_avg/exp_avg_sq
gives the p of torch.optim.AdamW/Adam(foreach=False) run on fp32 copies of the moments (``m.float()``,
``v.float()``), and the new moments equal that step's fp32 moments ``.to(torch.bfloat16)`` (round to nearest even),
bit for bit; over many steps the reference re-rounds after every step (``_testing.round_moments_to_bf16``). Fast
mode with bf16 moments equals fast mode with fp32 moments started from the same (upcast) values and rounded the
same way. Every kernel ISA this CPU can run is forced in turn; sizes cover SIMD tails, misaligned views, fp32 and
bf16 grads, the bf16 copy-out and non-finite gradients. Bad input is refused before anything changes.
"""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import ebbtide  # noqa: E402
from ebbtide import _native  # noqa: E402
from ebbtide.optim import CPUAdam, available_isas  # noqa: E402
from ebbtide.optim._testing import grads_for, offset_view, round_moments_to_bf16  # noqa: E402
from ebbtide.optim.cpu_adam import make_hyper  # noqa: E402
from ebbtide.testing.bits import bits_equal, describe_mismatch  # noqa: E402

ISAS = available_isas()
SIZES = [1, 7, 15, 16, 17, 31, 33, 127, 129, 4099]
BF16 = torch.bfloat16


def _assert_bits(name, a, b):
    assert bits_equal(a, b), f"{name}: {describe_mismatch(a, b)}"


def run_vs_reference(n, steps, *, isa, adamw=True, wd=0.1, maximize=False, threads=3, offset=0, grad_offset=0,
                     bf16_grads=False, special=False, lr=1e-3, copy_out=False, seed=0):
    gen = torch.Generator().manual_seed(seed + n)
    init = torch.randn(n, generator=gen)
    ref = init.clone()
    ours = offset_view(n, offset, fill=init)
    tcls = torch.optim.AdamW if adamw else torch.optim.Adam
    t_opt = tcls([ref], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd, maximize=maximize, foreach=False)
    o_opt = CPUAdam([ours], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd, adamw=adamw, maximize=maximize,
                    mode="exact", threads=threads, isa=isa, moments_dtype=BF16)
    out = None
    if copy_out:
        out = offset_view(n, offset, dtype=BF16)
        o_opt.attach_bf16_copy(ours, out)
    for g in grads_for(n, steps, seed, special=special):
        if bf16_grads:
            g = g.to(BF16)
        ref.grad = g.float()
        t_opt.step()
        round_moments_to_bf16(t_opt)
        o_opt.step(grads={ours: offset_view(n, grad_offset, dtype=g.dtype, fill=g)})
    ts, os_ = t_opt.state[ref], o_opt.state[ours]
    assert os_["exp_avg"].dtype == BF16 and os_["exp_avg_sq"].dtype == BF16
    _assert_bits("p", ours, ref)
    _assert_bits("exp_avg", os_["exp_avg"], ts["exp_avg"].to(BF16))
    _assert_bits("exp_avg_sq", os_["exp_avg_sq"], ts["exp_avg_sq"].to(BF16))
    if out is not None:
        _assert_bits("copy-out", out, ref.to(BF16))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n", SIZES)
def test_exact_matches_torch_on_fp32_copies_then_rounded(isa, n):
    run_vs_reference(n, 12, isa=isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("adamw,maximize", [(False, False), (True, True)])
def test_exact_adam_l2_and_maximize(isa, adamw, maximize):
    run_vs_reference(257, 8, isa=isa, adamw=adamw, maximize=maximize)


@pytest.mark.parametrize("isa", ISAS)
def test_exact_bf16_grads_misaligned_copy_out_threads(isa):
    run_vs_reference(2**16 + 37, 4, isa=isa, offset=3, grad_offset=5, bf16_grads=True, copy_out=True, threads=2)
    run_vs_reference(129, 6, isa=isa, offset=1, grad_offset=1, copy_out=True, threads=1, wd=0.0)


@pytest.mark.parametrize("isa", ISAS)
def test_exact_special_gradients_nan_inf_subnormal(isa):
    # NaN/Inf gradients make NaN moments: stored as NaN (positions compared), never a finite value.
    run_vs_reference(67, 8, isa=isa, special=True)


def _fast_pair(n, steps, isa, seed=3):
    gen = torch.Generator().manual_seed(seed)
    p16 = torch.randn(n, generator=gen)
    p32 = p16.clone()
    o16 = CPUAdam([p16], lr=1e-3, weight_decay=0.1, mode="fast", isa=isa, threads=2, moments_dtype=BF16)
    o32 = CPUAdam([p32], lr=1e-3, weight_decay=0.1, mode="fast", isa="scalar", threads=1)
    for g in grads_for(n, steps, seed):
        o16.step(grads={p16: g})
        o32.step(grads={p32: g})
        for key in ("exp_avg", "exp_avg_sq"):  # the fp32 run, rounded as bf16 moments are
            o32.state[p32][key].copy_(o32.state[p32][key].to(BF16))
    _assert_bits("p", p16, p32)
    for key in ("exp_avg", "exp_avg_sq"):
        _assert_bits(key, o16.state[p16][key], o32.state[p32][key].to(BF16))


@pytest.mark.parametrize("isa", ISAS)
def test_fast_mode_is_the_fp32_fast_step_with_rounded_moments(isa):
    for n in (1, 17, 1000, 2**15 + 3):
        _fast_pair(n, 5, isa)


def test_rounding_is_rne_with_ties_to_even_and_nan_kept():
    # Moments stored by the kernel round to nearest even: feed values whose new moment lands exactly on a tie.
    # With beta1 = 0 and lr = 0, exp_avg becomes the gradient itself; with beta2 = 0, exp_avg_sq becomes g*g.
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80C000, 0x3F807FFF, 0x00008000, 0x00018000, 0x7F7FFFFF,
                         0x7FC00000, 0x80000001], dtype=torch.int64).to(torch.int32)
    g = bits.view(torch.float32)
    for isa in ISAS:
        p = torch.zeros(g.numel())
        opt = CPUAdam([p], lr=0.0, betas=(0.0, 0.0), isa=isa, moments_dtype=BF16, mode="exact")
        opt.step(grads={p: g.clone()})
        m = opt.state[p]["exp_avg"]
        _assert_bits(f"{isa} exp_avg", m, g.to(BF16))
        assert m.view(torch.int16)[7].item() & 0xFFFF == 0xFFFF  # a NaN, written as torch's x86 conversion does


def test_state_dict_round_trips_and_moves_to_torch():
    p = torch.randn(100)
    opt = CPUAdam([p], lr=1e-2, moments_dtype=BF16, mode="exact")
    for g in grads_for(100, 3, 1):
        opt.step(grads={p: g})
    sd = copy.deepcopy(opt.state_dict())  # as a checkpoint would (torch's state_dict shares the step tensors)
    assert sd["state"][0]["exp_avg"].dtype == BF16
    q = p.clone()
    opt2 = CPUAdam([q], lr=0.5, moments_dtype=BF16, mode="exact")
    opt2.load_state_dict(sd)
    assert opt2.state[q]["exp_avg"].dtype == BF16 and opt2.state[q]["exp_avg_sq"].dtype == BF16
    for g in grads_for(100, 3, 2):
        opt.step(grads={p: g})
        opt2.step(grads={q: g})
    _assert_bits("p", q, p)
    _assert_bits("exp_avg", opt2.state[q]["exp_avg"], opt.state[p]["exp_avg"])
    # fp32 moments (torch's AdamW, or CPUAdam's default) load rounded to nearest even.
    r = p.clone()
    t = torch.optim.AdamW([r], lr=1e-2, foreach=False)
    r.grad = torch.randn(100)
    t.step()
    opt3 = CPUAdam([r.clone()], moments_dtype=BF16)
    opt3.load_state_dict(t.state_dict())
    st = next(iter(opt3.state.values()))
    _assert_bits("loaded exp_avg_sq", st["exp_avg_sq"], t.state[r]["exp_avg_sq"].to(BF16))
    # and the other way: bf16 moments load into an fp32 CPUAdam exactly (upcast)
    opt4 = CPUAdam([p.clone()])
    opt4.load_state_dict(opt.state_dict())
    st = next(iter(opt4.state.values()))
    assert st["exp_avg"].dtype == torch.float32
    _assert_bits("upcast exp_avg", st["exp_avg"], opt.state[p]["exp_avg"].float())


def test_bad_arguments_are_refused():
    E = ebbtide.InvalidArgumentError
    with pytest.raises(E, match="moments_dtype"):
        CPUAdam([torch.zeros(4)], moments_dtype=torch.float16)
    with pytest.raises(E, match="moments_dtype"):
        CPUAdam([torch.zeros(4)], moments_dtype="bf16")
    with pytest.raises(E, match="amsgrad"):
        CPUAdam([torch.zeros(4)], amsgrad=True, moments_dtype=BF16)
    opt = CPUAdam([torch.zeros(4)], moments_dtype=BF16)
    with pytest.raises(E, match="amsgrad"):
        opt.add_param_group({"params": [torch.zeros(3)], "amsgrad": True})
    p = opt.param_groups[0]["params"][0]
    opt.param_groups[0]["amsgrad"] = True  # e.g. set by hand after construction: refused at step, nothing moves
    with pytest.raises(E, match="amsgrad"):
        opt.step(grads={p: torch.ones(4)})
    assert torch.count_nonzero(p) == 0 and len(opt.state[p]) == 0


def _engine_call(eng, hyper, spans, moments_bf16):
    """spans: (p, m, v, g) tensors or raw pointers (ints)."""
    ptr = lambda t: t if isinstance(t, int) else t.data_ptr()  # noqa: E731
    return eng.step(hyper, [ptr(s[0]) for s in spans], [ptr(s[1]) for s in spans], [ptr(s[2]) for s in spans], [],
                    [ptr(s[3]) for s in spans], [False] * len(spans), [], [8] * len(spans), [], [1.0] * len(spans),
                    moments_bf16)


def test_native_bad_input_changes_nothing():
    C = _native.load()
    E = ebbtide.InvalidArgumentError
    eng = C.optim.AdamEngine(2, "")
    hyper = make_hyper(dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, mode="exact"))

    def fresh():
        return torch.ones(8), torch.zeros(8, dtype=BF16), torch.zeros(8, dtype=BF16), torch.ones(8)

    good, bad = fresh(), fresh()
    snapshot = [t.clone() for t in good]
    buf = torch.zeros(20, dtype=torch.uint8)
    odd = buf.data_ptr() + 1  # not 2-byte aligned: not a bf16 array
    for spans, flags, match in [
            ([good, (bad[0], odd, bad[2], bad[3])], [True, True], "aligned"),
            ([good, (bad[0], bad[1], odd, bad[3])], [True, True], "aligned"),
            ([good, bad], [True], "differ in length"),
            ([good, (bad[0], bad[0].data_ptr() + 8, bad[2], bad[3])], [True, True], "overlap"),
    ]:
        with pytest.raises(E, match=match):
            _engine_call(eng, hyper, spans, flags)
        for a, b in zip(good, snapshot):
            assert torch.equal(a, b)
    hyper.amsgrad = True
    with pytest.raises(E, match="amsgrad"):
        eng.step(hyper, [good[0].data_ptr()], [good[1].data_ptr()], [good[2].data_ptr()], [torch.zeros(8).data_ptr()],
                 [good[3].data_ptr()], [False], [], [8], [], [1.0], [True])
    for a, b in zip(good, snapshot):
        assert torch.equal(a, b)
    hyper.amsgrad = False
    assert _engine_call(eng, hyper, [good], [True]) is True
    assert not torch.equal(good[0], snapshot[0])
