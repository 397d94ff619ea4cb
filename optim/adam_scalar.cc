// adam_scalar.cc — the portable kernel (no ISA flags): the reference every SIMD kernel must match bit for bit,
// and the path for CPUs without AVX2+FMA (or EBBTIDE_CPU_ISA=scalar). Built with -ffp-contract=off; its FMAs
// are std::fmaf calls (correctly rounded in software where the CPU has no FMA).
#include "optim/adam_kernel.h"
#include "optim/sqrt_mkl_sse.h"

namespace ebbtide::optim {
namespace {

template <bool kExact>
void step_scalar(const KernelArgs& a, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) adam_element<kExact>(a, i);
}

}  // namespace

const KernelTable& kernels_scalar() {
  static const KernelTable t{"scalar", &step_scalar<true>, &step_scalar<false>, &scalar_non_finite};
  return t;
}

}  // namespace ebbtide::optim

namespace ebbtide::optim {
#if defined(__x86_64__)
void sqrt_mkl_sse(const float* x, float* out, int64_t n) {
  alignas(16) float lane[4];
  for (int64_t i = 0; i < n; i += 4) {
    const int64_t k = n - i < 4 ? n - i : 4;
    for (int64_t j = 0; j < 4; ++j) lane[j] = j < k ? x[i + j] : 1.f;
    _mm_store_ps(lane, sqrt_mkl_sse4(_mm_load_ps(lane)));
    for (int64_t j = 0; j < k; ++j) out[i + j] = lane[j];
  }
}
#else
// Only x86 torch builds use MKL's sqrt; adam.cc refuses those flavors on other CPUs, so these are never reached.
void sqrt_mkl_avx512(const float* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = std::sqrt(x[i]);
}
void sqrt_mkl_sse(const float* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = std::sqrt(x[i]);
}
#endif
}  // namespace ebbtide::optim
