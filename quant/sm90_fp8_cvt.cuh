/*
 * sm90_fp8_cvt.cuh — the hardware FP8 policy of the sm90 kernels: PTX cvt.rn.satfinite.e4m3x2.f32 and
 * cvt.rn.f16x2.e4m3x2, which exist from sm_89 (Ada) on. The build compiles the sm90_*.cu files only for its
 * architectures at or above 89 (quant/CMakeLists.txt); anything else is a configuration error, caught here. Same
 * interface and the same bits as Fp8Sw (common.cuh).
 */
#ifndef EBBTIDE_QUANT_SM90_FP8_CVT_CUH_
#define EBBTIDE_QUANT_SM90_FP8_CVT_CUH_

#include <cuda_runtime.h>
#include <stdint.h>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
#error "the sm90 quant kernels use the FP8 conversion instructions of sm_89+: build them only for such architectures"
#endif

namespace ebbtide::quant::dev {

struct Fp8Hw {
  // E4M3 of two fp32 values: lo -> low byte.
  static __device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
    uint16_t r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
  }
  // e4m3 pair (low byte first) -> two exact fp32 values (through f16, which holds every e4m3 value exactly).
  static __device__ __forceinline__ float2 e4m3x2_to_f32(uint16_t v) {
    uint32_t h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(v));
    float lo, hi;
    asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"((uint16_t)(h2 & 0xFFFFu)));
    asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"((uint16_t)(h2 >> 16)));
    return make_float2(lo, hi);
  }
};

}  // namespace ebbtide::quant::dev

#endif  // EBBTIDE_QUANT_SM90_FP8_CVT_CUH_
