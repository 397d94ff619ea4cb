// adam_avx2.cc — AVX2 + FMA kernel (8 lanes), compiled with -mavx2 -mfma -ffp-contract=off only (never
// -march=native). Tails run the scalar element function, which is bit-identical (adam_kernel.h, Note [Exact
// mode]). bf16 grads are widened in registers: no scalar fallback for bf16 (DeepSpeed's AVX2 weakness).
#if defined(__x86_64__)  // other architectures build the portable kernel only
#include <immintrin.h>

#include "optim/adam_kernel.h"
#include "optim/sqrt_mkl_sse.h"

namespace ebbtide::optim {
namespace {

// A gradient or moment: fp32, or bf16 bits widened exactly.
inline __m256 load_g(const void* g, bool bf16, int64_t i) {
  if (bf16) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  return _mm256_loadu_ps(static_cast<const float*>(g) + i);
}

// 8 floats as bf16 bits in the low half of each 32-bit lane: round to nearest even, every NaN -> 0xFFFF
// (adam_kernel.h Note [bf16 copy-out]). A NaN lane's sum is ORed with all ones before the shift, which is cheaper
// than a blend after it; every lane ends in [0, 0xFFFF], so the unsigned-saturating packs below are exact.
inline __m256i bf16_rne_lanes(__m256 p) {
  const __m256i u = _mm256_castps_si256(p);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q));
  return _mm256_srli_epi32(_mm256_or_si256(sum, nan), 16);
}

// 8 floats as 8 bf16.
inline __m128i bf16_rne(__m256 p) {
  const __m256i r = bf16_rne_lanes(p);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// 16 floats (a then b) as 16 bf16: one pack and one cross-lane permute for both halves.
inline __m256i bf16_rne16(__m256 a, __m256 b) {
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_rne_lanes(a), bf16_rne_lanes(b)), 0xD8);
}

// `stream`: 16-byte aligned output goes out with non-temporal stores (see adam_avx512_impl.h). Caller fences.
inline void store_bf16(uint16_t* out, __m256 p, bool stream) {
  if (stream) _mm_stream_si128(reinterpret_cast<__m128i*>(out), bf16_rne(p));
  else _mm_storeu_si128(reinterpret_cast<__m128i*>(out), bf16_rne(p));
}
inline void store_bf16x16(uint16_t* out, __m256 a, __m256 b, bool stream) {
  const __m256i h = bf16_rne16(a, b);
  if (stream) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(h));
    _mm_stream_si128(reinterpret_cast<__m128i*>(out + 8), _mm256_extracti128_si256(h, 1));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), h);
  }
}

// A moment: fp32, or bf16 bits with RNE (adam_kernel.h Note [bf16 moments]); 8 or 16 elements.
inline void store_moment(void* x, bool bf16, int64_t i, __m256 y) {
  if (bf16) _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(x) + i), bf16_rne(y));
  else _mm256_storeu_ps(static_cast<float*>(x) + i, y);
}
inline void store_moment16(void* x, bool bf16, int64_t i, __m256 a, __m256 b) {
  if (bf16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(x) + i), bf16_rne16(a, b));
  } else {
    _mm256_storeu_ps(static_cast<float*>(x) + i, a);
    _mm256_storeu_ps(static_cast<float*>(x) + i + 8, b);
  }
}

inline __m256 max_nan(__m256 a, __m256 b) {
  return _mm256_or_ps(_mm256_max_ps(a, b), _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
}

inline __m256 sqrt_exact(__m256 x, SqrtFlavor f) {
  if (f == SqrtFlavor::kMklSse) return sqrt_mkl_sse8(x);
  if (f != SqrtFlavor::kMklAvx512) return _mm256_sqrt_ps(x);
  alignas(32) float in[8], out[8];  // MKL's kernel needs VRSQRT14 (adam_kernel.h Note [torch's sqrt])
  _mm256_store_ps(in, x);
  sqrt_mkl_avx512(in, out, 8);
  return _mm256_load_ps(out);
}

struct Lanes {
  __m256 p, m, v;
};

// The loop over one span with its dtypes fixed at compile time. Every field of `a` is read once into a local:
// the stores go through float/uint16_t pointers the compiler cannot prove disjoint from `a`, so reading the
// fields in the loop reloaded them (and re-tested the dtype flags) for every 8 elements, which cost ~20% of the
// step's speed on a memory-bound AMD EPYC core against torch's fused AdamW. The main loop takes 16 elements, so
// each bf16 output (moments, copy-out) is one pack, one permute and one 32-byte store per 16 elements: with bf16
// moments the bf16 conversions are most of the arithmetic, and a single thread is compute-bound on them.
template <bool kExact, bool kGradBf16, bool kMomBf16>
void step_avx2_span(const KernelArgs& a, int64_t begin, int64_t end) {
  const __m256 gs = _mm256_set1_ps(a.gs), decay = _mm256_set1_ps(a.decay), wd = _mm256_set1_ps(a.wd);
  const __m256 lc = _mm256_set1_ps(a.lerp_coeff), b2 = _mm256_set1_ps(a.b2), c2 = _mm256_set1_ps(a.c2);
  const __m256 bc2s = _mm256_set1_ps(a.bc2s), eps = _mm256_set1_ps(a.eps), ss = _mm256_set1_ps(a.ss);
  const __m256 b1 = _mm256_set1_ps(a.b1), c1 = _mm256_set1_ps(a.c1), rbc2s = _mm256_set1_ps(a.rbc2s);
  const __m256 nlrwd = _mm256_set1_ps(a.neg_lrwd);
  const bool decoupled = a.wd_kind == WeightDecay::kDecoupled, l2 = a.wd_kind == WeightDecay::kL2;
  const bool lerp_small = a.lerp_small;
  const SqrtFlavor flavor = a.sqrt_flavor;
  float* const pp = a.p;
  void* const mp = a.m;
  void* const vp = a.v;
  float* const vmax = a.vmax;
  const void* const gp = a.g;
  uint16_t* const out = a.out;
  const bool stream = out && (reinterpret_cast<uintptr_t>(out + begin) & 15) == 0;
  // The new p, m and v of elements [i, i + 8) (amsgrad's running max stored here); nothing else written.
  auto update = [=](int64_t i) -> Lanes {
    __m256 g = _mm256_mul_ps(load_g(gp, kGradBf16, i), gs);
    __m256 p = _mm256_loadu_ps(pp + i), m = load_g(mp, kMomBf16, i), v = load_g(vp, kMomBf16, i);
    if (kExact) {
      if (decoupled) p = _mm256_mul_ps(p, decay);
      if (l2) g = _mm256_fmadd_ps(p, wd, g);
      const __m256 d = _mm256_sub_ps(g, m);
      m = _mm256_fmadd_ps(lc, d, lerp_small ? m : g);
      v = _mm256_fmadd_ps(_mm256_mul_ps(c2, g), g, _mm256_mul_ps(v, b2));
    } else {
      if (l2) g = _mm256_fmadd_ps(p, wd, g);
      m = _mm256_fmadd_ps(b1, m, _mm256_mul_ps(c1, g));
      v = _mm256_fmadd_ps(b2, v, _mm256_mul_ps(_mm256_mul_ps(c2, g), g));
    }
    __m256 vv = v;
    if (vmax) {
      vv = max_nan(_mm256_loadu_ps(vmax + i), v);
      _mm256_storeu_ps(vmax + i, vv);
    }
    if (kExact) {
      const __m256 den = _mm256_add_ps(_mm256_div_ps(sqrt_exact(vv, flavor), bc2s), eps);
      p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(ss, m), den));
    } else {
      const __m256 den = _mm256_fmadd_ps(_mm256_sqrt_ps(vv), rbc2s, eps);
      if (decoupled) p = _mm256_fmadd_ps(nlrwd, p, p);
      p = _mm256_fmadd_ps(ss, _mm256_div_ps(m, den), p);
    }
    return Lanes{p, m, v};
  };
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    const Lanes x = update(i), y = update(i + 8);
    _mm256_storeu_ps(pp + i, x.p);
    _mm256_storeu_ps(pp + i + 8, y.p);
    store_moment16(mp, kMomBf16, i, x.m, y.m);
    store_moment16(vp, kMomBf16, i, x.v, y.v);
    if (out) store_bf16x16(out + i, x.p, y.p, stream);
  }
  if (i + 8 <= end) {
    const Lanes x = update(i);
    _mm256_storeu_ps(pp + i, x.p);
    store_moment(mp, kMomBf16, i, x.m);
    store_moment(vp, kMomBf16, i, x.v);
    if (out) store_bf16(out + i, x.p, stream);
    i += 8;
  }
  if (stream) _mm_sfence();  // order the streaming stores before the pool reports completion
  for (; i < end; ++i) adam_element<kExact>(a, i);
}

template <bool kExact>
void step_avx2(const KernelArgs& a, int64_t begin, int64_t end) {
  if (a.grad_bf16) {
    if (a.moments_bf16) return step_avx2_span<kExact, true, true>(a, begin, end);
    return step_avx2_span<kExact, true, false>(a, begin, end);
  }
  if (a.moments_bf16) return step_avx2_span<kExact, false, true>(a, begin, end);
  step_avx2_span<kExact, false, false>(a, begin, end);
}

bool non_finite_avx2(const void* g, bool bf16, float gs_s, int64_t begin, int64_t end) {
  const __m256 gs = _mm256_set1_ps(gs_s);
  const __m256i expo = _mm256_set1_epi32(0x7F800000);
  __m256i bad = _mm256_setzero_si256();
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256i u = _mm256_castps_si256(_mm256_mul_ps(load_g(g, bf16, i), gs));
    bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(u, expo), expo));
  }
  return !_mm256_testz_si256(bad, bad) || scalar_non_finite(g, bf16, gs_s, i, end);
}

}  // namespace

const KernelTable& kernels_avx2() {
  static const KernelTable t{"avx2", &step_avx2<true>, &step_avx2<false>, &non_finite_avx2};
  return t;
}

}  // namespace ebbtide::optim
#endif  // __x86_64__
