/*
 * sm90_bf16_int4_quant.cu — INT4 W4A16 symmetric group quant: the QAT fake-quant forward, the compressed-tensors
 * pack-quantized export and the bf16 group scales, from ONE kernel (any subset of the three outputs per launch).
 * Because the trainer's forward and the exporter run the same instructions on the same bits, the contract
 * fake_quant(W) == RNbf16(unpack(pack(W)) * scale) holds by construction; tests/quant checks it anyway.
 *
 * Numerics (specs/quant.md): s = RNbf16(max(RN32(amax * RN32(1/D)), eps)) — the scale is rounded to its storage
 * dtype BEFORE it is used; q = clamp(rint(__fdiv_rn(x, s)), qmin, qmax); out = RNbf16(q * s) (exact product).
 * Non-finite group: scale 0x7FC0, q = 0 (nibble 8), out 0x7FC0.
 * Mapping: one thread per 8 consecutive elements (one 16-byte load = one packed int32 word), G/8 threads per
 * group reduce with xor-shuffles; kUnroll chunks per thread, all loads first.
 */
#include "quant/sm90_common.cuh"
#include "quant/sm90_launch.cuh"

namespace ebbtide::quant {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 8;

struct Int4Out {
  uint16_t* fake_quant;  // bf16 [rows, cols] or null
  uint32_t* packed;      // int32 [rows, cols / 8] or null
  uint16_t* scale;       // bf16 [rows, cols / group] or null
};

// 1.5 * 2^23: for |t| < 2^22, RN32(t + kRound) is kRound + RNE(t), and its bits are 0x4B400000 + RNE(t).
constexpr float kRound = 12582912.0f;

// Two fp32 -> bf16 RNE in one instruction: lo -> low half. Inputs are finite (never NaN here).
__device__ __forceinline__ uint32_t bf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// q = clamp(RNE(RN32(x / s)), qmin, 7) for a bf16 x and a positive normal bf16 scale s, WITHOUT the division,
// carried as y = kRound + q (so bits(y) = 0x4B400000 + q). r = RN32(1/s). Why this equals the IEEE formula:
//  - x and s carry 8 significant bits each, so wherever x/s is not exactly a half-integer h it is at least 2^-9
//    away from one (x - h*s is a non-zero multiple of 2^min(ex, es-1), and x/s >= 1/2 forces ex >= es - 1);
//    RN32(x/s) and x*r (relative error <= 2^-23, |x/s| <= 8) stay on the same side of h, so
//    fma(x, r, kRound) - kRound == RNE(x*r) == RNE(RN32(x/s)) there (|x/s| > 8 only clamps).
//  - Exactly at a half-integer (RN32(x/s) = h exactly; RNE picks the even neighbour) x*r may land on either
//    side of h. The residual e = x - q*s is exact in one fma (q*s has <= 12 significant bits, x 8, |e| <= s), so
//    the tie shows as |e| == s/2 exactly, and an odd q is moved one step toward x (int4_fix_tie). Ties are rare,
//    so int4_round only flags them and the caller fixes a pair only when one of its values is a tie.
// tests/quant/test_quant_reference_int4.py checks this rule against IEEE division for every finite bf16 x over
// every bf16 scale mantissa at three exponents; the GPU tests check the kernel against the reference.
__device__ __forceinline__ float int4_round(float x, float s, float r, float hs, bool& tie) {
  const float y = __fmaf_rn(x, r, kRound);
  tie |= fabsf(__fmaf_rn(-__fsub_rn(y, kRound), s, x)) == hs;
  return y;
}

__device__ __forceinline__ float int4_fix_tie(float y, float x, float s, float hs) {
  const float e = __fmaf_rn(-__fsub_rn(y, kRound), s, x);
  return (fabsf(e) == hs && (__float_as_uint(y) & 1u)) ? __fadd_rn(y, copysignf(1.0f, e)) : y;
}

// Mapping: one thread per 8 consecutive elements (one 16-byte load = one packed int32 word); kGroup / 8
// consecutive threads own one group and reduce its max with xor-shuffles; kUnroll chunks per thread, all loads
// issued before the first use. kContig (ld == cols): chunk ch starts at element 8 ch, no row arithmetic.
template <int kGroup, bool kVec, bool kContig>
__global__ void __launch_bounds__(kThreads, 4)
    int4_quant_kernel(const uint16_t* __restrict__ src, int64_t rows, int64_t cols, int64_t ld, int divisor_x2,
                      float eps, Int4Out out) {
  constexpr int kLanes = kGroup / 8;  // threads per group
  const int64_t cpr = cols / 8;
  const int64_t total = rows * cpr;
  const float inv_d = __uint_as_float(divisor_x2 == 14 ? dev::kInv7Bits : dev::kInv7_5Bits);
  const float lo = kRound + (divisor_x2 == 14 ? -7.0f : -8.0f), hi = kRound + 7.0f;
  const int64_t base = (int64_t)blockIdx.x * kThreads * kUnroll + threadIdx.x;

  uint4 v[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t ch = base + (int64_t)u * kThreads;
    const uint16_t* p;
    if (kContig) {
      p = src + ch * 8;
    } else {
      const int64_t r = dev::udiv(ch, cpr);
      p = src + r * ld + (ch - r * cpr) * 8;
    }
    if (ch >= total) {
      v[u] = make_uint4(0, 0, 0, 0);
    } else if (kVec) {
      v[u] = dev::ld_stream16(p);
    } else {
      v[u].x = p[0] | ((uint32_t)p[1] << 16);
      v[u].y = p[2] | ((uint32_t)p[3] << 16);
      v[u].z = p[4] | ((uint32_t)p[5] << 16);
      v[u].w = p[6] | ((uint32_t)p[7] << 16);
    }
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t ch = base + (int64_t)u * kThreads;
    uint32_t m = dev::fold2(dev::absmax2(dev::absmax2(dev::absmax2(dev::absmax2(0u, v[u].x), v[u].y), v[u].z),
                                         v[u].w));
#pragma unroll
    for (int off = kLanes / 2; off >= 1; off >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
    if (ch >= total) continue;
    const bool bad = m >= dev::kBf16AbsInf;
    const float s32 = fmaxf(__fmul_rn(__uint_as_float((bad ? 0u : m) << 16), inv_d), eps);
    const uint32_t s_bits = bad ? dev::kBf16NanBits : dev::f32_to_bf16_bits(s32);
    const float s = bad ? 1.0f : __uint_as_float(s_bits << 16);  // s >= RNbf16(1e-30): normal, > 0
    const float r = __frcp_rn(s), hs = 0.5f * s;
    const uint32_t w[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
    uint32_t word = 0;
    uint32_t fq[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // one bf16 pair at a time (registers: 8 chunks of input stay live)
      const float x0 = dev::bf16_lo(w[i]), x1 = dev::bf16_hi(w[i]);
      bool tie = false;
      float y0 = int4_round(x0, s, r, hs, tie), y1 = int4_round(x1, s, r, hs, tie);
      if (tie) {
        y0 = int4_fix_tie(y0, x0, s, hs);
        y1 = int4_fix_tie(y1, x1, s, hs);
      }
      y0 = fminf(fmaxf(y0, lo), hi);
      y1 = fminf(fmaxf(y1, lo), hi);
      // nibble = q + 8 = (bits(y) - 0x4B400000 + 8) & 15, and 0x4B400000 & 15 == 0
      word |= ((__float_as_uint(y0) + 8u) & 0xFu) << (8 * i);
      word |= ((__float_as_uint(y1) + 8u) & 0xFu) << (8 * i + 4);
      // RNbf16(q * s): q * s is exact in fp32 (<= 12 significant bits); q = +0 for y = kRound
      fq[i] = bf16x2(__fmul_rn(__fsub_rn(y0, kRound), s), __fmul_rn(__fsub_rn(y1, kRound), s));
    }
    if (bad) {
      word = 0x88888888u;  // q = 0 everywhere
#pragma unroll
      for (int i = 0; i < 4; ++i) fq[i] = dev::kBf16NanBits | (dev::kBf16NanBits << 16);
    }
    if (out.fake_quant)
      *reinterpret_cast<uint4*>(out.fake_quant + ch * 8) = make_uint4(fq[0], fq[1], fq[2], fq[3]);
    if (out.packed) out.packed[ch] = word;
    if (out.scale && (threadIdx.x % kLanes) == 0) {
      // contiguous chunks are row-major over all groups: the group index is ch / kLanes either way
      out.scale[ch / kLanes] = (uint16_t)s_bits;
    }
  }
}

template <int kGroup>
void launch(bool vec, bool contig, unsigned ctas, cudaStream_t s, const uint16_t* src, int64_t rows, int64_t cols,
            int64_t ld, int divisor_x2, float eps, Int4Out out) {
  if (vec && contig)
    int4_quant_kernel<kGroup, true, true><<<ctas, kThreads, 0, s>>>(src, rows, cols, ld, divisor_x2, eps, out);
  else if (vec)
    int4_quant_kernel<kGroup, true, false><<<ctas, kThreads, 0, s>>>(src, rows, cols, ld, divisor_x2, eps, out);
  else
    int4_quant_kernel<kGroup, false, false><<<ctas, kThreads, 0, s>>>(src, rows, cols, ld, divisor_x2, eps, out);
}

}  // namespace

ebt_status_t sm90_bf16_int4_quant(const void* src, int64_t rows, int64_t cols, int64_t ld, int64_t group,
                                  int divisor_x2, float eps, void* fake_quant, void* packed, void* scale,
                                  void* stream) {
  EBT_QUANT_REQUIRE(rows >= 0 && cols >= 0, "int4_quant: negative size (%lld, %lld)", (long long)rows,
                    (long long)cols);
  EBT_QUANT_REQUIRE(group == 32 || group == 64 || group == 128, "int4_quant: group must be 32, 64 or 128 (got %lld)",
                    (long long)group);
  EBT_QUANT_REQUIRE(cols % group == 0, "int4_quant: K=%lld is not a multiple of the group size %lld",
                    (long long)cols, (long long)group);
  EBT_QUANT_REQUIRE(divisor_x2 == 14 || divisor_x2 == 15,
                    "int4_quant: divisor must be 7 (q in [-7, 7]) or 7.5 (q in [-8, 7]); got %g",
                    divisor_x2 / 2.0);
  EBT_QUANT_REQUIRE(eps_in_range(eps), "int4_quant: eps must be in [1e-30, 1e30] (got %g)", (double)eps);
  if (rows == 0 || cols == 0) return EBT_SUCCESS;
  EBT_QUANT_REQUIRE(src, "int4_quant: null source");
  EBT_QUANT_REQUIRE(fake_quant || packed || scale, "int4_quant: no output requested");
  EBT_QUANT_REQUIRE(ld >= cols, "int4_quant: row stride %lld < cols %lld", (long long)ld, (long long)cols);
  EBT_QUANT_REQUIRE((reinterpret_cast<uintptr_t>(fake_quant) & 15u) == 0, "int4_quant: fake_quant not 16-byte aligned");
  EBT_QUANT_REQUIRE((reinterpret_cast<uintptr_t>(packed) & 3u) == 0, "int4_quant: packed not 4-byte aligned");
  EBT_QUANT_REQUIRE((reinterpret_cast<uintptr_t>(scale) & 1u) == 0, "int4_quant: scale not 2-byte aligned");
  const int64_t chunks = rows * (cols / 8);
  const int64_t ctas = (chunks + kThreads * kUnroll - 1) / (kThreads * kUnroll);
  EBT_QUANT_REQUIRE(ctas <= 0x7FFFFFFF, "int4_quant: tensor too large");
  const bool vec = (reinterpret_cast<uintptr_t>(src) & 15u) == 0 && ld % 8 == 0;
  const Int4Out out{static_cast<uint16_t*>(fake_quant), static_cast<uint32_t*>(packed), static_cast<uint16_t*>(scale)};
  auto s = static_cast<cudaStream_t>(stream);
  auto in = static_cast<const uint16_t*>(src);
  const bool contig = ld == cols;
  if (group == 32) launch<32>(vec, contig, (unsigned)ctas, s, in, rows, cols, ld, divisor_x2, eps, out);
  else if (group == 64) launch<64>(vec, contig, (unsigned)ctas, s, in, rows, cols, ld, divisor_x2, eps, out);
  else launch<128>(vec, contig, (unsigned)ctas, s, in, rows, cols, ld, divisor_x2, eps, out);
  return launch_status("int4_quant");
}

}  // namespace ebbtide::quant
