/*
 * bf16_fp8_block_quant.cu — FP8 e4m3 128x128 block quant of bf16 weights, single matrix or MoE [E, N, K]
 * in one launch (grid = (K blocks, N blocks, experts): a block never straddles experts).
 *
 * Contract: launchers.h and docs/quant.md; the tile arithmetic lives in fp8_block_tile.cuh. One source, two
 * variants (common.cuh): sm90_ and portable_bf16_fp8_block_quant.
 * Bandwidth: each CTA reads its 32 KB tile once (8 x 16-byte loads per thread in flight) and writes 16 KB.
 */
#include "quant/fp8_block_tile.cuh"
#include "quant/launch.cuh"

namespace ebbtide::quant {
namespace {

__global__ void __launch_bounds__(dev::kTileThreads, 4)
    fp8_block_quant_kernel(const uint16_t* __restrict__ src, int64_t rows, int64_t cols, int64_t ld,
                           int64_t expert_stride, uint8_t* __restrict__ q, void* __restrict__ scale,
                           int scale_mode, float eps) {
  __shared__ uint32_t red[dev::kTileThreads / 32];
  const int64_t bj = blockIdx.x, bi = blockIdx.y, e = blockIdx.z;
  const int64_t nb = gridDim.y, kb = gridDim.x;
  dev::BlockTileArgs a;
  a.src = src + e * expert_stride + bi * dev::kBlock * ld + bj * dev::kBlock;
  a.ld = ld;
  a.rows = dev::clip_block(rows - bi * dev::kBlock);
  a.cols = dev::clip_block(cols - bj * dev::kBlock);
  a.q = q + e * rows * cols + bi * dev::kBlock * cols + bj * dev::kBlock;
  a.ldq = cols;
  a.eps = eps;
  a.scale_mode = scale_mode;
  if (scale_mode == kScaleUe8m0Packed) {
    const int64_t words = (kb + 3) / 4;
    a.scale = static_cast<uint8_t*>(scale) + e * words * dev::align4(rows) * 4;
  } else {
    a.scale = static_cast<float*>(scale) + (e * nb + bi) * kb + bj;
  }
  a.row0 = bi * dev::kBlock;
  a.mat_rows = rows;
  a.bj = bj;
  a.kb = kb;
  dev::fp8_block_tile(a, red);
}

}  // namespace

ebt_status_t EBT_QUANT_VARIANT(bf16_fp8_block_quant)(const void* src, int64_t experts, int64_t rows, int64_t cols,
                                                     int64_t ld, int64_t expert_stride, void* q, void* scale,
                                                     int scale_mode, float eps, void* stream) {
  EBT_QUANT_REQUIRE(experts >= 0 && rows >= 0 && cols >= 0, "fp8_block_quant: negative size (%lld, %lld, %lld)",
                    (long long)experts, (long long)rows, (long long)cols);
  if (experts == 0 || rows == 0 || cols == 0) return EBT_SUCCESS;
  EBT_QUANT_REQUIRE(src && q && scale, "fp8_block_quant: null pointer (src, q and scale are required)");
  EBT_QUANT_REQUIRE(ld >= cols, "fp8_block_quant: row stride %lld < cols %lld", (long long)ld, (long long)cols);
  EBT_QUANT_REQUIRE(experts == 1 || expert_stride >= (rows - 1) * ld + cols,
                    "fp8_block_quant: expert stride %lld overlaps the [%lld, %lld] matrices (ld %lld)",
                    (long long)expert_stride, (long long)rows, (long long)cols, (long long)ld);
  EBT_QUANT_REQUIRE(scale_mode == kScaleFp32 || scale_mode == kScaleUe8m0 || scale_mode == kScaleUe8m0Packed,
                    "fp8_block_quant: unknown scale mode %d", scale_mode);
  EBT_QUANT_REQUIRE(eps_in_range(eps), "fp8_block_quant: eps must be in [1e-30, 1e30] (got %g)", (double)eps);
  const int64_t nb = (rows + 127) / 128, kb = (cols + 127) / 128;
  EBT_QUANT_REQUIRE(nb <= 65535 && experts <= 65535 && kb <= 0x7FFFFFFF,
                    "fp8_block_quant: grid too large (%lld x %lld blocks, %lld experts)", (long long)nb,
                    (long long)kb, (long long)experts);
  EBT_QUANT_REQUIRE(scale_mode == kScaleUe8m0Packed || (reinterpret_cast<uintptr_t>(scale) & 3u) == 0,
                    "fp8_block_quant: fp32 scale buffer is not 4-byte aligned");
  const dim3 grid((unsigned)kb, (unsigned)nb, (unsigned)experts);
  fp8_block_quant_kernel<<<grid, dev::kTileThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint16_t*>(src), rows, cols, ld, experts == 1 ? 0 : expert_stride,
      static_cast<uint8_t*>(q), scale, scale_mode, eps);
  return launch_status("fp8_block_quant");
}

}  // namespace ebbtide::quant
