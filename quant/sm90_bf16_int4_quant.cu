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
constexpr int kUnroll = 4;

struct Int4Out {
  uint16_t* fake_quant;  // bf16 [rows, cols] or null
  uint32_t* packed;      // int32 [rows, cols / 8] or null
  uint16_t* scale;       // bf16 [rows, cols / group] or null
};

template <int kGroup, bool kVec>
__global__ void __launch_bounds__(kThreads)
    int4_quant_kernel(const uint16_t* __restrict__ src, int64_t rows, int64_t cols, int64_t ld, int divisor_x2,
                      float eps, Int4Out out) {
  constexpr int kLanes = kGroup / 8;  // threads per group
  const int64_t cpr = cols / 8;
  const int64_t total = rows * cpr;
  const float inv_d = __uint_as_float(divisor_x2 == 14 ? dev::kInv7Bits : dev::kInv7_5Bits);
  const float qmin = divisor_x2 == 14 ? -7.0f : -8.0f;
  const int64_t base = (int64_t)blockIdx.x * kThreads * kUnroll + threadIdx.x;

  uint4 v[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t ch = base + (int64_t)u * kThreads;
    const int64_t r = dev::udiv(ch, cpr), c = (ch - r * cpr) * 8;
    const uint16_t* p = src + r * ld + c;
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
    const float s = __uint_as_float(s_bits << 16);
    const uint32_t w[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
    uint32_t word = 0;
    uint32_t fq[4];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float x = (i & 1) ? dev::bf16_hi(w[i >> 1]) : dev::bf16_lo(w[i >> 1]);
      const float r = fminf(fmaxf(rintf(__fdiv_rn(x, s)), qmin), 7.0f);
      const int qi = bad ? 0 : (int)r;
      word |= (uint32_t)(qi + 8) << (4 * i);
      const uint32_t o = bad ? dev::kBf16NanBits : dev::f32_to_bf16_bits(__fmul_rn((float)qi, s));
      if (i & 1) fq[i >> 1] |= o << 16; else fq[i >> 1] = o;
    }
    if (out.fake_quant)
      *reinterpret_cast<uint4*>(out.fake_quant + ch * 8) = make_uint4(fq[0], fq[1], fq[2], fq[3]);
    if (out.packed) out.packed[ch] = word;
    if (out.scale && (threadIdx.x % kLanes) == 0) {
      const int64_t r = dev::udiv(ch, cpr), c = (ch - r * cpr) * 8;
      out.scale[r * (cols / kGroup) + c / kGroup] = (uint16_t)s_bits;
    }
  }
}

template <int kGroup>
void launch(bool vec, unsigned ctas, cudaStream_t s, const uint16_t* src, int64_t rows, int64_t cols, int64_t ld,
            int divisor_x2, float eps, Int4Out out) {
  if (vec)
    int4_quant_kernel<kGroup, true><<<ctas, kThreads, 0, s>>>(src, rows, cols, ld, divisor_x2, eps, out);
  else
    int4_quant_kernel<kGroup, false><<<ctas, kThreads, 0, s>>>(src, rows, cols, ld, divisor_x2, eps, out);
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
  if (group == 32) launch<32>(vec, (unsigned)ctas, s, in, rows, cols, ld, divisor_x2, eps, out);
  else if (group == 64) launch<64>(vec, (unsigned)ctas, s, in, rows, cols, ld, divisor_x2, eps, out);
  else launch<128>(vec, (unsigned)ctas, s, in, rows, cols, ld, divisor_x2, eps, out);
  return launch_status("int4_quant");
}

}  // namespace ebbtide::quant
