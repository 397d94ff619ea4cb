/*
 * adam_kernel.h — the per-element Adam/AdamW arithmetic shared by every ISA kernel, and the kernel table.
 *
 * Contract of a kernel: `fn(args, begin, end)` updates elements [begin, end) of ONE span in place (master p,
 * exp_avg m, exp_avg_sq v (fp32, or both bf16), optional max_exp_avg_sq), reading the gradient (fp32 or bf16, never written) and
 * optionally writing the bf16 copy of the new p. All scalars arrive already rounded to float (adam.cc derives
 * them from the hyper-parameters exactly as torch does), so a kernel is pure elementwise arithmetic.
 *
 * Note [Exact mode]: bit-identical to torch.optim.Adam/AdamW (foreach=False, fp32) because every operation
 * below is one IEEE-754 operation with the rounding torch's CPU kernels use (measured against torch 2.13's
 * AVX512 build, ATen's vectorized ops, FMA where ATen's Vectorized code uses vec::fmadd or GCC contracts the
 * expression):
 *   g  = g * gs                        (gs = ±grad_scale; maximize negates, which is exact)
 *   p  = p * decay                     (AdamW, wd != 0: param.mul_(1 - lr*wd))
 *   g  = fma(p, wd, g)                 (Adam L2, wd != 0: grad.add(param, alpha=wd))
 *   m  = |w| < .5 ? fma(w, g-m, m) : fma(w-1, g-m, g)      (exp_avg.lerp_(grad, 1-beta1))
 *   v  = fma(c*g, g, v*b2)             (exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1-beta2))
 *   vm = max(vm, v), NaN-propagating   (amsgrad: torch.maximum)
 *   d  = sqrt(v or vm) / bc2s + eps    (two roundings: div then add)
 *   p  = p + (ss * m) / d              (addcdiv_(m, d, value=-step_size): three roundings)
 * Every operation is correctly rounded, so the scalar, AVX2 and AVX-512 kernels agree bit for bit whatever the
 * thread partition: a requirement, tested on every ISA the test machine has. The files are compiled with
 * -ffp-contract=off so the compiler never fuses what torch rounds separately; FMAs are explicit.
 *
 * Note [Fast mode]: fewer roundings, same formula: m = fma(b1, m, (1-b1)g), v = fma(b2, v, ((1-b2)g)g),
 * d = fma(sqrt(v), 1/bc2s, eps), p = fma(-lr*wd, p, p), p = fma(ss, m/d, p). Still every operation is correctly
 * rounded (no approximate reciprocals), so fast mode is also identical across ISAs and thread counts; its
 * distance from a float64 reference is bounded by tests/optim/test_cpu_adam_fast.py.
 *
 * Note [bf16 copy-out]: round-to-nearest-even by the integer rounding bias, bit-equal to torch's
 * `.to(torch.bfloat16)` on x86 for every non-NaN input including subnormals; every NaN becomes 0xFFFF, which is
 * what torch's vectorized conversion writes. (VCVTNEPS2BF16 treats subnormal inputs as zero, so the avx512_bf16
 * kernel blends the integer result back into subnormal and NaN lanes.)
 *
 * Note [bf16 moments]: with `moments_bf16`, m and v are loaded as bf16 -> fp32 (exact: a shift), the element
 * goes through exactly the fp32 arithmetic above, and the new m and v are stored rounded to nearest even by the
 * same rounding as the copy-out (every NaN -> 0xFFFF; the avx512_bf16 kernel's VCVTNEPS2BF16 result is fixed in
 * subnormal and NaN lanes exactly as for the copy-out, so the bits agree across ISAs, subnormals included). The new p is computed from the unrounded fp32 m and v of this step, and the
 * rounding happens only at the store. So exact mode equals torch.optim.Adam/AdamW(foreach=False) run on
 * `m.float()`, `v.float()` followed by `.to(torch.bfloat16)` of the new moments, bit for bit.
 */
#ifndef EBBTIDE_OPTIM_ADAM_KERNEL_H_
#define EBBTIDE_OPTIM_ADAM_KERNEL_H_

#include <cmath>
#include <cstdint>
#include <cstring>

namespace ebbtide::optim {

enum class WeightDecay : int { kNone = 0, kDecoupled = 1, kL2 = 2 };

// Note [torch's sqrt]: torch's CPU `Tensor.sqrt` (used by Adam for the denominator) is not IEEE sqrt on x86
// builds with MKL: ATen's vml::vsqrt calls MKL vsSqrt(VML_HA), and which kernel MKL runs depends on the CPU
// (all three read from libtorch_cpu.so of torch 2.13, MKL 2024.2):
//  - AVX-512 Intel CPUs: mkl_vml_kernel_sSqrt_Z0HAynn, y = rsqrt14(x), s = x*y, h = 0.5*y,
//    r = fma(h, x - s*s, s) (inputs below 2^-78 scaled by 2^78 in the residual): ~0.1-1% of results one ulp
//    below the correctly rounded value. Flavor kMklAvx512; needs VRSQRT14PS, so only AVX-512 CPUs evaluate it.
//  - AVX2-only Intel CPUs: the AVX2 kernel is correctly rounded (kCorrectlyRounded).
//  - CPUs MKL does not tune for (AMD EPYC, any generation seen): the generic SSE2 kernel
//    mkl_vml_kernel_sSqrt_EXHAynn, whatever MKL_ENABLE_INSTRUCTIONS says. No FMA, every step rounded:
//    y = rsqrtps(x), s = x*y, h = 0.5*y, e = 0.5 - s*h, s1 = s + s*e, h1 = h + h*e, r = s1 + (x - s1*s1)*h1,
//    for 2^-126 <= x <= bits 0x7F7FF000; other inputs take a scalar double-precision path that is correctly
//    rounded. ~17% of results are an ulp off either way, and which ones depends on the CPU's RSQRTPS table
//    (AMD's differs from Intel's), so this flavor is evaluated with the same instruction (kMklSse).
// Exact mode takes the flavor torch has on this machine (python/ebbtide/optim/cpu_adam.py probes torch.sqrt
// once). NaN payloads may differ from MKL's (tests compare NaN positions only).
enum class SqrtFlavor : int { kCorrectlyRounded = 0, kMklAvx512 = 1, kMklSse = 2 };

// MKL's AVX-512 HA sqrt, elementwise (defined in adam_avx512.cc; needs AVX-512F/VL at run time).
void sqrt_mkl_avx512(const float* x, float* out, int64_t n);
// MKL's generic SSE2 HA sqrt, elementwise (defined in adam_scalar.cc; x86 only).
void sqrt_mkl_sse(const float* x, float* out, int64_t n);

// One span with every scalar resolved for its step. Pointers are not required to be aligned.
struct KernelArgs {
  float* p = nullptr;            // fp32 master, updated in place
  void* m = nullptr;             // exp_avg, fp32 or bf16 bits (moments_bf16)
  void* v = nullptr;             // exp_avg_sq, same dtype as m
  float* vmax = nullptr;         // max_exp_avg_sq (amsgrad) or null
  const void* g = nullptr;       // gradient, fp32 or bf16 bits (read only)
  uint16_t* out = nullptr;       // bf16 copy of the new p, or null
  bool grad_bf16 = false;
  bool moments_bf16 = false;
  SqrtFlavor sqrt_flavor = SqrtFlavor::kCorrectlyRounded;  // exact mode only
  WeightDecay wd_kind = WeightDecay::kNone;
  // exact-mode scalars (torch's roundings)
  float gs = 1.f;         // grad scale, negated for maximize
  float decay = 1.f;      // float(1 - lr*wd)
  float wd = 0.f;         // L2 alpha
  float lerp_w = 0.f;     // float(1 - beta1)
  float lerp_coeff = 0.f; // lerp_w if |lerp_w| < 0.5 else lerp_w - 1
  bool lerp_small = true;
  float b2 = 0.f;         // float(beta2)
  float c2 = 0.f;         // float(1 - beta2)
  float bc2s = 1.f;       // float(sqrt(1 - beta2^t)) (divisor)
  float eps = 0.f;
  float ss = 0.f;         // float(-lr / (1 - beta1^t))
  // fast-mode scalars
  float b1 = 0.f;         // float(beta1)
  float c1 = 0.f;         // float(1 - beta1)
  float rbc2s = 1.f;      // float(1 / sqrt(1 - beta2^t))
  float neg_lrwd = 0.f;   // float(-lr*wd)
};

using KernelFn = void (*)(const KernelArgs& a, int64_t begin, int64_t end);
// Returns true if any of g[begin, end) * gs is not finite.
using NonFiniteFn = bool (*)(const void* g, bool grad_bf16, float gs, int64_t begin, int64_t end);

struct KernelTable {
  const char* isa;
  KernelFn exact;
  KernelFn fast;
  NonFiniteFn non_finite;
};

// Defined in one translation unit each (compiled with that ISA's flags only).
const KernelTable& kernels_scalar();
const KernelTable& kernels_avx2();
const KernelTable& kernels_avx512();
const KernelTable& kernels_avx512_bf16();

// ---- scalar element math (the reference; also the tail of the AVX2 kernel) ---------------------------------

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float load_grad(const void* g, bool bf16, int64_t i) {
  if (bf16) return bits_to_float(static_cast<uint32_t>(static_cast<const uint16_t*>(g)[i]) << 16);
  return static_cast<const float*>(g)[i];
}
inline uint16_t to_bf16_rne(float f) {
  if (std::isnan(f)) return 0xFFFFu;
  uint32_t u = float_to_bits(f);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
// A moment (exp_avg or exp_avg_sq) is fp32 or bf16 bits: loaded as the gradient is, stored with RNE.
inline float load_moment(const void* x, bool bf16, int64_t i) { return load_grad(x, bf16, i); }
inline void store_moment(void* x, bool bf16, int64_t i, float f) {
  if (bf16) static_cast<uint16_t*>(x)[i] = to_bf16_rne(f);
  else static_cast<float*>(x)[i] = f;
}
// torch.maximum(a, b) as ATen's vectorized code computes it: max_ps(a, b) (b on ties such as ±0), and an
// all-ones NaN when either input is NaN. The SIMD kernels do the same, so even NaN bits agree across ISAs.
inline float max_nan(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return bits_to_float(0xFFFFFFFFu);
  return a > b ? a : b;
}

template <bool kExact>
inline void adam_element(const KernelArgs& a, int64_t i) {
  float g = load_grad(a.g, a.grad_bf16, i) * a.gs;
  float p = a.p[i], m = load_moment(a.m, a.moments_bf16, i), v = load_moment(a.v, a.moments_bf16, i);
  if (kExact) {
    if (a.wd_kind == WeightDecay::kDecoupled) p = p * a.decay;
    if (a.wd_kind == WeightDecay::kL2) g = std::fmaf(p, a.wd, g);
    float d = g - m;
    m = a.lerp_small ? std::fmaf(a.lerp_coeff, d, m) : std::fmaf(a.lerp_coeff, d, g);
    v = std::fmaf(a.c2 * g, g, v * a.b2);
  } else {
    if (a.wd_kind == WeightDecay::kL2) g = std::fmaf(p, a.wd, g);
    m = std::fmaf(a.b1, m, a.c1 * g);
    v = std::fmaf(a.b2, v, (a.c2 * g) * g);
  }
  float vv = v;
  if (a.vmax) {
    vv = max_nan(a.vmax[i], v);
    a.vmax[i] = vv;
  }
  if (kExact) {
    float root;
    if (a.sqrt_flavor == SqrtFlavor::kMklAvx512) sqrt_mkl_avx512(&vv, &root, 1);
    else if (a.sqrt_flavor == SqrtFlavor::kMklSse) sqrt_mkl_sse(&vv, &root, 1);
    else root = std::sqrt(vv);
    float den = root / a.bc2s + a.eps;
    p = p + (a.ss * m) / den;
  } else {
    float den = std::fmaf(std::sqrt(vv), a.rbc2s, a.eps);
    if (a.wd_kind == WeightDecay::kDecoupled) p = std::fmaf(a.neg_lrwd, p, p);
    p = std::fmaf(a.ss, m / den, p);
  }
  a.p[i] = p;
  store_moment(a.m, a.moments_bf16, i, m);
  store_moment(a.v, a.moments_bf16, i, v);
  if (a.out) a.out[i] = to_bf16_rne(p);
}

inline bool scalar_non_finite(const void* g, bool bf16, float gs, int64_t begin, int64_t end) {
  bool bad = false;
  for (int64_t i = begin; i < end; ++i) bad |= !std::isfinite(load_grad(g, bf16, i) * gs);
  return bad;
}

}  // namespace ebbtide::optim

#endif  // EBBTIDE_OPTIM_ADAM_KERNEL_H_
