// bindings.cc — ebbtide._C.quant: thin pybind11 wrappers over the launchers (launchers.h). Arguments are raw
// device pointers (Python ints from tensor.data_ptr()), sizes, strides and the CUDA stream handle; no torch
// types cross this boundary. Failing statuses raise the typed ebbtide exception (EBT_PY_CHECK). Without a CUDA
// build every launcher raises UnsupportedError.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "csrc/py_status.h"
#include "csrc/status.h"
#include "quant/launchers.h"

namespace py = pybind11;

namespace ebbtide::quant {
namespace {

#if EBBTIDE_WITH_CUDA
constexpr bool kWithCuda = true;
#define EBT_QUANT_CALL(call) EBT_PY_CHECK(call)
#else
constexpr bool kWithCuda = false;
#define EBT_QUANT_CALL(call) \
  EBT_PY_CHECK(ebt_set_error(EBT_ERROR_UNSUPPORTED, "ebbtide was built without CUDA: quant kernels unavailable"))
#endif

inline void* ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }

}  // namespace

void register_bindings(py::module_& m) {
  m.doc() = "FP8 / INT4 quantization kernels (sm90); the numerics contract is ebbtide.quant.reference";
  m.attr("WITH_CUDA") = kWithCuda;
  m.attr("SCALE_FP32") = int(kScaleFp32);
  m.attr("SCALE_UE8M0") = int(kScaleUe8m0);
  m.attr("SCALE_UE8M0_PACKED") = int(kScaleUe8m0Packed);
  m.attr("LAYOUT_ROW") = int(kLayoutRow);
  m.attr("LAYOUT_MN_MAJOR") = int(kLayoutMnMajor);
  m.attr("LIST_ENTRY_WORDS") = int(sizeof(BlockListEntry) / sizeof(int64_t));

  m.def(
      "fp8_block_quant",
      [](uintptr_t src, int64_t experts, int64_t rows, int64_t cols, int64_t ld, int64_t expert_stride, uintptr_t q,
         uintptr_t scale, int scale_mode, float eps, uintptr_t stream) {
        EBT_QUANT_CALL(sm90_bf16_fp8_block_quant(ptr(src), experts, rows, cols, ld, expert_stride, ptr(q),
                                                 ptr(scale), scale_mode, eps, ptr(stream)));
      },
      py::arg("src"), py::arg("experts"), py::arg("rows"), py::arg("cols"), py::arg("ld"), py::arg("expert_stride"),
      py::arg("q"), py::arg("scale"), py::arg("scale_mode"), py::arg("eps"), py::arg("stream"),
      "128x128 FP8 block quant of bf16 [experts, rows, cols] (row stride ld) in one launch.");
  m.def(
      "fp8_block_quant_list",
      [](uintptr_t host_entries, uintptr_t device_entries, int64_t count, float eps, uintptr_t stream) {
        EBT_QUANT_CALL(sm90_bf16_fp8_block_quant_list(reinterpret_cast<const BlockListEntry*>(host_entries),
                                                      ptr(device_entries), count, eps, ptr(stream)));
      },
      py::arg("host_entries"), py::arg("device_entries"), py::arg("count"), py::arg("eps"), py::arg("stream"),
      "Block quant of `count` tensors in one launch; entries are int64[count, 8] tables (host copy validated, "
      "device copy read by the kernel).");
  m.attr("COPY_SEGMENT_CHUNK") = int64_t(kCopySegmentChunk);
  m.def(
      "copy_segments",
      [](uintptr_t host_segments, uintptr_t device_segments, int64_t count, uintptr_t stream) {
        EBT_QUANT_CALL(sm90_copy_segments(reinterpret_cast<const CopySegment*>(host_segments), ptr(device_segments),
                                          count, ptr(stream)));
      },
      py::arg("host_segments"), py::arg("device_segments"), py::arg("count"), py::arg("stream"),
      "Byte copies of `count` segments in one launch; segments are int64[count, 4] tables (dst, src, nbytes, "
      "chunk_begin): the host copy validated, the device copy read by the kernel.");
  m.def(
      "fp8_block_dequant",
      [](uintptr_t q, uintptr_t scale, int64_t experts, int64_t rows, int64_t cols, uintptr_t out, uintptr_t stream) {
        EBT_QUANT_CALL(sm90_bf16_fp8_block_dequant(ptr(q), ptr(scale), experts, rows, cols, ptr(out), ptr(stream)));
      },
      py::arg("q"), py::arg("scale"), py::arg("experts"), py::arg("rows"), py::arg("cols"), py::arg("out"),
      py::arg("stream"), "bf16 = RNbf16(float(q) * s) over 128x128 blocks.");
  m.def(
      "fp8_group_quant",
      [](uintptr_t src, int64_t rows, int64_t cols, int64_t ld, int64_t group, uintptr_t q, uintptr_t scale,
         int scale_mode, int scale_layout, float eps, uintptr_t stream) {
        EBT_QUANT_CALL(sm90_bf16_fp8_group_quant(ptr(src), rows, cols, ld, group, ptr(q), ptr(scale), scale_mode,
                                                 scale_layout, eps, ptr(stream)));
      },
      py::arg("src"), py::arg("rows"), py::arg("cols"), py::arg("ld"), py::arg("group"), py::arg("q"),
      py::arg("scale"), py::arg("scale_mode"), py::arg("scale_layout"), py::arg("eps"), py::arg("stream"),
      "1 x group FP8 token-group quant with the scale layout fused.");
  m.def(
      "int4_quant",
      [](uintptr_t src, int64_t rows, int64_t cols, int64_t ld, int64_t group, int divisor_x2, float eps,
         uintptr_t fake_quant, uintptr_t packed, uintptr_t scale, uintptr_t stream) {
        EBT_QUANT_CALL(sm90_bf16_int4_quant(ptr(src), rows, cols, ld, group, divisor_x2, eps, ptr(fake_quant),
                                            ptr(packed), ptr(scale), ptr(stream)));
      },
      py::arg("src"), py::arg("rows"), py::arg("cols"), py::arg("ld"), py::arg("group"), py::arg("divisor_x2"),
      py::arg("eps"), py::arg("fake_quant"), py::arg("packed"), py::arg("scale"), py::arg("stream"),
      "INT4 symmetric group quant: any of fake-quant bf16, pack-quantized int32 and bf16 scales (0 = skip).");
  m.def(
      "int4_unpack",
      [](uintptr_t packed, uintptr_t scale, int64_t rows, int64_t cols, int64_t group, uintptr_t out, uintptr_t q,
         uintptr_t stream) {
        EBT_QUANT_CALL(sm90_bf16_int4_unpack(ptr(packed), ptr(scale), rows, cols, group, ptr(out), ptr(q),
                                             ptr(stream)));
      },
      py::arg("packed"), py::arg("scale"), py::arg("rows"), py::arg("cols"), py::arg("group"), py::arg("out"),
      py::arg("q"), py::arg("stream"), "pack-quantized INT4 -> served bf16 weight and/or int8 codes (0 = skip).");
}

}  // namespace ebbtide::quant
