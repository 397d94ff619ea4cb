/*
 * bf16_fp8_group_quant.cu — FP8 e4m3 1x128 per-token-group quant of bf16 activations with the scale layout
 * fused into the store: row-major fp32, MN-major TMA-aligned fp32 (DeepGEMM SFA), UE8M0 in an fp32 container,
 * or packed UE8M0 (4 K-groups per int32, MN-major).
 *
 * Mapping: a 256-thread CTA owns a tile of 16 rows x 8 K-groups (32 KB of input) and walks it row-major, so
 * every layout reads the same way: 128 threads cover one row's 8 groups (2 KB contiguous) per pass, two rows per
 * pass, 8 passes with all loads issued before the first reduction (8 x 16 bytes in flight per thread, like the
 * block kernel). 16 threads own one group and reduce its max with 4 xor-shuffles. The tile's 128 scales go
 * through shared memory and leave in the layout's order: row-major 8 consecutive floats per row, MN-major 16
 * consecutive floats per K-group, packed UE8M0 16 consecutive int32 words per 4 K-groups (padding rows and bytes
 * written as 0 by the tile that holds them).
 * Contract: launchers.h; numerics in common.cuh (the same fp8_scale/fp8_quant8 as the block kernels); built as
 * the sm90 and the portable variant (common.cuh).
 */
#include "quant/common.cuh"
#include "quant/launch.cuh"

namespace ebbtide::quant {
namespace {

constexpr int kThreads = 256;
constexpr int kTileRows = 16;
constexpr int kTileGroups = 8;
constexpr int kPasses = kTileRows * kTileGroups * 16 / kThreads;  // 8

template <bool kVec>
__global__ void __launch_bounds__(kThreads, 4)
    fp8_group_quant_kernel(const uint16_t* __restrict__ src, int64_t rows, int64_t cols, int64_t ld,
                           uint8_t* __restrict__ q, void* __restrict__ scale, int scale_mode, int scale_layout,
                           float eps) {
  __shared__ float tile_scale[kTileRows][kTileGroups];
  const int64_t G = cols / 128;
  const int64_t tiles_g = (G + kTileGroups - 1) / kTileGroups;
  const int64_t ty = dev::udiv(blockIdx.x, tiles_g);
  const int64_t row0 = ty * kTileRows, g0 = (blockIdx.x - ty * tiles_g) * kTileGroups;
  const bool ue8m0 = scale_mode != kScaleFp32;
  const int lane = threadIdx.x & 15;                   // 16-byte chunk within the group
  const int tg = (threadIdx.x >> 4) & (kTileGroups - 1);  // group within the tile
  const int tr = threadIdx.x >> 7;                     // row within the pass (0, 1)
  const int64_t gc = g0 + tg;
  const bool g_ok = gc < G;
  const int64_t col = gc * 128 + lane * 8;

  uint4 v[kPasses];
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int64_t row = row0 + tr + 2 * p;
    const uint16_t* ptr = src + row * ld + col;
    if (!g_ok || row >= rows) {
      v[p] = make_uint4(0, 0, 0, 0);
    } else if (kVec) {
      v[p] = dev::ld_stream16(ptr);
    } else {
      v[p].x = ptr[0] | ((uint32_t)ptr[1] << 16);
      v[p].y = ptr[2] | ((uint32_t)ptr[3] << 16);
      v[p].z = ptr[4] | ((uint32_t)ptr[5] << 16);
      v[p].w = ptr[6] | ((uint32_t)ptr[7] << 16);
    }
  }
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int64_t row = row0 + tr + 2 * p;
    uint32_t m = dev::fold2(dev::absmax2(dev::absmax2(dev::absmax2(dev::absmax2(0u, v[p].x), v[p].y), v[p].z),
                                         v[p].w));
#pragma unroll
    for (int off = 8; off >= 1; off >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
    if (!g_ok || row >= rows) continue;
    const dev::Fp8Scale sc = dev::fp8_scale(m, eps, ue8m0);
    *reinterpret_cast<uint2*>(q + row * cols + col) = dev::fp8_quant8(v[p], sc);
    if (lane == 0) tile_scale[tr + 2 * p][tg] = sc.s;
  }
  __syncthreads();
  const int t = threadIdx.x;
  if (scale_mode == kScaleUe8m0Packed) {
    // words (g0 / 4 + w) of rows row0 + r: 4 K-groups each, byte k = exponent of group 4 w + k (0 past G)
    const int64_t A = dev::align4(rows), W = (G + 3) / 4;
    const int r = t & (kTileRows - 1), w = t >> 4;
    const int64_t row = row0 + r, word = g0 / 4 + w;
    if (w < kTileGroups / 4 && word < W && row < A) {
      uint32_t packed = 0;
      if (row < rows) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          if (g0 + 4 * w + k >= G) break;
          const float sv = tile_scale[r][4 * w + k];
          const uint32_t byte = isnan(sv) ? 0xFFu : (__float_as_uint(sv) >> 23);
          packed |= byte << (8 * k);
        }
      }
      static_cast<uint32_t*>(scale)[word * A + row] = packed;
    }
  } else if (scale_layout == kLayoutRow) {
    const int r = t >> 3, g = t & (kTileGroups - 1);
    const int64_t row = row0 + r;
    if (r < kTileRows && row < rows && g0 + g < G) static_cast<float*>(scale)[row * G + g0 + g] = tile_scale[r][g];
  } else {
    // MN-major: column g0 + g holds rows 0..A-1; padding rows (rows..A-1) lie in the last row tile, written 0
    const int64_t A = dev::align4(rows);
    const int r = t & (kTileRows - 1), g = t >> 4;
    const int64_t row = row0 + r;
    if (g < kTileGroups && row < A && g0 + g < G)
      static_cast<float*>(scale)[(g0 + g) * A + row] = row < rows ? tile_scale[r][g] : 0.0f;
  }
}

}  // namespace

ebt_status_t EBT_QUANT_VARIANT(bf16_fp8_group_quant)(const void* src, int64_t rows, int64_t cols, int64_t ld,
                                                     int64_t group, void* q, void* scale, int scale_mode,
                                                     int scale_layout, float eps, void* stream) {
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
  const int64_t tiles = ((rows + kTileRows - 1) / kTileRows) * ((cols / 128 + kTileGroups - 1) / kTileGroups);
  EBT_QUANT_REQUIRE(tiles <= 0x7FFFFFFF, "fp8_group_quant: too many tiles (%lld)", (long long)tiles);
  const bool vec = (reinterpret_cast<uintptr_t>(src) & 15u) == 0 && ld % 8 == 0;
  auto s = static_cast<cudaStream_t>(stream);
  if (vec)
    fp8_group_quant_kernel<true><<<(unsigned)tiles, kThreads, 0, s>>>(static_cast<const uint16_t*>(src), rows, cols,
                                                                     ld, static_cast<uint8_t*>(q), scale,
                                                                     scale_mode, scale_layout, eps);
  else
    fp8_group_quant_kernel<false><<<(unsigned)tiles, kThreads, 0, s>>>(static_cast<const uint16_t*>(src), rows,
                                                                      cols, ld, static_cast<uint8_t*>(q), scale,
                                                                      scale_mode, scale_layout, eps);
  return launch_status("fp8_group_quant");
}

}  // namespace ebbtide::quant
