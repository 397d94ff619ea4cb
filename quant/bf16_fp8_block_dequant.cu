/*
 * bf16_fp8_block_dequant.cu — bf16 = RNbf16(RN32(float(q) * s)) for 128x128 block-scaled e4m3 weights,
 * single matrix or [E, N, K] in one launch.
 *
 * Mapping: one thread per 8 consecutive elements of a row (8-byte load, 16-byte store), kUnroll chunks per
 * thread with grid-stride-free indexing; rows whose length is not a multiple of 8 take the per-element kernel.
 * e4m3 -> fp32 is exact in both variants (sm90: cvt.rn.f16x2.e4m3x2, f16 holds every e4m3 value; portable: bit
 * moves, fp8_convert.h); NaN codes give 0x7FC0.
 */
#include "quant/common.cuh"
#include "quant/launch.cuh"

namespace ebbtide::quant {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

__device__ __forceinline__ uint32_t deq2(uint16_t pair, float s) {
  const float2 f = dev::Fp8::e4m3x2_to_f32(pair);
  return dev::f32_to_bf16_bits(__fmul_rn(f.x, s)) | (dev::f32_to_bf16_bits(__fmul_rn(f.y, s)) << 16);
}

__global__ void __launch_bounds__(kThreads)
    fp8_block_dequant_vec_kernel(const uint8_t* __restrict__ q, const float* __restrict__ scale, int64_t rows,
                                 int64_t cols, int64_t total_chunks, uint16_t* __restrict__ out) {
  const int64_t cpr = cols / 8;  // chunks per row
  const int64_t nb = (rows + 127) / 128, kb = (cols + 127) / 128;
  const int64_t base = (int64_t)blockIdx.x * kThreads * kUnroll + threadIdx.x;
  uint2 v[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t ch = base + (int64_t)u * kThreads;
    v[u] = ch < total_chunks ? *reinterpret_cast<const uint2*>(q + ch * 8) : make_uint2(0, 0);
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t ch = base + (int64_t)u * kThreads;
    if (ch >= total_chunks) continue;
    const int64_t grow = dev::udiv(ch, cpr), c = (ch - grow * cpr) * 8;
    const int64_t e = dev::udiv(grow, rows), r = grow - e * rows;
    const float s = __ldg(&scale[(e * nb + r / 128) * kb + c / 128]);
    uint4 o;
    o.x = deq2((uint16_t)(v[u].x & 0xFFFFu), s);
    o.y = deq2((uint16_t)(v[u].x >> 16), s);
    o.z = deq2((uint16_t)(v[u].y & 0xFFFFu), s);
    o.w = deq2((uint16_t)(v[u].y >> 16), s);
    *reinterpret_cast<uint4*>(out + ch * 8) = o;
  }
}

__global__ void __launch_bounds__(kThreads)
    fp8_block_dequant_scalar_kernel(const uint8_t* __restrict__ q, const float* __restrict__ scale, int64_t rows,
                                    int64_t cols, int64_t total, uint16_t* __restrict__ out) {
  const int64_t nb = (rows + 127) / 128, kb = (cols + 127) / 128;
  for (int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x; i < total; i += (int64_t)gridDim.x * kThreads) {
    const int64_t grow = dev::udiv(i, cols), c = i - grow * cols;
    const int64_t e = dev::udiv(grow, rows), r = grow - e * rows;
    const float s = __ldg(&scale[(e * nb + r / 128) * kb + c / 128]);
    out[i] = (uint16_t)(deq2((uint16_t)q[i], s) & 0xFFFFu);
  }
}

}  // namespace

ebt_status_t EBT_QUANT_VARIANT(bf16_fp8_block_dequant)(const void* q, const void* scale, int64_t experts,
                                                       int64_t rows, int64_t cols, void* out, void* stream) {
  EBT_QUANT_REQUIRE(experts >= 0 && rows >= 0 && cols >= 0, "fp8_block_dequant: negative size");
  if (experts == 0 || rows == 0 || cols == 0) return EBT_SUCCESS;
  EBT_QUANT_REQUIRE(q && scale && out, "fp8_block_dequant: null pointer (q, scale and out are required)");
  EBT_QUANT_REQUIRE((reinterpret_cast<uintptr_t>(scale) & 3u) == 0, "fp8_block_dequant: scale is not 4-byte aligned");
  EBT_QUANT_REQUIRE((reinterpret_cast<uintptr_t>(out) & 1u) == 0, "fp8_block_dequant: out is not 2-byte aligned");
  auto s = static_cast<cudaStream_t>(stream);
  const int64_t total = experts * rows * cols;
  const bool vec = cols % 8 == 0 && (reinterpret_cast<uintptr_t>(q) & 7u) == 0 &&
                   (reinterpret_cast<uintptr_t>(out) & 15u) == 0;
  if (vec) {
    const int64_t chunks = total / 8;
    const int64_t ctas = (chunks + kThreads * kUnroll - 1) / (kThreads * kUnroll);
    EBT_QUANT_REQUIRE(ctas <= 0x7FFFFFFF, "fp8_block_dequant: tensor too large");
    fp8_block_dequant_vec_kernel<<<(unsigned)ctas, kThreads, 0, s>>>(
        static_cast<const uint8_t*>(q), static_cast<const float*>(scale), rows, cols, chunks,
        static_cast<uint16_t*>(out));
  } else {
    const int64_t ctas = (total + kThreads - 1) / kThreads;
    const unsigned grid = (unsigned)(ctas < 65536 * 8 ? ctas : 65536 * 8);
    fp8_block_dequant_scalar_kernel<<<grid, kThreads, 0, s>>>(static_cast<const uint8_t*>(q),
                                                              static_cast<const float*>(scale), rows, cols, total,
                                                              static_cast<uint16_t*>(out));
  }
  return launch_status("fp8_block_dequant");
}

}  // namespace ebbtide::quant
