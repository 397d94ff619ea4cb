/*
 * host_bandwidth.cc — the host-memory limit probe: an in-place triad a[i] = a[i] + s * b[i], the access pattern
 * of an optimizer step (read two streams, write one back in place). Each thread first-touches its own contiguous
 * slice so pages land on its NUMA node, then the best of `repeats` timed passes is reported.
 * Compiled with the default (baseline) ISA flags: the compiler's SSE2 vectorization already saturates memory,
 * so the probe needs no dispatch.
 */
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "csrc/status.h"
#include "csrc/thread_pool.h"

extern "C" ebt_status_t ebt_host_triad_bandwidth(size_t bytes_per_array, int threads, int repeats,
                                                 double* bytes_per_second) {
  EBT_REQUIRE_ARG(bytes_per_second != nullptr, "ebt_host_triad_bandwidth: bytes_per_second is NULL");
  EBT_REQUIRE_ARG(bytes_per_array >= 4096, "ebt_host_triad_bandwidth: bytes_per_array must be >= 4096, got %zu",
                  bytes_per_array);
  EBT_REQUIRE_ARG(repeats >= 1, "ebt_host_triad_bandwidth: repeats must be >= 1, got %d", repeats);
  EBT_REQUIRE_ARG(threads >= 0, "ebt_host_triad_bandwidth: threads must be >= 0, got %d", threads);
  if (threads == 0) EBT_CHECK(ebt_cpu_affinity_count(&threads));

  const size_t n = bytes_per_array / sizeof(float);
  const size_t bytes = n * sizeof(float);
  const size_t alloc = (bytes + 63) / 64 * 64;
  float* a = static_cast<float*>(aligned_alloc(64, alloc));
  float* b = static_cast<float*>(aligned_alloc(64, alloc));
  if (!a || !b) {
    free(a);
    free(b);
    return ebt_set_error(EBT_ERROR_HOST_OUT_OF_MEMORY, "ebt_host_triad_bandwidth: cannot allocate 2 x %zu bytes",
                         bytes);
  }
  ebbtide::ThreadPool pool(threads);
  const size_t per = (n + threads - 1) / threads;
  auto slice = [&](size_t t, size_t* lo, size_t* hi) {
    *lo = t * per < n ? t * per : n;
    *hi = *lo + per < n ? *lo + per : n;
  };
  pool.run(threads, [&](size_t t, int) {
    size_t lo, hi;
    slice(t, &lo, &hi);
    for (size_t i = lo; i < hi; ++i) {
      a[i] = 1.0f;
      b[i] = 0.5f;
    }
  });
  double best = 0.0;
  const float s = 1e-6f;  // keeps values finite and normal over many passes
  for (int r = 0; r < repeats; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    pool.run(threads, [&](size_t t, int) {
      size_t lo, hi;
      slice(t, &lo, &hi);
      float* __restrict pa = a;
      const float* __restrict pb = b;
      for (size_t i = lo; i < hi; ++i) pa[i] = pa[i] + s * pb[i];
    });
    double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double bw = 3.0 * static_cast<double>(bytes) / sec;
    if (bw > best) best = bw;
  }
  volatile float sink = a[n / 2];  // keep the passes observable
  (void)sink;
  free(a);
  free(b);
  *bytes_per_second = best;
  return EBT_SUCCESS;
}
