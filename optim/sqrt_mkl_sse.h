// sqrt_mkl_sse.h — MKL's generic SSE2 vsSqrt (HA) kernel, lane for lane (adam_kernel.h Note [torch's sqrt],
// flavor kMklSse), at 4 lanes (SSE2, for the scalar kernel) and 8 lanes (AVX, for the AVX2 and AVX-512 kernels).
// Both widths must agree bit for bit: RSQRTPS and VRSQRTPS read the same per-lane table on a given CPU, and every
// other step is one IEEE operation (the including files are compiled with -ffp-contract=off).
#ifndef EBBTIDE_OPTIM_SQRT_MKL_SSE_H_
#define EBBTIDE_OPTIM_SQRT_MKL_SSE_H_
#if defined(__x86_64__)
#include <immintrin.h>

namespace ebbtide::optim {

// MKL's range test: bits + 0x7F800000 > 0xFEFFF000 (signed) unless 2^-126 <= x <= bits 0x7F7FF000. Zero,
// subnormal, huge, infinite, negative and NaN lanes take MKL's scalar path, which is correctly rounded.
constexpr int kMklSseBias = 0x7F800000;
constexpr int kMklSseLimit = static_cast<int>(0xFEFFF000u);

inline __m128 sqrt_mkl_sse4(__m128 x) {
  const __m128 half = _mm_set1_ps(0.5f);
  const __m128 y = _mm_rsqrt_ps(x);
  const __m128 s = _mm_mul_ps(x, y), h = _mm_mul_ps(y, half);
  const __m128 e = _mm_sub_ps(half, _mm_mul_ps(s, h));
  const __m128 s1 = _mm_add_ps(_mm_mul_ps(s, e), s), h1 = _mm_add_ps(_mm_mul_ps(h, e), h);
  const __m128 r = _mm_add_ps(_mm_mul_ps(_mm_sub_ps(x, _mm_mul_ps(s1, s1)), h1), s1);
  const __m128i biased = _mm_add_epi32(_mm_castps_si128(x), _mm_set1_epi32(kMklSseBias));
  const __m128 special = _mm_castsi128_ps(_mm_cmpgt_epi32(biased, _mm_set1_epi32(kMklSseLimit)));
  return _mm_or_ps(_mm_andnot_ps(special, r), _mm_and_ps(special, _mm_sqrt_ps(x)));
}

#if defined(__AVX2__)
inline __m256 sqrt_mkl_sse8(__m256 x) {
  const __m256 half = _mm256_set1_ps(0.5f);
  const __m256 y = _mm256_rsqrt_ps(x);
  const __m256 s = _mm256_mul_ps(x, y), h = _mm256_mul_ps(y, half);
  const __m256 e = _mm256_sub_ps(half, _mm256_mul_ps(s, h));
  const __m256 s1 = _mm256_add_ps(_mm256_mul_ps(s, e), s), h1 = _mm256_add_ps(_mm256_mul_ps(h, e), h);
  const __m256 r = _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(x, _mm256_mul_ps(s1, s1)), h1), s1);
  const __m256i biased = _mm256_add_epi32(_mm256_castps_si256(x), _mm256_set1_epi32(kMklSseBias));
  const __m256 special = _mm256_castsi256_ps(_mm256_cmpgt_epi32(biased, _mm256_set1_epi32(kMklSseLimit)));
  // The hardware sqrt only where a lane needs it: it shares the divider with the step's two divisions, the
  // bottleneck of one core in exact mode.
  if (_mm256_testz_ps(special, special)) return r;
  return _mm256_blendv_ps(r, _mm256_sqrt_ps(x), special);
}
#endif  // __AVX2__

}  // namespace ebbtide::optim

#endif  // __x86_64__
#endif  // EBBTIDE_OPTIM_SQRT_MKL_SSE_H_
