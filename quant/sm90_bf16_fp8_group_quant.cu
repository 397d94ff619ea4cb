/*
 * sm90_bf16_fp8_group_quant.cu — FP8 e4m3 1x128 per-token-group quant of bf16 activations with the scale layout
 * fused into the store: row-major fp32, MN-major TMA-aligned fp32 (DeepGEMM SFA), UE8M0 in an fp32 container,
 * or packed UE8M0 (4 K-groups per int32, MN-major).
 *
 * Mapping: 16 threads own one group (8 bf16 = one 16-byte load each) and reduce its max with 4 xor-shuffles; a
 * 256-thread CTA owns kUnroll x 16 groups, all loads issued before the first reduction. Groups are numbered
 * row-major for the row layout (contiguous scale stores) and column-major (consecutive rows of one K-group) for
 * the MN-major layouts, so a CTA's scale stores are contiguous either way.
 * Contract: launchers.h; numerics in sm90_common.cuh (the same fp8_scale/fp8_quant8 as the block kernels).
 */
#include "quant/sm90_common.cuh"
#include "quant/sm90_launch.cuh"

namespace ebbtide::quant {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int kGroupsPerPass = kThreads / 16;
constexpr int kGroupsPerCta = kGroupsPerPass * kUnroll;

template <bool kVec>
__global__ void __launch_bounds__(kThreads, 4)
    fp8_group_quant_kernel(const uint16_t* __restrict__ src, int64_t rows, int64_t cols, int64_t ld,
                           uint8_t* __restrict__ q, void* __restrict__ scale, int scale_mode, int scale_layout,
                           float eps) {
  const int64_t G = cols / 128;
  const int64_t total = rows * G;
  const bool mn_order = scale_layout == kLayoutMnMajor || scale_mode == kScaleUe8m0Packed;
  const bool ue8m0 = scale_mode != kScaleFp32;
  const int lane = threadIdx.x & 15;
  const int sub = threadIdx.x >> 4;
  const int64_t base = (int64_t)blockIdx.x * kGroupsPerCta;

  uint4 v[kUnroll];
  int64_t row[kUnroll], gc[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t gid = base + u * kGroupsPerPass + sub;
    const bool ok = gid < total;
    const int64_t g = ok ? gid : 0;
    const int64_t d = dev::udiv(g, mn_order ? rows : G);
    row[u] = mn_order ? g - d * rows : d;
    gc[u] = mn_order ? d : g - d * G;
    const uint16_t* p = src + row[u] * ld + gc[u] * 128 + lane * 8;
    if (!ok) {
      v[u] = make_uint4(0, 0, 0, 0);
      row[u] = -1;
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
    uint32_t m = dev::fold2(dev::absmax2(dev::absmax2(dev::absmax2(dev::absmax2(0u, v[u].x), v[u].y), v[u].z),
                                         v[u].w));
#pragma unroll
    for (int off = 8; off >= 1; off >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
    if (row[u] < 0) continue;
    const dev::Fp8Scale sc = dev::fp8_scale(m, eps, ue8m0);
    *reinterpret_cast<uint2*>(q + row[u] * cols + gc[u] * 128 + lane * 8) = dev::fp8_quant8(v[u], sc);
    if (lane != 0) continue;
    if (scale_mode == kScaleUe8m0Packed) {
      dev::store_packed_ue8m0(static_cast<uint8_t*>(scale), row[u], rows, gc[u], G, sc.s);
    } else if (scale_layout == kLayoutRow) {
      static_cast<float*>(scale)[row[u] * G + gc[u]] = sc.s;
    } else {
      const int64_t A = dev::align4(rows);
      float* col = static_cast<float*>(scale) + gc[u] * A;
      col[row[u]] = sc.s;
      if (row[u] == rows - 1)
        for (int64_t r = rows; r < A; ++r) col[r] = 0.0f;
    }
  }
}

}  // namespace

ebt_status_t sm90_bf16_fp8_group_quant(const void* src, int64_t rows, int64_t cols, int64_t ld, int64_t group,
                                       void* q, void* scale, int scale_mode, int scale_layout, float eps,
                                       void* stream) {
  EBT_QUANT_REQUIRE(rows >= 0 && cols >= 0, "fp8_group_quant: negative size (%lld, %lld)", (long long)rows,
                    (long long)cols);
  EBT_QUANT_REQUIRE(group == 128, "fp8_group_quant: group must be 128 (got %lld)", (long long)group);
  EBT_QUANT_REQUIRE(cols % group == 0, "fp8_group_quant: K=%lld is not a multiple of the group size %lld",
                    (long long)cols, (long long)group);
  if (rows == 0 || cols == 0) return EBT_SUCCESS;
  EBT_QUANT_REQUIRE(src && q && scale, "fp8_group_quant: null pointer (src, q and scale are required)");
  EBT_QUANT_REQUIRE(ld >= cols, "fp8_group_quant: row stride %lld < cols %lld", (long long)ld, (long long)cols);
  EBT_QUANT_REQUIRE(scale_mode == kScaleFp32 || scale_mode == kScaleUe8m0 || scale_mode == kScaleUe8m0Packed,
                    "fp8_group_quant: unknown scale mode %d", scale_mode);
  EBT_QUANT_REQUIRE(scale_layout == kLayoutRow || scale_layout == kLayoutMnMajor,
                    "fp8_group_quant: unknown scale layout %d", scale_layout);
  EBT_QUANT_REQUIRE(scale_mode != kScaleUe8m0Packed || scale_layout == kLayoutMnMajor,
                    "fp8_group_quant: packed UE8M0 scales are MN-major (scale_layout must be mn_major)");
  EBT_QUANT_REQUIRE(eps_in_range(eps), "fp8_group_quant: eps must be in [1e-30, 1e30] (got %g)", (double)eps);
  EBT_QUANT_REQUIRE((reinterpret_cast<uintptr_t>(q) & 7u) == 0, "fp8_group_quant: q is not 8-byte aligned");
  EBT_QUANT_REQUIRE(scale_mode == kScaleUe8m0Packed || (reinterpret_cast<uintptr_t>(scale) & 3u) == 0,
                    "fp8_group_quant: fp32 scale buffer is not 4-byte aligned");
  const int64_t total = rows * (cols / 128);
  const int64_t ctas = (total + kGroupsPerCta - 1) / kGroupsPerCta;
  EBT_QUANT_REQUIRE(ctas <= 0x7FFFFFFF, "fp8_group_quant: too many groups (%lld)", (long long)total);
  const bool vec = (reinterpret_cast<uintptr_t>(src) & 15u) == 0 && ld % 8 == 0;
  auto s = static_cast<cudaStream_t>(stream);
  if (vec)
    fp8_group_quant_kernel<true><<<(unsigned)ctas, kThreads, 0, s>>>(static_cast<const uint16_t*>(src), rows, cols,
                                                                     ld, static_cast<uint8_t*>(q), scale,
                                                                     scale_mode, scale_layout, eps);
  else
    fp8_group_quant_kernel<false><<<(unsigned)ctas, kThreads, 0, s>>>(static_cast<const uint16_t*>(src), rows,
                                                                      cols, ld, static_cast<uint8_t*>(q), scale,
                                                                      scale_mode, scale_layout, eps);
  return launch_status("fp8_group_quant");
}

}  // namespace ebbtide::quant
