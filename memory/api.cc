/*
 * api.cc — the exported memory C API (memory/ebbtide_memory.h): routing state (thread-local regions, the
 * process default region, the disabled flag), asynchronous ops, the PyTorch pluggable-allocator entry points,
 * and fork safety.
 *
 * Routing contract (where an allocation lands; see NOTES.md "Which thread's allocations are captured"):
 *  - the calling thread's innermost region, unless the thread is disabled;
 *  - else the process default region (ebt_mem_set_default_region), which covers threads the caller does not
 *    control (autograd's device threads allocate gradients during backward);
 *  - else nothing: the interposer forwards to the real cudaMalloc. ebt_torch_malloc has no "forward" (its pool
 *    asked for VMM memory), so it falls back to tag "default", backup none.
 * Fork: pthread_atfork marks a child "forked": every ebt_mem_* call then fails with INVALID_STATE and the
 * interposers forward, so a child never touches the parent's bookkeeping (its CUDA state is unusable anyway).
 */
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "csrc/status.h"
#include "memory/engine.h"
#include "memory/routing.h"

using ebbtide::memory::Engine;
using ebbtide::memory::OpKind;
using ebbtide::memory::Plan;

namespace ebbtide::memory {

namespace {

constexpr int kMaxDepth = 32;  // region nesting per thread

struct Region {
  char tag[EBT_MEM_TAG_MAX + 1];
  int backup;
};

// Trivially constructible so the TLS block needs no constructor (the interposer reads it on every cudaMalloc).
struct ThreadRouting {
  Region stack[kMaxDepth];
  int depth;     // regions pushed, 0..kMaxDepth
  int disabled;  // >0: bypass
};
thread_local ThreadRouting t_routing;

std::atomic<bool> g_forked{false};
std::atomic<bool> g_has_default{false};  // fast-path flag for the interposer
std::mutex g_default_mu;                 // guards g_default
Region g_default;                        // valid iff g_has_default

void on_fork_child() { g_forked.store(true); }

// Library load: install the fork handler; EBBTIDE_MEM_DEFAULT_TAG (+ EBBTIDE_MEM_DEFAULT_BACKUP=none|cpu) sets
// the process default region, so a process started under the shim captures every allocation from its start.
void apply_default_from_env();
void apply_margin_from_env();
void apply_coalesce_from_env();
struct LoadTimeSetup {
  LoadTimeSetup() {
    pthread_atfork(nullptr, nullptr, on_fork_child);
    apply_margin_from_env();
    apply_coalesce_from_env();
    apply_default_from_env();
  }
};

void apply_margin_from_env() {
  const char* m = getenv("EBBTIDE_MEM_MARGIN_BYTES");
  if (!m || !*m) return;
  char* end = nullptr;
  unsigned long long v = strtoull(m, &end, 10);
  if (end && *end == '\0') Engine::get().set_margin(static_cast<size_t>(v));
  else EBT_WARN(EBT_SUBSYS_MEM, "EBBTIDE_MEM_MARGIN_BYTES=%s ignored: not a byte count", m);
}

void apply_coalesce_from_env() {
  const char* v = getenv("EBBTIDE_MEM_COALESCE");
  if (!v || !*v) return;
  if (strcmp(v, "1") == 0 || strcmp(v, "0") == 0) Engine::get().set_coalescing(v[0] == '1');
  else EBT_WARN(EBT_SUBSYS_MEM, "EBBTIDE_MEM_COALESCE=%s ignored: use 1 or 0", v);
}

// torch_memory_saver's equivalent (TMS_INIT_ENABLE=1, TMS_INIT_ENABLE_CPU_BACKUP=1: tag "default") is honoured when
// EBBTIDE_MEM_DEFAULT_TAG is unset, so a launcher written for it (slime) runs unchanged under this shim.
void apply_default_from_env() {
  const char* tag = getenv("EBBTIDE_MEM_DEFAULT_TAG");
  const char* b = getenv("EBBTIDE_MEM_DEFAULT_BACKUP");
  int backup = (b && strcmp(b, "cpu") == 0) ? EBT_MEM_BACKUP_CPU : EBT_MEM_BACKUP_NONE;
  if (!tag || !*tag) {
    const char* tms = getenv("TMS_INIT_ENABLE");
    if (!tms || strcmp(tms, "1") != 0) return;
    tag = "default";
    const char* tb = getenv("TMS_INIT_ENABLE_CPU_BACKUP");
    backup = (tb && strcmp(tb, "1") == 0) ? EBT_MEM_BACKUP_CPU : EBT_MEM_BACKUP_NONE;
  }
  // PyTorch >= 2.9 reads PYTORCH_ALLOC_CONF too (PYTORCH_CUDA_ALLOC_CONF is its older name).
  const char* conf = nullptr;
  for (const char* name : {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"}) {
    const char* c = getenv(name);
    if (c && (strstr(c, "expandable_segments:True") || strstr(c, "expandable_segments:true"))) conf = c;
  }
  if (conf) {
    // Expandable segments map memory with cuMemCreate, never through cudaMalloc: the default region would
    // silently miss PyTorch's allocations. Refuse loudly instead (Python's region() raises UnsupportedError).
    EBT_WARN(EBT_SUBSYS_MEM, "EBBTIDE_MEM_DEFAULT_TAG=%s refused: PYTORCH_CUDA_ALLOC_CONF=%s enables expandable "
             "segments, whose memory bypasses cudaMalloc and could not be paused", tag, conf);
    return;
  }
  if (ebt_mem_set_default_region(tag, backup) != EBT_SUCCESS)
    EBT_WARN(EBT_SUBSYS_MEM, "EBBTIDE_MEM_DEFAULT_TAG=%s ignored: %s", tag, ebt_last_error());
}
LoadTimeSetup g_load_time_setup;  // after every global it touches (same translation unit: in order)

}  // namespace

bool forked_child() { return g_forked.load(std::memory_order_relaxed); }

bool route_current(char* tag, int* backup) {
  const ThreadRouting& t = t_routing;
  if (t.disabled > 0) return false;
  if (t.depth > 0) {
    memcpy(tag, t.stack[t.depth - 1].tag, EBT_MEM_TAG_MAX + 1);
    *backup = t.stack[t.depth - 1].backup;
    return true;
  }
  if (!g_has_default.load(std::memory_order_acquire)) return false;
  std::lock_guard<std::mutex> lock(g_default_mu);
  if (!g_has_default.load()) return false;
  memcpy(tag, g_default.tag, EBT_MEM_TAG_MAX + 1);
  *backup = g_default.backup;
  return true;
}

bool routing_might_capture() {
  return t_routing.disabled == 0 && (t_routing.depth > 0 || g_has_default.load(std::memory_order_relaxed));
}

}  // namespace ebbtide::memory

using namespace ebbtide::memory;

// An asynchronous op: the runtime thread fills the outcome; waiters block on cv.
struct ebt_mem_op {
  std::mutex mu;               // guards done, status, message, report
  std::condition_variable cv;  // signalled once when done
  bool done = false;
  ebt_status_t status = EBT_SUCCESS;
  std::string message;         // ebt_last_error() of the failing op
  ebt_mem_report_t report{};
};

namespace {

#define EBT_NOT_IN_FORK()                                                                              \
  do {                                                                                                 \
    if (forked_child())                                                                                \
      return ebt_set_error(EBT_ERROR_INVALID_STATE, "ebbtide memory is disabled in a forked child"); \
  } while (0)

bool valid_tag(const char* tag) { return tag && *tag && strlen(tag) <= EBT_MEM_TAG_MAX; }
bool valid_backup(int backup) {
  const int base = backup & ~EBT_MEM_SHAREABLE;
  return base == EBT_MEM_BACKUP_NONE || base == EBT_MEM_BACKUP_CPU;
}

ebt_status_t run_sync(OpKind kind, const char* tag, ebt_mem_report_t* report) {
  EBT_NOT_IN_FORK();
  Plan plan;
  ebt_mem_report_t scratch;
  memset(&scratch, 0, sizeof(scratch));
  EBT_CHECK(Engine::get().prepare(kind, tag, &plan, &scratch));
  return Engine::get().execute(plan, report);
}

ebt_status_t run_async(OpKind kind, const char* tag, ebt_mem_op_t* out) {
  EBT_REQUIRE_ARG(out, "op is NULL");
  *out = nullptr;
  EBT_NOT_IN_FORK();
  auto plan = std::make_shared<Plan>();
  ebt_mem_report_t scratch;
  memset(&scratch, 0, sizeof(scratch));
  EBT_CHECK(Engine::get().prepare(kind, tag, plan.get(), &scratch));  // busy marks taken before we return
  auto* op = new ebt_mem_op();
  std::thread([op, plan] {
    ebt_mem_report_t r;
    memset(&r, 0, sizeof(r));
    r.struct_size = sizeof(r);
    ebt_status_t st = Engine::get().execute(*plan, &r);
    std::lock_guard<std::mutex> lock(op->mu);
    op->status = st;
    op->message = st == EBT_SUCCESS ? "" : ebt_last_error();
    op->report = r;
    op->done = true;
    op->cv.notify_all();
  }).detach();
  *out = op;
  return EBT_SUCCESS;
}

// The stats structs only grow by appending fields, so a caller states the size of the struct it was built with
// and gets that prefix: old callers keep working with new libraries. Fields this library does not know (a newer
// caller's) read as zero, never as stale bytes.
void copy_versioned(void* dst, size_t dst_size, const void* src, size_t src_size) {
  const size_t n = std::min(dst_size, src_size);
  memcpy(dst, src, n);
  if (dst_size > n) memset(static_cast<char*>(dst) + n, 0, dst_size - n);
}

void copy_report(const ebt_mem_report_t& src, ebt_mem_report_t* dst) {
  if (!dst) return;
  size_t n = dst->struct_size && dst->struct_size < sizeof(src) ? dst->struct_size : sizeof(src);
  memcpy(dst, &src, n);
  dst->struct_size = n;
}

}  // namespace

extern "C" {

ebt_status_t ebt_mem_region_push(const char* tag, int backup, int* token) {
  EBT_REQUIRE_ARG(token, "token is NULL");
  EBT_REQUIRE_ARG(valid_tag(tag), "tag must be 1..%d bytes", EBT_MEM_TAG_MAX);
  EBT_REQUIRE_ARG(valid_backup(backup), "backup must be NONE(0) or CPU(1), optionally | EBT_MEM_SHAREABLE");
  EBT_NOT_IN_FORK();
  ThreadRouting& t = t_routing;
  if (t.depth >= kMaxDepth) return ebt_set_error(EBT_ERROR_INVALID_STATE, "regions nested deeper than %d", kMaxDepth);
  EBT_CHECK(Engine::get().register_tag(tag));
  *token = t.depth;
  snprintf(t.stack[t.depth].tag, sizeof(t.stack[t.depth].tag), "%s", tag);
  t.stack[t.depth].backup = backup;
  ++t.depth;
  return EBT_SUCCESS;
}

ebt_status_t ebt_mem_region_pop(int token) {
  ThreadRouting& t = t_routing;
  EBT_REQUIRE_ARG(token >= 0 && token < t.depth, "region token %d does not match this thread's regions (depth %d)",
                  token, t.depth);
  t.depth = token;
  return EBT_SUCCESS;
}

ebt_status_t ebt_mem_set_disabled(int disabled, int* previous) {
  if (previous) *previous = t_routing.disabled;
  EBT_REQUIRE_ARG(disabled >= 0, "disabled must be >= 0");
  t_routing.disabled = disabled;
  return EBT_SUCCESS;
}

ebt_status_t ebt_mem_set_default_region(const char* tag, int backup) {
  EBT_NOT_IN_FORK();
  if (!tag) {
    std::lock_guard<std::mutex> lock(g_default_mu);
    g_has_default.store(false);
    return EBT_SUCCESS;
  }
  EBT_REQUIRE_ARG(valid_tag(tag), "tag must be 1..%d bytes", EBT_MEM_TAG_MAX);
  EBT_REQUIRE_ARG(valid_backup(backup), "backup must be NONE(0) or CPU(1), optionally | EBT_MEM_SHAREABLE");
  EBT_CHECK(Engine::get().register_tag(tag));
  std::lock_guard<std::mutex> lock(g_default_mu);
  snprintf(g_default.tag, sizeof(g_default.tag), "%s", tag);
  g_default.backup = backup;
  g_has_default.store(true, std::memory_order_release);
  return EBT_SUCCESS;
}

ebt_status_t ebt_mem_current_region(char* tag, int* backup, int* disabled) {
  EBT_REQUIRE_ARG(tag && backup && disabled, "out-pointers must not be NULL");
  *disabled = t_routing.disabled;
  int saved = t_routing.disabled;
  t_routing.disabled = 0;  // report the region that would apply if enabled
  bool routed = route_current(tag, backup);
  t_routing.disabled = saved;
  if (!routed) {
    tag[0] = '\0';
    *backup = EBT_MEM_BACKUP_NONE;
  }
  return EBT_SUCCESS;
}

ebt_status_t ebt_mem_malloc(void** ptr, size_t size, int device, const char* tag, int backup) {
  EBT_NOT_IN_FORK();
  return Engine::get().malloc(ptr, size, device, tag, backup);
}

ebt_status_t ebt_mem_free(void* ptr, int* found) {
  EBT_NOT_IN_FORK();
  return Engine::get().free(ptr, found);
}

ebt_status_t ebt_mem_pause(const char* tag, ebt_mem_report_t* report) { return run_sync(OpKind::kPause, tag, report); }
ebt_status_t ebt_mem_resume(const char* tag, ebt_mem_report_t* report) { return run_sync(OpKind::kResume, tag, report); }
ebt_status_t ebt_mem_pause_async(const char* tag, ebt_mem_op_t* op) { return run_async(OpKind::kPause, tag, op); }
ebt_status_t ebt_mem_resume_async(const char* tag, ebt_mem_op_t* op) { return run_async(OpKind::kResume, tag, op); }

ebt_status_t ebt_mem_op_wait(ebt_mem_op_t op, double timeout_s, ebt_mem_report_t* report) {
  EBT_REQUIRE_ARG(op, "op is NULL");
  std::unique_lock<std::mutex> lock(op->mu);
  if (timeout_s < 0) {
    op->cv.wait(lock, [op] { return op->done; });
  } else if (!op->cv.wait_for(lock, std::chrono::duration<double>(timeout_s), [op] { return op->done; })) {
    return ebt_set_error(EBT_ERROR_TIMEOUT, "pause/resume still running after %.3f s", timeout_s);
  }
  copy_report(op->report, report);
  if (op->status != EBT_SUCCESS) return ebt_set_error(op->status, "%s", op->message.c_str());
  return EBT_SUCCESS;
}

ebt_status_t ebt_mem_op_release(ebt_mem_op_t op) {
  if (!op) return EBT_SUCCESS;
  {
    std::unique_lock<std::mutex> lock(op->mu);
    op->cv.wait(lock, [op] { return op->done; });
  }
  delete op;
  return EBT_SUCCESS;
}

ebt_status_t ebt_mem_mark_clean(const char* tag) {
  EBT_NOT_IN_FORK();
  return Engine::get().mark_clean(tag);
}

ebt_status_t ebt_mem_tag_state(const char* tag, int* state, unsigned long long* pauses) {
  EBT_NOT_IN_FORK();
  return Engine::get().tag_state(tag, state, pauses);
}

ebt_status_t ebt_mem_export_fd(const void* ptr, int* fd, size_t* offset, size_t* size) {
  EBT_NOT_IN_FORK();
  return Engine::get().export_fd(ptr, fd, offset, size);
}

ebt_status_t ebt_mem_import_fd(int fd, size_t size, int device, void** ptr) {
  EBT_NOT_IN_FORK();
  return Engine::get().import_fd(fd, size, device, ptr);
}

ebt_status_t ebt_mem_close_import(void* ptr) {
  EBT_NOT_IN_FORK();
  return Engine::get().close_import(ptr);
}

ebt_status_t ebt_mem_set_memory_margin(size_t bytes) {
  EBT_NOT_IN_FORK();
  Engine::get().set_margin(bytes);
  return EBT_SUCCESS;
}

ebt_status_t ebt_mem_get_memory_margin(size_t* bytes) {
  EBT_REQUIRE_ARG(bytes, "bytes is NULL");
  *bytes = Engine::get().margin();
  return EBT_SUCCESS;
}

ebt_status_t ebt_mem_set_coalescing(int enabled) {
  EBT_NOT_IN_FORK();
  EBT_REQUIRE_ARG(enabled == 0 || enabled == 1, "enabled must be 0 or 1, not %d", enabled);
  Engine::get().set_coalescing(enabled != 0);
  return EBT_SUCCESS;
}

ebt_status_t ebt_mem_get_coalescing(int* enabled) {
  EBT_REQUIRE_ARG(enabled, "enabled is NULL");
  *enabled = Engine::get().coalescing() ? 1 : 0;
  return EBT_SUCCESS;
}

ebt_status_t ebt_mem_stats(void* rows, size_t row_size, size_t capacity, size_t* count) {
  EBT_NOT_IN_FORK();
  EBT_REQUIRE_ARG(count, "count is NULL");
  EBT_REQUIRE_ARG(capacity == 0 || rows, "rows is NULL with capacity %zu", capacity);
  EBT_REQUIRE_ARG(capacity == 0 || row_size >= offsetof(ebt_mem_tag_stats_t, bytes_pending_free),
                  "row_size %zu is smaller than any released ebt_mem_tag_stats_t", row_size);
  if (capacity == 0) return Engine::get().stats(nullptr, 0, count);
  std::unique_ptr<ebt_mem_tag_stats_t[]> full(new (std::nothrow) ebt_mem_tag_stats_t[capacity]);
  if (!full) return ebt_set_error(EBT_ERROR_HOST_OUT_OF_MEMORY, "ebt_mem_stats: no memory for %zu rows", capacity);
  ebt_status_t st = Engine::get().stats(full.get(), capacity, count);
  if (st != EBT_SUCCESS) return st;
  for (size_t i = 0; i < std::min(capacity, *count); ++i)
    copy_versioned(static_cast<char*>(rows) + i * row_size, row_size, &full[i], sizeof(full[i]));
  return EBT_SUCCESS;
}

ebt_status_t ebt_mem_global_stats(void* out, size_t size) {
  EBT_NOT_IN_FORK();
  EBT_REQUIRE_ARG(out, "out is NULL");
  EBT_REQUIRE_ARG(size >= offsetof(ebt_mem_global_stats_t, coalesced_mappings),
                  "size %zu is smaller than any released ebt_mem_global_stats_t", size);
  ebt_mem_global_stats_t g;
  ebt_status_t st = Engine::get().global_stats(&g);
  if (st == EBT_SUCCESS) copy_versioned(out, size, &g, sizeof(g));
  return st;
}

ebt_status_t ebt_mem_tag_reports(const char* tag, ebt_mem_report_t* last_pause, ebt_mem_report_t* last_resume) {
  EBT_NOT_IN_FORK();
  ebt_mem_report_t p, r;
  ebt_status_t st = Engine::get().tag_reports(tag, &p, &r);
  if (st != EBT_SUCCESS) return st;
  copy_report(p, last_pause);
  copy_report(r, last_resume);
  return EBT_SUCCESS;
}

ebt_status_t ebt_mem_get_cpu_backup(const void* ptr, void** host, size_t* bytes_after) {
  EBT_NOT_IN_FORK();
  return Engine::get().get_cpu_backup(ptr, host, bytes_after);
}

ebt_status_t ebt_mem_lookup(const void* ptr, void** base, size_t* size, char* tag, int* paused) {
  EBT_NOT_IN_FORK();
  return Engine::get().lookup(ptr, base, size, tag, paused);
}

ebt_status_t ebt_mem_paused_ranges(uintptr_t* starts, size_t* lengths, size_t capacity, size_t* count) {
  EBT_NOT_IN_FORK();
  return Engine::get().paused_ranges(starts, lengths, capacity, count);
}

ebt_status_t ebt_mem_reserve_host_memory(size_t bytes) {
  EBT_NOT_IN_FORK();
  return Engine::get().reserve_host(bytes);
}

ebt_status_t ebt_mem_release_host_memory(size_t* released) {
  EBT_NOT_IN_FORK();
  return Engine::get().release_host(released);
}

ebt_status_t ebt_mem_set_background_pinning(int enabled) {
  EBT_NOT_IN_FORK();
  Engine::get().set_background_pinning(enabled != 0);
  return EBT_SUCCESS;
}

ebt_status_t ebt_mem_wait_background_pinning(void) {
  EBT_NOT_IN_FORK();
  Engine::get().wait_background_pinning();
  return EBT_SUCCESS;
}

ebt_status_t ebt_mem_reset_for_testing(void) {
  EBT_NOT_IN_FORK();
  EBT_CHECK(Engine::get().reset());
  t_routing.depth = 0;
  t_routing.disabled = 0;
  return ebt_mem_set_default_region(nullptr, 0);
}

void* ebt_torch_malloc(ssize_t size, int device, void* stream) {
  if (forked_child() || size <= 0) return nullptr;
  char tag[EBT_MEM_TAG_MAX + 1];
  int backup = EBT_MEM_BACKUP_NONE;
  if (!route_current(tag, &backup)) {
    snprintf(tag, sizeof(tag), "default");
    backup = EBT_MEM_BACKUP_NONE;
  }
  void* p = nullptr;
  ebt_status_t st = Engine::get().malloc(&p, static_cast<size_t>(size), device, tag, backup);
  if (st != EBT_SUCCESS) {
    // NULL makes the caching allocator free its cache and retry, then raise torch.OutOfMemoryError.
    EBT_INFO(EBT_SUBSYS_MEM, "ebt_torch_malloc(%zd, device %d) failed: %s", size, device, ebt_last_error());
    return nullptr;
  }
  return p;
}

void ebt_torch_free(void* ptr, ssize_t size, int device, void* stream) {
  if (forked_child() || !ptr) return;
  int found = 0;
  if (Engine::get().free(ptr, &found) != EBT_SUCCESS)
    EBT_WARN(EBT_SUBSYS_MEM, "ebt_torch_free(%p): %s", ptr, ebt_last_error());
  else if (!found)
    EBT_WARN(EBT_SUBSYS_MEM, "ebt_torch_free(%p): not an ebbtide allocation (ignored)", ptr);
}

}  // extern "C"
