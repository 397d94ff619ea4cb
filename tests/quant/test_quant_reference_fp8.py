"""Golden tests of the FP8 CPU reference against independent oracles (exact rationals, float64 products, table
search) — exhaustive where the input space allows it. Tolerances: none; every comparison is bitwise unless a
bound is named."""
from __future__ import annotations

import hashlib
from fractions import Fraction

import numpy as np
import pytest
import torch

from ebbtide.quant import reference as R
from quant_oracle import (E4M3_POS, all_finite_bf16_f32, e4m3_nearest, heavy_tailed,
                          positive_finite_bf16_bits, rn32_fraction)


def f32bits(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


# ---- constants -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,value", [(R.C448_BITS, Fraction(1, 448)), (R.INV7_BITS, Fraction(1, 7)),
                                        (R.INV7_5_BITS, Fraction(2, 15))])
def test_constants_are_rn32_of_exact_rationals(bits, value):
    assert int(f32bits([rn32_fraction(value)])[0]) == bits


# ---- e4m3 codes ----------------------------------------------------------------------------------------------
def test_all_256_codes_decode():
    codes = np.arange(256, dtype=np.uint8)
    d = R.e4m3_decode(codes).astype(np.float64)
    nan = (codes & 0x7F) == 0x7F
    assert nan.sum() == 2 and np.isnan(d[nan]).all()
    assert np.array_equal(d[:127], E4M3_POS)
    assert np.array_equal(d[128:255], -E4M3_POS)
    assert np.signbit(d[0x80]) and d[0x80] == 0
    assert d[0x7E] == 448 and d[0x01] == 2.0 ** -9 and d[0x08] == 2.0 ** -6
    # the decode table agrees with torch's (decode of every code is exact in every torch version)
    t = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(d, t.astype(np.float64), equal_nan=True)


def test_every_code_round_trips_through_the_encoder():
    codes = np.array([c for c in range(256) if (c & 0x7F) != 0x7F], dtype=np.uint8)
    assert np.array_equal(R.e4m3_encode(R.e4m3_decode(codes)), codes)


def test_encoder_ties_and_edges():
    enc = lambda v: int(R.e4m3_encode(np.array([v], dtype=np.float32))[0])  # noqa: E731
    assert enc(432.0) == 0x7E and enc(-432.0) == 0xFE  # tie 416|448 -> even mantissa (448)
    assert enc(448.0) == 0x7E and enc(0.0) == 0x00 and enc(-0.0) == 0x80
    assert enc(2.0 ** -10) == 0x00 and enc(-(2.0 ** -10)) == 0x80  # tie 0|2^-9 -> 0, sign kept
    assert enc(3 * 2.0 ** -10) == 0x02  # tie 1|2 (x 2^-9) -> even
    assert enc(2.0 ** -10 * 1.0000001) == 0x01
    assert enc(15 * 2.0 ** -10) == 0x08  # tie 7|8 (x 2^-9) -> 8 = smallest normal 2^-6
    assert enc(float("nan")) == 0x7F
    assert enc(1e-45) == 0x00  # fp32 subnormal


def test_encoder_matches_table_search_on_all_bf16_and_random_fp32():
    x = np.clip(all_finite_bf16_f32(), -448, 448)
    assert np.array_equal(R.e4m3_encode(x), e4m3_nearest(x))
    g = np.random.default_rng(0)
    y = (g.standard_normal(1 << 20) * np.exp2(g.uniform(-16, 9, 1 << 20))).astype(np.float32)
    y = np.clip(y, -448, 448)
    assert np.array_equal(R.e4m3_encode(y), e4m3_nearest(y))


# ---- scales --------------------------------------------------------------------------------------------------
def _all_amax() -> np.ndarray:
    return R.bf16_to_f32(positive_finite_bf16_bits())


@pytest.mark.parametrize("eps", [1e-4, 1e-10])
def test_every_positive_bf16_amax_scale_bits(eps):
    a = _all_amax()
    assert a.size == 32639
    s = R.fp8_scale_fp32(a, eps)
    # oracle: the float64 product of two fp32 values is exact (24 + 24 bits), so one cast is one rounding
    a_eps = np.maximum(a.astype(np.float64), float(np.float32(eps)))
    oracle = (a_eps * float(R.f32_const(R.C448_BITS))).astype(np.float32)
    assert np.array_equal(f32bits(s), f32bits(oracle))
    # and it differs from IEEE a/448 where it should (the reason the contract pins the formula)
    ieee = (a_eps / 448.0).astype(np.float32)  # float64 a/448 then one rounding: exact-enough for a count
    assert (f32bits(s) != f32bits(ieee)).sum() > 10000


def test_every_positive_bf16_amax_multiplier_is_ieee_reciprocal():
    s = R.fp8_scale_fp32(_all_amax(), 1e-4)
    _, m, _ = R._scales_and_multipliers(positive_finite_bf16_bits(), 1e-4, ue8m0=False)
    uniq = np.unique(s)
    oracle = {float(v): rn32_fraction(1 / Fraction(float(v))) for v in uniq}
    want = np.array([oracle[float(v)] for v in s], dtype=np.float32)
    assert np.array_equal(f32bits(m), f32bits(want))


def test_scale_table_golden_hash():
    """Pins the whole amax -> (scale, ue8m0 exponent) table (eps 1e-4); any change to the arithmetic shows."""
    s = R.fp8_scale_fp32(_all_amax(), 1e-4)
    e = R.ue8m0_exponent(s).astype(np.uint8)
    h = hashlib.sha256(f32bits(s).tobytes() + e.tobytes()).hexdigest()
    assert h == GOLDEN_SCALE_SHA256


GOLDEN_SCALE_SHA256 = "739d0f90788b60864dad6d0df65f425f27015d3b0d7abed7821fa18d628cae72"


def test_every_positive_bf16_amax_ue8m0_is_bit_ceil():
    s = R.fp8_scale_fp32(_all_amax(), 1e-4)
    e = R.ue8m0_exponent(s)
    for v, ev in zip(s[::7], e[::7]):
        mant, exp = np.frexp(np.float64(v))  # v = mant * 2^exp, mant in [0.5, 1)
        ceil_exp = exp - 1 if mant == 0.5 else exp  # smallest k with 2^k >= v
        assert ev == min(max(ceil_exp + 127, 1), 254)
    m = R.ue8m0_multiplier(e)
    assert np.array_equal(m.astype(np.float64), np.exp2(127.0 - e))
    assert R.ue8m0_multiplier(np.array([254])).view(np.uint32)[0] == 0x00400000


# ---- element bytes across scales -----------------------------------------------------------------------------
def _scale_set() -> np.ndarray:
    a = _all_amax()
    pick = np.concatenate([a[::331], R.bf16_to_f32(np.array([0x3F80, 0x43E0, 0x0001, 0x7F7F, 0x3C00],
                                                            dtype=np.uint16))])
    return np.unique(R.fp8_scale_fp32(pick, 1e-4))


def test_all_bf16_inputs_across_scales_to_e4m3_bytes():
    x = all_finite_bf16_f32()
    scales = _scale_set()
    assert scales.size >= 30
    with np.errstate(divide="ignore"):
        ms = (np.float32(1) / scales).astype(np.float32)
    for m in ms:
        got = R.fp8_quantize_values(x, m)
        y = np.clip((x.astype(np.float64) * float(m)).astype(np.float32), -448, 448)  # exact product, 1 rounding
        assert np.array_equal(got, e4m3_nearest(y)), f"m={m!r}"


# ---- block quant ---------------------------------------------------------------------------------------------
def naive_block_quant(w: torch.Tensor, block=128, eps=1e-4, ue8m0=False):
    """Per-block loop in float64/Fraction: the contract written out literally."""
    x = w.float().numpy()
    N, K = x.shape
    nb, kb = -(-N // block), -(-K // block)
    q = np.zeros((N, K), np.uint8)
    s_out = np.zeros((nb, kb), np.float32)
    for i in range(nb):
        for j in range(kb):
            blk = x[i * block:(i + 1) * block, j * block:(j + 1) * block]
            a = max(float(np.abs(blk).max()), float(np.float32(eps)))
            s = np.float32(a * float(R.f32_const(R.C448_BITS)))
            if ue8m0:
                mant, exp = np.frexp(np.float64(s))
                e = min(max((exp - 1 if mant == 0.5 else exp) + 127, 1), 254)
                s, m = np.float32(2.0 ** (e - 127)), np.float32(2.0 ** (127 - e))
            else:
                m = rn32_fraction(1 / Fraction(float(s)))
            y = np.clip((blk.astype(np.float64) * float(m)).astype(np.float32), -448, 448)
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = e4m3_nearest(y)
            s_out[i, j] = s
    return q, s_out


@pytest.mark.parametrize("N", [1, 127, 128, 129, 303])
@pytest.mark.parametrize("K", [1, 127, 129, 303])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_block_quant_ragged_matches_literal_contract(N, K, ue8m0):
    w = heavy_tailed((N, K), seed=N * 1000 + K)
    q, s = R.fp8_block_quant(w, scale="ue8m0" if ue8m0 else "fp32")
    qo, so = naive_block_quant(w, ue8m0=ue8m0)
    assert q.shape == (N, K) and q.dtype == torch.float8_e4m3fn
    assert s.shape == (-(-N // 128), -(-K // 128)) and s.dtype == torch.float32
    assert np.array_equal(q.view(torch.uint8).numpy(), qo)
    assert np.array_equal(f32bits(s.numpy()), f32bits(so))


def test_block_quant_error_bounds_and_max_maps_to_448():
    w = heavy_tailed((512, 384), seed=7)
    for kind in ("fp32", "ue8m0"):
        q, s = R.fp8_block_quant(w, scale=kind)
        x = w.float().numpy().astype(np.float64)
        deq = R.e4m3_decode(q.view(torch.uint8).numpy()).astype(np.float64)
        s_full = np.repeat(np.repeat(s.numpy().astype(np.float64), 128, 0), 128, 1)[:512, :384]
        xr = deq * s_full
        normal = np.abs(x) / s_full >= 2.0 ** -6
        assert np.all(np.abs(xr - x)[normal] <= 2.0 ** -4 * np.abs(x)[normal])  # bound: 2^-4 relative
        # bound: 2^-10 * s, widened by 2^-20 relative because m = RN32(1/s) is not exactly 1/s (ties at 3.5*2^-9)
        assert np.all(np.abs(xr - x)[~normal] <= 2.0 ** -10 * s_full[~normal] * (1 + 2.0 ** -20))
        qa = np.abs(deq)
        blkmax = qa.reshape(4, 128, 3, 128).max(axis=(1, 3))
        if kind == "fp32":
            assert np.all(blkmax == 448)
        else:
            # the pre-rounding max a * 2^(127-e) lies in (224, 448]; E4M3 may round (224, 232) down to 224
            amax = np.abs(x).reshape(4, 128, 3, 128).max(axis=(1, 3))
            pre = amax / s.numpy().astype(np.float64)
            assert np.all((pre > 224) & (pre <= 448)) and np.all((blkmax >= 224) & (blkmax <= 448))
            assert np.all((f32bits(s.numpy()) & 0x807FFFFF) == 0)  # powers of two


def test_block_quant_zero_block_signed_zero_subnormal_and_448_ties():
    w = torch.zeros(256, 256, dtype=torch.bfloat16)
    w[0, 0] = -0.0
    w[128:, :128] = 1.0
    w[128, 1] = -1.0
    w[129, 0] = torch.tensor(2.0 ** -130, dtype=torch.bfloat16)  # bf16 subnormal
    w[129, 1] = -torch.tensor(2.0 ** -130, dtype=torch.bfloat16)
    w[:128, 128:] = 3.0
    w[5, 200] = -3.0
    q, s = R.fp8_block_quant(w)
    qb = q.view(torch.uint8).numpy()
    sb = s.numpy()
    # zero block: scale = RN32(eps * C), every byte 0x00 (and -0 -> 0x80)
    assert sb[0, 0] == np.float32(np.float32(1e-4) * R.f32_const(R.C448_BITS))
    assert qb[0, 0] == 0x80 and (qb[:128, :128].reshape(-1)[1:] == 0).all()
    assert qb[128, 0] == 0x7E and qb[128, 1] == 0xFE and qb[129, 0] == 0x00 and qb[129, 1] == 0x80
    assert qb[5, 200] == 0xFE and (qb[:128, 128:][qb[:128, 128:] != 0xFE] == 0x7E).all()
    assert (qb[128:, 128:] == 0).all()


def test_block_quant_nan_inf_poison_their_block_only():
    w = heavy_tailed((256, 256), seed=3)
    w[3, 4] = float("nan")
    w[200, 250] = float("-inf")
    q, s = R.fp8_block_quant(w)
    qb = q.view(torch.uint8).numpy()
    sb = f32bits(s.numpy())
    assert sb[0, 0] == R.F32_NAN_BITS and sb[1, 1] == R.F32_NAN_BITS
    assert (qb[:128, :128] == 0x7F).all() and (qb[128:, 128:] == 0x7F).all()
    assert np.isfinite(s.numpy()[0, 1]) and (qb[:128, 128:] != 0x7F).all()
    qp, sp = R.fp8_block_quant(w, scale="ue8m0_packed")
    words = sp.contiguous().numpy().view(np.uint32)
    assert (words[:128, 0] & 0xFF == 0xFF).all() and (words[128:, 0] & 0xFF00 == 0xFF00).all()


def test_block_quant_moe_batch_equals_per_expert():
    w = heavy_tailed((3, 200, 300), seed=11)
    q, s = R.fp8_block_quant(w)
    assert q.shape == (3, 200, 300) and s.shape == (3, 2, 3)
    for e in range(3):
        qe, se = R.fp8_block_quant(w[e])
        assert torch.equal(q[e].view(torch.uint8), qe.view(torch.uint8)) and torch.equal(s[e], se)


def test_block_dequant_is_rnbf16_of_fp32_product():
    w = heavy_tailed((130, 260), seed=5)
    q, s = R.fp8_block_quant(w)
    d = R.fp8_block_dequant(q, s)
    prod = (q.float() * s.repeat_interleave(128, 0)[:130].repeat_interleave(128, 1)[:, :260])
    assert torch.equal(d.view(torch.int16), prod.to(torch.bfloat16).view(torch.int16))
    # UE8M0 requant of its own dequant: same bytes wherever the block max did not round down to 224; where it
    # did, the scale halves exactly (the Blackwell dequant -> requant chain is not an identity)
    w = heavy_tailed((512, 512), seed=6)
    q2, s2 = R.fp8_block_quant(w, scale="ue8m0")
    q3, s3 = R.fp8_block_quant(R.fp8_block_dequant(q2, s2), scale="ue8m0")
    qmax = q2.float().abs().reshape(4, 128, 4, 128).amax(dim=(1, 3))
    same = s3 == s2
    assert torch.equal(same, qmax != 224) and torch.equal(s3[~same], s2[~same] / 2)
    keep = same.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert torch.equal(q2.view(torch.uint8)[keep], q3.view(torch.uint8)[keep])


# ---- group quant and layouts ---------------------------------------------------------------------------------
def test_group_quant_matches_block_rule_per_group():
    x = heavy_tailed((37, 512), seed=9, block=128)
    q, s = R.fp8_group_quant(x)
    assert s.shape == (37, 4) and s.is_contiguous()
    for r in (0, 17, 36):
        qr, sr = naive_block_quant(x[r:r + 1], block=128, eps=1e-10)
        assert np.array_equal(q[r:r + 1].view(torch.uint8).numpy(), qr)
        assert np.array_equal(f32bits(s[r:r + 1].numpy()), f32bits(sr))


def test_group_quant_k_not_multiple_raises_value_error():
    with pytest.raises(ValueError, match="multiple"):
        R.fp8_group_quant(torch.zeros(4, 200, dtype=torch.bfloat16))


@pytest.mark.parametrize("M", [1, 5, 8, 130])
def test_group_scale_mn_major_layout(M):
    x = heavy_tailed((M, 128 * 6), seed=M)
    q, s_row = R.fp8_group_quant(x)
    q2, s_mn = R.fp8_group_quant(x, scale_layout="mn_major")
    A = (M + 3) // 4 * 4
    assert s_mn.shape == (M, 6) and s_mn.stride() == (1, A)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s_row, s_mn)
    buf = torch.as_strided(s_mn, (6, A), (A, 1))
    assert (buf[:, M:] == 0).all()


@pytest.mark.parametrize("M,G", [(1, 1), (5, 6), (8, 8), (130, 9)])
def test_ue8m0_pack_layout(M, G):
    x = heavy_tailed((M, 128 * G), seed=G)
    _, s = R.fp8_group_quant(x, scale="ue8m0")
    _, p = R.fp8_group_quant(x, scale="ue8m0_packed", scale_layout="mn_major")
    W, A = -(-G // 4), (M + 3) // 4 * 4
    assert p.dtype == torch.int32 and p.shape == (M, W) and p.stride() == (1, A)
    words = p.numpy().view(np.uint32) if p.is_contiguous() else p.contiguous().numpy().view(np.uint32)
    sb = f32bits(s.numpy())
    for g in range(G):
        assert np.array_equal((words[:, g // 4] >> (8 * (g % 4))) & 0xFF, sb[:, g] >> 23)
    if G % 4:
        assert ((words[:, -1] >> (8 * (G % 4))) == 0).all()  # padding bytes are zero
    assert torch.equal(R.ue8m0_unpack(p, G), s)


def test_ue8m0_pack_refuses_non_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        R.ue8m0_pack(torch.tensor([[1.0, 3.0, 0.5, 2.0]]))


def test_block_packed_ue8m0_is_row_replicated_mn_major():
    w = heavy_tailed((300, 700), seed=2)
    _, s = R.fp8_block_quant(w, scale="ue8m0")
    _, p = R.fp8_block_quant(w, scale="ue8m0_packed")
    assert p.shape == (300, 2) and p.stride() == (1, 300)
    assert torch.equal(R.ue8m0_unpack(p, 6), s[torch.arange(300) // 128])
