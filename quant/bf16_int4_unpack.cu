/*
 * bf16_int4_unpack.cu — compressed-tensors pack-quantized INT4 -> the served bf16 weight
 * RNbf16(q * s) (Marlin's dequant: exact int4 -> bf16, one bf16 multiply) and/or the int8 codes.
 *
 * Mapping: one thread per packed int32 word (8 elements): 4-byte load, 16-byte bf16 store / 8-byte int8 store;
 * kUnroll words per thread, loads first. A NaN scale (the non-finite policy) gives 0x7FC0.
 */
#include "quant/common.cuh"
#include "quant/launch.cuh"

namespace ebbtide::quant {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

__global__ void __launch_bounds__(kThreads)
    int4_unpack_kernel(const uint32_t* __restrict__ packed, const uint16_t* __restrict__ scale, int64_t rows,
                       int64_t cols, int64_t group, uint16_t* __restrict__ out, int8_t* __restrict__ q) {
  const int64_t cpr = cols / 8;
  const int64_t gpr = cols / group;  // groups per row
  const int64_t total = rows * cpr;
  const int64_t base = (int64_t)blockIdx.x * kThreads * kUnroll + threadIdx.x;
  uint32_t w[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t ch = base + (int64_t)u * kThreads;
    w[u] = ch < total ? __ldg(&packed[ch]) : 0u;
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t ch = base + (int64_t)u * kThreads;
    if (ch >= total) continue;
    const int64_t r = dev::udiv(ch, cpr), c = (ch - r * cpr) * 8;
    const float s = __uint_as_float((uint32_t)__ldg(&scale[r * gpr + dev::udiv(c, group)]) << 16);
    uint32_t o[4];
    uint32_t qb[2] = {0, 0};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int qi = (int)((w[u] >> (4 * i)) & 0xFu) - 8;
      const uint32_t b = dev::f32_to_bf16_bits(__fmul_rn((float)qi, s));
      if (i & 1) o[i >> 1] |= b << 16; else o[i >> 1] = b;
      qb[i >> 2] |= ((uint32_t)qi & 0xFFu) << (8 * (i & 3));
    }
    if (out) *reinterpret_cast<uint4*>(out + ch * 8) = make_uint4(o[0], o[1], o[2], o[3]);
    if (q) *reinterpret_cast<uint2*>(q + ch * 8) = make_uint2(qb[0], qb[1]);
  }
}

}  // namespace

ebt_status_t EBT_QUANT_VARIANT(bf16_int4_unpack)(const void* packed, const void* scale, int64_t rows,
                                                 int64_t cols, int64_t group, void* out, void* q, void* stream) {
  EBT_QUANT_REQUIRE(rows >= 0 && cols >= 0, "int4_unpack: negative size");
  EBT_QUANT_REQUIRE(group == 32 || group == 64 || group == 128, "int4_unpack: group must be 32, 64 or 128 (got %lld)",
                    (long long)group);
  EBT_QUANT_REQUIRE(cols % group == 0, "int4_unpack: K=%lld is not a multiple of the group size %lld",
                    (long long)cols, (long long)group);
  if (rows == 0 || cols == 0) return EBT_SUCCESS;
  EBT_QUANT_REQUIRE(packed && scale, "int4_unpack: null packed or scale");
  EBT_QUANT_REQUIRE(out || q, "int4_unpack: no output requested");
  EBT_QUANT_REQUIRE((reinterpret_cast<uintptr_t>(packed) & 3u) == 0, "int4_unpack: packed not 4-byte aligned");
  EBT_QUANT_REQUIRE((reinterpret_cast<uintptr_t>(scale) & 1u) == 0, "int4_unpack: scale not 2-byte aligned");
  EBT_QUANT_REQUIRE((reinterpret_cast<uintptr_t>(out) & 15u) == 0, "int4_unpack: out not 16-byte aligned");
  EBT_QUANT_REQUIRE((reinterpret_cast<uintptr_t>(q) & 7u) == 0, "int4_unpack: q not 8-byte aligned");
  const int64_t chunks = rows * (cols / 8);
  const int64_t ctas = (chunks + kThreads * kUnroll - 1) / (kThreads * kUnroll);
  EBT_QUANT_REQUIRE(ctas <= 0x7FFFFFFF, "int4_unpack: tensor too large");
  int4_unpack_kernel<<<(unsigned)ctas, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint32_t*>(packed), static_cast<const uint16_t*>(scale), rows, cols, group,
      static_cast<uint16_t*>(out), static_cast<int8_t*>(q));
  return launch_status("int4_unpack");
}

}  // namespace ebbtide::quant
