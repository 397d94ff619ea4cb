"""Golden tests of the INT4 (W4A16 symmetric group, compressed-tensors pack-quantized) CPU reference."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from ebbtide.quant import reference as R
from quant_oracle import all_finite_bf16_f32, heavy_tailed, positive_finite_bf16_bits, rn32_fraction


def f32bits(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def weights(N=64, K=256, seed=0, std=0.02):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * std
    w[0, :32] = 0  # an all-zero group
    w[1, 40] = 0.5  # an outlier
    return w.to(torch.bfloat16)


@pytest.mark.parametrize("divisor", [7, 7.5])
def test_every_positive_bf16_amax_int4_scale(divisor):
    amax_bits = positive_finite_bf16_bits()
    s_bits = R.int4_scale(amax_bits, divisor, 1e-5)
    a = R.bf16_to_f32(amax_bits).astype(np.float64)
    inv = float(R.f32_const(R.divisor_inverse_bits(divisor)))
    s32 = np.maximum((a * inv).astype(np.float32), np.float32(1e-5))  # exact product, one rounding
    oracle = torch.from_numpy(s32).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)  # torch RNE cast
    assert np.array_equal(s_bits, oracle)


def test_q_is_rne_of_ieee_quotient_exhaustive_over_inputs():
    """Every finite bf16 x against a set of bf16 scales; quotient oracle: exact rationals on a subsample, and the
    float64 quotient (correct unless the double lands exactly on an fp32 midpoint) on all."""
    x = all_finite_bf16_f32()
    for s_bits in (0x3C00, 0x3A83, 0x3F80, 0x3FE0, 0x0400, 0x4B12):
        s = R.bf16_to_f32(np.array([s_bits], np.uint16))[0]
        got = np.rint((x / s).astype(np.float32))
        ref64 = (x.astype(np.float64) / float(s)).astype(np.float32)
        assert np.array_equal(got, np.rint(ref64))
        for xi in x[::997]:
            assert np.float32(xi) / s == rn32_fraction(Fraction(float(xi)) / Fraction(float(s)))


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("divisor", [7, 7.5])
def test_fake_quant_matches_literal_contract(group, divisor):
    w = weights(seed=group)
    qmin, qmax = R.int4_qrange(divisor)
    out = R.int4_fake_quant(w, group=group, divisor=divisor)
    x = w.float().numpy().astype(np.float64).reshape(64, -1, group)
    a = np.abs(x).max(axis=2)
    inv = float(R.f32_const(R.divisor_inverse_bits(divisor)))
    s32 = np.maximum((a * inv).astype(np.float32), np.float32(1e-5))
    s = torch.from_numpy(s32).to(torch.bfloat16).float().numpy().astype(np.float64)
    q = np.clip(np.rint((x / s[:, :, None]).astype(np.float32)), qmin, qmax).astype(np.int64)  # int: no -0
    want = torch.from_numpy((q * s[:, :, None]).reshape(64, -1)).to(torch.bfloat16)  # q*s exact in float64
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    assert q.min() >= qmin and q.max() <= qmax


def test_qrange_reaches_minus_8_only_with_divisor_7_5():
    # 0.9375 * RN32(2/15) rounds down to bf16, so -0.9375 / s <= -7.5 -> -8 (for amax 1.0 it rounds up: -7)
    w = torch.tensor([[-0.9375] + [0.25] * 31], dtype=torch.bfloat16)
    q7, _ = R.int4_quant(w, group=32, divisor=7)
    q75, _ = R.int4_quant(w, group=32, divisor=7.5)
    assert q7[0, 0] == -7 and q75[0, 0] == -8


def test_zero_group_uses_eps_scale_and_gives_zeros():
    w = torch.zeros(2, 128, dtype=torch.bfloat16)
    w[1, 5] = -0.0
    q, s_bits = R.int4_quant(w)
    assert (q == 0).all()
    assert s_bits[0, 0] == torch.tensor(1e-5, dtype=torch.float32).to(torch.bfloat16).view(torch.int16).item()
    out = R.int4_fake_quant(w)
    assert (out.view(torch.int16) == 0).all()  # 0 * s = +0 (q is an integer, its zero has no sign)


def test_pack_layout_is_compressed_tensors_pack_quantized():
    q = np.array([[-8, -7, -1, 0, 1, 2, 6, 7, 3, 3, 3, 3, 3, 3, 3, -3]], dtype=np.int8)
    p = R.int4_pack(q).numpy().view(np.uint32)
    assert p.shape == (1, 2)
    assert p[0, 0] == sum(((int(v) + 8) & 0xF) << (4 * i) for i, v in enumerate(q[0, :8]))
    assert p[0, 0] == 0xFEA9_8710 and p[0, 1] == 0x5BBB_BBBB
    assert np.array_equal(R.int4_unpack_q(R.int4_pack(q), 16), q)


def test_pack_unpack_roundtrip_all_codes():
    q = np.tile(np.arange(-8, 8, dtype=np.int8), (3, 4))
    np.random.default_rng(1).shuffle(q, axis=1)
    assert np.array_equal(R.int4_unpack_q(R.int4_pack(q), q.shape[1]), q)


@pytest.mark.parametrize("group", [32, 128])
def test_qat_contract_on_cpu_reference(group):
    """fake_quant(W) == RNbf16(float(unpack(pack(W))) * float(weight_scale)), bit for bit."""
    for w in (weights(seed=3), heavy_tailed((64, 256), seed=4, spread=(-20, 10), block=group),
              torch.zeros(8, 256, dtype=torch.bfloat16)):
        q, s_bits = R.int4_quant(w, group=group)
        packed = R.int4_pack(q)
        served = (torch.from_numpy(R.int4_unpack_q(packed, w.shape[1]).astype(np.float32))
                  * R.bf16_from_bits(s_bits).float().repeat_interleave(group, 1)).to(torch.bfloat16)
        assert torch.equal(R.int4_fake_quant(w, group=group).view(torch.int16), served.view(torch.int16))


def test_scale_rounded_to_bf16_first_differs_from_fp32_scale_forward():
    """The bug the contract removes: bf16(q * s_fp32) differs from the served weight in ~6% of elements."""
    w = (torch.randn(256, 1024, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    x = w.float().reshape(256, -1, 128)
    s32 = torch.clamp(x.abs().amax(dim=2, keepdim=True) * float(R.f32_const(R.INV7_BITS)), min=1e-5)
    q = torch.clamp(torch.round(x / s32), -7, 7)
    slime = (q * s32).reshape(256, 1024).to(torch.bfloat16)
    ours = R.int4_fake_quant(w)
    frac = (slime.view(torch.int16) != ours.view(torch.int16)).float().mean().item()
    assert 0.01 < frac < 0.15


def test_non_finite_group_policy():
    w = weights(seed=5)
    w[2, 3] = float("nan")
    w[3, 200] = float("inf")
    q, s_bits = R.int4_quant(w)
    assert s_bits[2, 0] == R.BF16_NAN_BITS and s_bits[3, 1] == R.BF16_NAN_BITS
    assert (q[2, :128] == 0).all() and (q[3, 128:] == 0).all()
    out = R.int4_fake_quant(w).view(torch.int16)
    assert (out[2, :128] == R.BF16_NAN_BITS).all() and (out[3, 128:] == R.BF16_NAN_BITS).all()
    assert (s_bits[2, 1] != R.BF16_NAN_BITS) and torch.isfinite(R.int4_fake_quant(w)[2, 128:]).all()


def test_bad_arguments():
    w = weights()
    with pytest.raises(ValueError, match="group"):
        R.int4_quant(w, group=16)
    with pytest.raises(ValueError, match="divisor"):
        R.int4_quant(w, divisor=8)
    with pytest.raises(ValueError, match="multiple"):
        R.int4_quant(w[:, :100], group=32)


@pytest.mark.parametrize("qmin", [-7.0, -8.0])
def test_division_free_rounding_rule_equals_ieee_division(qmin):
    """The CUDA kernel's int4_round (sm90_bf16_int4_quant.cu) emulated exactly: q0 = RNE(x * RN32(1/s)) (one fma
    with 1.5 * 2^23), e = x - q0 * s (exact), an odd q0 with |e| == s/2 moves one step toward x; then the clamp.
    It must equal clamp(RNE(RN32(x / s))) for every finite bf16 x, over every bf16 scale mantissa at the
    exponents of tiny, unit and huge scales."""
    x = all_finite_bf16_f32()
    x64 = x.astype(np.float64)
    mism = 0
    for e in (-99, 0, 125):
        for m in range(128):
            s = np.array([((127 + e) << 23) | (m << 16)], np.uint32).view(np.float32)[0]
            r = np.float32(1) / s                      # __frcp_rn
            with np.errstate(over="ignore"):
                want = np.clip(np.rint(x / s), qmin, 7.0)
            q0 = np.rint(x64 * np.float64(r))          # the fma's exact product, rounded once to an integer
            res = x64 - q0 * np.float64(s)             # exact in float64 ...
            in_range = np.abs(x64 * np.float64(r)) < 16
            assert np.array_equal(res[in_range].astype(np.float32).astype(np.float64), res[in_range])  # ... and fp32
            tie = (np.abs(res) == 0.5 * np.float64(s)) & (np.mod(q0, 2) != 0)
            got = np.clip(q0 + np.where(tie, np.sign(res), 0.0), qmin, 7.0)
            mism += int(np.count_nonzero(got != want))
    assert mism == 0
