/*
 * adam_avx512_impl.h — the AVX-512 kernel body (16 lanes). Full vectors use plain loads/stores; only the last,
 * partial vector of a range uses masked ones (`kTail`), because a loop of masked 512-bit loads/stores runs at half
 * the speed of the unmasked loop on AMD Zen 4/5. Both paths share one vector body, so every element goes through
 * the same arithmetic whatever its position. Included by two translation units: adam_avx512.cc (F/BW/VL/DQ flags)
 * and adam_avx512_bf16.cc (adds -mavx512bf16 and EBT_AVX512_BF16=1, which converts the copy-out with
 * VCVTNEPS2BF16 and blends the integer result into subnormal/NaN lanes, see adam_kernel.h Note [bf16 copy-out]).
 * Not a public header; needs EBT_AVX512_KERNEL_NAME and EBT_AVX512_TABLE_FN defined by the includer.
 */
#include <immintrin.h>

#include "optim/adam_kernel.h"
#include "optim/sqrt_mkl_sse.h"

namespace ebbtide::optim {
namespace {

#define EBT_AVX512_INLINE inline __attribute__((always_inline))

// Lanes [0, n) of the last vector of a range, 0 < n < 16.
inline __mmask16 tail_mask(int64_t n) { return __mmask16((1u << n) - 1u); }

// kTail: masked access to the lanes in `k` (the others load as zero and are not stored); otherwise all 16 lanes.
template <bool kTail>
EBT_AVX512_INLINE __m512 load_ps(const float* x, __mmask16 k) {
  if constexpr (kTail) return _mm512_maskz_loadu_ps(k, x);
  else return _mm512_loadu_ps(x);
}

template <bool kTail>
EBT_AVX512_INLINE void store_ps(float* x, __mmask16 k, __m512 y) {
  if constexpr (kTail) _mm512_mask_storeu_ps(x, k, y);
  else _mm512_storeu_ps(x, y);
}

// A gradient or moment: fp32, or bf16 bits widened exactly.
template <bool kTail>
EBT_AVX512_INLINE __m512 load_g(const void* g, bool bf16, int64_t i, __mmask16 k) {
  if (bf16) {
    const uint16_t* src = static_cast<const uint16_t*>(g) + i;
    __m256i h;
    if constexpr (kTail) h = _mm256_maskz_loadu_epi16(k, src);
    else h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  return load_ps<kTail>(static_cast<const float*>(g) + i, k);
}

inline __m512i bf16_rne_int(__m512 p) {  // 32-bit lanes holding the bf16 bits; NaN -> 0xFFFF
  const __m512i u = _mm512_castps_si512(p);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q), r, _mm512_set1_epi32(0xFFFF));
}

// `stream`: a full, 32-byte aligned vector goes out with a non-temporal store (the copy-out is write-only and
// usually pinned staging the GPU reads next: no read-for-ownership, no cache pollution). Caller fences.
template <bool kTail>
EBT_AVX512_INLINE void store_bf16(uint16_t* out, __m512 p, __mmask16 k, bool stream) {
#if EBT_AVX512_BF16
  __m256i h = (__m256i)_mm512_cvtneps_pbh(p);
  // Subnormal inputs (exponent 0, mantissa != 0) are flushed by the instruction and NaNs keep their payload:
  // take the integer result in those lanes (rare: only computed when such a lane exists).
  const __m512i u = _mm512_castps_si512(p);
  const __mmask16 sub = _mm512_test_epi32_mask(u, _mm512_set1_epi32(0x007FFFFF)) &
                        _mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7F800000));
  const __mmask16 fix = sub | _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q);
  if (fix) h = _mm256_mask_blend_epi16(fix, h, _mm512_cvtepi32_epi16(bf16_rne_int(p)));
#else
  const __m256i h = _mm512_cvtepi32_epi16(bf16_rne_int(p));
#endif
  if constexpr (kTail) _mm256_mask_storeu_epi16(out, k, h);
  else if (stream) _mm256_stream_si256(reinterpret_cast<__m256i*>(out), h);
  else _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), h);
}

// A moment: fp32, or bf16 bits rounded exactly as the copy-out (adam_kernel.h Note [bf16 moments]); the
// avx512_bf16 kernel converts with VCVTNEPS2BF16 and fixes subnormal/NaN lanes, so the bits equal the integer path.
template <bool kTail>
EBT_AVX512_INLINE void store_moment(void* x, bool bf16, int64_t i, __mmask16 k, __m512 y) {
  if (bf16) store_bf16<kTail>(static_cast<uint16_t*>(x) + i, y, k, false);
  else store_ps<kTail>(static_cast<float*>(x) + i, k, y);
}

inline __m512 max_nan(__m512 a, __m512 b) {
  const __mmask16 un = _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q);
  return _mm512_mask_blend_ps(un, _mm512_max_ps(a, b), _mm512_castsi512_ps(_mm512_set1_epi32(-1)));
}

// adam_kernel.h Note [torch's sqrt]: MKL vsSqrt HA, AVX-512 kernel, lane for lane. Zero, infinite and negative
// inputs take MKL's rare path, which returns the IEEE result.
inline __m512 sqrt_mkl(__m512 x) {
  const __m512 y = _mm512_rsqrt14_ps(x);
  const __m512 s = _mm512_mul_ps(x, y);
  const __m512 h = _mm512_mul_ps(y, _mm512_set1_ps(0.5f));
  const __mmask16 tiny = _mm512_cmp_ps_mask(_mm512_set1_ps(0x1p39f), y, _CMP_LT_OS);
  const __m512 xs = _mm512_mask_mul_ps(x, tiny, x, _mm512_set1_ps(0x1p78f));
  const __m512 sc = _mm512_mask_mul_ps(s, tiny, s, _mm512_set1_ps(0x1p39f));
  const __m512 hs = _mm512_mask_mul_ps(h, tiny, h, _mm512_set1_ps(0x1p-78f));
  const __m512 r = _mm512_fmadd_ps(hs, _mm512_fnmadd_ps(sc, sc, xs), s);
  const __mmask16 special = _mm512_fpclass_ps_mask(x, 0x5E);  // ±0, ±inf, negative finite
  return _mm512_mask_sqrt_ps(r, special, x);
}

inline __m512 sqrt_exact(__m512 x, SqrtFlavor f) {
  if (f == SqrtFlavor::kMklSse) {  // an AVX-512 CPU MKL does not tune for (e.g. AMD Zen 4): two AVX halves
    const __m256 lo = sqrt_mkl_sse8(_mm512_castps512_ps256(x)), hi = sqrt_mkl_sse8(_mm512_extractf32x8_ps(x, 1));
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
  }
  return f == SqrtFlavor::kMklAvx512 ? sqrt_mkl(x) : _mm512_sqrt_ps(x);
}

// The broadcast scalars of one call.
struct Consts {
  __m512 gs, decay, wd, lc, b2, c2, bc2s, eps, ss, b1, c1, rbc2s, nlrwd;
  explicit Consts(const KernelArgs& a)
      : gs(_mm512_set1_ps(a.gs)), decay(_mm512_set1_ps(a.decay)), wd(_mm512_set1_ps(a.wd)),
        lc(_mm512_set1_ps(a.lerp_coeff)), b2(_mm512_set1_ps(a.b2)), c2(_mm512_set1_ps(a.c2)),
        bc2s(_mm512_set1_ps(a.bc2s)), eps(_mm512_set1_ps(a.eps)), ss(_mm512_set1_ps(a.ss)),
        b1(_mm512_set1_ps(a.b1)), c1(_mm512_set1_ps(a.c1)), rbc2s(_mm512_set1_ps(a.rbc2s)),
        nlrwd(_mm512_set1_ps(a.neg_lrwd)) {}
};

// One vector at element i: all 16 lanes, or (kTail) the lanes in k.
template <bool kExact, bool kTail>
EBT_AVX512_INLINE void step_vec(const KernelArgs& a, const Consts& c, int64_t i, __mmask16 k, bool stream) {
  const bool decoupled = a.wd_kind == WeightDecay::kDecoupled, l2 = a.wd_kind == WeightDecay::kL2;
  __m512 g = _mm512_mul_ps(load_g<kTail>(a.g, a.grad_bf16, i, k), c.gs);
  __m512 p = load_ps<kTail>(a.p + i, k), m = load_g<kTail>(a.m, a.moments_bf16, i, k);
  __m512 v = load_g<kTail>(a.v, a.moments_bf16, i, k);
  if constexpr (kExact) {
    if (decoupled) p = _mm512_mul_ps(p, c.decay);
    if (l2) g = _mm512_fmadd_ps(p, c.wd, g);
    const __m512 d = _mm512_sub_ps(g, m);
    m = _mm512_fmadd_ps(c.lc, d, a.lerp_small ? m : g);
    v = _mm512_fmadd_ps(_mm512_mul_ps(c.c2, g), g, _mm512_mul_ps(v, c.b2));
  } else {
    if (l2) g = _mm512_fmadd_ps(p, c.wd, g);
    m = _mm512_fmadd_ps(c.b1, m, _mm512_mul_ps(c.c1, g));
    v = _mm512_fmadd_ps(c.b2, v, _mm512_mul_ps(_mm512_mul_ps(c.c2, g), g));
  }
  __m512 vv = v;
  if (a.vmax) {
    vv = max_nan(load_ps<kTail>(a.vmax + i, k), v);
    store_ps<kTail>(a.vmax + i, k, vv);
  }
  if constexpr (kExact) {
    const __m512 den = _mm512_add_ps(_mm512_div_ps(sqrt_exact(vv, a.sqrt_flavor), c.bc2s), c.eps);
    p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(c.ss, m), den));
  } else {
    const __m512 den = _mm512_fmadd_ps(_mm512_sqrt_ps(vv), c.rbc2s, c.eps);
    if (decoupled) p = _mm512_fmadd_ps(c.nlrwd, p, p);
    p = _mm512_fmadd_ps(c.ss, _mm512_div_ps(m, den), p);
  }
  store_ps<kTail>(a.p + i, k, p);
  store_moment<kTail>(a.m, a.moments_bf16, i, k, m);
  store_moment<kTail>(a.v, a.moments_bf16, i, k, v);
  if (a.out) store_bf16<kTail>(a.out + i, p, k, stream);
}

template <bool kExact>
void step_avx512(const KernelArgs& a, int64_t begin, int64_t end) {
  const Consts c(a);
  const bool stream = a.out && (reinterpret_cast<uintptr_t>(a.out + begin) & 31) == 0;
  int64_t i = begin;
  for (; end - i >= 16; i += 16) step_vec<kExact, false>(a, c, i, 0xFFFF, stream);
  if (i < end) step_vec<kExact, true>(a, c, i, tail_mask(end - i), stream);
  if (stream) _mm_sfence();  // order the streaming stores before the pool reports completion
}

bool non_finite_avx512(const void* g, bool bf16, float gs_s, int64_t begin, int64_t end) {
  const __m512 gs = _mm512_set1_ps(gs_s);
  const __m512i expo = _mm512_set1_epi32(0x7F800000);
  __mmask16 bad = 0;
  int64_t i = begin;
  for (; end - i >= 16; i += 16) {
    const __m512i u = _mm512_castps_si512(_mm512_mul_ps(load_g<false>(g, bf16, i, 0xFFFF), gs));
    bad |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(u, expo), expo);
  }
  if (i < end) {
    const __mmask16 k = tail_mask(end - i);
    const __m512i u = _mm512_castps_si512(_mm512_mul_ps(load_g<true>(g, bf16, i, k), gs));
    bad |= _mm512_mask_cmpeq_epi32_mask(k, _mm512_and_si512(u, expo), expo);
  }
  return bad != 0;
}

}  // namespace

#if !EBT_AVX512_BF16
void sqrt_mkl_avx512(const float* x, float* out, int64_t n) {
  int64_t i = 0;
  for (; n - i >= 16; i += 16) _mm512_storeu_ps(out + i, sqrt_mkl(_mm512_loadu_ps(x + i)));
  if (i < n) {
    const __mmask16 k = tail_mask(n - i);
    _mm512_mask_storeu_ps(out + i, k, sqrt_mkl(_mm512_maskz_loadu_ps(k, x + i)));
  }
}
#endif

const KernelTable& EBT_AVX512_TABLE_FN() {
  static const KernelTable t{EBT_AVX512_KERNEL_NAME, &step_avx512<true>, &step_avx512<false>, &non_finite_avx512};
  return t;
}

}  // namespace ebbtide::optim

#undef EBT_AVX512_INLINE
