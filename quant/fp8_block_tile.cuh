/*
 * fp8_block_tile.cuh — one 128x128 FP8 block tile processed by one 256-thread CTA; shared by the single /
 * MoE block-quant kernel and the list kernel so both produce the same bits by construction.
 *
 * Tile mapping (vector path): thread t owns column chunk t % 16 (8 bf16 = 16 bytes) of rows t / 16 + 16 p,
 * p = 0..7, so a warp reads two full 256-byte rows per step and each thread has 8 independent 16-byte loads in
 * flight before the first use. The values stay in registers between the amax reduction and the quantization:
 * every input byte is read from memory once. Any tile whose source rows are 16-byte aligned takes this path: a
 * ragged last chunk is loaded element by element, and stores narrow to the output's alignment (a K of 300 gives
 * 4-byte aligned output rows). Only a misaligned source takes the scalar path (per element, re-reading the tile;
 * same arithmetic).
 */
#ifndef EBBTIDE_QUANT_FP8_BLOCK_TILE_CUH_
#define EBBTIDE_QUANT_FP8_BLOCK_TILE_CUH_

#include "quant/launchers.h"
#include "quant/common.cuh"

namespace ebbtide::quant::dev {

constexpr int kBlock = 128;
constexpr int kTileThreads = 256;

__device__ __forceinline__ int clip_block(int64_t remaining) { return remaining < kBlock ? (int)remaining : kBlock; }

struct BlockTileArgs {
  const uint16_t* src;  // tile origin
  int64_t ld;           // source row stride, elements
  int rows, cols;       // valid extent of the tile (1..128)
  uint8_t* q;           // tile origin in the output
  int64_t ldq;          // output row stride (the matrix's column count)
  float eps;
  int scale_mode;
  // scale destination
  void* scale;          // fp32 modes: &scale[block]; packed: base of this matrix's packed buffer
  int64_t row0;         // first row of the tile (packed mode)
  int64_t mat_rows;     // rows of the whole matrix (packed mode)
  int64_t bj, kb;       // K-block index and count (packed mode)
};

// Block-wide max of per-thread values (unsigned). `red` holds kTileThreads / 32 words.
__device__ __forceinline__ uint32_t block_max(uint32_t v, uint32_t* red) {
  v = __reduce_max_sync(0xFFFFFFFFu, v);
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) red[warp] = v;
  __syncthreads();
  uint32_t m = 0;
#pragma unroll
  for (int w = 0; w < kTileThreads / 32; ++w) m = max(m, red[w]);
  __syncthreads();  // red may be reused by the next tile
  return m;
}

__device__ __forceinline__ void write_block_scale(const BlockTileArgs& a, const Fp8Scale& sc) {
  if (a.scale_mode == kScaleUe8m0Packed) {
    for (int r = threadIdx.x; r < a.rows; r += kTileThreads)
      store_packed_ue8m0(static_cast<uint8_t*>(a.scale), a.row0 + r, a.mat_rows, a.bj, a.kb, sc.s);
  } else if (threadIdx.x == 0) {
    *static_cast<float*>(a.scale) = sc.s;
  }
}

// Up to 8 bf16 of one row from 16-byte aligned memory: a 16-byte load when all 8 are in the tile, else only the
// n valid ones (never reading past the row's end); missing values are 0, which no |x| max can exceed.
__device__ __forceinline__ uint4 load_chunk(const uint16_t* p, int n) {
  if (n >= 8) return ld_stream16(p);
  uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
  for (int i = 0; i < 8; ++i)
    if (i < n) w[i >> 1] |= (uint32_t)p[i] << (16 * (i & 1));
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// The first n (1..8) of 8 e4m3 bytes to q, as wide as its alignment allows.
__device__ __forceinline__ void store_chunk(uint8_t* q, uint2 b, int n) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(q);
  if (n >= 8 && (a & 7u) == 0) {
    *reinterpret_cast<uint2*>(q) = b;
  } else if (n >= 8 && (a & 3u) == 0) {
    reinterpret_cast<uint32_t*>(q)[0] = b.x;
    reinterpret_cast<uint32_t*>(q)[1] = b.y;
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (i < n) q[i] = (uint8_t)((i < 4 ? b.x : b.y) >> (8 * (i & 3)));
  }
}

// The vector path. kNarrow = false: every chunk is 8 valid values and every output row 8-byte aligned (the common
// case; no run-time width or alignment checks in the hot loop, which cost 4% at 7168^2). kNarrow = true: a ragged
// last chunk and any output alignment.
template <bool kNarrow>
__device__ __forceinline__ void fp8_block_tile_vec(const BlockTileArgs& a, uint32_t* red, bool ue8m0) {
  const int c = (threadIdx.x & 15) * 8;
  const int r0 = threadIdx.x >> 4;
  const int n = a.cols - c;  // valid elements of this thread's chunk (<= 0: none)
  uint4 v[8];
#pragma unroll
  for (int p = 0; p < 8; ++p) {
    const int r = r0 + 16 * p;
    const uint16_t* src = a.src + (int64_t)r * a.ld + c;
    v[p] = (n > 0 && r < a.rows) ? (kNarrow ? load_chunk(src, n) : ld_stream16(src)) : make_uint4(0, 0, 0, 0);
  }
  uint32_t m = 0;
#pragma unroll
  for (int p = 0; p < 8; ++p) m = absmax2(absmax2(absmax2(absmax2(m, v[p].x), v[p].y), v[p].z), v[p].w);
  const Fp8Scale sc = fp8_scale(block_max(fold2(m), red), a.eps, ue8m0);
#pragma unroll
  for (int p = 0; p < 8; ++p) {
    const int r = r0 + 16 * p;
    if (n > 0 && r < a.rows) {
      uint8_t* q = a.q + (int64_t)r * a.ldq + c;
      if (kNarrow) store_chunk(q, fp8_quant8(v[p], sc), n);
      else *reinterpret_cast<uint2*>(q) = fp8_quant8(v[p], sc);
    }
  }
  write_block_scale(a, sc);
}

__device__ __forceinline__ void fp8_block_tile(const BlockTileArgs& a, uint32_t* red) {
  const bool ue8m0 = a.scale_mode != kScaleFp32;
  const bool src_vec = ((reinterpret_cast<uintptr_t>(a.src) & 15u) == 0) && (a.ld % 8 == 0);
  if (src_vec && ((reinterpret_cast<uintptr_t>(a.q) & 7u) == 0) && (a.ldq % 8 == 0) && (a.cols % 8 == 0)) {
    fp8_block_tile_vec<false>(a, red, ue8m0);
    return;
  }
  if (src_vec) {
    fp8_block_tile_vec<true>(a, red, ue8m0);
    return;
  }
  // scalar path: element e of the tile is (e / 128, e % 128); coalesced along rows
  uint32_t m = 0;
  for (int e = threadIdx.x; e < kBlock * kBlock; e += kTileThreads) {
    const int r = e >> 7, c = e & 127;
    if (r < a.rows && c < a.cols) m = max(m, (uint32_t)(a.src[(int64_t)r * a.ld + c] & 0x7FFFu));
  }
  const Fp8Scale sc = fp8_scale(block_max(m, red), a.eps, ue8m0);
  for (int e = threadIdx.x; e < kBlock * kBlock; e += kTileThreads) {
    const int r = e >> 7, c = e & 127;
    if (r < a.rows && c < a.cols) a.q[(int64_t)r * a.ldq + c] = fp8_quant1(a.src[(int64_t)r * a.ld + c], sc);
  }
  write_block_scale(a, sc);
}

}  // namespace ebbtide::quant::dev

#endif  // EBBTIDE_QUANT_FP8_BLOCK_TILE_CUH_
