"""Properties of CPUAdam and OffloadedAdam over random sizes, hyper-parameters, states and group layouts:
exact mode equals torch AdamW/Adam bit for bit, fast mode stays within its documented bound of float64 AdamW,
and every bad input is an InvalidArgumentError that leaves params and state as they were."""
from __future__ import annotations

import copy
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("hypothesis")
from hypothesis import assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ebbtide import InvalidArgumentError  # noqa: E402
from ebbtide.optim import CPUAdam, OffloadedAdam  # noqa: E402
from ebbtide.testing.bits import bits_equal, describe_mismatch  # noqa: E402

# The fast-mode bound of tests/optim/test_cpu_adam_api.py (one step from a state shared with float64 AdamW):
#   |p_fast - p64| <= FAST_ULPS * ulp32(p64) + FAST_LR_FRACTION * lr
FAST_ULPS = 2.0
FAST_LR_FRACTION = 2.0**-12

hyper = st.fixed_dictionaries({
    "lr": st.floats(1e-5, 1e-1),
    "betas": st.tuples(st.floats(0.0, 0.99), st.floats(0.5, 0.9999)),
    "eps": st.sampled_from([1e-8, 1e-6, 1e-3]),
    "weight_decay": st.sampled_from([0.0, 0.01, 0.1]),
    "adamw": st.booleans(),
    "amsgrad": st.booleans(),
    "maximize": st.booleans(),
})


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _torch_opt(params, h):
    cls = torch.optim.AdamW if h["adamw"] else torch.optim.Adam
    kw = {k: v for k, v in h.items() if k != "adamw"}
    return cls(params, foreach=False, **kw)


@given(sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=3), h=hyper, steps=st.integers(1, 4),
       threads=st.integers(1, 3), seed=st.integers(0, 2**16), grad_exp=st.integers(-6, 2))
def test_exact_mode_equals_torch_bit_for_bit(sizes, h, steps, threads, seed, grad_exp):
    g = _gen(seed)
    init = [torch.randn(n, generator=g) for n in sizes]
    ours_p, ref_p = [t.clone() for t in init], [t.clone() for t in init]
    ours = CPUAdam(ours_p, mode="exact", threads=threads, **h)
    ref = _torch_opt(ref_p, h)
    for _ in range(steps):
        grads = [torch.randn(n, generator=g) * 10.0**grad_exp for n in sizes]
        for p, q, gr in zip(ours_p, ref_p, grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        ours.step()
        ref.step()
    for p, q in zip(ours_p, ref_p):
        assert bits_equal(p, q), describe_mismatch(p, q)
        for key in ("exp_avg", "exp_avg_sq"):
            assert bits_equal(ours.state[p][key], ref.state[q][key]), key


def _ulp32(x64):
    a = x64.float().abs()
    return (torch.nextafter(a, torch.tensor(float("inf"))) - a).double()


@given(n=st.integers(1, 5000), h=hyper, prior=st.integers(0, 5), seed=st.integers(0, 2**16),
       grad_exp=st.integers(-6, 2))
def test_fast_mode_one_step_within_the_documented_bound(n, h, prior, seed, grad_exp):
    g = _gen(seed)
    pf = torch.randn(n, generator=g)
    fast = CPUAdam([pf], mode="fast", **h)
    for _ in range(prior):  # a state reached by training, shared below with float64 torch
        pf.grad = torch.randn(n, generator=g) * 10.0**grad_exp
        fast.step()
    p64 = pf.double().clone()
    ref = _torch_opt([p64], h)
    grad = torch.randn(n, generator=g) * 10.0**grad_exp
    if prior:
        p64.grad = torch.zeros_like(p64)
        ref.step()  # create the state, then overwrite it with ours
        p64.copy_(pf.double())
        for key, t in ref.state[p64].items():
            src = fast.state[pf][key]
            t.copy_(src.double() if key != "step" else src)
    pf.grad, p64.grad = grad.clone(), grad.double()
    fast.step()
    ref.step()
    err = (pf.double() - p64).abs()
    tol = FAST_ULPS * _ulp32(p64) + FAST_LR_FRACTION * h["lr"]
    assert (err <= tol).all(), f"worst {(err / tol).max().item():.3f} of the bound"


bad_values = {
    "lr": st.sampled_from(["0.1", None, -1.0, math.inf, math.nan, True, [0.1], torch.tensor([0.1, 0.2])]),
    "betas": st.sampled_from([(0.9,), (0.9, 1.0), (-0.1, 0.9), ("0.9", 0.99), 0.9, "ab", (0.9, 0.99, 0.9)]),
    "eps": st.sampled_from(["1e-8", -1e-8, math.nan, None, torch.tensor(1e-8)]),
    "weight_decay": st.sampled_from(["0", -0.1, math.inf, None]),
    "amsgrad": st.sampled_from(["yes", 2, None, 0.5]),
    "maximize": st.sampled_from(["no", -1, None]),
    "decoupled_weight_decay": st.sampled_from(["true", 3]),
    "mode": st.sampled_from(["quick", None, "EXACT", 1]),
}


@given(n_groups=st.integers(1, 4), data=st.data())
def test_a_bad_value_in_any_group_is_refused_before_any_group_steps(n_groups, data):
    params = [torch.randn(64 + 7 * i) for i in range(n_groups)]
    opt = CPUAdam([{"params": [p]} for p in params], lr=1e-2)
    for p in params:  # one good step first: the state exists and must survive unchanged
        p.grad = torch.randn_like(p)
    opt.step()
    before = copy.deepcopy(opt.state_dict()), [p.clone() for p in params]
    bad_group = data.draw(st.integers(0, n_groups - 1), label="bad_group")
    key = data.draw(st.sampled_from(sorted(bad_values)), label="key")
    value = data.draw(bad_values[key], label="value")
    saved = opt.param_groups[bad_group][key]
    opt.param_groups[bad_group][key] = value
    with pytest.raises(InvalidArgumentError, match=f"param_groups\\[{bad_group}\\]"):
        opt.step()
    opt.param_groups[bad_group][key] = saved
    for p, q in zip(params, before[1]):
        assert torch.equal(p, q)
    after = opt.state_dict()
    for i in range(n_groups):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(after["state"][i][k], before[0]["state"][i][k])
    with pytest.raises(InvalidArgumentError):
        CPUAdam([torch.randn(3)], **{("adamw" if key == "decoupled_weight_decay" else key): value})


@given(spans=st.lists(st.tuples(st.integers(0, 90), st.integers(1, 30)), min_size=1, max_size=5),
       repeat=st.booleans())
def test_params_are_accepted_iff_distinct_and_not_overlapping(spans, repeat):
    base = torch.randn(128)
    views = [base[a:min(a + n, 128)] for a, n in spans]
    if repeat:
        views.append(views[0])
    ranges = [(a, min(a + n, 128)) for a, n in spans]
    overlap = any(a1 < b2 and a2 < b1 for i, (a1, b1) in enumerate(ranges) for (a2, b2) in ranges[i + 1:])
    if repeat or overlap:
        with pytest.raises(InvalidArgumentError, match="same tensor|overlaps"):
            CPUAdam(views)
    else:
        CPUAdam(views)


@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=3), other=st.lists(st.integers(1, 6), min_size=1,
       max_size=3), key=st.sampled_from(["exp_avg", "exp_avg_sq"]))
def test_loaded_state_must_have_the_param_shape(shape, other, key):
    p = torch.randn(*shape)
    opt = CPUAdam([p], lr=1e-2)
    p.grad = torch.randn_like(p)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    numel = math.prod(other)
    sd["state"][0][key] = torch.zeros(numel).reshape(other)
    kept = opt.state[p][key].clone()
    if tuple(other) == tuple(shape):
        opt.load_state_dict(sd)
        assert torch.equal(opt.state[p][key], torch.zeros(shape))
    else:
        with pytest.raises(InvalidArgumentError, match="shape"):
            opt.load_state_dict(sd)
        assert torch.equal(opt.state[p][key], kept)


@settings(max_examples=8)
@given(shapes=st.lists(st.integers(1, 300), min_size=1, max_size=5), n_groups=st.integers(1, 2),
       bucket=st.integers(64, 700), slots=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_offloaded_exact_mode_equals_torch_on_fp32_masters(shapes, n_groups, bucket, slots, seed):
    g = _gen(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=g).to(torch.bfloat16)) for n in shapes]
    groups = [params[i::n_groups] for i in range(n_groups)]
    groups = [grp for grp in groups if grp]
    assume(groups)
    kw = [{"lr": 1e-3 * (i + 1), "weight_decay": 0.05 * i} for i in range(len(groups))]
    masters = {id(p): p.detach().float().clone() for p in params}
    ref = torch.optim.AdamW([{"params": [masters[id(p)] for p in grp], **k} for grp, k in zip(groups, kw)],
                            foreach=False, betas=(0.9, 0.95))
    opt = OffloadedAdam([{"params": grp, **k} for grp, k in zip(groups, kw)], mode="exact", betas=(0.9, 0.95),
                        bucket_numel=bucket, slots=slots, threads=2)
    for _ in range(3):
        for p in params:
            p.grad.copy_(torch.randn(p.shape, generator=g).to(torch.bfloat16))
            masters[id(p)].grad = p.grad.float()
        opt.step()
        ref.step()
    for p in params:
        m = masters[id(p)]
        assert bits_equal(opt.state[p]["master_param"], m)
        assert bits_equal(p.detach(), m.to(torch.bfloat16))
