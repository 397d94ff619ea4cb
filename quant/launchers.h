/*
 * launchers.h — host entry points of the quant CUDA kernels. Plain C++ types only (no CUDA or torch headers), so
 * bindings.cc compiles without nvcc; streams travel as void* (a cudaStream_t).
 *
 * Variants: each kernel family is one source file (<dtype>_<op>.cu) built as the portable variant, whose launchers
 * are named portable_<dtype>_<op> (every architecture of the build, sm_80 and later), and the FP8 families once more
 * as the sm90 variant, sm90_<dtype>_<op> (only the build's sm_89+ architectures: the FP8 conversion instructions;
 * absent from builds without such an architecture: EBT_QUANT_HAS_SM90 == 0 in bindings.cc). The two variants
 * give the same bits for every input; which one runs is chosen at run time from the device's compute capability in one
 * place (python/ebbtide/quant/_dispatch.py), which reads kernel_image() below.
 *
 * Caller's contract (every launcher):
 *  - Pointers are device pointers on the current device; outputs do not overlap inputs or each other.
 *  - Sizes are elements; strides are elements. Zero-sized work is a successful no-op.
 *  - The launcher validates every argument and returns a status (EBT_ERROR_INVALID_ARGUMENT with
 *    ebt_last_error() saying why) before anything is launched; EBT_ERROR_CUDA_RUNTIME if the launch itself fails.
 *  - Asynchronous: the work is queued on `stream`; nothing blocks the host.
 *  - Numerics: exactly docs/quant.md and python/ebbtide/quant/reference.py (the oracle), including the
 *    non-finite policy: a NaN/Inf poisons its block/group (scale NaN, e4m3 bytes 0x7F; INT4 scale bf16 NaN, q 0).
 */
#ifndef EBBTIDE_QUANT_LAUNCHERS_H_
#define EBBTIDE_QUANT_LAUNCHERS_H_

#include <stdint.h>

#include "csrc/ebbtide.h"

namespace ebbtide::quant {

// Declares a launcher in both variants: sm90_<name> and portable_<name>, with the same parameters and contract.
#define EBT_QUANT_BOTH_VARIANTS(name, params) \
  ebt_status_t sm90_##name params;            \
  ebt_status_t portable_##name params;

// The variant a binding call runs (python/ebbtide/quant/_dispatch.py picks it).
enum Variant : int { kVariantSm90 = 0, kVariantPortable = 1 };

// What the current device loads of a variant's code (kernel_image): cuda_error 0 and the versions of the code the
// runtime picked (binary_version 90: sm_90 SASS, or the device's when it compiled PTX; ptx_version: the PTX it
// came from, 0 if SASS), or the cudaError_t of the query (209 no code for this device, 35 driver older than the
// runtime, 222 PTX newer than the driver, ...). runtime_version: the CUDA runtime built in (CUDART_VERSION);
// driver_version: cudaDriverGetVersion (0 without a driver); error_name: cudaGetErrorName of cuda_error.
struct KernelImage {
  int cuda_error;
  int binary_version;
  int ptx_version;
  int runtime_version;
  int driver_version;
  char error_name[48];
};
EBT_QUANT_BOTH_VARIANTS(kernel_image, (KernelImage* out))

// How block/group scales are written.
enum ScaleMode : int {
  kScaleFp32 = 0,        // fp32 s = RN32(max(amax, eps) * RN32(1/448))
  kScaleUe8m0 = 1,       // fp32 container holding 2^(e-127)
  kScaleUe8m0Packed = 2  // one byte e per scale, 4 consecutive K-groups per int32, MN-major, MN stride align(MN, 4)
};

// Group-quant scale layout (fp32 / ue8m0 modes; packed is always MN-major).
enum ScaleLayout : int { kLayoutRow = 0, kLayoutMnMajor = 1 };

// 128x128 block quant of `experts` bf16 matrices [rows, cols] (row stride `ld`, expert stride `expert_stride`)
// into q [experts, rows, cols] e4m3 (contiguous) and scales:
//   fp32/ue8m0: float [experts, ceil(rows/128), ceil(cols/128)] contiguous;
//   packed:     int32 [experts, rows, ceil(kb/4)] with strides (ceil(kb/4) * align(rows, 4), 1, align(rows, 4)),
//               block scales replicated per row (DeepGEMM SFB); padding bytes and rows written as 0.
// Blocks never straddle experts. One launch.
EBT_QUANT_BOTH_VARIANTS(bf16_fp8_block_quant,
                        (const void* src, int64_t experts, int64_t rows, int64_t cols, int64_t ld,
                         int64_t expert_stride, void* q, void* scale, int scale_mode, float eps, void* stream))

// One entry of a block-quant list (weight sync: many tensors into one bucket, one launch). 8 int64 words so that
// Python can build the table as an int64 [count, 8] tensor.
struct BlockListEntry {
  int64_t src;          // bf16 [rows, cols], row stride ld
  int64_t q;            // e4m3 [rows, cols] contiguous
  int64_t scale;        // per scale_mode, as in bf16_fp8_block_quant with experts = 1
  int64_t ld;           // elements, >= cols
  int64_t rows;         // >= 1
  int64_t cols;         // >= 1
  int64_t tile_begin;   // prefix sum of ceil(rows/128) * ceil(cols/128) over the earlier entries
  int64_t scale_mode;   // ScaleMode
};
static_assert(sizeof(BlockListEntry) == 64, "BlockListEntry is read as int64[8] by Python");

// Quantize `count` tensors in one launch. `host_entries` is validated (pointers, shapes, tile prefix sums). Up to
// kBlockListParamEntries entries are passed to the kernel inside the launch (`device_entries` may be null); longer
// lists are read from `device_entries`, which must hold the same bytes (copied there by the caller, stream-ordered).
constexpr int kBlockListParamEntries = 128;
EBT_QUANT_BOTH_VARIANTS(bf16_fp8_block_quant_list, (const BlockListEntry* host_entries, const void* device_entries,
                                                     int64_t count, float eps, void* stream))

// Byte copies dst <- src of `count` segments in one launch (not a quant kernel: the bucket unpack of weight sync,
// next to the bucket layout it serves). Segment i covers chunks [chunk_begin, chunk_begin + ceil(nbytes /
// kCopySegmentChunk)) of the launch; chunk_begin is the prefix sum. `host_segments` is validated; the kernel reads
// `device_segments`, which must hold the same bytes (stream-ordered before the launch). Segments do not overlap.
struct CopySegment {
  int64_t dst;
  int64_t src;
  int64_t nbytes;       // >= 1
  int64_t chunk_begin;
};
static_assert(sizeof(CopySegment) == 32, "CopySegment is read as int64[4] by Python");
constexpr int64_t kCopySegmentChunk = 32768;
ebt_status_t portable_copy_segments(const CopySegment* host_segments, const void* device_segments, int64_t count,
                                    void* stream);

// Dequant: bf16 out[e, r, c] = RNbf16(RN32(float(q) * scale[e, r/128, c/128])); scale fp32 (or UE8M0-valued fp32)
// [experts, ceil(rows/128), ceil(cols/128)] contiguous; q and out contiguous [experts, rows, cols].
EBT_QUANT_BOTH_VARIANTS(bf16_fp8_block_dequant, (const void* q, const void* scale, int64_t experts, int64_t rows,
                                                  int64_t cols, void* out, void* stream))

// 1 x group token-group quant of bf16 [rows, cols] (row stride ld), cols % group == 0, group == 128:
// q [rows, cols] e4m3 contiguous; scale per scale_mode/layout (G = cols / group, A = align(rows, 4)):
//   row:      float [rows, G] contiguous            mn_major: float [G, A] buffer (logical [rows, G], strides (1, A))
//   packed:   int32 [ceil(G/4), A] buffer (logical [rows, ceil(G/4)], strides (1, A)).
// MN-major padding rows and packed padding bytes are written as 0.
EBT_QUANT_BOTH_VARIANTS(bf16_fp8_group_quant,
                        (const void* src, int64_t rows, int64_t cols, int64_t ld, int64_t group, void* q,
                         void* scale, int scale_mode, int scale_layout, float eps, void* stream))

// INT4 symmetric group quant of bf16 [rows, cols] (row stride ld), group in {32, 64, 128}, cols % group == 0,
// divisor_x2 = 14 (D = 7, q in [-7, 7]) or 15 (D = 7.5, q in [-8, 7]). Always writes scale; writes fake_quant
// and/or packed, whichever are non-null (at least one):
//   fake_quant bf16 [rows, cols] contiguous: RNbf16(q * s)       (the QAT forward)
//   packed     int32 [rows, cols / 8]: nibble i of word j = q[8j + i] + 8   (compressed-tensors pack-quantized)
//   scale      bf16 [rows, cols / group]: s = RNbf16(max(RN32(amax * RN32(1/D)), eps))
// The QAT forward and the exporter call this same kernel, so they cannot disagree.
ebt_status_t portable_bf16_int4_quant(const void* src, int64_t rows, int64_t cols, int64_t ld, int64_t group,
                                      int divisor_x2, float eps, void* fake_quant, void* packed, void* scale,
                                      void* stream);

// INT4 unpack: packed int32 [rows, cols / 8] + scale bf16 [rows, cols / group] -> any non-null of
//   out bf16 [rows, cols]: RNbf16(q * s) (the served weight);  q int8 [rows, cols].
ebt_status_t portable_bf16_int4_unpack(const void* packed, const void* scale, int64_t rows, int64_t cols,
                                       int64_t group, void* out, void* q, void* stream);

// E4M3 of n fp32 values (src 16-byte aligned, dst 4-byte aligned) with the variant's conversion alone, by
// cvt.rn.satfinite's rules (fp8_convert.h): the sm90 variant's instruction against the portable variant's software
// on every fp32 pattern (tests/quant).
EBT_QUANT_BOTH_VARIANTS(f32_fp8_encode, (const void* src, int64_t n, void* dst, void* stream))

}  // namespace ebbtide::quant

#endif  // EBBTIDE_QUANT_LAUNCHERS_H_
