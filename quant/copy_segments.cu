/*
 * copy_segments.cu — many byte copies dst_i <- src_i in one launch (weight sync: a staged bucket's outputs into
 * the receiver's parameters, thousands of them for an MoE layer's experts and scales).
 *
 * Design: the segments are cut into 32 KB chunks numbered segment by segment (CopySegment::chunk_begin is the
 * prefix sum); one 256-thread CTA copies one chunk, so the hardware scheduler balances chunks of large and tiny
 * segments alike. Every thread finds its chunk's segment by a binary search over chunk_begin (uniform addresses:
 * one L1 broadcast per step). A chunk whose two addresses are 16-byte aligned moves as 8 x 16-byte loads per thread,
 * all in flight before the first store (the tail of a segment whose size is no multiple of 16 goes byte by byte);
 * other chunks go byte by byte. Segments must not overlap each other or themselves.
 */
#include "quant/common.cuh"
#include "quant/launch.cuh"

namespace ebbtide::quant {
namespace {

constexpr int kCopyThreads = 256;
constexpr int kCopyLoads = 8;  // 16-byte loads per thread per chunk
constexpr int64_t kChunk = int64_t(kCopyThreads) * kCopyLoads * 16;
static_assert(kChunk == kCopySegmentChunk, "launchers.h states the chunk size");

__global__ void __launch_bounds__(kCopyThreads)
    copy_segments_kernel(const CopySegment* __restrict__ segs, int64_t count) {
  const int64_t chunk = blockIdx.x;
  int64_t lo = 0, hi = count - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
    if (__ldg(&segs[mid].chunk_begin) <= chunk) lo = mid; else hi = mid - 1;
  }
  const int64_t off = (chunk - __ldg(&segs[lo].chunk_begin)) * kChunk;
  const int64_t left = __ldg(&segs[lo].nbytes) - off;
  const int64_t n = left < kChunk ? left : kChunk;
  uint8_t* d = reinterpret_cast<uint8_t*>(__ldg(&segs[lo].dst)) + off;
  const uint8_t* s = reinterpret_cast<const uint8_t*>(__ldg(&segs[lo].src)) + off;
  int64_t done = 0;
  if (((reinterpret_cast<uintptr_t>(d) | reinterpret_cast<uintptr_t>(s)) & 15u) == 0) {
    const int words = (int)(n >> 4);
    uint4 v[kCopyLoads];
#pragma unroll
    for (int i = 0; i < kCopyLoads; ++i) {
      const int w = (int)threadIdx.x + i * kCopyThreads;
      if (w < words) v[i] = dev::ld_stream16(s + 16 * (int64_t)w);
    }
#pragma unroll
    for (int i = 0; i < kCopyLoads; ++i) {
      const int w = (int)threadIdx.x + i * kCopyThreads;
      if (w < words) *reinterpret_cast<uint4*>(d + 16 * (int64_t)w) = v[i];
    }
    done = (int64_t)words * 16;
  }
  for (int64_t b = done + threadIdx.x; b < n; b += kCopyThreads) d[b] = s[b];
}

}  // namespace

ebt_status_t EBT_QUANT_VARIANT(copy_segments)(const CopySegment* host_segments, const void* device_segments,
                                              int64_t count, void* stream) {
  EBT_QUANT_REQUIRE(count >= 0, "copy_segments: negative count");
  if (count == 0) return EBT_SUCCESS;
  EBT_QUANT_REQUIRE(host_segments, "copy_segments: null host segment table");
  constexpr int64_t kMaxChunks = 0x7FFFFFFF;  // the grid's x extent
  int64_t chunks = 0;
  for (int64_t i = 0; i < count; ++i) {
    const CopySegment& g = host_segments[i];
    EBT_QUANT_REQUIRE(g.nbytes >= 1, "copy_segments: segment %lld has %lld bytes (at least 1)", (long long)i,
                      (long long)g.nbytes);
    EBT_QUANT_REQUIRE(g.dst && g.src, "copy_segments: segment %lld has a null pointer", (long long)i);
    EBT_QUANT_REQUIRE(g.chunk_begin == chunks,
                      "copy_segments: segment %lld chunk_begin %lld, expected the prefix sum %lld", (long long)i,
                      (long long)g.chunk_begin, (long long)chunks);
    EBT_QUANT_REQUIRE((g.nbytes - 1) / kChunk < kMaxChunks - chunks, "copy_segments: too many chunks at segment %lld",
                      (long long)i);  // never overflows: chunks <= kMaxChunks here
    chunks += (g.nbytes - 1) / kChunk + 1;
  }
  // the device copy is checked after the entries, so a test can pass a bad table with no device memory at all
  EBT_QUANT_REQUIRE(device_segments, "copy_segments: null device segment table (a device copy of the host table)");
  EBT_QUANT_REQUIRE((reinterpret_cast<uintptr_t>(device_segments) & 7u) == 0,
                    "copy_segments: device segment table is not 8-byte aligned");
  copy_segments_kernel<<<(unsigned)chunks, kCopyThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const CopySegment*>(device_segments), count);
  return launch_status("copy_segments");
}

}  // namespace ebbtide::quant
