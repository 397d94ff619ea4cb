/*
 * bf16_fp8_block_quant_list.cu — FP8 128x128 block quant of a list of bf16 tensors of different shapes in
 * one launch (weight sync: many parameters into one output bucket). Built as the sm90 and the portable variant
 * (common.cuh).
 *
 * Table: up to kParamEntries entries travel in the launch itself (a __grid_constant__ parameter), longer lists
 * are read from the caller's device copy.
 * Design: one 256-thread CTA per 128x128 tile of the global tile sequence (tiles numbered tensor by tensor;
 * BlockListEntry::tile_begin is the prefix sum), exactly as the single-tensor kernel launches, so the hardware
 * scheduler balances the tiles dynamically. A CTA finds its tensor by a binary search over tile_begin (log2(count)
 * loads that hit L1 after the first CTAs on the SM). Per tile the arithmetic is the single-tensor kernel's (the
 * shared fp8_block_tile), so list and single quant give identical bits.
 * A persistent grid (SMs x resident CTAs, static grid stride) measures the same on one 7168^2 weight (~80% of copy
 * bandwidth, against ~87% for the single-tensor kernel on the same tiles): what separates the two is the per-CTA
 * prologue (quant/NOTES.md).
 */
#include "quant/fp8_block_tile.cuh"
#include "quant/launch.cuh"

namespace ebbtide::quant {
namespace {

// Lists up to this long travel inside the launch as a kernel parameter (8 KB; CUDA >= 12.1 takes up to 32,764
// bytes on sm_70 and later): no host-to-device copy ahead of the kernel, whose few microseconds on the stream cost
// ~10% on one 7168^2 weight. Longer lists read a device copy of the table.
constexpr int kParamEntries = kBlockListParamEntries;
struct ParamTable {
  BlockListEntry e[kParamEntries];
};

// Entry field reads: global through the read-only path, or the kernel's parameter space (plain loads).
template <bool kParam>
__device__ __forceinline__ int64_t field(const int64_t* p) {
  if (kParam) return *p;
  return __ldg(p);
}

template <bool kParam>
__device__ __forceinline__ void list_tile(const BlockListEntry* entries, int64_t count, float eps) {
  __shared__ uint32_t red[dev::kTileThreads / 32];
  __shared__ dev::BlockTileArgs args;  // the tile's arguments, found once per CTA (registers stay for the data)
  if (threadIdx.x == 0) {
    const int64_t tile = blockIdx.x;
    // binary search: the last entry whose tile_begin <= tile
    int64_t lo = 0, hi = count - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) >> 1;
      if (field<kParam>(&entries[mid].tile_begin) <= tile) lo = mid; else hi = mid - 1;
    }
    const BlockListEntry& en = entries[lo];
    const int64_t rows = field<kParam>(&en.rows), cols = field<kParam>(&en.cols), ld = field<kParam>(&en.ld);
    const int64_t kb = (cols + 127) / 128;
    const int64_t local = tile - field<kParam>(&en.tile_begin);
    const int64_t bi = dev::udiv(local, kb), bj = local - bi * kb;
    const int mode = (int)field<kParam>(&en.scale_mode);
    const int64_t scale = field<kParam>(&en.scale);
    dev::BlockTileArgs a;
    a.src = reinterpret_cast<const uint16_t*>(field<kParam>(&en.src)) + bi * dev::kBlock * ld + bj * dev::kBlock;
    a.ld = ld;
    a.rows = dev::clip_block(rows - bi * dev::kBlock);
    a.cols = dev::clip_block(cols - bj * dev::kBlock);
    a.q = reinterpret_cast<uint8_t*>(field<kParam>(&en.q)) + bi * dev::kBlock * cols + bj * dev::kBlock;
    a.ldq = cols;
    a.eps = eps;
    a.scale_mode = mode;
    a.scale = mode == kScaleUe8m0Packed ? reinterpret_cast<void*>(scale)
                                        : reinterpret_cast<void*>(reinterpret_cast<float*>(scale) + local);
    a.row0 = bi * dev::kBlock;
    a.mat_rows = rows;
    a.bj = bj;
    a.kb = kb;
    args = a;
  }
  __syncthreads();
  dev::fp8_block_tile(args, red);
}

__global__ void __launch_bounds__(dev::kTileThreads, 4)
    fp8_block_quant_list_kernel(const BlockListEntry* __restrict__ entries, int64_t count, float eps) {
  list_tile<false>(entries, count, eps);
}

__global__ void __launch_bounds__(dev::kTileThreads, 4)
    fp8_block_quant_list_param_kernel(const __grid_constant__ ParamTable table, int64_t count, float eps) {
  list_tile<true>(table.e, count, eps);
}

}  // namespace

ebt_status_t EBT_QUANT_VARIANT(bf16_fp8_block_quant_list)(const BlockListEntry* host_entries,
                                                          const void* device_entries, int64_t count, float eps,
                                                          void* stream) {
  EBT_QUANT_REQUIRE(count >= 0, "fp8_block_quant_list: negative count");
  if (count == 0) return EBT_SUCCESS;
  EBT_QUANT_REQUIRE(host_entries, "fp8_block_quant_list: null host entry table");
  EBT_QUANT_REQUIRE(count <= kParamEntries || device_entries,
                    "fp8_block_quant_list: a list of more than %d entries needs the device copy of the table",
                    kParamEntries);
  EBT_QUANT_REQUIRE((reinterpret_cast<uintptr_t>(device_entries) & 7u) == 0,
                    "fp8_block_quant_list: device entry table is not 8-byte aligned");
  EBT_QUANT_REQUIRE(eps_in_range(eps), "fp8_block_quant_list: eps must be in [1e-30, 1e30] (got %g)", (double)eps);
  int64_t tiles = 0;
  for (int64_t i = 0; i < count; ++i) {
    const BlockListEntry& e = host_entries[i];
    EBT_QUANT_REQUIRE(e.src && e.q && e.scale, "fp8_block_quant_list: entry %lld has a null pointer", (long long)i);
    EBT_QUANT_REQUIRE(e.rows >= 1 && e.cols >= 1 && e.ld >= e.cols,
                      "fp8_block_quant_list: entry %lld has bad shape [%lld, %lld] / stride %lld", (long long)i,
                      (long long)e.rows, (long long)e.cols, (long long)e.ld);
    EBT_QUANT_REQUIRE(e.scale_mode == kScaleFp32 || e.scale_mode == kScaleUe8m0 || e.scale_mode == kScaleUe8m0Packed,
                      "fp8_block_quant_list: entry %lld has unknown scale mode %lld", (long long)i,
                      (long long)e.scale_mode);
    EBT_QUANT_REQUIRE(e.scale_mode == kScaleUe8m0Packed || (e.scale & 3) == 0,
                      "fp8_block_quant_list: entry %lld fp32 scale pointer is not 4-byte aligned", (long long)i);
    EBT_QUANT_REQUIRE(e.tile_begin == tiles,
                      "fp8_block_quant_list: entry %lld tile_begin %lld, expected the prefix sum %lld", (long long)i,
                      (long long)e.tile_begin, (long long)tiles);
    tiles += ((e.rows + 127) / 128) * ((e.cols + 127) / 128);
  }
  EBT_QUANT_REQUIRE(tiles <= 0x7FFFFFFF, "fp8_block_quant_list: too many tiles (%lld)", (long long)tiles);
  auto st = static_cast<cudaStream_t>(stream);
  if (count <= kParamEntries) {
    ParamTable table{};  // unused entries zero
    for (int64_t i = 0; i < count; ++i) table.e[i] = host_entries[i];
    fp8_block_quant_list_param_kernel<<<(unsigned)tiles, dev::kTileThreads, 0, st>>>(table, count, eps);
  } else {
    fp8_block_quant_list_kernel<<<(unsigned)tiles, dev::kTileThreads, 0, st>>>(
        static_cast<const BlockListEntry*>(device_entries), count, eps);
  }
  return launch_status("fp8_block_quant_list");
}

}  // namespace ebbtide::quant
