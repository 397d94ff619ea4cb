/*
 * common.cuh — device pieces shared by the quant kernels of every architecture: the numerics contract written once.
 *
 * Policies:
 *  - Every floating-point step is a named, correctly rounded operation: __fmul_rn, __frcp_rn, __fdiv_rn, rintf,
 *    cvt.rn.bf16.f32 and the e4m3 conversion of the kernel's FP8 policy. The build never uses fast-math or -ftz, so
 *    subnormals survive (the UE8M0 multiplier 2^-127 is one).
 *  - Every kernel family is one source file built as the "portable" variant (every architecture of the build) and,
 *    for the FP8 families, once more as the "sm90" variant (the build's sm_89+ architectures; quant/CMakeLists.txt
 *    defines EBT_QUANT_SM90=1 for it). The variants differ only in `dev::Fp8`, the e4m3 conversion: Fp8Sw below
 *    (integer arithmetic, fp8_convert.h) or Fp8Hw (the conversion instructions, sm90_fp8_cvt.cuh), equal bit for
 *    bit. A launcher is named for its variant (EBT_QUANT_VARIANT: sm90_<dtype>_<op> or portable_<dtype>_<op>);
 *    which variant runs is chosen at run time (python/ebbtide/quant/_dispatch.py). Everything else here needs
 *    nothing beyond sm_80 (cvt.rn.bf16.f32, __reduce_max_sync).
 *  - bf16 values are handled as bit patterns: widening is a 16-bit shift (exact), max |x| is an unsigned max over
 *    (bits & 0x7FFF) — order-independent, so any reduction tree gives the same bits, and NaN/Inf (>= 0x7F80) are
 *    detected by the same max.
 *  - Values are clamped to +-448 before the e4m3 conversion; the conversion's saturation never decides a result.
 *  - Every bf16 NaN produced is the canonical 0x7FC0; every fp32 NaN scale is 0x7FC00000.
 */
#ifndef EBBTIDE_QUANT_COMMON_CUH_
#define EBBTIDE_QUANT_COMMON_CUH_

#include <cuda_runtime.h>
#include <stdint.h>

#include "quant/fp8_convert.h"

namespace ebbtide::quant::dev {

constexpr uint32_t kC448Bits = 0x3B124925u;     // RN32(1/448)
constexpr uint32_t kInv7Bits = 0x3E124925u;     // RN32(1/7)
constexpr uint32_t kInv7_5Bits = 0x3E088889u;   // RN32(1/7.5)
constexpr uint32_t kF32NanBits = 0x7FC00000u;
constexpr uint32_t kBf16NanBits = 0x7FC0u;
constexpr uint32_t kBf16AbsInf = 0x7F80u;       // abs bits >= this: Inf or NaN
constexpr uint32_t kE4m3Nan = 0x7Fu;
constexpr float kE4m3Max = 448.0f;

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }
__device__ __forceinline__ float bf16_part(uint32_t w, int hi) { return hi ? bf16_hi(w) : bf16_lo(w); }

// max over the two bf16 halves of |x| bit patterns, accumulated into m (packed 2x16, compared per half).
__device__ __forceinline__ uint32_t absmax2(uint32_t m, uint32_t w) { return __vmaxu2(m, w & 0x7FFF7FFFu); }
__device__ __forceinline__ uint32_t fold2(uint32_t m) { return max(m & 0xFFFFu, m >> 16); }

// RNbf16 with the canonical NaN.
__device__ __forceinline__ uint32_t f32_to_bf16_bits(float f) {
  if (isnan(f)) return kBf16NanBits;
  uint16_t r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}

// The software FP8 policy: E4M3 of two fp32 values (lo -> low byte) and the exact fp32 values of an e4m3 pair (low
// byte first), in integer arithmetic (fp8_convert.h).
struct Fp8Sw {
  static __device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
    return fp8::e4m3_encode(__float_as_uint(lo)) | (fp8::e4m3_encode(__float_as_uint(hi)) << 8);
  }
  static __device__ __forceinline__ float2 e4m3x2_to_f32(uint16_t v) {
    return make_float2(__uint_as_float(fp8::e4m3_decode(v & 0xFFu)), __uint_as_float(fp8::e4m3_decode(v >> 8)));
  }
};

}  // namespace ebbtide::quant::dev

#if EBT_QUANT_SM90
#include "quant/sm90_fp8_cvt.cuh"
#define EBT_QUANT_VARIANT(name) sm90_##name
namespace ebbtide::quant::dev {
using Fp8 = Fp8Hw;
}
#else
#define EBT_QUANT_VARIANT(name) portable_##name
namespace ebbtide::quant::dev {
using Fp8 = Fp8Sw;
}
#endif

namespace ebbtide::quant::dev {

// The FP8 scale rule. amax16: max |x| bits of the block/group. Outputs the stored scale (fp32 bits: NaN if the
// block holds a non-finite value), the multiplier m, and whether the block is poisoned.
struct Fp8Scale {
  float s;
  float m;
  bool bad;
};

__device__ __forceinline__ Fp8Scale fp8_scale(uint32_t amax16, float eps, bool ue8m0) {
  Fp8Scale r;
  r.bad = amax16 >= kBf16AbsInf;
  const float a = fmaxf(__uint_as_float((r.bad ? 0u : amax16) << 16), eps);
  const float s32 = __fmul_rn(a, __uint_as_float(kC448Bits));
  if (ue8m0) {
    const uint32_t u = __float_as_uint(s32);
    int e = (int)((u >> 23) & 0xFFu) + ((u & 0x7FFFFFu) != 0u);
    e = min(max(e, 1), 254);
    r.s = __uint_as_float((uint32_t)e << 23);
    r.m = __uint_as_float(e <= 253 ? (uint32_t)(254 - e) << 23 : 0x00400000u);  // 2^(127-e), exact
  } else {
    r.s = s32;
    r.m = __frcp_rn(s32);
  }
  if (r.bad) r.s = __uint_as_float(kF32NanBits);
  return r;
}

__device__ __forceinline__ float fp8_clamped(float x, float m) {
  return fminf(fmaxf(__fmul_rn(x, m), -kE4m3Max), kE4m3Max);
}

// 8 bf16 (a uint4) -> 8 e4m3 bytes (a uint2), per the contract; poisoned blocks give 0x7F everywhere.
__device__ __forceinline__ uint2 fp8_quant8(uint4 v, const Fp8Scale& sc) {
  if (sc.bad) return make_uint2(0x7F7F7F7Fu, 0x7F7F7F7Fu);
  const float m = sc.m;
  uint2 o;
  o.x = Fp8::e4m3x2(fp8_clamped(bf16_lo(v.x), m), fp8_clamped(bf16_hi(v.x), m)) |
        (Fp8::e4m3x2(fp8_clamped(bf16_lo(v.y), m), fp8_clamped(bf16_hi(v.y), m)) << 16);
  o.y = Fp8::e4m3x2(fp8_clamped(bf16_lo(v.z), m), fp8_clamped(bf16_hi(v.z), m)) |
        (Fp8::e4m3x2(fp8_clamped(bf16_lo(v.w), m), fp8_clamped(bf16_hi(v.w), m)) << 16);
  return o;
}

__device__ __forceinline__ uint8_t fp8_quant1(uint16_t b, const Fp8Scale& sc) {
  if (sc.bad) return (uint8_t)kE4m3Nan;
  return (uint8_t)(Fp8::e4m3x2(fp8_clamped(__uint_as_float((uint32_t)b << 16), sc.m), 0.0f) & 0xFFu);
}

// Streaming 16-byte load (read once: no L1 allocation).
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// a / b for 0 <= a, 0 < b: 32-bit division when both fit (the common case; 64-bit division is a long
// software sequence on the GPU), 64-bit otherwise. Warp-uniform in practice.
__device__ __forceinline__ int64_t udiv(int64_t a, int64_t b) {
  if (((uint64_t)a | (uint64_t)b) <= 0xFFFFFFFFull) return (int64_t)((uint32_t)a / (uint32_t)b);
  return a / b;
}

__device__ __forceinline__ int64_t align4(int64_t x) { return (x + 3) & ~int64_t(3); }

// Write one scale for (row-of-scales `mn`, K-group `g`) of a matrix with `mn_count` MN entries and `groups`
// K-groups, per mode. For packed UE8M0 the byte lands at byte (g % 4) of word (g / 4) of row mn (MN-major, stride
// align(mn_count, 4) words); the writer of the last group / last row also zeroes the padding bytes / rows.
__device__ __forceinline__ void store_packed_ue8m0(uint8_t* base, int64_t mn, int64_t mn_count, int64_t g,
                                                   int64_t groups, float s) {
  const int64_t A = align4(mn_count);
  const uint32_t u = __float_as_uint(s);
  const uint8_t byte = isnan(s) ? (uint8_t)0xFF : (uint8_t)(u >> 23);
  base[((g >> 2) * A + mn) * 4 + (g & 3)] = byte;
  const bool last_g = g == groups - 1, last_mn = mn == mn_count - 1;
  if (last_g) {
    for (int64_t p = groups; p < align4(groups); ++p) base[((p >> 2) * A + mn) * 4 + (p & 3)] = 0;
  }
  if (last_mn) {
    for (int64_t r = mn_count; r < A; ++r) {
      base[((g >> 2) * A + r) * 4 + (g & 3)] = 0;
      if (last_g)
        for (int64_t p = groups; p < align4(groups); ++p) base[((p >> 2) * A + r) * 4 + (p & 3)] = 0;
    }
  }
}

}  // namespace ebbtide::quant::dev

#endif  // EBBTIDE_QUANT_COMMON_CUH_
