"""Properties of the public quant API over random shapes, magnitudes and options, checked against float64
arithmetic and the reference's own constants (ebbtide.quant.reference): scales within their rounding bounds,
round trips within the e4m3/INT4 error bounds, INT4 fake-quant equal to what int4_pack/int4_unpack serve, layouts
that agree with each other, and typed errors for bad arguments that leave the input unchanged."""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("hypothesis")
import numpy as np  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import ebbtide.quant as Q  # noqa: E402
from ebbtide import InvalidArgumentError  # noqa: E402
from ebbtide.quant import reference as R  # noqa: E402


def _weights(rows, cols, seed, lo_exp, hi_exp, zeros=False):
    """bf16 values whose magnitudes spread over 2^lo_exp .. 2^hi_exp (heavy-tailed, random signs)."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.empty(rows, cols).uniform_(lo_exp, hi_exp, generator=g))
    sign = torch.where(torch.rand(rows, cols, generator=g) < 0.5, -1.0, 1.0)
    x = mag * sign
    if zeros:
        x[torch.rand(rows, cols, generator=g) < 0.3] = 0.0
    return x.to(torch.bfloat16)


def _block_amax(x, n_blk, k_blk):
    xf = x.double().abs()
    out = torch.zeros(n_blk, k_blk, dtype=torch.float64)
    for i in range(n_blk):
        for j in range(k_blk):
            out[i, j] = xf[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].max()
    return out


shapes = st.tuples(st.integers(1, 300), st.integers(1, 300))
spread = st.tuples(st.integers(-30, 10), st.integers(0, 12)).map(lambda t: (t[0], t[0] + t[1]))


@given(shape=shapes, ex=spread, seed=st.integers(0, 2**16), eps=st.sampled_from([1e-4, 1e-12]),
       zeros=st.booleans())
def test_fp8_block_scale_bounds_and_round_trip(shape, ex, seed, eps, zeros):
    x = _weights(*shape, seed, *ex, zeros=zeros)
    before = x.clone()
    q, s = Q.fp8_block_quant(x, eps=eps)
    assert torch.equal(x.view(torch.int16), before.view(torch.int16))  # input untouched
    N, K = shape
    assert q.shape == x.shape and s.shape == (-(-N // 128), -(-K // 128)) and s.dtype == torch.float32
    # scale = RN32(max(amax, eps) * RN32(1/448)): within two fp32 roundings of max(amax, eps) / 448
    want = torch.clamp(_block_amax(x, *s.shape), min=float(np.float32(eps))) / 448.0
    assert ((s.double() - want).abs() <= want * 2.0**-22).all()
    qf = q.float()
    assert torch.isfinite(qf).all() and (qf.abs() <= 448).all()
    d = Q.fp8_block_dequant(q, s).double()
    xd = x.double()
    s_full = s.double().repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    # e4m3: half an ulp is 2^-4 relative in the normal range, 2^-10 * s absolute below it; + bf16 output rounding
    assert ((d - xd).abs() <= (2.0**-4 + 2.0**-8) * xd.abs() + 2.0**-10 * s_full * 1.01).all()


@given(shape=shapes, ex=spread, seed=st.integers(0, 2**16))
def test_ue8m0_scales_are_the_power_of_two_at_or_above_the_fp32_scale(shape, ex, seed):
    x = _weights(*shape, seed, *ex)
    _, s32 = Q.fp8_block_quant(x, scale="fp32")
    q, su = Q.fp8_block_quant(x, scale="ue8m0")
    m, e = torch.frexp(su)
    assert (m == 0.5).all()  # powers of two
    assert ((su >= s32) & (su < 2 * s32)).all()
    d = Q.fp8_block_dequant(q, su).double()
    xd = x.double()
    N, K = shape
    s_full = su.double().repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    assert ((d - xd).abs() <= (2.0**-4 + 2.0**-8) * xd.abs() + 2.0**-10 * s_full * 1.01).all()


@given(m=st.integers(1, 40), groups=st.integers(1, 5), lead=st.integers(1, 3), ex=spread, seed=st.integers(0, 2**16))
def test_group_quant_layouts_agree(m, groups, lead, ex, seed):
    x = _weights(lead * m, groups * 128, seed, *ex).view(lead, m, groups * 128)
    q_row, s_row = Q.fp8_group_quant(x, scale_layout="row")
    q_mn, s_mn = Q.fp8_group_quant(x, scale_layout="mn_major")
    assert torch.equal(q_row.view(torch.uint8), q_mn.view(torch.uint8))
    assert torch.equal(s_row, s_mn) and s_mn.stride() == (1, -(-(lead * m) // 4) * 4)
    want = x.double().abs().reshape(lead * m, groups, 128).amax(-1).clamp(min=float(np.float32(1e-10))) / 448.0
    assert ((s_row.double() - want).abs() <= want * 2.0**-22).all()
    q_ue, s_ue = Q.fp8_group_quant(x, scale_layout="mn_major", scale="ue8m0")
    _, s_packed = Q.fp8_group_quant(x, scale_layout="mn_major", scale="ue8m0_packed")
    assert torch.equal(R.ue8m0_unpack(s_packed, groups), s_ue.contiguous())


@given(shapes_=st.lists(shapes, min_size=1, max_size=4), seed=st.integers(0, 2**16),
       scale=st.sampled_from(["fp32", "ue8m0"]))
def test_list_quant_equals_per_tensor_quant(shapes_, seed, scale):
    ts = [_weights(*s, seed + i, -8, 4) for i, s in enumerate(shapes_)]
    bucket = Q.fp8_block_quant_list(ts, scale=scale)
    assert len(bucket) == len(ts)
    for t, (q, s) in zip(ts, bucket):
        q1, s1 = Q.fp8_block_quant(t, scale=scale)
        assert torch.equal(q.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s, s1)


@given(n=st.integers(1, 24), groups=st.integers(1, 4), group=st.sampled_from([32, 64, 128]),
       divisor=st.sampled_from([7, 7.5]), ex=spread, seed=st.integers(0, 2**16), eps=st.sampled_from([1e-5, 1e-9]))
def test_int4_scale_bound_round_trip_and_served_weight(n, groups, group, divisor, ex, seed, eps):
    w = _weights(n, groups * group, seed, *ex)
    fq = Q.int4_fake_quant(w, group=group, divisor=divisor, eps=eps)
    packed = Q.int4_pack(w, group=group, divisor=divisor, eps=eps)
    served, q = Q.int4_unpack(packed, return_q=True)
    assert torch.equal(fq.view(torch.int16), served.view(torch.int16))  # QAT forward == served weight
    lo = -7 if divisor == 7 else -8
    assert int(q.min()) >= lo and int(q.max()) <= 7
    s = packed["weight_scale"].double()
    amax = w.double().abs().reshape(n, groups, group).amax(-1)
    want = torch.clamp(amax / divisor, min=float(np.float32(eps)))
    assert ((s - want).abs() <= want * 2.0**-8 * 1.001).all()  # one bf16 rounding (plus fp32 ones)
    s_full = s.repeat_interleave(group, 1)
    err = (fq.double() - w.double()).abs()
    # half a step, plus what the bf16-rounded scale costs at the clamp (|q| <= 8) and the bf16 output rounding
    assert (err <= 0.5 * s_full + 8 * 2.0**-8 * s_full + 2.0**-8 * w.double().abs()).all()


@given(arg=st.sampled_from(["block", "group", "int4_group", "eps", "scale", "divisor", "layout"]),
       value=st.one_of(st.floats(allow_nan=True), st.text(max_size=4), st.booleans(), st.none(),
                       st.integers(-300, 300), st.just(128.0), st.just([128])))
def test_bad_arguments_are_typed_errors_and_change_nothing(arg, value):
    w = _weights(4, 128, 1, -4, 4)
    before = w.clone()
    calls = {
        "block": (lambda: Q.fp8_block_quant(w, block=value), lambda v: type(v) is int and v == 128),
        "group": (lambda: Q.fp8_group_quant(w, group=value), lambda v: type(v) is int and v == 128),
        "int4_group": (lambda: Q.int4_fake_quant(w, group=value), lambda v: type(v) is int and v in (32, 64, 128)),
        "eps": (lambda: Q.fp8_block_quant(w, eps=value),
                lambda v: type(v) in (int, float) and math.isfinite(v) and 1e-30 <= v <= 1e30),
        "scale": (lambda: Q.fp8_block_quant(w, scale=value), lambda v: v in ("fp32", "ue8m0", "ue8m0_packed")),
        "divisor": (lambda: Q.int4_pack(w, divisor=value), lambda v: type(v) in (int, float) and v in (7, 7.5)),
        "layout": (lambda: Q.fp8_group_quant(w, scale_layout=value), lambda v: v in ("row", "mn_major")),
    }
    call, valid = calls[arg]
    try:
        is_valid = valid(value)
    except TypeError:
        is_valid = False
    if is_valid:
        call()
    else:
        with pytest.raises(InvalidArgumentError, match=arg.replace("int4_", "").replace("layout", "scale_layout")):
            call()
    assert torch.equal(w.view(torch.int16), before.view(torch.int16))


@given(shape=st.one_of(st.none(), st.text(max_size=3), st.lists(st.one_of(st.integers(-2, 300), st.floats(0, 9)),
       max_size=3)), drop=st.sets(st.sampled_from(["weight_packed", "weight_scale", "weight_shape"]), max_size=3))
def test_int4_unpack_refuses_malformed_input_with_a_typed_error(shape, drop):
    good = Q.int4_pack(_weights(3, 64, 2, -3, 3), group=32)
    d = {k: v for k, v in good.items() if k not in drop}
    if shape is not None and "weight_shape" not in drop:
        d["weight_shape"] = shape
    ok = not drop and shape is not None and list(shape) == [3, 64] and all(type(v) is int for v in shape)
    if ok or (not drop and shape is None):
        Q.int4_unpack(d if shape is not None else good)
    else:
        with pytest.raises(InvalidArgumentError):
            Q.int4_unpack(d)
