"""CPU reference of the quant numerics contract (docs/quant.md) — the oracle every kernel must match bit
for bit.

Policies (the contract, restated where the code applies it):
- Every value is handled as its bit pattern (numpy uint16/uint32) or as one numpy float32 operation, which is a
  single IEEE-754 round-to-nearest-even operation on x86/ARM (numpy never flushes subnormals). Nothing here uses
  torch's division or float8 cast: torch's `/` is a reciprocal-multiply on CUDA and its e4m3 cast turned |v| >= 464
  into NaN before 2.12; both are exactly the platform semantics the contract refuses to depend on.
- Constants are pinned as fp32 bit patterns: C448 = RN32(1/448), INV7 = RN32(1/7), INV7_5 = RN32(1/7.5)
  (tests/quant/test_quant_reference_fp8.py re-derives each from exact rationals). A user eps is rounded once to fp32.
- FP8 e4m3 (fn): E4M3(v) is an integer round-to-nearest-even encoder (`e4m3_encode`); callers always clamp to
  [-448, 448] first, so the overflow branch is never taken.
- FP8 scale: s = RN32(max(amax, eps) * C448); multiplier m = RN32(1 / s); q = E4M3(clamp(RN32(x * m), +-448)).
  UE8M0: e = expbits(s) + (mantissa(s) != 0), clamped to [1, 254]; scale 2^(e-127); m = 2^(127-e) (exact, may be
  an fp32 subnormal for e = 254). Dequant: RNbf16(RN32(float(q) * s)).
- INT4: s = RNbf16(max(RN32(amax * RN32(1/D)), eps)); q = clamp(RNE(RN32(x / s)), qmin, qmax);
  fake-quant = RNbf16(q * s) (the product is exact in fp32, so one rounding).
- Non-finite input policy (Note [Non-finite inputs]): a NaN or +-Inf anywhere in a block/group poisons that whole
  block/group, loudly and deterministically: its fp32 scale is the canonical NaN 0x7FC00000 (packed UE8M0 byte
  0xFF, the E8M0 NaN code) and every e4m3 byte is 0x7F. INT4: scale bf16 0x7FC0, q = 0 (packed nibble 8), fake-quant
  output 0x7FC0. Every bf16 NaN this module produces is the canonical 0x7FC0. FP8 has no Inf, and a partially
  scaled block would silently hide the bad value; a NaN block cannot be missed downstream.
- Padding of the aligned scale layouts (MN-major rows beyond M, packed bytes beyond the last K-group) is zero.

Layouts:
- Block (weights): q [.., N, K] e4m3; scale [.., ceil(N/b), ceil(K/b)] fp32 (HF `weight_scale_inv`). Packed UE8M0
  (DeepGEMM SFB): scales replicated per row, [.., N, ceil(kb/4)] int32 with strides (.., 1, align(N, 4)).
- Group (activations): q [M, K] e4m3; scale "row" [M, K/g] fp32 contiguous, or "mn_major": logical [M, K/g] with
  strides (1, align(M, 4)); packed UE8M0 is always MN-major: [M, ceil(G/4)] int32, strides (1, align(M, 4)).
- INT4 pack-quantized (compressed-tensors): weight_packed int32 [N, K/8], element (n, 8j+i) in bits [4i, 4i+4) of
  word (n, j) as unsigned q + 8; weight_scale bf16 [N, K/g]; weight_shape int32 [N, K].
"""
from __future__ import annotations

import numpy as np
import torch

from ..errors import InvalidArgumentError

__all__ = [
    "C448_BITS", "INV7_BITS", "INV7_5_BITS", "E4M3_MAX", "F32_NAN_BITS", "BF16_NAN_BITS",
    "bf16_bits", "bf16_from_bits", "bf16_to_f32", "f32_to_bf16_bits", "f32_const", "eps_f32",
    "e4m3_encode", "e4m3_decode", "fp8_scale_fp32", "ue8m0_exponent", "ue8m0_multiplier",
    "fp8_quantize_values", "fp8_block_quant", "fp8_group_quant", "fp8_block_dequant", "fp8_group_dequant",
    "ue8m0_pack", "ue8m0_unpack", "mn_major_view",
    "int4_scale", "int4_quant", "int4_fake_quant", "int4_pack", "int4_unpack_q", "int4_dequant",
    "int4_qrange", "divisor_inverse_bits",
]

C448_BITS = 0x3B124925  # RN32(1/448)
INV7_BITS = 0x3E124925  # RN32(1/7)
INV7_5_BITS = 0x3E088889  # RN32(1/7.5) = RN32(2/15)
E4M3_MAX = 448.0
F32_NAN_BITS = 0x7FC00000
BF16_NAN_BITS = 0x7FC0
E4M3_NAN = 0x7F
_BF16_ABS_INF = 0x7F80  # |bits| >= this: Inf or NaN


# ---- bit helpers ---------------------------------------------------------------------------------------------
def f32_const(bits: int) -> np.float32:
    return np.array([bits], dtype=np.uint32).view(np.float32)[0]


def eps_f32(eps: float) -> np.float32:
    """The user's eps rounded once to fp32 (RNE, numpy's float64 -> float32 conversion)."""
    return np.float32(eps)


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    """uint16 bit patterns of a bf16 tensor (any strides; copied to C order)."""
    if t.dtype != torch.bfloat16:
        raise TypeError(f"expected a bfloat16 tensor, got {t.dtype}")
    return t.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16).copy()


def bf16_from_bits(u16: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(u16, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)


def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    return (u16.astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16_bits(f: np.ndarray) -> np.ndarray:
    """RNbf16: fp32 -> bf16 round-to-nearest-even on bits; NaN -> canonical 0x7FC0; overflow -> +-Inf."""
    u = np.ascontiguousarray(f, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(f), np.uint16(BF16_NAN_BITS), r)


# ---- e4m3 ----------------------------------------------------------------------------------------------------
def e4m3_encode(v: np.ndarray) -> np.ndarray:
    """E4M3(v): fp32 -> float8_e4m3fn byte, round-to-nearest-even, one rounding, integer arithmetic only.
    Precondition: |v| <= 448 or NaN (callers clamp). NaN -> 0x7F. -0 -> 0x80."""
    u = np.ascontiguousarray(v, dtype=np.float32).view(np.uint32).astype(np.int64)
    sign = (u >> 31) << 7
    a = u & 0x7FFFFFFF
    # normal e4m3 (|v| >= 2^-6, fp32 biased exponent >= 121): round the 23-bit mantissa to 3 bits, rebias 127 -> 7
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal e4m3: k = RNE(|v| * 2^9) in 0..8 (8 is the smallest normal's code, 0x08, as it should be)
    e32 = a >> 23
    mant = (a & 0x7FFFFF) | np.where(e32 > 0, 0x800000, 0)
    sh = np.clip(141 - np.maximum(e32, 1), 0, 40)
    q = mant >> sh
    rem = mant - (q << sh)
    half = np.where(sh > 0, np.int64(1) << np.maximum(sh - 1, 0), 0)
    up = (rem > half) | ((rem == half) & (sh > 0) & ((q & 1) == 1))
    sub = np.where(sh >= 26, 0, q + up)  # |v| < 2^-10: rounds to zero (the mantissa is < 2^24)
    mag = np.where(a >= (121 << 23), normal, sub)
    out = (sign | mag).astype(np.uint8)
    return np.where(a > 0x7F800000, np.uint8(E4M3_NAN), out)


def _e4m3_table() -> np.ndarray:
    codes = np.arange(256, dtype=np.int64)
    s = np.where(codes & 0x80, -1.0, 1.0)
    e = (codes >> 3) & 0xF
    m = codes & 7
    val = np.where(e == 0, m * 2.0 ** -9, (1 + m / 8.0) * 2.0 ** (e - 7.0))
    val = s * val
    val[(codes & 0x7F) == 0x7F] = np.nan
    return val.astype(np.float32)


_E4M3_DECODE = _e4m3_table()


def e4m3_decode(b: np.ndarray) -> np.ndarray:
    """float8_e4m3fn byte -> fp32 (exact); 0x7F/0xFF -> NaN."""
    return _E4M3_DECODE[np.asarray(b, dtype=np.uint8)]


# ---- FP8 scales ----------------------------------------------------------------------------------------------
def fp8_scale_fp32(amax: np.ndarray, eps: float) -> np.ndarray:
    """s = RN32(max(amax, eps) * C448) (amax fp32, finite, >= 0)."""
    a = np.maximum(np.asarray(amax, dtype=np.float32), eps_f32(eps))
    return (a * f32_const(C448_BITS)).astype(np.float32)


def ue8m0_exponent(s: np.ndarray) -> np.ndarray:
    """Biased exponent of the power of two >= s (bit-ceil), clamped to [1, 254]; int64."""
    u = np.ascontiguousarray(s, dtype=np.float32).view(np.uint32).astype(np.int64)
    e = ((u >> 23) & 0xFF) + ((u & 0x7FFFFF) != 0)
    return np.clip(e, 1, 254)


def ue8m0_multiplier(e: np.ndarray) -> np.ndarray:
    """2^(127-e) as fp32 (exact; 2^-127 for e = 254 is the subnormal 0x00400000)."""
    e = np.asarray(e, dtype=np.int64)
    bits = np.where(e <= 253, (254 - e) << 23, 0x00400000).astype(np.uint32)
    return bits.view(np.float32)


def _scales_and_multipliers(amax_bits: np.ndarray, eps: float, ue8m0: bool):
    """From per-block max |x| bit patterns (uint16): (scale fp32, multiplier fp32, bad mask)."""
    bad = amax_bits >= _BF16_ABS_INF
    amax = bf16_to_f32(np.where(bad, 0, amax_bits).astype(np.uint16))
    s = fp8_scale_fp32(amax, eps)
    if ue8m0:
        e = ue8m0_exponent(s)
        s = (e.astype(np.uint32) << np.uint32(23)).view(np.float32)
        m = ue8m0_multiplier(e)
    else:
        with np.errstate(divide="ignore", over="ignore"):
            m = (np.float32(1.0) / s).astype(np.float32)
    s = np.where(bad, f32_const(F32_NAN_BITS), s).astype(np.float32)
    return s, m, bad


def fp8_quantize_values(x_f32: np.ndarray, m: np.ndarray) -> np.ndarray:
    """q = E4M3(clamp(RN32(x * m), -448, 448)) elementwise (m broadcast)."""
    with np.errstate(over="ignore", invalid="ignore"):
        y = (x_f32 * m).astype(np.float32)
    # fmin/fmax ignore NaN exactly like CUDA's fminf/fmaxf (unreachable for in-range eps; kept identical anyway)
    y = np.fmin(np.fmax(y, np.float32(-E4M3_MAX)), np.float32(E4M3_MAX))
    return e4m3_encode(y)


def _scale_kind(scale: str) -> tuple[bool, bool]:
    if scale not in ("fp32", "ue8m0", "ue8m0_packed"):
        raise InvalidArgumentError(f"scale must be 'fp32', 'ue8m0' or 'ue8m0_packed', not {scale!r}")
    return scale != "fp32", scale == "ue8m0_packed"


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


# ---- FP8 128x128 block (weights) -----------------------------------------------------------------------------
def fp8_block_quant(w: torch.Tensor, block: int = 128, scale: str = "fp32", eps: float = 1e-4):
    """Block-quantize a bf16 [N, K] or [E, N, K] tensor. Returns (q float8_e4m3fn, scale) per the module contract;
    ragged edges are clipped blocks (padding never counts)."""
    ue8m0, packed = _scale_kind(scale)
    if w.dim() not in (2, 3):
        raise InvalidArgumentError(f"expected [N, K] or [E, N, K], got shape {tuple(w.shape)}")
    bits = bf16_bits(w)
    squeeze = bits.ndim == 2
    if squeeze:
        bits = bits[None]
    E, N, K = bits.shape
    nb, kb = -(-N // block), -(-K // block)
    padded = np.zeros((E, nb * block, kb * block), dtype=np.uint16)
    padded[:, :N, :K] = bits & 0x7FFF
    amax = padded.reshape(E, nb, block, kb, block).max(axis=(2, 4))
    s, m, bad = _scales_and_multipliers(amax, eps, ue8m0)
    row_blk = np.arange(N) // block
    col_blk = np.arange(K) // block
    m_full = m[:, row_blk][:, :, col_blk]
    q = fp8_quantize_values(bf16_to_f32(bits), m_full)
    q = np.where(bad[:, row_blk][:, :, col_blk], np.uint8(E4M3_NAN), q)
    q_t = torch.from_numpy(q).view(torch.float8_e4m3fn)
    if packed:
        per_row = s[:, row_blk, :]  # DeepGEMM SFB: one row of block scales per weight row
        scale_t = ue8m0_pack(torch.from_numpy(per_row))
    else:
        scale_t = torch.from_numpy(s)
    if squeeze:
        q_t, scale_t = q_t[0], scale_t[0]
    return q_t, scale_t


def fp8_block_dequant(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """RNbf16(RN32(float(q) * s)) with s the fp32 (or UE8M0-valued fp32) block scale; [.., N, K] -> bf16."""
    qb = q.contiguous().view(torch.uint8).numpy()
    s = scale.contiguous().numpy().astype(np.float32)
    N, K = qb.shape[-2:]
    s_full = np.take(np.take(s, np.arange(N) // block, axis=-2), np.arange(K) // block, axis=-1)
    with np.errstate(invalid="ignore", over="ignore"):
        y = (e4m3_decode(qb) * s_full).astype(np.float32)
    return bf16_from_bits(f32_to_bf16_bits(y))


# ---- FP8 1x128 token groups (activations) --------------------------------------------------------------------
def mn_major_view(buf: torch.Tensor, mn: int, cols: int) -> torch.Tensor:
    """Logical [mn, cols] view of a [cols, align(mn, 4)] buffer: strides (1, align(mn, 4))."""
    return buf.as_strided((mn, cols), (1, _align(mn, 4)))


def fp8_group_quant(x: torch.Tensor, group: int = 128, scale_layout: str = "row", scale: str = "fp32",
                    eps: float = 1e-10):
    """Per-token-group quant of a bf16 [M, K] tensor (K % group == 0). Returns (q, scale)."""
    ue8m0, packed = _scale_kind(scale)
    if scale_layout not in ("row", "mn_major"):
        raise InvalidArgumentError(f"scale_layout must be 'row' or 'mn_major', not {scale_layout!r}")
    if x.dim() != 2:
        raise InvalidArgumentError(f"expected [M, K], got shape {tuple(x.shape)}")
    M, K = x.shape
    if K % group != 0:
        raise InvalidArgumentError(f"K={K} is not a multiple of the group size {group}")
    if packed and scale_layout != "mn_major":
        raise InvalidArgumentError("packed UE8M0 scales are MN-major by definition: use scale_layout='mn_major'")
    G = K // group
    bits = bf16_bits(x)
    amax = (bits & 0x7FFF).reshape(M, G, group).max(axis=2)
    s, m, bad = _scales_and_multipliers(amax, eps, ue8m0)
    q = fp8_quantize_values(bf16_to_f32(bits).reshape(M, G, group), m[:, :, None])
    q = np.where(bad[:, :, None], np.uint8(E4M3_NAN), q).reshape(M, K)
    q_t = torch.from_numpy(q).view(torch.float8_e4m3fn)
    if packed:
        return q_t, ue8m0_pack(torch.from_numpy(s))
    if scale_layout == "row":
        return q_t, torch.from_numpy(s)
    buf = torch.zeros(G * _align(M, 4), dtype=torch.float32)
    view = mn_major_view(buf, M, G)
    view.copy_(torch.from_numpy(s))
    return q_t, view


def fp8_group_dequant(q: torch.Tensor, scale: torch.Tensor, group: int = 128) -> torch.Tensor:
    qb = q.contiguous().view(torch.uint8).numpy()
    s = scale.contiguous().numpy().astype(np.float32)
    M, K = qb.shape
    with np.errstate(invalid="ignore", over="ignore"):
        y = (e4m3_decode(qb).reshape(M, K // group, group) * s[:, :, None]).astype(np.float32)
    return bf16_from_bits(f32_to_bf16_bits(y.reshape(M, K)))


# ---- UE8M0 packing -------------------------------------------------------------------------------------------
def ue8m0_pack(s: torch.Tensor) -> torch.Tensor:
    """Pack power-of-two fp32 scales [.., MN, G] into DeepGEMM's int32 layout [.., MN, ceil(G/4)], MN-major with
    the MN stride aligned to 4: byte b of word j is the biased exponent of group 4j+b (little-endian); padding bytes
    and rows are 0. NaN scales pack as 0xFF. Raises ValueError on any finite scale that is not a power of two (it
    would corrupt its neighbours' bytes)."""
    sn = s.contiguous().numpy().astype(np.float32)
    u = sn.view(np.uint32)
    nan = np.isnan(sn)
    if np.any(((u & 0x807FFFFF) != 0) & ~nan) or np.any(((u >> 23) == 0) & ~nan):
        raise InvalidArgumentError("ue8m0_pack: every scale must be a positive normal power of two (use scale='ue8m0')")
    byte = np.where(nan, 0xFF, (u >> 23) & 0xFF).astype(np.uint32)
    *lead, MN, G = sn.shape
    W = -(-G // 4)
    padded = np.zeros((*lead, MN, W * 4), dtype=np.uint32)
    padded[..., :G] = byte
    p = padded.reshape(*lead, MN, W, 4)
    words = (p[..., 0] | (p[..., 1] << 8) | (p[..., 2] << 16) | (p[..., 3] << 24)).view(np.int32)
    A = _align(MN, 4)
    B = int(np.prod(lead)) if lead else 1
    buf = torch.zeros(B * W * A, dtype=torch.int32)
    view = buf.as_strided((B, MN, W), (W * A, 1, A))
    view.copy_(torch.from_numpy(np.ascontiguousarray(words)).reshape(B, MN, W))
    return view.reshape(*lead, MN, W) if lead else view[0]


def ue8m0_unpack(packed: torch.Tensor, groups: int) -> torch.Tensor:
    """Inverse of ue8m0_pack: int32 [.., MN, ceil(G/4)] -> fp32 [.., MN, G] (0xFF -> NaN)."""
    w = packed.contiguous().numpy().view(np.uint32)
    b = np.stack([(w >> (8 * i)) & 0xFF for i in range(4)], axis=-1).reshape(*w.shape[:-1], -1)[..., :groups]
    f = (b.astype(np.uint32) << np.uint32(23)).view(np.float32)
    return torch.from_numpy(np.where(b == 0xFF, f32_const(F32_NAN_BITS), f).astype(np.float32))


# ---- INT4 W4A16 symmetric group ------------------------------------------------------------------------------
def divisor_inverse_bits(divisor: float) -> int:
    if divisor == 7:
        return INV7_BITS
    if divisor == 7.5:
        return INV7_5_BITS
    raise InvalidArgumentError(f"divisor must be 7 (q in [-7, 7]) or 7.5 (q in [-8, 7]), not {divisor!r}")


def int4_qrange(divisor: float) -> tuple[int, int]:
    divisor_inverse_bits(divisor)
    return (-7, 7) if divisor == 7 else (-8, 7)


def _check_int4(w: torch.Tensor, group: int):
    if group not in (32, 64, 128):
        raise InvalidArgumentError(f"group must be 32, 64 or 128, not {group!r}")
    if w.dim() != 2:
        raise InvalidArgumentError(f"expected [N, K], got shape {tuple(w.shape)}")
    if w.shape[1] % group != 0:
        raise InvalidArgumentError(f"K={w.shape[1]} is not a multiple of the group size {group}")


def int4_scale(amax_bits: np.ndarray, divisor: float, eps: float) -> np.ndarray:
    """s = RNbf16(max(RN32(amax * RN32(1/D)), eps)) as bf16 bits; non-finite amax -> 0x7FC0."""
    bad = amax_bits >= _BF16_ABS_INF
    amax = bf16_to_f32(np.where(bad, 0, amax_bits).astype(np.uint16))
    s32 = np.maximum((amax * f32_const(divisor_inverse_bits(divisor))).astype(np.float32), eps_f32(eps))
    return np.where(bad, np.uint16(BF16_NAN_BITS), f32_to_bf16_bits(s32))


def int4_quant(w: torch.Tensor, group: int = 128, divisor: float = 7, eps: float = 1e-5):
    """(q int8 [N, K], scale bf16 bits uint16 [N, K/g]) per the contract."""
    _check_int4(w, group)
    qmin, qmax = int4_qrange(divisor)
    bits = bf16_bits(w)
    N, K = bits.shape
    G = K // group
    amax = (bits & 0x7FFF).reshape(N, G, group).max(axis=2)
    s_bits = int4_scale(amax, divisor, eps)
    s = bf16_to_f32(s_bits)
    x = bf16_to_f32(bits).reshape(N, G, group)
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.rint((x / s[:, :, None]).astype(np.float32))
    q = np.clip(np.nan_to_num(r, nan=0.0), qmin, qmax).astype(np.int8)
    q = np.where((s_bits >= _BF16_ABS_INF)[:, :, None], np.int8(0), q)
    return q.reshape(N, K), s_bits


def int4_dequant(q: np.ndarray, s_bits: np.ndarray, group: int) -> torch.Tensor:
    """RNbf16(q * float(s)) (exact product), NaN scale -> 0x7FC0; returns a bf16 tensor."""
    N, K = q.shape
    s = bf16_to_f32(s_bits)
    with np.errstate(invalid="ignore"):
        y = (q.reshape(N, K // group, group).astype(np.float32) * s[:, :, None]).astype(np.float32)
    return bf16_from_bits(f32_to_bf16_bits(y.reshape(N, K)))


def int4_fake_quant(w: torch.Tensor, group: int = 128, divisor: float = 7, eps: float = 1e-5) -> torch.Tensor:
    q, s_bits = int4_quant(w, group, divisor, eps)
    return int4_dequant(q, s_bits, group)


def int4_pack(q: np.ndarray) -> torch.Tensor:
    """int8 q [N, K] (K % 8 == 0, values in [-8, 7]) -> int32 [N, K/8], nibble i of word j = q[n, 8j+i] + 8."""
    N, K = q.shape
    u = (q.astype(np.int64) + 8).astype(np.uint32).reshape(N, K // 8, 8)
    word = np.zeros((N, K // 8), dtype=np.uint32)
    for i in range(8):
        word |= u[:, :, i] << np.uint32(4 * i)
    return torch.from_numpy(word.view(np.int32))


def int4_unpack_q(packed: torch.Tensor, K: int) -> np.ndarray:
    w = packed.contiguous().numpy().view(np.uint32)
    N = w.shape[0]
    nib = np.stack([(w >> np.uint32(4 * i)) & 0xF for i in range(8)], axis=-1).reshape(N, -1)[:, :K]
    return (nib.astype(np.int64) - 8).astype(np.int8)
