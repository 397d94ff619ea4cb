/*
 * routing.cc — where an allocation lands: routing state (thread-local regions, the process default region, the
 * disabled flag), the settings applied at library load, fork safety, and the C API that changes them.
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

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "csrc/status.h"
#include "memory/api_internal.h"
#include "memory/engine.h"
#include "memory/routing.h"
#include "memory/settings.h"

using ebbtide::memory::Engine;

namespace ebbtide::memory {

namespace {

constexpr int kMaxDepth = 32;  // region nesting per thread

struct Region {
  char tag[EBT_MEM_TAG_MAX + 1];
  int backup;
  bool pageable;  // torch_memory_saver's cpu_backup_backend of this region ("mmap"), CPU-backed or not
};

// Trivially constructible so the TLS block needs no constructor (the interposer reads it on every cudaMalloc).
struct ThreadRouting {
  Region stack[kMaxDepth];
  int depth;     // regions pushed, 0..kMaxDepth
  int disabled;  // >0: bypass
  // torch_memory_saver's per-thread configuration, made by a tms_set_* call while no region is open: in force
  // (when own_on) before the process default region.
  bool own_set;
  bool own_on;
  Region own;
};
thread_local ThreadRouting t_routing;

std::atomic<bool> g_forked{false};
std::atomic<bool> g_has_default{false};  // fast-path flag for the interposer
std::mutex g_default_mu;                 // guards g_default (a leaf: lock order in engine.cc)
Region g_default;                        // valid iff g_has_default

void on_fork_child() { g_forked.store(true); }

// Library load: install the fork handler, then apply the memory settings (settings.cc): the memory margin,
// coalescing, and the process default region (EBBTIDE_MEM_DEFAULT_TAG + EBBTIDE_MEM_DEFAULT_BACKUP, or
// torch_memory_saver's TMS_INIT_ENABLE + TMS_INIT_ENABLE_CPU_BACKUP), so a process started under the shim captures
// every allocation from its start. A bad setting applies nothing: it is reported here once, and every ebt_mem_*
// call then fails with it (EBT_MEM_ENTRY).
void apply_default_region(const Settings& s);
struct LoadTimeSetup {
  LoadTimeSetup() {
    pthread_atfork(nullptr, nullptr, on_fork_child);
    if (load_settings() != EBT_SUCCESS) {
      EBT_WARN(EBT_SUBSYS_MEM, "memory engine disabled: %s", ebt_last_error());
      return;
    }
    const Settings& s = settings();
    Engine::get().set_margin(s.margin_bytes);
    Engine::get().set_coalescing(s.coalesce);
    Engine::get().set_host_retention(s.host_retain);
    if (!s.default_tag.empty()) apply_default_region(s);
  }
};

void apply_default_region(const Settings& s) {
  const char* tag = s.default_tag.c_str();
  const int backup = s.default_backup;
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

// The configuration in force for this thread, disabled or not: false when there is none (nothing would be
// captured even if enabled).
bool config_current(Region* out) {
  const ThreadRouting& t = t_routing;
  if (t.depth > 0) {
    *out = t.stack[t.depth - 1];
    return true;
  }
  if (t.own_set) {
    *out = t.own;
    return t.own_on;
  }
  if (!g_has_default.load(std::memory_order_acquire)) return false;
  std::lock_guard<std::mutex> lock(g_default_mu);
  if (!g_has_default.load()) return false;
  *out = g_default;
  return true;
}

bool route_current(char* tag, int* backup) {
  if (t_routing.disabled > 0) return false;
  Region r;
  if (!config_current(&r)) return false;
  memcpy(tag, r.tag, EBT_MEM_TAG_MAX + 1);
  *backup = r.backup;
  return true;
}

bool routing_might_capture() {
  const ThreadRouting& t = t_routing;
  return t.disabled == 0 &&
         (t.depth > 0 || (t.own_set ? t.own_on : g_has_default.load(std::memory_order_relaxed)));
}

// ---- torch_memory_saver's per-thread configuration ------------------------------------------------------------

void tms_view(TmsView* out) {
  Region r;
  const bool on = config_current(&r);
  if (!on && !(t_routing.depth == 0 && t_routing.own_set)) {  // nothing configured: its defaults
    snprintf(r.tag, sizeof(r.tag), "default");
    r.backup = EBT_MEM_BACKUP_NONE;
    r.pageable = settings().default_pageable;
  }
  memcpy(out->tag, r.tag, sizeof(out->tag));
  out->backup = r.backup;
  out->pageable = r.pageable;
  out->interesting = on && t_routing.disabled == 0;
}

namespace {
// The configuration a tms_set_* call changes: the innermost region, else the thread's own (made from the view).
Region* tms_target() {
  ThreadRouting& t = t_routing;
  if (t.depth > 0) return &t.stack[t.depth - 1];
  if (!t.own_set) {
    TmsView v;
    tms_view(&v);
    Region r;
    memcpy(t.own.tag, v.tag, sizeof(t.own.tag));
    t.own.backup = v.backup;
    t.own.pageable = v.pageable;
    t.own_on = config_current(&r);  // the process default region applied: the thread's copy of it does too
    t.own_set = true;
  }
  return &t.own;
}

// A CPU copy made through torch_memory_saver's configuration is transient, pageable with its "mmap" backend.
int tms_cpu_code(bool pageable) {
  return EBT_MEM_BACKUP_CPU | EBT_MEM_HOST_TRANSIENT | (pageable ? EBT_MEM_HOST_PAGEABLE : 0);
}
}  // namespace

bool tms_set_interesting(bool on) {
  ThreadRouting& t = t_routing;
  if (!on) {
    if (t.disabled == 0) t.disabled = 1;
    return true;
  }
  t.disabled = 0;
  if (t.depth == 0) {
    tms_target();
    t.own_on = true;
  }
  return true;
}

bool tms_set_tag(const char* tag) {
  if (!tag || !*tag || strlen(tag) > EBT_MEM_TAG_MAX) {
    ebt_set_error(EBT_ERROR_INVALID_ARGUMENT, "tag must be 1..%d bytes", EBT_MEM_TAG_MAX);
    return false;
  }
  if (Engine::get().register_tag(tag) != EBT_SUCCESS) return false;
  Region* r = tms_target();
  snprintf(r->tag, sizeof(r->tag), "%s", tag);
  return true;
}

bool tms_set_backup(int base, bool on) {
  Region* r = tms_target();
  const int flags = r->backup & EBT_MEM_SHAREABLE;
  const int cur = r->backup & EBT_MEM_BACKUP_MASK;
  if (on) r->backup = (base == EBT_MEM_BACKUP_CPU ? tms_cpu_code(r->pageable) : base) | flags;
  else if (cur == base) r->backup = EBT_MEM_BACKUP_NONE | flags;
  return true;
}

bool tms_set_pageable(bool pageable) {
  Region* r = tms_target();
  r->pageable = pageable;
  if ((r->backup & EBT_MEM_BACKUP_MASK) == EBT_MEM_BACKUP_CPU)
    r->backup = tms_cpu_code(pageable) | (r->backup & EBT_MEM_SHAREABLE);
  return true;
}

}  // namespace ebbtide::memory
using namespace ebbtide::memory;

namespace {

bool valid_tag(const char* tag) { return tag && *tag && strlen(tag) <= EBT_MEM_TAG_MAX; }

// The backend a new region reports to torch_memory_saver's getter: its own when it backs up to the CPU, else the
// enclosing configuration's (a region without a CPU copy does not change it).
bool region_pageable(int backup) {
  if ((backup & EBT_MEM_BACKUP_MASK) == EBT_MEM_BACKUP_CPU) return (backup & EBT_MEM_HOST_PAGEABLE) != 0;
  TmsView v;
  tms_view(&v);
  return v.pageable;
}
}  // namespace

extern "C" {

ebt_status_t ebt_mem_region_push(const char* tag, int backup, int* token) {
  EBT_MEM_ENTRY();
  EBT_REQUIRE_ARG(token, "token is NULL");
  EBT_REQUIRE_ARG(valid_tag(tag), "tag must be 1..%d bytes", EBT_MEM_TAG_MAX);
  EBT_CHECK(check_backup_code(backup));
  ThreadRouting& t = t_routing;
  if (t.depth >= kMaxDepth) return ebt_set_error(EBT_ERROR_INVALID_STATE, "regions nested deeper than %d", kMaxDepth);
  EBT_CHECK(Engine::get().register_tag(tag));
  const bool pageable = region_pageable(backup);
  *token = t.depth;
  snprintf(t.stack[t.depth].tag, sizeof(t.stack[t.depth].tag), "%s", tag);
  t.stack[t.depth].backup = backup;
  t.stack[t.depth].pageable = pageable;
  ++t.depth;
  return EBT_SUCCESS;
}

ebt_status_t ebt_mem_region_pop(int token) {
  EBT_MEM_SETTINGS_OK();
  ThreadRouting& t = t_routing;
  EBT_REQUIRE_ARG(token >= 0 && token < t.depth, "region token %d does not match this thread's regions (depth %d)",
                  token, t.depth);
  t.depth = token;
  return EBT_SUCCESS;
}

ebt_status_t ebt_mem_set_disabled(int disabled, int* previous) {
  EBT_MEM_SETTINGS_OK();
  if (previous) *previous = t_routing.disabled;
  EBT_REQUIRE_ARG(disabled >= 0, "disabled must be >= 0");
  t_routing.disabled = disabled;
  return EBT_SUCCESS;
}

ebt_status_t ebt_mem_set_default_region(const char* tag, int backup) {
  EBT_MEM_ENTRY();
  if (!tag) {
    std::lock_guard<std::mutex> lock(g_default_mu);
    g_has_default.store(false);
    return EBT_SUCCESS;
  }
  EBT_REQUIRE_ARG(valid_tag(tag), "tag must be 1..%d bytes", EBT_MEM_TAG_MAX);
  EBT_CHECK(check_backup_code(backup));
  EBT_CHECK(Engine::get().register_tag(tag));
  std::lock_guard<std::mutex> lock(g_default_mu);
  snprintf(g_default.tag, sizeof(g_default.tag), "%s", tag);
  g_default.backup = backup;
  g_default.pageable = (backup & EBT_MEM_BACKUP_MASK) == EBT_MEM_BACKUP_CPU ? (backup & EBT_MEM_HOST_PAGEABLE) != 0
                                                                            : settings().default_pageable;
  g_has_default.store(true, std::memory_order_release);
  return EBT_SUCCESS;
}

ebt_status_t ebt_mem_current_region(char* tag, int* backup, int* disabled) {
  EBT_MEM_SETTINGS_OK();
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
ebt_status_t ebt_mem_reset_for_testing(void) {
  EBT_MEM_ENTRY();
  EBT_CHECK(Engine::get().reset());
  t_routing.depth = 0;
  t_routing.disabled = 0;
  t_routing.own_set = false;
  return ebt_mem_set_default_region(nullptr, 0);
}
}  // extern "C"
