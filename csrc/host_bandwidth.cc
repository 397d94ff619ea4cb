/*
 * host_bandwidth.cc — the host-memory limit probes: stream a mix of arrays the way a CPU kernel does, and report
 * the bytes that mix moves per second.
 *
 * A mix is counted in streams of five kinds, all walked together element by element (as a fused optimizer step
 * walks its param, grad and moments): fp32 read, fp32 updated in place (read and written back), bf16 read, bf16
 * updated in place, bf16 written only. The bytes counted per element are what DRAM really moves for that mix:
 * 4 per fp32 read, 8 per fp32 update, 2 per bf16 read, 4 per bf16 update, 2 per bf16 write. A write-only stream
 * goes out with non-temporal stores (as the Adam kernels' bf16 copy-out does), so it costs no write-allocate
 * read; an in-place update's line is already in cache when it is written, so it costs none either.
 * ebt_host_triad_bandwidth is the mix {1 fp32 read, 1 fp32 update} (a[i] += s * b[i]).
 *
 * Each thread first-touches its own contiguous slice so pages land on its NUMA node, then the best of `repeats`
 * timed passes is reported. Compiled with the default (baseline) ISA flags: SSE2's 16-byte vectors saturate
 * memory (x86-64 always has them; elsewhere the scalar loop runs), so the probe needs no dispatch. Only the mixes
 * in kMixes have a probe (each a compiled instantiation); another mix is refused by name.
 */
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "csrc/status.h"
#include "csrc/thread_pool.h"

namespace {

constexpr int kMaxPerKind = 4;
constexpr size_t kStep = 8;  // elements per vector step: two fp32 vectors, one vector of bf16

struct Mix {
  int f32_read = 0, f32_update = 0, bf16_read = 0, bf16_update = 0, bf16_write = 0;
  double bytes_per_element() const {
    return 4.0 * f32_read + 8.0 * f32_update + 2.0 * bf16_read + 4.0 * bf16_update + 2.0 * bf16_write;
  }
  bool operator==(const Mix& o) const {
    return f32_read == o.f32_read && f32_update == o.f32_update && bf16_read == o.bf16_read &&
           bf16_update == o.bf16_update && bf16_write == o.bf16_write;
  }
};

// The arrays of one probe, by kind (64-byte aligned, owned).
struct Streams {
  float* fr[kMaxPerKind] = {};
  float* fu[kMaxPerKind] = {};
  uint16_t* br[kMaxPerKind] = {};
  uint16_t* bu[kMaxPerKind] = {};
  uint16_t* bw[kMaxPerKind] = {};
  std::vector<void*> owned;
  ~Streams() {
    for (void* p : owned) free(p);
  }
  template <class T>
  bool add(T** slot, size_t n) {
    *slot = static_cast<T*>(aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64));
    if (*slot) owned.push_back(*slot);
    return *slot != nullptr;
  }
};

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // truncation: the probe's values only need to stay finite
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return static_cast<uint16_t>(u >> 16);
}

#if defined(__SSE2__)
inline __m128 widen_lo(__m128i h) { return _mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), h)); }
inline __m128 widen_hi(__m128i h) { return _mm_castsi128_ps(_mm_unpackhi_epi16(_mm_setzero_si128(), h)); }
inline __m128i narrow(__m128 a, __m128 b) {  // 8 fp32 -> 8 bf16 by truncation (arithmetic shift: packs is exact)
  return _mm_packs_epi32(_mm_srai_epi32(_mm_castps_si128(a), 16), _mm_srai_epi32(_mm_castps_si128(b), 16));
}
#endif

// One pass over [lo, hi) (lo a multiple of kStep): every stream read and/or written once per element, all
// streams interleaved element by element as a fused kernel walks them. The counts are template parameters so
// each stream is one load/store per step (measured on a Zen 4 core: walking the streams one after the other in
// blocks moved half the bytes per second of this interleaved walk).
template <int FR, int FU, int BR, int BU, int BW>
void pass(const Streams& a, size_t lo, size_t hi, float s) {
  size_t i = lo;
#if defined(__SSE2__)
  const __m128 vs = _mm_set1_ps(s);
  for (; i + kStep <= hi; i += kStep) {
    __m128 a0 = _mm_setzero_ps(), a1 = _mm_setzero_ps();
    for (int r = 0; r < FR; ++r) {
      a0 = _mm_add_ps(a0, _mm_load_ps(a.fr[r] + i));
      a1 = _mm_add_ps(a1, _mm_load_ps(a.fr[r] + i + 4));
    }
    for (int r = 0; r < BR; ++r) {
      const __m128i h = _mm_load_si128(reinterpret_cast<const __m128i*>(a.br[r] + i));
      a0 = _mm_add_ps(a0, widen_lo(h));
      a1 = _mm_add_ps(a1, widen_hi(h));
    }
    const __m128 d0 = _mm_mul_ps(vs, a0), d1 = _mm_mul_ps(vs, a1);
    for (int r = 0; r < FU; ++r) {
      float* p = a.fu[r] + i;
      _mm_store_ps(p, _mm_add_ps(_mm_load_ps(p), d0));
      _mm_store_ps(p + 4, _mm_add_ps(_mm_load_ps(p + 4), d1));
    }
    for (int r = 0; r < BU; ++r) {
      __m128i* p = reinterpret_cast<__m128i*>(a.bu[r] + i);
      const __m128i h = _mm_load_si128(p);
      _mm_store_si128(p, narrow(_mm_add_ps(widen_lo(h), d0), _mm_add_ps(widen_hi(h), d1)));
    }
    if (BW) {
      const __m128i o = narrow(a0, a1);
      for (int r = 0; r < BW; ++r) _mm_stream_si128(reinterpret_cast<__m128i*>(a.bw[r] + i), o);
    }
  }
  if (BW) _mm_sfence();  // the streaming stores are done before the pool reports the task done
#endif
  for (; i < hi; ++i) {  // the tail (and the whole slice without SSE2)
    float acc = 0.0f;
    for (int r = 0; r < FR; ++r) acc += a.fr[r][i];
    for (int r = 0; r < BR; ++r) acc += bf16_to_f32(a.br[r][i]);
    for (int r = 0; r < FU; ++r) a.fu[r][i] += s * acc;
    for (int r = 0; r < BU; ++r) a.bu[r][i] = f32_to_bf16(bf16_to_f32(a.bu[r][i]) + s * acc);
    for (int r = 0; r < BW; ++r) a.bw[r][i] = f32_to_bf16(acc);
  }
}

using PassFn = void (*)(const Streams&, size_t, size_t, float);
struct CompiledMix {
  Mix mix;
  PassFn fn;
  const char* what;
};
// The mixes with a compiled probe. To add one: a line here (and in the header comment of ebbtide.h).
constexpr CompiledMix kMixes[] = {
    {{1, 1, 0, 0, 0}, &pass<1, 1, 0, 0, 0>, "the in-place triad"},
    {{1, 3, 0, 0, 0}, &pass<1, 3, 0, 0, 0>, "an Adam step with fp32 grads"},
    {{0, 3, 1, 0, 1}, &pass<0, 3, 1, 0, 1>, "an Adam step with bf16 grads and the bf16 copy-out"},
    {{0, 1, 1, 2, 1}, &pass<0, 1, 1, 2, 1>, "the same with bf16 moments"},
};

std::string mix_text(const Mix& m) {
  return "(" + std::to_string(m.f32_read) + ", " + std::to_string(m.f32_update) + ", " +
         std::to_string(m.bf16_read) + ", " + std::to_string(m.bf16_update) + ", " + std::to_string(m.bf16_write) +
         ")";
}

ebt_status_t stream_bandwidth(const Mix& mix, size_t n, int threads, int repeats, double* bytes_per_second) {
  PassFn fn = nullptr;
  for (const CompiledMix& c : kMixes)
    if (c.mix == mix) fn = c.fn;
  if (!fn) {
    std::string known;
    for (const CompiledMix& c : kMixes) known += std::string(known.empty() ? "" : ", ") + mix_text(c.mix) + " " + c.what;
    return ebt_set_error(EBT_ERROR_UNSUPPORTED, "host bandwidth probe: no compiled probe for the mix %s (fp32 read, "
                         "fp32 updated, bf16 read, bf16 updated, bf16 written); the mixes: %s",
                         mix_text(mix).c_str(), known.c_str());
  }
  Streams a;
  bool ok = true;
  for (int k = 0; k < mix.f32_read; ++k) ok = ok && a.add(&a.fr[k], n);
  for (int k = 0; k < mix.f32_update; ++k) ok = ok && a.add(&a.fu[k], n);
  for (int k = 0; k < mix.bf16_read; ++k) ok = ok && a.add(&a.br[k], n);
  for (int k = 0; k < mix.bf16_update; ++k) ok = ok && a.add(&a.bu[k], n);
  for (int k = 0; k < mix.bf16_write; ++k) ok = ok && a.add(&a.bw[k], n);
  if (!ok)
    return ebt_set_error(EBT_ERROR_HOST_OUT_OF_MEMORY, "host bandwidth probe: cannot allocate %.0f MB of arrays",
                         mix.bytes_per_element() * static_cast<double>(n) / 1e6);
  ebbtide::ThreadPool pool(threads);
  // Slices start on vector steps, so every aligned load and streaming store stays aligned.
  const size_t steps = (n + kStep - 1) / kStep;
  const size_t per = (steps + threads - 1) / threads * kStep;
  auto slice = [&](size_t t, size_t* lo, size_t* hi) {
    *lo = t * per < n ? t * per : n;
    *hi = *lo + per < n ? *lo + per : n;
  };
  pool.run(threads, [&](size_t t, int) {
    size_t lo, hi;
    slice(t, &lo, &hi);
    for (int k = 0; k < mix.f32_read; ++k) std::fill(a.fr[k] + lo, a.fr[k] + hi, 0.5f);
    for (int k = 0; k < mix.f32_update; ++k) std::fill(a.fu[k] + lo, a.fu[k] + hi, 1.0f);
    for (int k = 0; k < mix.bf16_read; ++k) std::fill(a.br[k] + lo, a.br[k] + hi, uint16_t(0x3f00));  // 0.5
    for (int k = 0; k < mix.bf16_update; ++k) std::fill(a.bu[k] + lo, a.bu[k] + hi, uint16_t(0x3f80));  // 1.0
    for (int k = 0; k < mix.bf16_write; ++k) std::fill(a.bw[k] + lo, a.bw[k] + hi, uint16_t(0));
  });
  double best = 0.0;
  const float s = 1e-7f;  // keeps values finite and normal over many passes
  for (int r = 0; r < repeats; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    pool.run(threads, [&](size_t t, int) {
      size_t lo, hi;
      slice(t, &lo, &hi);
      fn(a, lo, hi, s);
    });
    double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double bw = mix.bytes_per_element() * static_cast<double>(n) / sec;
    if (bw > best) best = bw;
  }
  volatile float sink = mix.f32_update ? a.fu[0][n / 2] : 0.0f;  // keep the passes observable
  (void)sink;
  *bytes_per_second = best;
  return EBT_SUCCESS;
}

}  // namespace

extern "C" ebt_status_t ebt_host_stream_bandwidth(int f32_read, int f32_update, int bf16_read, int bf16_update,
                                                  int bf16_write, size_t elements, int threads, int repeats,
                                                  double* bytes_per_second) {
  EBT_REQUIRE_ARG(bytes_per_second != nullptr, "bytes_per_second is NULL");
  for (int c : {f32_read, f32_update, bf16_read, bf16_update, bf16_write})
    EBT_REQUIRE_ARG(c >= 0 && c <= kMaxPerKind, "each stream count must be in [0, %d], got %d", kMaxPerKind, c);
  EBT_REQUIRE_ARG(f32_update + bf16_update + bf16_write > 0,
                  "the mix writes nothing (needs an updated or a written stream)");
  EBT_REQUIRE_ARG(elements >= 1024, "elements must be >= 1024, got %zu", elements);
  EBT_REQUIRE_ARG(repeats >= 1, "repeats must be >= 1, got %d", repeats);
  EBT_REQUIRE_ARG(threads >= 0, "threads must be >= 0, got %d", threads);
  if (threads == 0) EBT_CHECK(ebt_cpu_affinity_count(&threads));
  Mix mix;
  mix.f32_read = f32_read;
  mix.f32_update = f32_update;
  mix.bf16_read = bf16_read;
  mix.bf16_update = bf16_update;
  mix.bf16_write = bf16_write;
  return stream_bandwidth(mix, elements, threads, repeats, bytes_per_second);
}

extern "C" ebt_status_t ebt_host_triad_bandwidth(size_t bytes_per_array, int threads, int repeats,
                                                 double* bytes_per_second) {
  EBT_REQUIRE_ARG(bytes_per_array >= 4096, "bytes_per_array must be >= 4096, got %zu", bytes_per_array);
  return ebt_host_stream_bandwidth(1, 1, 0, 0, 0, bytes_per_array / sizeof(float), threads, repeats,
                                   bytes_per_second);
}
