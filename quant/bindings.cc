// bindings.cc — ebbtide._C.quant: thin pybind11 wrappers over the launchers (launchers.h). Arguments are raw
// device pointers (Python ints from tensor.data_ptr()), sizes, strides and the CUDA stream handle; no torch
// types cross this boundary. Failing statuses raise the typed ebbtide exception (EBT_PY_CHECK). Without a CUDA
// build every launcher raises UnsupportedError. The FP8 calls take `variant` (VARIANT_SM90 / VARIANT_PORTABLE,
// chosen by python/ebbtide/quant/_dispatch.py); VARIANTS lists the variants this build has. The host e4m3 encoder
// and decoder are the portable variant's conversion (fp8_convert.h) compiled for the CPU, in every build.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

#include "csrc/py_status.h"
#include "csrc/status.h"
#include "quant/fp8_convert.h"
#include "quant/launchers.h"
#include "ebbtide_build_info.h"

namespace py = pybind11;

namespace ebbtide::quant {
namespace {

// Every failing status raises the typed exception with the launcher's own message (it names the kernel).
#if EBBTIDE_WITH_CUDA
constexpr bool kWithCuda = true;
#define EBT_QUANT_CALL(call) ::ebbtide::py_check((call), "ebbtide.quant")
#else
constexpr bool kWithCuda = false;
#define EBT_QUANT_CALL(call)                                                                         \
  ::ebbtide::py_check(                                                                                 \
      ebt_set_error(EBT_ERROR_UNSUPPORTED, "ebbtide was built without CUDA: quant kernels unavailable"), \
      "ebbtide.quant")
#endif
#if !defined(EBT_QUANT_HAS_SM90)
#define EBT_QUANT_HAS_SM90 0
#endif

// The variant a call asked for, after checking that this build has it: InvalidArgumentError for an unknown one,
// UnsupportedError for the sm90 variant in a build without it.
int check_variant(int variant, const char* kernel) {
  if (variant != kVariantSm90 && variant != kVariantPortable)
    py_check(ebt_set_error(EBT_ERROR_INVALID_ARGUMENT, "%s: unknown kernel variant %d (0 sm90, 1 portable)", kernel,
                           variant), "ebbtide.quant");
  if (variant == kVariantSm90 && !EBT_QUANT_HAS_SM90)
    py_check(ebt_set_error(EBT_ERROR_UNSUPPORTED, "%s: this build has no sm90 kernels (no architecture >= 89 in %s)",
                           kernel, EBBTIDE_BUILD_CUDA_ARCHS), "ebbtide.quant");
  return variant;
}

// The launcher of an FP8 family in the variant asked for: sm90_<name> or portable_<name>.
#if EBT_QUANT_HAS_SM90
#define EBT_QUANT_PICK(variant, name) (check_variant(variant, #name) == kVariantSm90 ? sm90_##name : portable_##name)
#else
#define EBT_QUANT_PICK(variant, name) (check_variant(variant, #name), portable_##name)
#endif

py::list built_variants() {
  py::list v;
  if (kWithCuda && EBT_QUANT_HAS_SM90) v.append("sm90");
  if (kWithCuda) v.append("portable");
  return v;
}

inline void* ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }

// dst[i] = f(src[i]) for n host values, without the GIL: the portable conversions on the CPU.
template <class In, class Out, class F>
void host_map(uintptr_t src, int64_t n, uintptr_t dst, const char* what, F f) {
  if (n < 0) py_check(ebt_set_error(EBT_ERROR_INVALID_ARGUMENT, "%s: negative count", what), "ebbtide.quant");
  const auto* in = reinterpret_cast<const In*>(src);
  auto* out = reinterpret_cast<Out*>(dst);
  py::gil_scoped_release nogil;
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<Out>(f(in[i]));
}

}  // namespace

void register_bindings(py::module_& m) {
  m.doc() = "FP8 / INT4 quantization kernels (sm90 and portable variants); the numerics contract is "
            "ebbtide.quant.reference";
  m.attr("WITH_CUDA") = kWithCuda;
  m.attr("VARIANTS") = built_variants();
  m.attr("VARIANT_SM90") = int(kVariantSm90);
  m.attr("VARIANT_PORTABLE") = int(kVariantPortable);
  m.attr("SCALE_FP32") = int(kScaleFp32);
  m.attr("SCALE_UE8M0") = int(kScaleUe8m0);
  m.attr("SCALE_UE8M0_PACKED") = int(kScaleUe8m0Packed);
  m.attr("LAYOUT_ROW") = int(kLayoutRow);
  m.attr("LAYOUT_MN_MAJOR") = int(kLayoutMnMajor);
  m.attr("LIST_ENTRY_WORDS") = int(sizeof(BlockListEntry) / sizeof(int64_t));

  m.def(
      "kernel_image",
      [](int variant) {
        KernelImage img{};
        EBT_QUANT_CALL(EBT_QUANT_PICK(variant, kernel_image)(&img));
        return py::dict(py::arg("cuda_error") = img.cuda_error, py::arg("error_name") = std::string(img.error_name),
                        py::arg("binary_version") = img.binary_version, py::arg("ptx_version") = img.ptx_version,
                        py::arg("runtime_version") = img.runtime_version,
                        py::arg("driver_version") = img.driver_version);
      },
      py::arg("variant"),
      "What the current device loads of a variant's kernels: {cuda_error (0: loadable), error_name, "
      "binary_version, ptx_version, runtime_version, driver_version} (launchers.h KernelImage).");
  m.def(
      "fp8_block_quant",
      [](uintptr_t src, int64_t experts, int64_t rows, int64_t cols, int64_t ld, int64_t expert_stride, uintptr_t q,
         uintptr_t scale, int scale_mode, float eps, int variant, uintptr_t stream) {
        EBT_QUANT_CALL(EBT_QUANT_PICK(variant, bf16_fp8_block_quant)(ptr(src), experts, rows, cols, ld, expert_stride,
                                                                     ptr(q), ptr(scale), scale_mode, eps, ptr(stream)));
      },
      py::arg("src"), py::arg("experts"), py::arg("rows"), py::arg("cols"), py::arg("ld"), py::arg("expert_stride"),
      py::arg("q"), py::arg("scale"), py::arg("scale_mode"), py::arg("eps"), py::arg("variant"), py::arg("stream"),
      "128x128 FP8 block quant of bf16 [experts, rows, cols] (row stride ld) in one launch.");
  m.def(
      "fp8_block_quant_list",
      [](uintptr_t host_entries, uintptr_t device_entries, int64_t count, float eps, int variant, uintptr_t stream) {
        EBT_QUANT_CALL(EBT_QUANT_PICK(variant, bf16_fp8_block_quant_list)(
            reinterpret_cast<const BlockListEntry*>(host_entries), ptr(device_entries), count, eps, ptr(stream)));
      },
      py::arg("host_entries"), py::arg("device_entries"), py::arg("count"), py::arg("eps"), py::arg("variant"),
      py::arg("stream"),
      "Block quant of `count` tensors in one launch; entries are int64[count, 8] tables (host copy validated, "
      "device copy read by the kernel).");
  m.attr("COPY_SEGMENT_CHUNK") = int64_t(kCopySegmentChunk);
  m.def(
      "copy_segments",
      [](uintptr_t host_segments, uintptr_t device_segments, int64_t count, uintptr_t stream) {
        EBT_QUANT_CALL(portable_copy_segments(reinterpret_cast<const CopySegment*>(host_segments),
                                              ptr(device_segments), count, ptr(stream)));
      },
      py::arg("host_segments"), py::arg("device_segments"), py::arg("count"), py::arg("stream"),
      "Byte copies of `count` segments in one launch; segments are int64[count, 4] tables (dst, src, nbytes, "
      "chunk_begin): the host copy validated, the device copy read by the kernel.");
  m.def(
      "fp8_block_dequant",
      [](uintptr_t q, uintptr_t scale, int64_t experts, int64_t rows, int64_t cols, uintptr_t out, int variant,
         uintptr_t stream) {
        EBT_QUANT_CALL(EBT_QUANT_PICK(variant, bf16_fp8_block_dequant)(ptr(q), ptr(scale), experts, rows, cols,
                                                                       ptr(out), ptr(stream)));
      },
      py::arg("q"), py::arg("scale"), py::arg("experts"), py::arg("rows"), py::arg("cols"), py::arg("out"),
      py::arg("variant"), py::arg("stream"), "bf16 = RNbf16(float(q) * s) over 128x128 blocks.");
  m.def(
      "fp8_group_quant",
      [](uintptr_t src, int64_t rows, int64_t cols, int64_t ld, int64_t group, uintptr_t q, uintptr_t scale,
         int scale_mode, int scale_layout, float eps, int variant, uintptr_t stream) {
        EBT_QUANT_CALL(EBT_QUANT_PICK(variant, bf16_fp8_group_quant)(ptr(src), rows, cols, ld, group, ptr(q),
                                                                     ptr(scale), scale_mode, scale_layout, eps,
                                                                     ptr(stream)));
      },
      py::arg("src"), py::arg("rows"), py::arg("cols"), py::arg("ld"), py::arg("group"), py::arg("q"),
      py::arg("scale"), py::arg("scale_mode"), py::arg("scale_layout"), py::arg("eps"), py::arg("variant"),
      py::arg("stream"), "1 x group FP8 token-group quant with the scale layout fused.");
  m.def(
      "f32_fp8_encode",
      [](uintptr_t src, int64_t n, uintptr_t dst, int variant, uintptr_t stream) {
        EBT_QUANT_CALL(EBT_QUANT_PICK(variant, f32_fp8_encode)(ptr(src), n, ptr(dst), ptr(stream)));
      },
      py::arg("src"), py::arg("n"), py::arg("dst"), py::arg("variant"), py::arg("stream"),
      "E4M3 (satfinite) of n fp32 values on the GPU with the variant's conversion alone (its test).");
  m.def(
      "int4_quant",
      [](uintptr_t src, int64_t rows, int64_t cols, int64_t ld, int64_t group, int divisor_x2, float eps,
         uintptr_t fake_quant, uintptr_t packed, uintptr_t scale, uintptr_t stream) {
        EBT_QUANT_CALL(portable_bf16_int4_quant(ptr(src), rows, cols, ld, group, divisor_x2, eps, ptr(fake_quant),
                                                ptr(packed), ptr(scale), ptr(stream)));
      },
      py::arg("src"), py::arg("rows"), py::arg("cols"), py::arg("ld"), py::arg("group"), py::arg("divisor_x2"),
      py::arg("eps"), py::arg("fake_quant"), py::arg("packed"), py::arg("scale"), py::arg("stream"),
      "INT4 symmetric group quant: any of fake-quant bf16, pack-quantized int32 and bf16 scales (0 = skip).");
  m.def(
      "int4_unpack",
      [](uintptr_t packed, uintptr_t scale, int64_t rows, int64_t cols, int64_t group, uintptr_t out, uintptr_t q,
         uintptr_t stream) {
        EBT_QUANT_CALL(portable_bf16_int4_unpack(ptr(packed), ptr(scale), rows, cols, group, ptr(out), ptr(q),
                                                 ptr(stream)));
      },
      py::arg("packed"), py::arg("scale"), py::arg("rows"), py::arg("cols"), py::arg("group"), py::arg("out"),
      py::arg("q"), py::arg("stream"), "pack-quantized INT4 -> served bf16 weight and/or int8 codes (0 = skip).");

  // The portable variant's conversions on the CPU (any build): what the CPU tests compare with the reference.
  m.def(
      "e4m3_encode_host",
      [](uintptr_t src, int64_t n, uintptr_t dst) {
        host_map<uint32_t, uint8_t>(src, n, dst, "e4m3_encode_host", [](uint32_t v) { return fp8::e4m3_encode(v); });
      },
      py::arg("src"), py::arg("n"), py::arg("dst"),
      "E4M3 (satfinite) of n fp32 bit patterns in host memory (uint32 src, uint8 dst) with the portable kernels' "
      "software conversion.");
  m.def(
      "e4m3_decode_host",
      [](uintptr_t src, int64_t n, uintptr_t dst) {
        host_map<uint8_t, uint32_t>(src, n, dst, "e4m3_decode_host", [](uint8_t v) { return fp8::e4m3_decode(v); });
      },
      py::arg("src"), py::arg("n"), py::arg("dst"),
      "fp32 bit patterns (uint32 dst) of n e4m3 bytes in host memory, with the portable kernels' software decode.");
}

}  // namespace ebbtide::quant
