/*
 * shim.cc — the cudaMalloc/cudaFree interposers exported by libebbtide.so.
 *
 * Under LD_PRELOAD these definitions come first in the process's global scope, so PyTorch's caching allocator
 * (which calls libcudart dynamically) lands here. Outside a region every call is forwarded to the real runtime
 * function and counted, so a report can say how much memory bypassed ebbtide. Loaded any other way (as _C's
 * dependency, RTLD_LOCAL) the library interposes nothing: only a preload puts it first in the global scope.
 *
 * Policy: never throw, never exit; a missing real function returns cudaErrorInitializationError (3) with a
 * WARN line, so the caller sees a CUDA error rather than a crash.
 */
#include <dlfcn.h>

#include <atomic>
#include <cstddef>
#include <mutex>

#include "csrc/ebbtide.h"
#include "csrc/log.h"

namespace {

typedef int (*CudaMallocFn)(void**, size_t);
typedef int (*CudaFreeFn)(void*);
constexpr int kCudaErrorInitializationError = 3;

std::once_flag g_once;
CudaMallocFn g_real_malloc = nullptr;
CudaFreeFn g_real_free = nullptr;
std::atomic<unsigned long long> g_forwarded_allocs{0};  // calls forwarded to the real cudaMalloc
std::atomic<unsigned long long> g_forwarded_bytes{0};   // bytes they asked for (successful calls)

// The next definition after ours in the search order; if libcudart was loaded RTLD_LOCAL (so RTLD_NEXT cannot
// see it), the already-loaded runtime found by soname.
void resolve_real() {
  g_real_malloc = reinterpret_cast<CudaMallocFn>(dlsym(RTLD_NEXT, "cudaMalloc"));
  g_real_free = reinterpret_cast<CudaFreeFn>(dlsym(RTLD_NEXT, "cudaFree"));
  const char* names[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so"};
  for (const char* n : names) {
    if (g_real_malloc && g_real_free) break;
    void* h = dlopen(n, RTLD_NOW | RTLD_NOLOAD);
    if (!h) continue;
    if (!g_real_malloc) g_real_malloc = reinterpret_cast<CudaMallocFn>(dlsym(h, "cudaMalloc"));
    if (!g_real_free) g_real_free = reinterpret_cast<CudaFreeFn>(dlsym(h, "cudaFree"));
  }
  EBT_INFO(EBT_SUBSYS_SHIM, "real cudaMalloc=%p cudaFree=%p", reinterpret_cast<void*>(g_real_malloc),
           reinterpret_cast<void*>(g_real_free));
}

}  // namespace

extern "C" {

EBT_API int cudaMalloc(void** ptr, size_t size) {
  std::call_once(g_once, resolve_real);
  if (!g_real_malloc) {
    EBT_WARN(EBT_SUBSYS_SHIM, "cudaMalloc: no CUDA runtime found behind the ebbtide shim");
    return kCudaErrorInitializationError;
  }
  int err = g_real_malloc(ptr, size);
  if (err == 0) {
    g_forwarded_allocs.fetch_add(1, std::memory_order_relaxed);
    g_forwarded_bytes.fetch_add(size, std::memory_order_relaxed);
  }
  return err;
}

EBT_API int cudaFree(void* ptr) {
  std::call_once(g_once, resolve_real);
  if (!g_real_free) {
    EBT_WARN(EBT_SUBSYS_SHIM, "cudaFree: no CUDA runtime found behind the ebbtide shim");
    return kCudaErrorInitializationError;
  }
  return g_real_free(ptr);
}

/* Calls and bytes the shim forwarded to the real cudaMalloc (memory that bypassed ebbtide). */
EBT_API ebt_status_t ebt_shim_forwarded(unsigned long long* allocs, unsigned long long* bytes) {
  if (!allocs || !bytes) return EBT_ERROR_INVALID_ARGUMENT;
  *allocs = g_forwarded_allocs.load();
  *bytes = g_forwarded_bytes.load();
  return EBT_SUCCESS;
}

}  // extern "C"
