"""The portable kernels' software e4m3 conversion (quant/fp8_convert.h), as the host build compiles it: every fp32
with |v| <= 448 (all that reach it from the kernels, which clamp first) against torch's CPU cast, every rounding
class of every bf16 pattern against the reference and the table-search oracle, the saturation and NaN rules of
cvt.rn.satfinite, and every e4m3 code's decode. The GPU side (the software against the instruction on every fp32
pattern, on the GPU) is tests/quant/test_portable_gpu.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ebbtide.quant import reference as R
from quant_oracle import e4m3_nearest

E4M3_MAX_BITS = 0x43E00000  # 448.0f
CHUNK = 1 << 24


@pytest.fixture(scope="module")
def Q(native):
    return native.quant


def encode(Q, u: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(u, dtype=np.uint32)
    out = np.empty(u.size, dtype=np.uint8)
    Q.e4m3_encode_host(src=u.ctypes.data, n=u.size, dst=out.ctypes.data)
    return out


def torch_cast(u: np.ndarray) -> np.ndarray:
    return torch.from_numpy(u.view(np.float32)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def first_mismatches(u, got, want, k=5) -> str:
    idx = np.flatnonzero(got != want)[:k]
    return ", ".join(f"{int(u[i]):#010x}: {int(got[i]):#04x} != {int(want[i]):#04x}" for i in idx)


def test_encode_every_fp32_up_to_448_equals_torch_cast(Q):
    """2^31.1 patterns (both signs, zero to 448 inclusive): the same byte as torch's cast (c10's encoder, written
    independently), which rounds to nearest even in this range in every torch version."""
    checked = 0
    for sign in (0, 0x80000000):
        for lo in range(0, E4M3_MAX_BITS + 1, CHUNK):
            u = np.arange(lo, min(lo + CHUNK, E4M3_MAX_BITS + 1), dtype=np.uint32) | np.uint32(sign)
            got, want = encode(Q, u), torch_cast(u)
            assert np.array_equal(got, want), first_mismatches(u, got, want)
            checked += u.size
    assert checked == 2 * (E4M3_MAX_BITS + 1)


def rounding_classes() -> np.ndarray:
    """Every bf16 pattern (the high half) with every low half the rounding can tell apart: exact (0), just above
    (1), below / at / above the half of the next bf16 step (0x7FFF, 0x8000, 0x8001), and just below it (0xFFFF).
    Every e4m3 rounding boundary sits at or above bit 19, inside the high half, so these classes cover each side of
    every boundary and every tie."""
    hi = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    lows = np.array([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32)
    u = (hi[:, None] | lows[None, :]).reshape(-1)
    return u[(u & 0x7FFFFFFF) <= E4M3_MAX_BITS]


def test_encode_equals_reference_and_table_search_on_every_rounding_class(Q):
    u = rounding_classes()
    f = u.view(np.float32)
    got = encode(Q, u)
    ref = R.e4m3_encode(f)
    assert np.array_equal(got, ref), first_mismatches(u, got, ref)
    oracle = e4m3_nearest(f)
    assert np.array_equal(got, oracle), first_mismatches(u, got, oracle)


def test_encode_every_bf16_value_equals_the_reference(Q):
    u = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    u = u[(u & 0x7FFFFFFF) <= E4M3_MAX_BITS]
    got = encode(Q, u)
    ref = R.e4m3_encode(u.view(np.float32))
    assert np.array_equal(got, ref), first_mismatches(u, got, ref)


@pytest.mark.parametrize("value,code", [
    (0.0, 0x00), (-0.0, 0x80), (2.0 ** -10, 0x00), (-(2.0 ** -10), 0x80),       # the tie at 2^-10 goes to 0
    (np.nextafter(np.float32(2.0 ** -10), np.float32(1)), 0x01), (1.5 * 2.0 ** -9, 0x02),  # tie: even code 2
    (2.5 * 2.0 ** -9, 0x02), (2.0 ** -6, 0x08), (np.nextafter(np.float32(2.0 ** -6), np.float32(0)), 0x08),
    (1.0625, 0x38), (1.1875, 0x3A), (448.0, 0x7E), (-448.0, 0xFE),               # ties at 1 + 1/16, 1 + 3/16
    (464.0, 0x7E), (480.0, 0x7E), (1e30, 0x7E), (-3.0e38, 0xFE),                 # satfinite: +-448
    (float("inf"), 0x7E), (float("-inf"), 0xFE), (2.0 ** -149, 0x00), (-(2.0 ** -149), 0x80),
])
def test_encode_edges(Q, value, code):
    u = np.array([value], dtype=np.float32).view(np.uint32)
    assert int(encode(Q, u)[0]) == code


def test_encode_saturates_beyond_448_and_maps_every_nan_to_0x7f(Q):
    """Above 448 (Inf included) the byte is +-448 and every NaN, whatever its sign and payload, is 0x7F (what
    cvt.rn.satfinite.e4m3x2.f32 and CUDA's own software conversion give): checked on a sample of each range with
    both ends included; the GPU test compares every pattern with the instruction."""
    rng = np.random.default_rng(0)
    above = np.concatenate([np.arange(E4M3_MAX_BITS, E4M3_MAX_BITS + 4096, dtype=np.uint32),
                            rng.integers(E4M3_MAX_BITS, 0x7F800001, size=1 << 20, dtype=np.uint32),
                            np.array([0x7F800000], dtype=np.uint32)])
    for sign, code in ((0, 0x7E), (0x80000000, 0xFE)):
        got = encode(Q, above | np.uint32(sign))
        assert (got == code).all(), first_mismatches(above, got, np.full_like(got, code))
    nans = np.concatenate([np.arange(0x7F800001, 0x7F801001, dtype=np.uint32),
                           rng.integers(0x7F800001, 0x80000000, size=1 << 20, dtype=np.uint32),
                           np.array([0x7FC00000, 0x7FFFFFFF], dtype=np.uint32)])
    for sign in (0, 0x80000000):
        assert (encode(Q, nans | np.uint32(sign)) == 0x7F).all()


def test_decode_every_code_is_exact(Q):
    codes = np.arange(256, dtype=np.uint8)
    out = np.empty(256, dtype=np.uint32)
    Q.e4m3_decode_host(src=codes.ctypes.data, n=256, dst=out.ctypes.data)
    got = out.view(np.float32)
    want = R.e4m3_decode(codes)
    nan = (codes & 0x7F) == 0x7F
    assert np.isnan(got[nan]).all()
    assert np.array_equal(out[~nan], want[~nan].view(np.uint32))  # bits: -0 stays -0
    assert np.array_equal(encode(Q, out[~nan]), codes[~nan])  # and every value encodes back to its code


def test_host_conversions_refuse_a_negative_count(Q):
    from ebbtide.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="negative count"):
        Q.e4m3_encode_host(src=0, n=-1, dst=0)
    with pytest.raises(InvalidArgumentError, match="negative count"):
        Q.e4m3_decode_host(src=0, n=-1, dst=0)
