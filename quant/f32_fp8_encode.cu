/*
 * f32_fp8_encode.cu — E4M3 (satfinite: cvt.rn.satfinite's rules, fp8_convert.h) of n fp32 values with the
 * variant's conversion alone. What it is for: comparing the portable variant's software conversion with the sm90
 * variant's instruction on every fp32 bit pattern, on the GPU that runs them (tests/quant). Built as both variants
 * (common.cuh).
 *
 * Mapping: 4 values per thread (one 16-byte load, one 4-byte store); a tail of n % 4 values element by element.
 */
#include "quant/common.cuh"
#include "quant/launch.cuh"

namespace ebbtide::quant {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    fp8_encode_kernel(const uint32_t* __restrict__ src, int64_t n, uint8_t* __restrict__ dst) {
  const int64_t i = ((int64_t)blockIdx.x * kThreads + threadIdx.x) * 4;
  if (i + 4 <= n) {
    const uint4 v = *reinterpret_cast<const uint4*>(src + i);
    *reinterpret_cast<uint32_t*>(dst + i) =
        dev::Fp8::e4m3x2(__uint_as_float(v.x), __uint_as_float(v.y)) |
        (dev::Fp8::e4m3x2(__uint_as_float(v.z), __uint_as_float(v.w)) << 16);
  } else {
    for (int64_t k = i; k < n; ++k) dst[k] = (uint8_t)(dev::Fp8::e4m3x2(__uint_as_float(src[k]), 0.0f) & 0xFFu);
  }
}

}  // namespace

ebt_status_t EBT_QUANT_VARIANT(f32_fp8_encode)(const void* src, int64_t n, void* dst, void* stream) {
  EBT_QUANT_REQUIRE(n >= 0, "fp8_encode: negative count %lld", (long long)n);
  if (n == 0) return EBT_SUCCESS;
  EBT_QUANT_REQUIRE(src && dst, "fp8_encode: null pointer (src and dst are required)");
  EBT_QUANT_REQUIRE((reinterpret_cast<uintptr_t>(src) & 15u) == 0, "fp8_encode: src is not 16-byte aligned");
  EBT_QUANT_REQUIRE((reinterpret_cast<uintptr_t>(dst) & 3u) == 0, "fp8_encode: dst is not 4-byte aligned");
  const int64_t ctas = (n + kThreads * 4 - 1) / (kThreads * 4);
  EBT_QUANT_REQUIRE(ctas <= 0x7FFFFFFF, "fp8_encode: too many values (%lld)", (long long)n);
  fp8_encode_kernel<<<(unsigned)ctas, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint32_t*>(src), n, static_cast<uint8_t*>(dst));
  return launch_status("fp8_encode");
}

}  // namespace ebbtide::quant
