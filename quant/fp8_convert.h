/*
 * fp8_convert.h — fp32 <-> float8_e4m3fn in integer arithmetic: the software conversion of the portable kernels
 * (GPUs without an FP8 conversion instruction: sm_80, sm_86), also compiled into the host build so the CPU tests
 * check the very code the GPU runs. Plain C++ (host and device); no CUDA header.
 *
 * e4m3_encode(bits of v) is what PTX `cvt.rn.satfinite.e4m3x2.f32` computes for one value:
 *  - round to nearest, ties to even, one rounding, e4m3 subnormals (k * 2^-9) included: |v| <= 2^-10 gives a zero
 *    of v's sign (0x00 / 0x80), the tie at 2^-10 included;
 *  - |v| >= 448 (Inf included) gives +-448 (0x7E / 0xFE); NaN gives 0x7F whatever its sign.
 * The kernels clamp to +-448 and never pass a NaN (a non-finite block is poisoned before), so only the first rule
 * decides their bits; the other two make the function total, so that it can be compared with the instruction on
 * every fp32 pattern (tests/quant: every pattern on the GPU against the instruction; every |v| <= 448 on the CPU
 * against torch's cast, and the reference on every bf16 pattern times the rounding-relevant low halves).
 * e4m3_decode(byte) is the exact fp32 value (bits); 0x7F / 0xFF give a NaN (the kernels canonicalize what they
 * store).
 */
#ifndef EBBTIDE_QUANT_FP8_CONVERT_H_
#define EBBTIDE_QUANT_FP8_CONVERT_H_

#include <stdint.h>

#include <cstring>

#if defined(__CUDACC__)
#define EBT_FP8_HD __host__ __device__ __forceinline__
#else
#define EBT_FP8_HD inline
#endif

namespace ebbtide::quant::fp8 {

constexpr uint32_t kF32AbsMask = 0x7FFFFFFFu;
constexpr uint32_t kF32Inf = 0x7F800000u;
constexpr uint32_t kF32E4m3Max = 0x43E00000u;    // 448.0f
constexpr uint32_t kF32E4m3MinNormal = 121u << 23;  // 2^-6
constexpr uint32_t kE4m3MaxCode = 0x7Eu;
constexpr uint32_t kE4m3NanCode = 0x7Fu;

// RN32(|v| + 2^14) as bits, for |v| < 2^-6 given as fp32 bits a. The fp32 spacing at 2^14 is 2^-9, the e4m3
// subnormal step, so the one rounding of the sum is RNE(|v| / 2^-9) in the sum's low mantissa bits. Round to
// nearest is the default rounding mode on every host; a subnormal |v| read as zero (DAZ) still gives 0.
EBT_FP8_HD uint32_t add_2p14_bits(uint32_t a) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(__fadd_rn(__uint_as_float(a), 16384.0f));
#else
  float f;
  std::memcpy(&f, &a, sizeof f);
  f += 16384.0f;
  uint32_t r;
  std::memcpy(&r, &f, sizeof r);
  return r;
#endif
}

// |v| (fp32 bits a, a < 448) -> e4m3 magnitude code, RNE. Both forms are computed and one is selected (about ten
// instructions, no branch, so a warp whose values straddle 2^-6 does not diverge).
EBT_FP8_HD uint32_t e4m3_magnitude(uint32_t a) {
  // normal (a >= 2^-6): keep exponent and 3 mantissa bits (a >> 20), round on the 20 bits below, rebias 127 -> 7
  const uint32_t normal = ((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
  // subnormal (a < 2^-6): k = RNE(|v| * 2^9) in 0..8 (8 is the smallest normal's code, as it should be)
  const uint32_t sub = add_2p14_bits(a) - 0x46800000u;  // - bits(2^14)
  return a >= kF32E4m3MinNormal ? normal : sub;
}

// E4M3 with saturation (cvt.rn.satfinite): fp32 bits -> e4m3 byte.
EBT_FP8_HD uint32_t e4m3_encode(uint32_t bits) {
  const uint32_t a = bits & kF32AbsMask;
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t mag = a >= kF32E4m3Max ? kE4m3MaxCode : e4m3_magnitude(a);
  return a > kF32Inf ? kE4m3NanCode : (sign | mag);
}

// e4m3 byte -> fp32 bits, exact. Normal codes move exponent and mantissa into place (rebias 7 -> 127);
// subnormal codes m * 2^-9 (m = 1..7) are normalized: the leading bit of m at position p gives exponent p - 9.
EBT_FP8_HD uint32_t e4m3_decode(uint32_t code) {
  const uint32_t sign = (code & 0x80u) << 24;
  const uint32_t mag = code & 0x7Fu;
  const uint32_t e = mag >> 3, m = mag & 7u;
  const uint32_t normal = ((e + 120u) << 23) | (m << 20);
  // m = 1: 2^-9; 2,3: 2^-8 * (1, 1.5); 4..7: 2^-7 * (1, 1.25, 1.5, 1.75)
  const uint32_t p = m >= 4u ? 2u : (m >= 2u ? 1u : 0u);
  const uint32_t subnormal = m ? (((118u + p) << 23) | (((m << (3u - p)) & 7u) << 20)) : 0u;
  const uint32_t value = mag == kE4m3NanCode ? 0x7FC00000u : (e ? normal : subnormal);
  return sign | value;
}

}  // namespace ebbtide::quant::fp8

#endif  // EBBTIDE_QUANT_FP8_CONVERT_H_
