/*
 * launch.cuh — host-side helpers of the quant launchers: argument checks that record why they failed, the
 * post-launch status, and the eps range check.
 */
#ifndef EBBTIDE_QUANT_LAUNCH_CUH_
#define EBBTIDE_QUANT_LAUNCH_CUH_

#include <cuda_runtime.h>
#include <stdint.h>

#include "quant/launchers.h"
#include "csrc/status.h"

namespace ebbtide::quant {

// Return EBT_ERROR_INVALID_ARGUMENT, recording the message as ebt_last_error(), when `cond` is false.
#define EBT_QUANT_REQUIRE(cond, ...) EBT_REQUIRE_ARG(cond, __VA_ARGS__)

inline ebt_status_t launch_status(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return EBT_SUCCESS;
  return ebt_set_error(EBT_ERROR_CUDA_RUNTIME, "%s: launch failed: %s (%s)", kernel, cudaGetErrorName(err),
                     cudaGetErrorString(err));
}

// eps in [1e-30, 1e30]: every scale stays a normal fp32 number and every multiplier finite (a subnormal scale
// would give an infinite multiplier and 0 * inf = NaN for zero inputs).
inline bool eps_in_range(float eps) { return eps >= 1e-30f && eps <= 1e30f; }

}  // namespace ebbtide::quant

#endif  // EBBTIDE_QUANT_LAUNCH_CUH_
