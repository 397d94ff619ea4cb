/*
 * fake_cuda.cc — a host-memory fake of the CUDA driver subset ebbtide calls (test-only; loaded through
 * EBBTIDE_LIBCUDA in place of libcuda.so.1).
 *
 * Model: "device memory" is host memory. cuMemAddressReserve reserves PROT_NONE address space; cuMemCreate makes
 * a memfd of the handle's size (the physical memory; counts against EBT_FAKE_DEVICE_BYTES, default 1 GiB, per
 * device); cuMemMap maps the memfd MAP_SHARED|MAP_FIXED at the VA (inaccessible until cuMemSetAccess); cuMemUnmap
 * puts PROT_NONE address space back. As in the real driver, the physical memory lives while it is mapped OR any
 * handle reference is unreleased: cuMemCreate and cuMemRetainAllocationHandle each add a reference, cuMemRelease
 * drops one (a handle may be released while mapped; the last unmap then frees the memory), and a released handle
 * value is invalid for cuMemMap/export. So a device pointer is directly readable by the test (through ctypes) exactly
 * while it is mapped with access, content survives only in the memfd, and a use of released memory faults.
 * Copies, memsets, streams and events run synchronously. Strict checks return CUDA_ERROR_INVALID_VALUE for
 * misuse the real driver also rejects (map over a mapping, free of a reservation that still has mappings,
 * set-access over an unmapped hole, double host registration). As in the real driver, cuMemUnmap and
 * cuMemSetAccess never act on part of a mapping: a range that cuts through one fails with CUDA_ERROR_INVALID_VALUE
 * (counted as the pseudo-call "cuMemUnmap:subrange" / "cuMemSetAccess:subrange", so a test can assert the engine
 * never tried; coalesced mappings hold several allocations). They accept a range of
 * several whole back-to-back mappings (reported of the real driver for unmap, used by ebbtide for set-access; the
 * docs do not say) unless
 * exact-unmap mode is on, where cuMemUnmap must name exactly one mapping (a stricter driver: tests the fallback).
 *
 * Test controls (exported, call through ctypes on the same path):
 *   ebt_fake_set_fault(name, nth, err)  the nth next call (1 = next) of `name` returns `err` and does nothing;
 *                                       nth < 0: every call fails until cleared with nth = 0;
 *                                       also EBT_FAKE_FAULT="name:nth:err" at load.
 *   ebt_fake_counters(out[8])           live handles, physical bytes, live mappings, reservations,
 *                                       reserved bytes, registered host bytes, registrations, unpinned copies
 *   ebt_fake_calls(name)                calls of `name` so far (also "cuMemUnmap:subrange", "cuMemSetAccess:subrange":
 *                                       refused ranges that cut through a mapping)
 *   ebt_fake_call_threads(name)         distinct threads that called `name` so far
 *   ebt_fake_trace(buf, len, clear)     comma-separated call names since the last clear
 *   ebt_fake_set_device_bytes(bytes)    physical memory per device from now on
 *   ebt_fake_set_exact_unmap(on)        cuMemUnmap over more than one mapping fails (INVALID_VALUE); also
 *                                       EBT_FAKE_EXACT_UNMAP=1 at load
 *   ebt_fake_set_partial_unmap(on)      a cuMemUnmap over several mappings unmaps the first one, then fails
 *                                       (INVALID_VALUE): a driver that gives up half way (tests that case)
 *   ebt_fake_set_delay(name, us)        every call of `name` first sleeps `us` microseconds, outside the fake's
 *                                       lock (0 clears): widens a window for concurrency tests
 *   ebt_fake_set_foreign_global_capture(on)  pretend another thread captures a graph in global mode:
 *                                       cuMemHostRegister then fails (906) unless the calling thread is relaxed
 * EBT_FAKE_DEVICES sets the device count (default 1). Thread-safe (one mutex).
 */
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "csrc/cuda_driver_types.h"

#define FAKE_API extern "C" __attribute__((visibility("default")))

namespace {

constexpr size_t kGranularity = size_t(2) << 20;
constexpr CUresult kAlreadyRegistered = 712;
constexpr CUresult kNotRegistered = 713;

struct Handle {
  int fd = -1;
  size_t size = 0;
  int device = 0;
  int maps = 0;        // live mappings of this handle
  int refs = 1;        // unreleased handle references (cuMemCreate/Import: 1; +1 per cuMemRetainAllocationHandle)
  bool shareable = false;  // created with requestedHandleTypes = POSIX fd (exportable)
  bool imported = false;   // made by cuMemImportFromShareableHandle: the exporter's memory, not counted again
};
struct Reservation {
  char* raw = nullptr;
  size_t raw_size = 0;
  CUdeviceptr base = 0;
  size_t size = 0;
};
struct Mapping {
  size_t size = 0;
  Handle* handle = nullptr;
};

std::mutex g_mu;  // guards everything below
std::map<Handle*, bool> g_handles;                  // live (not yet destroyed) handles
std::map<CUdeviceptr, Reservation> g_reservations;  // by base
std::map<CUdeviceptr, Mapping> g_mappings;          // by VA
std::map<char*, size_t> g_registered;               // host registrations
std::map<std::string, long> g_calls;
std::map<std::string, std::set<std::thread::id>> g_call_threads;
std::map<std::string, std::pair<long, CUresult>> g_faults;  // name -> (countdown, error)
std::string g_trace;
size_t g_device_bytes = size_t(1) << 30;
bool g_exact_unmap = false;  // ebt_fake_set_exact_unmap: cuMemUnmap must name exactly one mapping
bool g_partial_unmap = false;  // ebt_fake_set_partial_unmap: a multi-mapping cuMemUnmap unmaps the first, then fails
std::vector<size_t> g_used;  // physical bytes in use, per device
int g_devices = 1;
long g_unpinned_copies = 0;
int g_ctx_tokens[64];  // fake context objects (their addresses)
thread_local std::vector<CUcontext> t_ctx_stack;
thread_local int t_capture_mode = 0;       // cuThreadExchangeStreamCaptureMode: global (0) until changed
bool g_foreign_global_capture = false;     // ebt_fake_set_foreign_global_capture: another thread captures (global)
constexpr CUresult kStreamCaptureImplicit = static_cast<CUresult>(906);  // CUDA_ERROR_STREAM_CAPTURE_IMPLICIT

void init_once() {
  static bool done = false;
  if (done) return;
  done = true;
  if (const char* d = getenv("EBT_FAKE_DEVICES")) g_devices = atoi(d) > 0 ? atoi(d) : 1;
  if (const char* b = getenv("EBT_FAKE_DEVICE_BYTES")) g_device_bytes = strtoull(b, nullptr, 10);
  if (const char* x = getenv("EBT_FAKE_EXACT_UNMAP")) g_exact_unmap = atoi(x) != 0;
  g_used.assign(g_devices, 0);
  if (const char* f = getenv("EBT_FAKE_FAULT")) {
    char name[128];
    long nth = 0;
    int err = 0;
    if (sscanf(f, "%127[^:]:%ld:%d", name, &nth, &err) == 3) g_faults[name] = {nth, err};
  }
}

// Count the call, append it to the trace, and fire an armed fault. Caller holds g_mu.
bool fault(const char* name, CUresult* err) {
  init_once();
  ++g_calls[name];
  g_call_threads[name].insert(std::this_thread::get_id());
  if (!g_trace.empty()) g_trace += ",";
  g_trace += name;
  auto it = g_faults.find(name);
  if (it == g_faults.end()) return false;
  if (it->second.first < 0) {  // persistent: every call fails until cleared
    *err = it->second.second;
    return true;
  }
  if (--it->second.first > 0) return false;
  *err = it->second.second;
  g_faults.erase(it);
  return true;
}

std::mutex g_delay_mu;                    // guards g_delays (apart from g_mu: a sleeping call holds neither)
std::map<std::string, long> g_delays;     // ebt_fake_set_delay: microseconds before each call of a name
void delay(const char* name) {
  long us = 0;
  {
    std::lock_guard<std::mutex> lk(g_delay_mu);
    auto it = g_delays.find(name);
    if (it != g_delays.end()) us = it->second;
  }
  if (us > 0) usleep(static_cast<useconds_t>(us));
}

#define ENTER(name)               \
  delay(name);                    \
  std::lock_guard<std::mutex> lk(g_mu); \
  do {                            \
    CUresult fe_;                 \
    if (fault(name, &fe_)) return fe_; \
  } while (0)

int ctx_device(CUcontext c) { return static_cast<int>(reinterpret_cast<int*>(c) - g_ctx_tokens); }

const Reservation* reservation_of(CUdeviceptr p, size_t n) {
  auto it = g_reservations.upper_bound(p);
  if (it == g_reservations.begin()) return nullptr;
  --it;
  const Reservation& r = it->second;
  return (p >= r.base && p + n <= r.base + r.size) ? &r : nullptr;
}

bool overlaps_mapping(CUdeviceptr p, size_t n) {
  auto it = g_mappings.lower_bound(p);
  if (it != g_mappings.end() && it->first < p + n) return true;
  if (it != g_mappings.begin()) {
    --it;
    if (it->first + it->second.size > p) return true;
  }
  return false;
}

// [p, p+n) is exactly covered by whole mappings, back to back.
bool covered_by_mappings(CUdeviceptr p, size_t n, std::vector<CUdeviceptr>* which) {
  CUdeviceptr cur = p;
  while (cur < p + n) {
    auto it = g_mappings.find(cur);
    if (it == g_mappings.end()) return false;
    if (which) which->push_back(cur);
    cur += it->second.size;
  }
  return cur == p + n;
}

void destroy_handle_if_done(Handle* h) {
  if (h->refs > 0 || h->maps > 0) return;
  close(h->fd);
  if (!h->imported) g_used[h->device] -= h->size;
  g_handles.erase(h);
  delete h;
}

bool host_registered(const void* p, size_t n) {
  auto it = g_registered.upper_bound(const_cast<char*>(static_cast<const char*>(p)));
  if (it == g_registered.begin()) return false;
  --it;
  const char* c = static_cast<const char*>(p);
  return c >= it->first && c + n <= it->first + it->second;
}

}  // namespace

// ---- test controls ------------------------------------------------------------------------------------------
FAKE_API void ebt_fake_set_fault(const char* name, long nth, int err) {
  std::lock_guard<std::mutex> lk(g_mu);
  init_once();
  if (nth == 0) g_faults.erase(name);
  else g_faults[name] = {nth, err};
}
FAKE_API void ebt_fake_set_delay(const char* name, long us) {
  std::lock_guard<std::mutex> lk(g_delay_mu);
  if (us <= 0) g_delays.erase(name);
  else g_delays[name] = us;
}
FAKE_API void ebt_fake_counters(long long* out) {
  std::lock_guard<std::mutex> lk(g_mu);
  init_once();
  long long phys = 0, reserved = 0, reg = 0;
  for (size_t u : g_used) phys += static_cast<long long>(u);
  for (auto& r : g_reservations) reserved += static_cast<long long>(r.second.size);
  for (auto& r : g_registered) reg += static_cast<long long>(r.second);
  out[0] = static_cast<long long>(g_handles.size());
  out[1] = phys;
  out[2] = static_cast<long long>(g_mappings.size());
  out[3] = static_cast<long long>(g_reservations.size());
  out[4] = reserved;
  out[5] = reg;
  out[6] = static_cast<long long>(g_registered.size());
  out[7] = g_unpinned_copies;
}
FAKE_API long ebt_fake_calls(const char* name) {
  std::lock_guard<std::mutex> lk(g_mu);
  auto it = g_calls.find(name);
  return it == g_calls.end() ? 0 : it->second;
}
FAKE_API long ebt_fake_call_threads(const char* name) {
  std::lock_guard<std::mutex> lk(g_mu);
  auto it = g_call_threads.find(name);
  return it == g_call_threads.end() ? 0 : static_cast<long>(it->second.size());
}
FAKE_API size_t ebt_fake_trace(char* buf, size_t len, int clear) {
  std::lock_guard<std::mutex> lk(g_mu);
  size_t n = g_trace.size();
  if (buf && len) snprintf(buf, len, "%s", g_trace.c_str());
  if (clear) g_trace.clear();
  return n;
}
FAKE_API void ebt_fake_set_foreign_global_capture(int on) {
  std::lock_guard<std::mutex> lk(g_mu);
  g_foreign_global_capture = on != 0;
}
FAKE_API void ebt_fake_set_exact_unmap(int on) {
  std::lock_guard<std::mutex> lk(g_mu);
  init_once();
  g_exact_unmap = on != 0;
}
FAKE_API void ebt_fake_set_partial_unmap(int on) {
  std::lock_guard<std::mutex> lk(g_mu);
  init_once();
  g_partial_unmap = on != 0;
}
FAKE_API void ebt_fake_set_device_bytes(size_t bytes) {
  std::lock_guard<std::mutex> lk(g_mu);
  init_once();
  g_device_bytes = bytes;
}

// ---- init / device / context ----------------------------------------------------------------------------------
FAKE_API CUresult cuInit(unsigned int) { ENTER("cuInit"); return CUDA_SUCCESS; }
FAKE_API CUresult cuDriverGetVersion(int* v) { ENTER("cuDriverGetVersion"); *v = 12080; return CUDA_SUCCESS; }
FAKE_API CUresult cuGetErrorName(CUresult e, const char** s) {
  switch (e) {
    case CUDA_SUCCESS: *s = "CUDA_SUCCESS"; break;
    case CUDA_ERROR_INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *s = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    default: *s = "CUDA_ERROR_FAKE"; break;
  }
  return CUDA_SUCCESS;
}
FAKE_API CUresult cuGetErrorString(CUresult e, const char** s) {
  *s = e == CUDA_ERROR_OUT_OF_MEMORY ? "out of memory (fake)" : "fake driver error";
  return CUDA_SUCCESS;
}
FAKE_API CUresult cuDeviceGet(CUdevice* d, int ordinal) {
  ENTER("cuDeviceGet");
  if (ordinal < 0 || ordinal >= g_devices) return CUDA_ERROR_INVALID_DEVICE;
  *d = ordinal;
  return CUDA_SUCCESS;
}
FAKE_API CUresult cuDeviceGetCount(int* n) { ENTER("cuDeviceGetCount"); *n = g_devices; return CUDA_SUCCESS; }
FAKE_API CUresult cuDeviceGetName(char* name, int len, CUdevice d) {
  ENTER("cuDeviceGetName");
  snprintf(name, len, "ebbtide fake device %d", d);
  return CUDA_SUCCESS;
}
FAKE_API CUresult cuDeviceTotalMem(size_t* b, CUdevice) { ENTER("cuDeviceTotalMem"); *b = g_device_bytes; return CUDA_SUCCESS; }
FAKE_API CUresult cuDeviceGetAttribute(int* v, int attr, CUdevice) {
  ENTER("cuDeviceGetAttribute");
  *v = (attr == CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED ||
        attr == CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED) ? 1 : 0;
  if (attr == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR) *v = 9;
  return CUDA_SUCCESS;
}
FAKE_API CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice d) {
  ENTER("cuDevicePrimaryCtxRetain");
  if (d < 0 || d >= g_devices) return CUDA_ERROR_INVALID_DEVICE;
  *c = reinterpret_cast<CUcontext>(&g_ctx_tokens[d]);
  return CUDA_SUCCESS;
}
FAKE_API CUresult cuDevicePrimaryCtxRelease(CUdevice) { ENTER("cuDevicePrimaryCtxRelease"); return CUDA_SUCCESS; }
FAKE_API CUresult cuCtxGetCurrent(CUcontext* c) {
  *c = t_ctx_stack.empty() ? nullptr : t_ctx_stack.back();
  return CUDA_SUCCESS;
}
FAKE_API CUresult cuCtxSetCurrent(CUcontext c) {
  if (t_ctx_stack.empty()) t_ctx_stack.push_back(c);
  else t_ctx_stack.back() = c;
  return CUDA_SUCCESS;
}
FAKE_API CUresult cuCtxPushCurrent(CUcontext c) { t_ctx_stack.push_back(c); return CUDA_SUCCESS; }
FAKE_API CUresult cuCtxPopCurrent(CUcontext* c) {
  if (t_ctx_stack.empty()) return CUDA_ERROR_INVALID_CONTEXT;
  if (c) *c = t_ctx_stack.back();
  t_ctx_stack.pop_back();
  return CUDA_SUCCESS;
}
FAKE_API CUresult cuCtxGetDevice(CUdevice* d) {
  if (t_ctx_stack.empty() || !t_ctx_stack.back()) return CUDA_ERROR_INVALID_CONTEXT;
  *d = ctx_device(t_ctx_stack.back());
  return CUDA_SUCCESS;
}
FAKE_API CUresult cuCtxSynchronize(void) {
  ENTER("cuCtxSynchronize");
  return t_ctx_stack.empty() ? CUDA_ERROR_INVALID_CONTEXT : CUDA_SUCCESS;
}

// ---- memory info, plain allocations ----------------------------------------------------------------------------
FAKE_API CUresult cuMemGetInfo(size_t* free_b, size_t* total) {
  ENTER("cuMemGetInfo");
  int d = t_ctx_stack.empty() || !t_ctx_stack.back() ? 0 : ctx_device(t_ctx_stack.back());
  *free_b = g_device_bytes > g_used[d] ? g_device_bytes - g_used[d] : 0;
  if (total) *total = g_device_bytes;
  return CUDA_SUCCESS;
}
FAKE_API CUresult cuMemAlloc(CUdeviceptr* p, size_t n) {
  ENTER("cuMemAlloc");
  void* m = malloc(n);
  if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
  *p = reinterpret_cast<CUdeviceptr>(m);
  return CUDA_SUCCESS;
}
FAKE_API CUresult cuMemFree(CUdeviceptr p) { ENTER("cuMemFree"); free(reinterpret_cast<void*>(p)); return CUDA_SUCCESS; }
FAKE_API CUresult cuMemHostAlloc(void** p, size_t n, unsigned) {
  ENTER("cuMemHostAlloc");
  *p = malloc(n);
  return *p ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}
FAKE_API CUresult cuMemFreeHost(void* p) { ENTER("cuMemFreeHost"); free(p); return CUDA_SUCCESS; }
FAKE_API CUresult cuMemHostRegister(void* p, size_t n, unsigned) {
  ENTER("cuMemHostRegister");
  // A potentially unsafe call while another thread captures in global mode: refused unless this thread is relaxed.
  if (g_foreign_global_capture && t_capture_mode != 2) return kStreamCaptureImplicit;
  if (t_ctx_stack.empty() || !t_ctx_stack.back()) return CUDA_ERROR_INVALID_CONTEXT;
  char* c = static_cast<char*>(p);
  auto it = g_registered.lower_bound(c);
  if (it != g_registered.end() && it->first < c + n) return kAlreadyRegistered;
  if (it != g_registered.begin() && std::prev(it)->first + std::prev(it)->second > c) return kAlreadyRegistered;
  g_registered[c] = n;
  return CUDA_SUCCESS;
}
FAKE_API CUresult cuMemHostUnregister(void* p) {
  ENTER("cuMemHostUnregister");
  return g_registered.erase(static_cast<char*>(p)) ? CUDA_SUCCESS : kNotRegistered;
}

// ---- copies, streams, events (synchronous) ---------------------------------------------------------------------
FAKE_API CUresult cuMemcpyDtoHAsync(void* dst, CUdeviceptr src, size_t n, CUstream) {
  ENTER("cuMemcpyDtoHAsync");
  if (!host_registered(dst, n)) ++g_unpinned_copies;
  memcpy(dst, reinterpret_cast<void*>(src), n);
  return CUDA_SUCCESS;
}
FAKE_API CUresult cuMemcpyHtoDAsync(CUdeviceptr dst, const void* src, size_t n, CUstream) {
  ENTER("cuMemcpyHtoDAsync");
  if (!host_registered(src, n)) ++g_unpinned_copies;
  memcpy(reinterpret_cast<void*>(dst), src, n);
  return CUDA_SUCCESS;
}
FAKE_API CUresult cuMemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream) {
  ENTER("cuMemcpyDtoDAsync");
  memmove(reinterpret_cast<void*>(dst), reinterpret_cast<void*>(src), n);
  return CUDA_SUCCESS;
}
FAKE_API CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, CUstream) {
  ENTER("cuMemsetD8Async");
  memset(reinterpret_cast<void*>(dst), v, n);
  return CUDA_SUCCESS;
}
FAKE_API CUresult cuStreamCreate(CUstream* s, unsigned) { ENTER("cuStreamCreate"); *s = reinterpret_cast<CUstream>(new int(1)); return CUDA_SUCCESS; }
FAKE_API CUresult cuStreamDestroy(CUstream s) { ENTER("cuStreamDestroy"); delete reinterpret_cast<int*>(s); return CUDA_SUCCESS; }
FAKE_API CUresult cuStreamSynchronize(CUstream) { ENTER("cuStreamSynchronize"); return CUDA_SUCCESS; }
FAKE_API CUresult cuStreamQuery(CUstream) { ENTER("cuStreamQuery"); return CUDA_SUCCESS; }
FAKE_API CUresult cuStreamWaitEvent(CUstream, CUevent, unsigned) { ENTER("cuStreamWaitEvent"); return CUDA_SUCCESS; }
FAKE_API CUresult cuEventCreate(CUevent* e, unsigned) { ENTER("cuEventCreate"); *e = reinterpret_cast<CUevent>(new int(2)); return CUDA_SUCCESS; }
FAKE_API CUresult cuEventDestroy(CUevent e) { ENTER("cuEventDestroy"); delete reinterpret_cast<int*>(e); return CUDA_SUCCESS; }
FAKE_API CUresult cuEventRecord(CUevent, CUstream) { ENTER("cuEventRecord"); return CUDA_SUCCESS; }
FAKE_API CUresult cuEventQuery(CUevent) { ENTER("cuEventQuery"); return CUDA_SUCCESS; }
FAKE_API CUresult cuEventSynchronize(CUevent) { ENTER("cuEventSynchronize"); return CUDA_SUCCESS; }
FAKE_API CUresult cuEventElapsedTime(float* ms, CUevent, CUevent) { ENTER("cuEventElapsedTime"); *ms = 0; return CUDA_SUCCESS; }
FAKE_API CUresult cuPointerGetAttribute(void*, int, CUdeviceptr) { ENTER("cuPointerGetAttribute"); return CUDA_ERROR_NOT_SUPPORTED; }

// ---- virtual memory management ---------------------------------------------------------------------------------
FAKE_API CUresult cuMemGetAllocationGranularity(size_t* g, const CUmemAllocationProp*, int) {
  ENTER("cuMemGetAllocationGranularity");
  *g = kGranularity;
  return CUDA_SUCCESS;
}
FAKE_API CUresult cuMemAddressReserve(CUdeviceptr* p, size_t size, size_t align, CUdeviceptr, unsigned long long) {
  ENTER("cuMemAddressReserve");
  if (size == 0 || size % kGranularity) return CUDA_ERROR_INVALID_VALUE;
  if (align < kGranularity) align = kGranularity;
  Reservation r;
  r.raw_size = size + align;
  void* raw = mmap(nullptr, r.raw_size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  r.raw = static_cast<char*>(raw);
  r.base = (reinterpret_cast<CUdeviceptr>(raw) + align - 1) / align * align;
  r.size = size;
  g_reservations[r.base] = r;
  *p = r.base;
  return CUDA_SUCCESS;
}
FAKE_API CUresult cuMemAddressFree(CUdeviceptr p, size_t size) {
  ENTER("cuMemAddressFree");
  auto it = g_reservations.find(p);
  if (it == g_reservations.end() || it->second.size != size) return CUDA_ERROR_INVALID_VALUE;
  if (overlaps_mapping(p, size)) return CUDA_ERROR_INVALID_VALUE;  // still mapped inside
  munmap(it->second.raw, it->second.raw_size);
  g_reservations.erase(it);
  return CUDA_SUCCESS;
}
FAKE_API CUresult cuMemCreate(CUmemGenericAllocationHandle* out, size_t size, const CUmemAllocationProp* prop,
                              unsigned long long) {
  ENTER("cuMemCreate");
  if (size == 0 || size % kGranularity || !prop || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED)
    return CUDA_ERROR_INVALID_VALUE;
  int dev = prop->location.id;
  if (dev < 0 || dev >= g_devices) return CUDA_ERROR_INVALID_DEVICE;
  if (g_used[dev] + size > g_device_bytes) return CUDA_ERROR_OUT_OF_MEMORY;
  int fd = memfd_create("ebt_fake_handle", 0);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(size)) != 0) {
    if (fd >= 0) close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  auto* h = new Handle{fd, size, dev, 0, 1};
  h->shareable = prop->requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  g_handles[h] = true;
  g_used[dev] += size;
  *out = reinterpret_cast<CUmemGenericAllocationHandle>(h);
  return CUDA_SUCCESS;
}
FAKE_API CUresult cuMemRelease(CUmemGenericAllocationHandle hh) {
  ENTER("cuMemRelease");
  auto* h = reinterpret_cast<Handle*>(hh);
  if (!g_handles.count(h) || h->refs == 0) return CUDA_ERROR_INVALID_VALUE;
  --h->refs;
  destroy_handle_if_done(h);
  return CUDA_SUCCESS;
}
FAKE_API CUresult cuMemMap(CUdeviceptr p, size_t size, size_t offset, CUmemGenericAllocationHandle hh,
                           unsigned long long) {
  ENTER("cuMemMap");
  auto* h = reinterpret_cast<Handle*>(hh);
  if (!g_handles.count(h) || h->refs == 0 || offset != 0 || size != h->size) return CUDA_ERROR_INVALID_VALUE;
  if (!reservation_of(p, size) || overlaps_mapping(p, size)) return CUDA_ERROR_INVALID_VALUE;
  void* m = mmap(reinterpret_cast<void*>(p), size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->fd, 0);
  if (m == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  g_mappings[p] = Mapping{size, h};
  ++h->maps;
  return CUDA_SUCCESS;
}
FAKE_API CUresult cuMemUnmap(CUdeviceptr p, size_t size) {
  ENTER("cuMemUnmap");
  std::vector<CUdeviceptr> which;
  if (!covered_by_mappings(p, size, &which)) {
    if (overlaps_mapping(p, size)) ++g_calls["cuMemUnmap:subrange"];  // cuts through a mapping: refused
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (g_exact_unmap && which.size() != 1) return CUDA_ERROR_INVALID_VALUE;
  if (g_partial_unmap && which.size() > 1) {  // a driver that gives up half way: first mapping gone, then fails
    size = g_mappings[which[0]].size;
    which.resize(1);
    mmap(reinterpret_cast<void*>(p), size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    Handle* h = g_mappings[p].handle;
    g_mappings.erase(p);
    --h->maps;
    destroy_handle_if_done(h);
    return CUDA_ERROR_INVALID_VALUE;
  }
  mmap(reinterpret_cast<void*>(p), size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  for (CUdeviceptr va : which) {
    Handle* h = g_mappings[va].handle;
    g_mappings.erase(va);
    --h->maps;
    destroy_handle_if_done(h);
  }
  return CUDA_SUCCESS;
}
FAKE_API CUresult cuMemSetAccess(CUdeviceptr p, size_t size, const CUmemAccessDesc* desc, size_t count) {
  ENTER("cuMemSetAccess");
  if (!desc || count == 0) return CUDA_ERROR_INVALID_VALUE;
  if (!covered_by_mappings(p, size, nullptr)) {
    if (overlaps_mapping(p, size)) ++g_calls["cuMemSetAccess:subrange"];  // cuts through a mapping: refused
    return CUDA_ERROR_INVALID_VALUE;
  }
  int prot = desc[0].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE ? PROT_READ | PROT_WRITE
             : desc[0].flags == CU_MEM_ACCESS_FLAGS_PROT_READ     ? PROT_READ
                                                                  : PROT_NONE;
  return mprotect(reinterpret_cast<void*>(p), size, prot) == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
// POSIX fd handles: the exported fd is a dup of the handle's memfd, so an importer in another process maps the
// very same pages (as the real driver shares the physical allocation).
FAKE_API CUresult cuMemExportToShareableHandle(void* out, CUmemGenericAllocationHandle hh, int type,
                                               unsigned long long) {
  ENTER("cuMemExportToShareableHandle");
  auto* h = reinterpret_cast<Handle*>(hh);
  if (!out || !g_handles.count(h) || h->refs == 0) return CUDA_ERROR_INVALID_VALUE;
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || !h->shareable) return CUDA_ERROR_INVALID_VALUE;
  int fd = dup(h->fd);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *static_cast<int*>(out) = fd;
  return CUDA_SUCCESS;
}
FAKE_API CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle* out, void* os_handle, int type) {
  ENTER("cuMemImportFromShareableHandle");
  if (!out || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_INVALID_VALUE;
  int src = static_cast<int>(reinterpret_cast<uintptr_t>(os_handle));
  off_t size = lseek(src, 0, SEEK_END);
  if (size <= 0) return CUDA_ERROR_INVALID_VALUE;
  int fd = dup(src);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  auto* h = new Handle{fd, static_cast<size_t>(size), 0, 0, 1};
  h->imported = true;
  g_handles[h] = true;
  *out = reinterpret_cast<CUmemGenericAllocationHandle>(h);
  return CUDA_SUCCESS;
}
FAKE_API CUresult cuThreadExchangeStreamCaptureMode(int* mode) {
  ENTER("cuThreadExchangeStreamCaptureMode");
  if (!mode || *mode < 0 || *mode > 2) return CUDA_ERROR_INVALID_VALUE;
  std::swap(*mode, t_capture_mode);
  return CUDA_SUCCESS;
}
// The handle of the mapping that contains addr, with one more reference (the caller releases it).
FAKE_API CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle* out, void* addr) {
  ENTER("cuMemRetainAllocationHandle");
  auto p = reinterpret_cast<CUdeviceptr>(addr);
  auto it = g_mappings.upper_bound(p);
  if (!out || it == g_mappings.begin()) return CUDA_ERROR_INVALID_VALUE;
  --it;
  if (p >= it->first + it->second.size) return CUDA_ERROR_INVALID_VALUE;
  ++it->second.handle->refs;
  *out = reinterpret_cast<CUmemGenericAllocationHandle>(it->second.handle);
  return CUDA_SUCCESS;
}
