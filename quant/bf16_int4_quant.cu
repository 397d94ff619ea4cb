/*
 * bf16_int4_quant.cu — INT4 W4A16 symmetric group quant: the QAT fake-quant forward, the compressed-tensors
 * pack-quantized export and the bf16 group scales, from ONE kernel (any subset of the three outputs per launch).
 * Because the trainer's forward and the exporter run the same instructions on the same bits, the contract
 * fake_quant(W) == RNbf16(unpack(pack(W)) * scale) holds by construction; tests/quant checks it anyway.
 *
 * Numerics (docs/quant.md): s = RNbf16(max(RN32(amax * RN32(1/D)), eps)) — the scale is rounded to its storage
 * dtype BEFORE it is used; q = clamp(rint(RN32(x / s)), qmin, qmax) (computed exactly without a division, see
 * int4_round); out = RNbf16(q * s) (exact product).
 * Non-finite group: scale 0x7FC0, q = 0 (nibble 8), out 0x7FC0.
 * Mapping and the division-free rounding: see int4_quant_kernel and int4_round below.
 */
#include "quant/common.cuh"
#include "quant/launch.cuh"

namespace ebbtide::quant {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // units (2 chunks each) per thread

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

// Packed word of 8 values from their y = kRound + q: sum over i of (bits(y_i) - 0x4B400000 + 8) << 4i. Each term
// is a nibble (q + 8 in 0..15), so the sum is computed mod 2^32 as sum(bits(y_i) << 4i) minus one constant: one
// shift-add per value.
constexpr uint32_t kNibbleBias = (0x4B400000u - 8u) * 0x11111111u;  // mod 2^32

// 8 values (one 16-byte chunk) of one group: q as y = kRound + q, the fake-quant bf16 pairs and/or the word.
template <bool kFq, bool kPack>
__device__ __forceinline__ void int4_chunk(uint4 v, float s, float r, float hs, float lo, float hi, uint4& fq,
                                           uint32_t& word) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  uint32_t f[4];
  uint32_t acc = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // one bf16 pair at a time
    const float x0 = dev::bf16_lo(w[i]), x1 = dev::bf16_hi(w[i]);
    bool tie = false;
    float y0 = int4_round(x0, s, r, hs, tie), y1 = int4_round(x1, s, r, hs, tie);
    if (tie) {
      y0 = int4_fix_tie(y0, x0, s, hs);
      y1 = int4_fix_tie(y1, x1, s, hs);
    }
    y0 = fminf(fmaxf(y0, lo), hi);
    y1 = fminf(fmaxf(y1, lo), hi);
    if (kPack) acc += (__float_as_uint(y0) << (8 * i)) + (__float_as_uint(y1) << (8 * i + 4));
    // RNbf16(q * s): q * s is exact in fp32 (<= 12 significant bits); q = +0 for y = kRound
    if (kFq) f[i] = bf16x2(__fmul_rn(__fsub_rn(y0, kRound), s), __fmul_rn(__fsub_rn(y1, kRound), s));
  }
  if (kPack) word = acc - kNibbleBias;
  if (kFq) fq = make_uint4(f[0], f[1], f[2], f[3]);
}

// Mapping: a "unit" is two 16-byte chunks of one group, chunks l and l + kLanes (l < kLanes = kGroup / 16), so
// kLanes consecutive threads own a group (fewer shuffles and scale computations per element than one chunk per
// thread) while each load instruction still reads 128 contiguous bytes per group. kUnroll units per thread, all
// loads issued before the first use (8 x 16 bytes in flight per thread). kContig (ld == K): the group's elements
// start at group * kGroup, no row arithmetic. kFq / kPack: which outputs this instance computes (scales always).
template <int kGroup, bool kVec, bool kContig, bool kFq, bool kPack>
__global__ void __launch_bounds__(kThreads, 4)
    int4_quant_kernel(const uint16_t* __restrict__ src, int64_t rows, int64_t cols, int64_t ld, int divisor_x2,
                      float eps, Int4Out out) {
  constexpr int kLanes = kGroup / 16;  // threads per group
  const int64_t gpr = cols / kGroup;   // groups per row
  const int64_t total = rows * gpr * kLanes;
  const float inv_d = __uint_as_float(divisor_x2 == 14 ? dev::kInv7Bits : dev::kInv7_5Bits);
  const float lo = kRound + (divisor_x2 == 14 ? -7.0f : -8.0f), hi = kRound + 7.0f;
  const int64_t base = (int64_t)blockIdx.x * kThreads * kUnroll + threadIdx.x;
  const int lane = threadIdx.x % kLanes;

  uint4 v[kUnroll][2];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t un = base + (int64_t)u * kThreads;
    const int64_t g = un / kLanes;  // group id, row-major over [rows, gpr]
    const uint16_t* p;
    if (kContig) {
      p = src + g * kGroup + lane * 8;
    } else {
      const int64_t r = dev::udiv(g, gpr);
      p = src + r * ld + (g - r * gpr) * kGroup + lane * 8;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint16_t* ph = p + h * kLanes * 8;
      if (un >= total) {
        v[u][h] = make_uint4(0, 0, 0, 0);
      } else if (kVec) {
        v[u][h] = dev::ld_stream16(ph);
      } else {
        v[u][h].x = ph[0] | ((uint32_t)ph[1] << 16);
        v[u][h].y = ph[2] | ((uint32_t)ph[3] << 16);
        v[u][h].z = ph[4] | ((uint32_t)ph[5] << 16);
        v[u][h].w = ph[6] | ((uint32_t)ph[7] << 16);
      }
    }
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t un = base + (int64_t)u * kThreads;
    uint32_t m = 0;
#pragma unroll
    for (int h = 0; h < 2; ++h)
      m = dev::absmax2(dev::absmax2(dev::absmax2(dev::absmax2(m, v[u][h].x), v[u][h].y), v[u][h].z), v[u][h].w);
    m = dev::fold2(m);
#pragma unroll
    for (int off = kLanes / 2; off >= 1; off >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
    if (un >= total) continue;
    const int64_t g = un / kLanes;
    const bool bad = m >= dev::kBf16AbsInf;
    const float s32 = fmaxf(__fmul_rn(__uint_as_float((bad ? 0u : m) << 16), inv_d), eps);
    const uint32_t s_bits = bad ? dev::kBf16NanBits : dev::f32_to_bf16_bits(s32);
    const float s = bad ? 1.0f : __uint_as_float(s_bits << 16);  // s >= RNbf16(1e-30): normal, > 0
    const float r = __frcp_rn(s), hs = 0.5f * s;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint4 fq;
      uint32_t word;
      int4_chunk<kFq, kPack>(v[u][h], s, r, hs, lo, hi, fq, word);
      const int64_t chunk = g * (kGroup / 8) + lane + h * kLanes;  // 8-element chunk of the contiguous outputs
      if (kFq) {
        if (bad) fq = make_uint4(0x7FC07FC0u, 0x7FC07FC0u, 0x7FC07FC0u, 0x7FC07FC0u);
        *reinterpret_cast<uint4*>(out.fake_quant + chunk * 8) = fq;
      }
      if (kPack) out.packed[chunk] = bad ? 0x88888888u : word;  // q = 0 everywhere in a poisoned group
    }
    if (lane == 0) out.scale[g] = (uint16_t)s_bits;
  }
}

template <int kGroup, bool kFq, bool kPack>
void launch_outputs(bool vec, bool contig, unsigned ctas, cudaStream_t s, const uint16_t* src, int64_t rows,
                    int64_t cols, int64_t ld, int divisor_x2, float eps, Int4Out out) {
  if (vec && contig)
    int4_quant_kernel<kGroup, true, true, kFq, kPack><<<ctas, kThreads, 0, s>>>(src, rows, cols, ld, divisor_x2,
                                                                                eps, out);
  else if (vec)
    int4_quant_kernel<kGroup, true, false, kFq, kPack><<<ctas, kThreads, 0, s>>>(src, rows, cols, ld, divisor_x2,
                                                                                 eps, out);
  else
    int4_quant_kernel<kGroup, false, false, kFq, kPack><<<ctas, kThreads, 0, s>>>(src, rows, cols, ld, divisor_x2,
                                                                                  eps, out);
}

template <int kGroup>
void launch(bool vec, bool contig, unsigned ctas, cudaStream_t s, const uint16_t* src, int64_t rows, int64_t cols,
            int64_t ld, int divisor_x2, float eps, Int4Out out) {
  if (out.fake_quant && out.packed)
    launch_outputs<kGroup, true, true>(vec, contig, ctas, s, src, rows, cols, ld, divisor_x2, eps, out);
  else if (out.fake_quant)
    launch_outputs<kGroup, true, false>(vec, contig, ctas, s, src, rows, cols, ld, divisor_x2, eps, out);
  else
    launch_outputs<kGroup, false, true>(vec, contig, ctas, s, src, rows, cols, ld, divisor_x2, eps, out);
}

}  // namespace

ebt_status_t EBT_QUANT_VARIANT(bf16_int4_quant)(const void* src, int64_t rows, int64_t cols, int64_t ld,
                                                int64_t group, int divisor_x2, float eps, void* fake_quant,
                                                void* packed, void* scale, void* stream) {
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
  EBT_QUANT_REQUIRE(scale, "int4_quant: the scale output is required");
  EBT_QUANT_REQUIRE(fake_quant || packed, "int4_quant: no output requested (fake_quant and/or packed)");
  EBT_QUANT_REQUIRE(ld >= cols, "int4_quant: row stride %lld < cols %lld", (long long)ld, (long long)cols);
  EBT_QUANT_REQUIRE((reinterpret_cast<uintptr_t>(fake_quant) & 15u) == 0, "int4_quant: fake_quant not 16-byte aligned");
  EBT_QUANT_REQUIRE((reinterpret_cast<uintptr_t>(packed) & 3u) == 0, "int4_quant: packed not 4-byte aligned");
  EBT_QUANT_REQUIRE((reinterpret_cast<uintptr_t>(scale) & 1u) == 0, "int4_quant: scale not 2-byte aligned");
  const int64_t units = rows * (cols / 16);  // 2 chunks of 8 each (group % 16 == 0)
  const int64_t ctas = (units + kThreads * kUnroll - 1) / (kThreads * kUnroll);
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
