/*
 * kernel_image.cu — which code of this variant the current GPU loads (built as both variants, common.cuh): the
 * SASS architecture and the PTX version the runtime picked for a probe kernel, or the CUDA error that says why
 * there is none. Every file of a variant is compiled for the same architectures, so the probe speaks for all of
 * them. The run-time choice of variant (python/ebbtide/quant/_dispatch.py) reads this; it decides nothing itself.
 */
#include <cstdio>

#include "quant/common.cuh"
#include "quant/launch.cuh"

namespace ebbtide::quant {
namespace {

__global__ void probe_kernel() {}

}  // namespace

ebt_status_t EBT_QUANT_VARIANT(kernel_image)(KernelImage* out) {
  EBT_QUANT_REQUIRE(out, "kernel_image: null output");
  *out = KernelImage{};
  out->runtime_version = CUDART_VERSION;
  cudaDriverGetVersion(&out->driver_version);  // 0 where no driver is loaded
  cudaFuncAttributes attr{};
  const cudaError_t err = cudaFuncGetAttributes(&attr, probe_kernel);
  cudaGetLastError();  // the query's error must not be reported by the next launch
  out->cuda_error = (int)err;
  snprintf(out->error_name, sizeof out->error_name, "%s", cudaGetErrorName(err));
  if (err == cudaSuccess) {
    out->binary_version = attr.binaryVersion;
    out->ptx_version = attr.ptxVersion;
  }
  return EBT_SUCCESS;
}

}  // namespace ebbtide::quant
