/*
 * shim.cc — the cudaMalloc/cudaFree interposers exported by libebbtide.so.
 *
 * Under LD_PRELOAD these definitions come first in the process's global scope, so PyTorch's caching allocator
 * (which calls libcudart dynamically) lands here. Outside a region every call is forwarded to the real runtime
 * function and counted, so a report can say how much memory bypassed ebbtide. Loaded any other way (as _C's
 * dependency, RTLD_LOCAL) the library interposes nothing: only a preload puts it first in the global scope.
 *
 * Inside a region (memory/routing.cc says which thread's allocations a region captures) cudaMalloc allocates from
 * the memory engine on the current device instead; cudaFree of an engine pointer frees it there (active or
 * paused), anything else is forwarded. In a forked child everything is forwarded.
 *
 * Policy: never throw, never exit; a missing real function returns cudaErrorInitializationError (3) with a
 * WARN line, so the caller sees a CUDA error rather than a crash. An engine OOM returns
 * cudaErrorMemoryAllocation (2), so PyTorch's caching allocator frees its cache and retries. Memory settings
 * that do not parse (memory/settings.h) make every cudaMalloc return cudaErrorInitializationError, with the
 * setting's error in a WARN line (the first time; INFO after): a preloaded process asked for capture, and
 * forwarding its allocations past the engine would drop that request silently.
 */
#include <dlfcn.h>

#include <atomic>
#include <cstddef>
#include <mutex>

#include "csrc/driver.h"
#include "csrc/ebbtide.h"
#include "csrc/log.h"
#include "memory/ebbtide_memory.h"
#include "memory/engine.h"
#include "memory/routing.h"
#include "memory/settings.h"

namespace {

typedef int (*CudaMallocFn)(void**, size_t);
typedef int (*CudaFreeFn)(void*);
constexpr int kCudaSuccess = 0;
constexpr int kCudaErrorInvalidValue = 1;
constexpr int kCudaErrorMemoryAllocation = 2;
constexpr int kCudaErrorInitializationError = 3;
constexpr int kCudaErrorUnknown = 999;

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

// The device of the calling thread's current context; initializes the runtime's primary context (through the
// real cudaFree(0), as the first cudaMalloc would) when none is current yet.
int current_device(const ebt_driver_table_t* drv) {
  CUdevice dev = 0;
  if (drv->cuCtxGetDevice(&dev) == CUDA_SUCCESS) return dev;
  if (g_real_free) g_real_free(nullptr);
  if (drv->cuCtxGetDevice(&dev) == CUDA_SUCCESS) return dev;
  return 0;
}

int to_cuda_error(ebt_status_t st) {
  switch (st) {
    case EBT_SUCCESS: return kCudaSuccess;
    case EBT_ERROR_OUT_OF_MEMORY: return kCudaErrorMemoryAllocation;
    case EBT_ERROR_INVALID_ARGUMENT: return kCudaErrorInvalidValue;
    default: return kCudaErrorUnknown;
  }
}

// An allocation the engine takes (a region applies to this thread); false = forward it.
bool engine_malloc(void** ptr, size_t size, int* err) {
  if (size == 0 || ebbtide::memory::forked_child() || !ebbtide::memory::routing_might_capture()) return false;
  char tag[EBT_MEM_TAG_MAX + 1];
  int backup = 0;
  if (!ebbtide::memory::route_current(tag, &backup)) return false;
  const ebt_driver_table_t* drv;
  if (ebt_driver_get(&drv) != EBT_SUCCESS) {
    EBT_WARN(EBT_SUBSYS_SHIM, "cudaMalloc in region '%s': %s", tag, ebt_last_error());
    *err = kCudaErrorInitializationError;
    return true;
  }
  ebt_status_t st = ebbtide::memory::Engine::get().malloc(ptr, size, current_device(drv), tag, backup);
  if (st != EBT_SUCCESS) EBT_INFO(EBT_SUBSYS_SHIM, "cudaMalloc(%zu) in region '%s': %s", size, tag, ebt_last_error());
  *err = to_cuda_error(st);
  return true;
}

}  // namespace

extern "C" {

EBT_API int cudaMalloc(void** ptr, size_t size) {
  std::call_once(g_once, resolve_real);
  if (!ebbtide::memory::forked_child() && ebbtide::memory::load_settings() != EBT_SUCCESS) {
    static std::atomic<bool> warned{false};
    if (!warned.exchange(true)) EBT_WARN(EBT_SUBSYS_SHIM, "cudaMalloc(%zu) refused: %s", size, ebt_last_error());
    else EBT_INFO(EBT_SUBSYS_SHIM, "cudaMalloc(%zu) refused: %s", size, ebt_last_error());
    return kCudaErrorInitializationError;
  }
  int engine_err = 0;
  if (ptr && engine_malloc(ptr, size, &engine_err)) return engine_err;
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
  if (ptr && !ebbtide::memory::forked_child()) {
    int found = 0;
    ebt_status_t st = ebbtide::memory::Engine::get().free(ptr, &found);
    if (found) {
      if (st != EBT_SUCCESS) EBT_WARN(EBT_SUBSYS_SHIM, "cudaFree(%p): %s", ptr, ebt_last_error());
      return to_cuda_error(st);
    }
  }
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

EBT_API ebt_status_t ebt_mem_shim_active(int* active) {
  if (!active) return EBT_ERROR_INVALID_ARGUMENT;
  // Ask the global scope (the main program's handle: executable, preloads, RTLD_GLOBAL libraries) which
  // cudaMalloc a caller gets, and whether it lives in this library. Comparing with &cudaMalloc would not do:
  // taking the address of an exported function goes through the same interposable lookup, so both sides name
  // libcudart's definition whenever that one comes first.
  *active = 0;
  void* global = dlopen(nullptr, RTLD_NOW);
  void* resolved = global ? dlsym(global, "cudaMalloc") : nullptr;
  Dl_info where, self;
  if (resolved && dladdr(resolved, &where) && dladdr(reinterpret_cast<void*>(&resolve_real), &self))
    *active = where.dli_fbase == self.dli_fbase ? 1 : 0;
  if (global) dlclose(global);
  return EBT_SUCCESS;
}

}  // extern "C"
