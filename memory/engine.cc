/*
 * engine.cc — the VMM pause/resume engine.
 *
 * Policies and invariants (state machine drawn in memory/NOTES.md):
 *  - Every allocation is mapped at a VA taken from the device's VaSpace; the VA never changes until free.
 *    ACTIVE <=> mapped read-write; PAUSED <=> nothing mapped, VA kept. An allocation is its own physical
 *    allocation, except with coalescing on (opt-in): a resume then maps each VA-contiguous run of one tag's
 *    non-shareable allocations on one device as ONE physical allocation (a Segment, engine_segments.cc).
 *    The engine holds no handle: each is released right after its cuMemMap (and on every failure path), so the
 *    mapping alone keeps the physical memory and cuMemUnmap frees it (driver: memory is freed when unmapped and no
 *    handle reference is left). Whoever needs a handle later (export) retains one from the VA and releases it.
 *  - A tag is ACTIVE or PAUSED (plus busy while an op owns it). pause(ACTIVE tag) pauses its active
 *    allocations; pause(PAUSED tag) and resume(ACTIVE tag) are no-ops with a warning. Allocations made into a
 *    paused tag are active; the next resume leaves them alone.
 *  - Ops run in two steps: prepare() marks the tag and its allocations busy under mu_; execute() does driver
 *    work and copies WITHOUT mu_ (so a pause of one tag and a resume of another overlap), then commits under
 *    mu_. Only the owning op touches a busy allocation's state/mapping/host; free() of a busy allocation waits.
 *  - Drain before unmap: pause synchronizes each involved device (cuCtxSynchronize in that
 *    device's primary context) before its first copy/unmap; free() synchronizes the allocation's device before
 *    unmapping it.
 *  - Driver mappings are never unmapped in part: a pause unmaps a Segment whole (all its live members are ACTIVE
 *    allocations of one tag, so in the same plan), after all its members' copies finished, and dissolves it
 *    (a PAUSED allocation has no Segment). free() of an ACTIVE Segment member makes it a zombie: unlisted at once,
 *    VA reserved and memory mapped until the Segment is unmapped (the tag's next pause, or its last live member's
 *    free, which drains and unmaps the whole range). a->seg and Segment fields change only under mu_.
 *  - Pause: copies of all CPU-backed allocations are issued first (chunked, on the device's runtime-owned D2H
 *    stream, never crossing a host registration piece), then VA-contiguous runs of same-device allocations are
 *    unmapped, one cuMemUnmap per run (per allocation if the driver refuses the span), each run right after its
 *    own copies finished; a run closes at 256 MiB of copies, so unmaps overlap later copies.
 *  - Resume: pre-flight free-memory check per device; create+map+release every mapping unit (an allocation, or a
 *    coalesced run) first, grant access once per VA-contiguous run, then stream H2D. Any failure unmaps what
 *    this op mapped (whole mappings): the tag stays PAUSED, host copies intact, retryable. OOM
 *    fills report->oom_*.
 *  - Pause failure before the first release: nothing changed. After it: released allocations are mapped again
 *    and restored from their host copies (discard-mode content is gone, as a pause would have made it); if even
 *    that fails, they stay paused and the tag is PAUSED (resume retries).
 *  - Host backups live in the persistent HostArena; an allocation keeps its block across cycles (fast warm
 *    cycles), gives it back on free or release_host(). CPU-backed allocations are queued for background pinning
 *    when made (engine_pinning.cc), so the first pause usually finds its blocks ready; a pause that needs blocks
 *    waits for an in-flight background batch, then pins whatever is still missing itself.
 * Lock order: mu_ -> dev_mu_ -> Device::mu; HostArena and VaSpace locks are leaves. No driver call holds mu_
 * except in free()'s lookup-free paths and reset().
 */
#include "memory/engine.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <thread>

#include "csrc/status.h"
#include "memory/free_ranges.h"

namespace ebbtide::memory {

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

size_t env_size(const char* name, size_t dflt) {
  const char* v = getenv(name);
  if (!v || !*v) return dflt;
  char* end = nullptr;
  unsigned long long x = strtoull(v, &end, 10);
  return (end && *end == '\0' && x > 0) ? static_cast<size_t>(x) : dflt;
}

// Copy chunk (EBBTIDE_MEM_CHUNK_BYTES, default 64 MiB: as fast as one large copy, and unmap can start early).
size_t chunk_bytes() {
  static const size_t n = env_size("EBBTIDE_MEM_CHUNK_BYTES", size_t(64) << 20);
  return n;
}
// Debug: fill discard-mode allocations with 0xA5 on resume so stale reads show (EBBTIDE_MEM_POISON=1).
// A pause unmaps a VA-contiguous run with one call; a run with CPU-backed copies closes once it holds this many
// copied bytes, so unmapping still overlaps the later copies (EBBTIDE_MEM_UNMAP_RUN_BYTES, default 256 MiB).
size_t unmap_run_copy_bytes() {
  static const size_t n = env_size("EBBTIDE_MEM_UNMAP_RUN_BYTES", size_t(256) << 20);
  return n;
}
// Resume: cuMemCreate on a helper thread ahead of the maps for resumes of at least EBBTIDE_MEM_CREATE_AHEAD
// allocations (0 or unset: never; off by default because on H200 it did not shorten resumes: the driver appears
// to serialize creates with maps; memory/NOTES.md).
size_t create_ahead_min() {
  static const size_t n = env_size("EBBTIDE_MEM_CREATE_AHEAD", 0);
  return n;
}
bool poison_enabled() {
  static const bool on = env_size("EBBTIDE_MEM_POISON", 0) != 0;
  return on;
}


bool tag_ok(const char* tag) { return tag && *tag && strlen(tag) <= EBT_MEM_TAG_MAX; }

bool by_device_va(const Allocation* a, const Allocation* b) {
  return a->device != b->device ? a->device < b->device : a->va < b->va;
}

}  // namespace

CUmemAllocationProp Engine::device_prop(int ordinal, bool shareable) {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof(prop));
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = ordinal;
  if (shareable) prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

Engine& Engine::get() {
  static Engine* e = new Engine();  // leaked on purpose
  return *e;
}

ebt_status_t Engine::driver(const ebt_driver_table_t** drv) {
  EBT_CHECK(ebt_driver_get(drv));
  if (!(*drv)->cuMemCreate || !(*drv)->cuMemMap || !(*drv)->cuMemAddressReserve || !(*drv)->cuMemSetAccess)
    return ebt_set_error(EBT_ERROR_UNSUPPORTED, "the CUDA driver lacks the virtual memory management API");
  return EBT_SUCCESS;
}

ebt_status_t Engine::device(int ordinal, Device** out) {
  const ebt_driver_table_t* drv;
  EBT_CHECK(driver(&drv));
  std::lock_guard<std::mutex> lock(dev_mu_);
  auto it = devices_.find(ordinal);
  if (it != devices_.end()) {
    *out = it->second.get();
    return EBT_SUCCESS;
  }
  int count = 0;
  EBT_CU_CHECK(drv->cuDeviceGetCount(&count));
  if (ordinal < 0 || ordinal >= count)
    return ebt_set_error(EBT_ERROR_INVALID_ARGUMENT, "device %d out of range (%d devices)", ordinal, count);
  auto d = std::make_unique<Device>();
  d->ordinal = ordinal;
  EBT_CU_CHECK(drv->cuDeviceGet(&d->dev, ordinal));
  int vmm = 0;
  EBT_CU_CHECK(drv->cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, d->dev));
  if (!vmm) return ebt_set_error(EBT_ERROR_UNSUPPORTED, "device %d does not support virtual memory management", ordinal);
  CUmemAllocationProp prop = device_prop(ordinal, false);
  EBT_CU_CHECK(drv->cuMemGetAllocationGranularity(&d->granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  int posix_fd = 0;
  if (drv->cuDeviceGetAttribute(&posix_fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, d->dev) ==
      CUDA_SUCCESS)
    d->posix_fd = posix_fd != 0;
  EBT_CU_CHECK(drv->cuDevicePrimaryCtxRetain(&d->ctx, d->dev));
  d->va = std::make_unique<VaSpace>(d->granularity);
  *out = d.get();
  devices_.emplace(ordinal, std::move(d));
  return EBT_SUCCESS;
}

ebt_status_t Engine::streams(Device* d) {  // d->ctx must be current
  const ebt_driver_table_t* drv;
  EBT_CHECK(driver(&drv));
  std::lock_guard<std::mutex> lock(d->mu);
  if (!d->d2h) EBT_CU_CHECK(drv->cuStreamCreate(&d->d2h, CU_STREAM_NON_BLOCKING));
  if (!d->h2d) EBT_CU_CHECK(drv->cuStreamCreate(&d->h2d, CU_STREAM_NON_BLOCKING));
  return EBT_SUCCESS;
}

CUevent Engine::take_event(Device* d) {  // d->ctx must be current; null on failure
  {
    std::lock_guard<std::mutex> lock(d->mu);
    if (!d->free_events.empty()) {
      CUevent e = d->free_events.back();
      d->free_events.pop_back();
      return e;
    }
  }
  const ebt_driver_table_t* drv;
  if (ebt_driver_get(&drv) != EBT_SUCCESS) return nullptr;
  CUevent e = nullptr;
  CUresult r = drv->cuEventCreate(&e, CU_EVENT_DISABLE_TIMING);
  if (r != CUDA_SUCCESS) {
    ebt_cu_error(r, "cuEventCreate", __FILE__, __LINE__);
    return nullptr;
  }
  return e;
}

void Engine::give_event(Device* d, CUevent e) {
  if (!e) return;
  std::lock_guard<std::mutex> lock(d->mu);
  d->free_events.push_back(e);
}

Tag* Engine::tag_locked(const std::string& name) {
  auto it = tags_.find(name);
  if (it != tags_.end()) return it->second.get();
  auto t = std::make_unique<Tag>();
  t->name = name;
  t->last_pause.device = t->last_resume.device = -1;
  t->last_pause.oom_device = t->last_resume.oom_device = -1;
  Tag* raw = t.get();
  tags_.emplace(name, std::move(t));
  return raw;
}

ebt_status_t Engine::register_tag(const char* tag) {
  EBT_REQUIRE_ARG(tag_ok(tag), "tag must be 1..%d bytes", EBT_MEM_TAG_MAX);
  std::lock_guard<std::mutex> lock(mu_);
  tag_locked(tag);
  return EBT_SUCCESS;
}

// ---- allocate / free ------------------------------------------------------------------------------------------

ebt_status_t Engine::malloc(void** ptr, size_t size, int device_ordinal, const char* tag, int backup) {
  EBT_REQUIRE_ARG(ptr, "ptr is NULL");
  *ptr = nullptr;
  EBT_REQUIRE_ARG(size > 0, "size must be > 0");
  EBT_REQUIRE_ARG(tag_ok(tag), "tag must be 1..%d bytes", EBT_MEM_TAG_MAX);
  const bool shareable = (backup & EBT_MEM_SHAREABLE) != 0;
  backup &= ~EBT_MEM_SHAREABLE;
  EBT_REQUIRE_ARG(backup == EBT_MEM_BACKUP_NONE || backup == EBT_MEM_BACKUP_CPU,
                  "backup must be NONE or CPU (optionally | EBT_MEM_SHAREABLE)");
  const ebt_driver_table_t* drv;
  EBT_CHECK(driver(&drv));
  Device* d;
  EBT_CHECK(device(device_ordinal, &d));
  if (shareable && (!d->posix_fd || !drv->cuMemExportToShareableHandle))
    return ebt_set_error(EBT_ERROR_UNSUPPORTED, "device %d does not support POSIX-fd shareable memory",
                         device_ordinal);
  auto a = std::make_unique<Allocation>();
  a->size = size;
  a->aligned = round_up(size, d->granularity);
  a->device = device_ordinal;
  a->backup = backup;
  a->shareable = shareable;
  CtxGuard ctx(drv, d->ctx);
  if (const size_t margin = this->margin()) {  // refuse what would leave less than the margin free (OOM: retry)
    size_t free_b = 0, total = 0;
    EBT_CU_CHECK(drv->cuMemGetInfo(&free_b, &total));
    if (free_b < a->aligned || free_b - a->aligned < margin)
      return oom_hint(ebt_set_error(EBT_ERROR_OUT_OF_MEMORY,
                                    "allocating %zu bytes on device %d would leave %zu of %zu free, under the memory "
                                    "margin of %zu bytes", a->aligned, device_ordinal,
                                    free_b > a->aligned ? free_b - a->aligned : 0, free_b, margin));
  }
  EBT_CHECK(d->va->allocate(drv, a->aligned, &a->va));
  CUmemAllocationProp prop = device_prop(device_ordinal, shareable);
  CUmemAccessDesc access{{CU_MEM_LOCATION_TYPE_DEVICE, device_ordinal}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  ebt_status_t st = EBT_SUCCESS;
  CUmemGenericAllocationHandle h = 0;
  EBT_CU_CHECK_GOTO(drv->cuMemCreate(&h, a->aligned, &prop, 0), st, fail_va);
  EBT_CU_CHECK_GOTO(drv->cuMemMap(a->va, a->aligned, 0, h, 0), st, fail_handle);
  EBT_CU_CHECK_GOTO(drv->cuMemSetAccess(a->va, a->aligned, &access, 1), st, fail_map);
  EBT_CU_CHECK_GOTO(drv->cuMemRelease(h), st, fail_map);  // the mapping now holds the memory alone
  {
    std::lock_guard<std::mutex> lock(mu_);
    a->tag = tag_locked(tag);
    if (a->tag->state == EBT_MEM_TAG_PAUSED)
      EBT_INFO(EBT_SUBSYS_MEM, "allocation into paused tag '%s': it stays active until the tag is paused again", tag);
    a->tag->allocations.insert(a.get());
    by_va_.emplace(a->va, a.get());
    a->id = ++allocs_total_;
    if (backup == EBT_MEM_BACKUP_CPU) enqueue_pinning(a.get());
  }
  *ptr = reinterpret_cast<void*>(a->va);
  EBT_TRACE(EBT_SUBSYS_MEM, "malloc %zu (mapped %zu) on device %d tag %s -> 0x%llx", size, a->aligned,
            device_ordinal, tag, a->va);
  a.release();
  return EBT_SUCCESS;
fail_map:
  drv->cuMemUnmap(a->va, a->aligned);
fail_handle:
  drv->cuMemRelease(h);  // the last reference: with the mapping gone, this frees the memory
fail_va:
  d->va->free(a->va, a->aligned);
  return oom_hint(st);
}

bool Engine::owns(const void* ptr) {
  std::lock_guard<std::mutex> lock(mu_);
  return by_va_.count(reinterpret_cast<CUdeviceptr>(ptr)) != 0;
}

ebt_status_t Engine::free(void* ptr, int* found) {
  EBT_REQUIRE_ARG(found, "found is NULL");
  *found = 0;
  Allocation* a = nullptr;
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = by_va_.find(reinterpret_cast<CUdeviceptr>(ptr));
    if (it == by_va_.end()) return EBT_SUCCESS;
    a = it->second;
    cv_.wait(lock, [a] { return !a->busy; });  // an op owns it: let it finish (state is then final)
    by_va_.erase(a->va);
    a->tag->allocations.erase(a);
    ++frees_total_;
    *found = 1;
    // Inside a coalesced mapping: a zombie until the mapping goes (engine_segments.cc).
    if (a->state == AllocState::kActive && a->seg) return free_member(a, lock);
  }
  std::unique_ptr<Allocation> owned(a);
  const ebt_driver_table_t* drv;
  EBT_CHECK(driver(&drv));
  Device* d;
  EBT_CHECK(device(a->device, &d));
  ebt_status_t st = EBT_SUCCESS;
  bool va_free = true;
  if (a->state == AllocState::kActive) {  // free of a paused allocation: nothing mapped (TMS #92)
    CtxGuard ctx(drv, d->ctx);
    CUresult r = drv->cuCtxSynchronize();  // kernels still using it must finish before unmap (TMS #58)
    if (r != CUDA_SUCCESS) st = ebt_cu_error(r, "cuCtxSynchronize (free)", __FILE__, __LINE__);
    r = drv->cuMemUnmap(a->va, a->aligned);  // the last unmap frees the memory (its handle was released at map)
    if (r != CUDA_SUCCESS) {
      st = ebt_cu_error(r, "cuMemUnmap (free)", __FILE__, __LINE__);
      va_free = false;  // still mapped: never hand this VA out again
    }
  }
  if (va_free) d->va->free(a->va, a->aligned);
  arena_.free(a->host);
  return st;
}

// ---- pause / resume -------------------------------------------------------------------------------------------

ebt_status_t Engine::prepare(OpKind kind, const char* tag, Plan* plan, ebt_mem_report_t* r) {
  EBT_REQUIRE_ARG(tag == nullptr || tag_ok(tag), "tag must be NULL or 1..%d bytes", EBT_MEM_TAG_MAX);
  plan->kind = kind;
  plan->tags.clear();
  plan->allocs.clear();
  plan->noop = false;
  const char* verb = kind == OpKind::kPause ? "pause" : "resume";
  const int from = kind == OpKind::kPause ? EBT_MEM_TAG_ACTIVE : EBT_MEM_TAG_PAUSED;
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Tag*> candidates;
  if (tag) {
    auto it = tags_.find(tag);
    if (it == tags_.end())
      return ebt_set_error(EBT_ERROR_NOT_FOUND, "%s: unknown tag '%s' (no region ever used it)", verb, tag);
    candidates.push_back(it->second.get());
  } else {
    for (auto& kv : tags_) candidates.push_back(kv.second.get());
  }
  for (Tag* t : candidates)
    if (t->busy)
      return ebt_set_error(EBT_ERROR_INVALID_STATE, "%s: tag '%s' has a pause/resume in flight; wait for it first",
                           verb, t->name.c_str());
  for (Tag* t : candidates) {
    if (t->state != from) {
      if (tag) EBT_WARN(EBT_SUBSYS_MEM, "%s('%s'): tag is already %s; nothing to do", verb, tag,
                        kind == OpKind::kPause ? "paused" : "active");
      continue;
    }
    plan->tags.push_back(t);
  }
  const AllocState want = kind == OpKind::kPause ? AllocState::kActive : AllocState::kPaused;
  for (Tag* t : plan->tags) {
    t->busy = true;
    // Counted when the pause begins, not when it ends: a region opened while this pause runs must get a pool
    // epoch of its own, never the previous paused period's pool whose blocks this pause is unmapping.
    if (kind == OpKind::kPause) ++t->pauses;
    for (Allocation* a : t->allocations)
      if (a->state == want) {
        a->busy = true;
        plan->allocs.push_back(a);
      }
  }
  std::sort(plan->allocs.begin(), plan->allocs.end(), by_device_va);
  plan->noop = plan->tags.empty();
  if (r) r->noop = plan->noop ? 1 : 0;
  return EBT_SUCCESS;
}

void Engine::commit(Plan& plan, ebt_status_t st, const ebt_mem_report_t& r) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    // A tag is PAUSED while any of its planned allocations is paused (a failed, un-rollable pause included).
    std::unordered_set<const Tag*> has_paused;
    for (Allocation* a : plan.allocs)
      if (a->state == AllocState::kPaused) has_paused.insert(a->tag);
    for (Tag* t : plan.tags) {
      const bool any_paused = has_paused.count(t) != 0;
      if (plan.kind == OpKind::kPause) {
        t->state = (st == EBT_SUCCESS || any_paused) ? EBT_MEM_TAG_PAUSED : EBT_MEM_TAG_ACTIVE;
        if (st == EBT_SUCCESS) t->last_pause = r;
      } else {
        t->state = (st == EBT_SUCCESS && !any_paused) ? EBT_MEM_TAG_ACTIVE : EBT_MEM_TAG_PAUSED;
        if (st == EBT_SUCCESS) t->last_resume = r;
      }
      t->busy = false;
    }
    for (Allocation* a : plan.allocs) a->busy = false;
  }
  cv_.notify_all();
}

ebt_status_t Engine::execute(Plan& plan, ebt_mem_report_t* report) {
  ebt_mem_report_t r;
  memset(&r, 0, sizeof(r));
  r.struct_size = sizeof(r);
  r.device = r.oom_device = -1;
  r.noop = plan.noop ? 1 : 0;
  auto t0 = Clock::now();
  ebt_status_t st = EBT_SUCCESS;
  if (!plan.allocs.empty()) {
    st = plan.kind == OpKind::kPause ? run_pause(plan, &r) : run_resume(plan.allocs, &r);
  }
  r.total_s = since(t0);
  if (st == EBT_SUCCESS)
    EBT_INFO(EBT_SUBSYS_MEM,
             "%s: %zu allocations, %zu bytes, %zu copied in %.3f ms (sync %.3f copy %.3f unmap %.3f in %zu calls, "
             "map %.3f of which create %.3f access %.3f)",
             plan.kind == OpKind::kPause ? "pause" : "resume", r.allocations, r.bytes, r.bytes_copied, r.total_s * 1e3,
             r.sync_s * 1e3, r.copy_s * 1e3, r.unmap_s * 1e3, r.unmap_calls, r.map_s * 1e3, r.create_s * 1e3,
             r.access_s * 1e3);
  commit(plan, st, r);
  if (report) {
    size_t n = report->struct_size && report->struct_size < sizeof(r) ? report->struct_size : sizeof(r);
    memcpy(report, &r, n);
    report->struct_size = n;
  }
  return st;
}

void Engine::fill_oom(int device_ordinal, size_t needed, ebt_mem_report_t* r) {
  const ebt_driver_table_t* drv;
  Device* d;
  r->oom_device = device_ordinal;
  r->oom_needed = needed;
  if (driver(&drv) != EBT_SUCCESS || device(device_ordinal, &d) != EBT_SUCCESS) return;
  CtxGuard ctx(drv, d->ctx);
  size_t free_b = 0, total = 0;
  if (drv->cuMemGetInfo(&free_b, &total) == CUDA_SUCCESS) r->oom_free = free_b;
}

ebt_status_t Engine::run_pause(Plan& plan, ebt_mem_report_t* r) {
  const ebt_driver_table_t* drv;
  EBT_CHECK(driver(&drv));
  std::vector<Allocation*>& allocs = plan.allocs;
  std::vector<Device*> devs(allocs.size());
  for (size_t i = 0; i < allocs.size(); ++i) EBT_CHECK(device(allocs[i]->device, &devs[i]));
  r->device = allocs[0]->device;
  std::vector<MapUnit> units;  // the driver mappings to unmap (a coalesced mapping is one unit, unmapped whole)
  EBT_CHECK(pause_units(allocs, &units));
  // 1. Drain every involved device (not just the current one).
  auto t_sync = Clock::now();
  for (size_t i = 0; i < allocs.size(); ++i) {
    if (i > 0 && devs[i] == devs[i - 1]) continue;
    CtxGuard ctx(drv, devs[i]->ctx);
    size_t total = 0;
    if (i == 0) drv->cuMemGetInfo(&r->driver_free_before, &total);
    EBT_CU_CHECK(drv->cuCtxSynchronize());
    EBT_CHECK(streams(devs[i]));
  }
  r->sync_s = since(t_sync);
  // 2. Host blocks for backups that have none yet (one arena growth for the whole batch).
  std::vector<bool> copy(allocs.size(), false);
  std::vector<size_t> need_sizes;
  std::vector<size_t> need_idx;
  for (size_t i = 0; i < allocs.size(); ++i) {
    Allocation* a = allocs[i];
    if (a->backup != EBT_MEM_BACKUP_CPU) continue;
    if (a->host_valid && a->host_clean) {
      r->bytes_skipped_clean += a->size;
      continue;
    }
    copy[i] = true;
    if (!a->host.ptr) {
      need_sizes.push_back(a->size);
      need_idx.push_back(i);
    }
  }
  if (!need_sizes.empty()) {
    // A background batch may be pinning for these very allocations: let it finish (it hands its blocks back to the
    // arena when it finds them busy), so the arena is not grown twice.
    wait_background_pinning();
    std::vector<HostArena::Block> blocks;
    CtxGuard ctx(drv, devs[0]->ctx);
    EBT_CHECK(arena_.allocate(drv, devs[0]->ctx, need_sizes, &blocks));
    for (size_t k = 0; k < need_idx.size(); ++k) allocs[need_idx[k]]->host = blocks[k];
  }
  // 3. Issue every copy (chunked, cut at registration pieces), one event per allocation.
  auto t_copy = Clock::now();
  std::vector<CUevent> events(allocs.size(), nullptr);
  ebt_status_t st = EBT_SUCCESS;
  size_t i = 0;
  for (; i < allocs.size() && st == EBT_SUCCESS; ++i) {
    if (!copy[i]) continue;
    Allocation* a = allocs[i];
    a->host_valid = false;  // until this copy completes
    CtxGuard ctx(drv, devs[i]->ctx);
    for (size_t off = 0; off < a->size && st == EBT_SUCCESS;) {
      size_t n = std::min({chunk_bytes(), a->size - off, arena_.piece_remaining(a->host, off)});
      CUresult res = drv->cuMemcpyDtoHAsync(a->host.ptr + off, a->va + off, n, devs[i]->d2h);
      if (res != CUDA_SUCCESS) st = ebt_cu_error(res, "cuMemcpyDtoHAsync (pause)", __FILE__, __LINE__);
      off += n;
    }
    if (st != EBT_SUCCESS) break;
    events[i] = take_event(devs[i]);
    if (!events[i]) {
      st = EBT_ERROR_DRIVER;
      break;
    }
    CUresult res = drv->cuEventRecord(events[i], devs[i]->d2h);
    if (res != CUDA_SUCCESS) st = ebt_cu_error(res, "cuEventRecord (pause)", __FILE__, __LINE__);
  }
  // 4. Unmap VA-contiguous runs of same-device mappings, one driver call per run, each as soon as its copies
  //    finished. A run holding copies closes at unmap_run_copy_bytes() of them, so unmaps still overlap the
  //    copies that stream behind them; a discard-only run spans the whole contiguous range. A run never splits a
  //    unit: a coalesced mapping is unmapped whole, after all its members' copies finished.
  auto copied_in = [&](const MapUnit& u) {
    size_t c = 0;
    for (size_t m = u.begin; m < u.end; ++m)
      if (copy[m]) c += allocs[m]->size;
    return c;
  };
  std::vector<Allocation*> released;
  std::vector<const MapUnit*> retired;  // coalesced mappings unmapped (their segments are dissolved below)
  for (size_t k = 0; k < units.size() && st == EBT_SUCCESS;) {
    size_t j = k + 1;
    size_t copied = copied_in(units[k]);
    CUdeviceptr end = units[k].va + units[k].size;
    while (j < units.size() && units[j].device == units[k].device && units[j].va == end &&
           copied < unmap_run_copy_bytes()) {
      end += units[j].size;
      copied += copied_in(units[j]);
      ++j;
    }
    CtxGuard ctx(drv, devs[units[k].begin]->ctx);
    for (size_t m = units[k].begin; m < units[j - 1].end; ++m) {
      if (!copy[m]) continue;
      CUresult res = drv->cuEventSynchronize(events[m]);
      if (res != CUDA_SUCCESS) {
        st = ebt_cu_error(res, "cuEventSynchronize (pause copy)", __FILE__, __LINE__);
        break;
      }
      allocs[m]->host_valid = true;
      r->bytes_copied += allocs[m]->size;
      r->copy_s = since(t_copy);
    }
    if (st != EBT_SUCCESS) break;
    auto t_unmap = Clock::now();
    st = unmap_run(allocs, units, k, j, &released, &retired, r);
    r->unmap_s += since(t_unmap);
    k = j;
  }
  // Drain outstanding copies (on failure) and return events to the pool. A copy failure can leave chunks of its
  // allocation issued with no event behind them: drain each involved D2H stream as a whole, so no DMA still
  // writes into a host block that the rollback or a release_host_memory() may hand back.
  if (st != EBT_SUCCESS) {
    std::unordered_set<Device*> drained;
    for (size_t k = 0; k < allocs.size(); ++k)
      if (copy[k] && drained.insert(devs[k]).second) {
        CtxGuard ctx(drv, devs[k]->ctx);
        drv->cuStreamSynchronize(devs[k]->d2h);
      }
  }
  for (size_t k = 0; k < allocs.size(); ++k) {
    if (!events[k]) continue;
    if (st != EBT_SUCCESS) drv->cuEventSynchronize(events[k]);
    give_event(devs[k], events[k]);
  }
  if (!retired.empty()) {  // dissolve the unmapped segments first (a rollback makes new ones)
    std::string msg = st != EBT_SUCCESS ? ebt_last_error() : "";
    retire_segments(allocs, retired, r);
    if (st != EBT_SUCCESS) ebt_set_error(st, "%s", msg.c_str());
  }
  if (st != EBT_SUCCESS) {
    std::string msg = ebt_last_error();
    if (!released.empty()) {  // roll back: map and restore what this pause released
      ebt_mem_report_t rr;
      memset(&rr, 0, sizeof(rr));
      if (run_resume(released, &rr, /*rollback=*/true) != EBT_SUCCESS)
        msg += " (rollback failed too: the released allocations stay paused; resume() retries)";
    }
    return ebt_set_error(st, "%s", msg.c_str());
  }
  {
    CtxGuard ctx(drv, devs[0]->ctx);
    size_t total = 0;
    drv->cuMemGetInfo(&r->driver_free_after, &total);
  }
  return EBT_SUCCESS;
}

// Whether VA `va` is still backed by a mapping: cuMemRetainAllocationHandle succeeds only on mapped memory.
static bool still_mapped(const ebt_driver_table_t* drv, CUdeviceptr va) {
  if (!drv->cuMemRetainAllocationHandle) return true;  // cannot tell: keep the driver's error
  CUmemGenericAllocationHandle h = 0;
  if (drv->cuMemRetainAllocationHandle(&h, reinterpret_cast<void*>(va)) != CUDA_SUCCESS) return false;
  drv->cuMemRelease(h);
  return true;
}

// One cuMemUnmap over the run first: the documentation asks for "the entire contiguous address range that was
// mapped" without saying whether that range may consist of several mappings (accepted on H200, driver 580; see
// NOTES.md). Any error (a driver that wants one mapping per call) falls back to one call per unit (a coalesced
// mapping is still unmapped whole: never a sub-range); an error there is the pause's failure (what was unmapped
// before it is in *released, for the rollback).
ebt_status_t Engine::unmap_run(const std::vector<Allocation*>& allocs, const std::vector<MapUnit>& units,
                               size_t begin, size_t end, std::vector<Allocation*>* released,
                               std::vector<const MapUnit*>* retired, ebt_mem_report_t* r) {
  const ebt_driver_table_t* drv;
  EBT_CHECK(driver(&drv));
  auto mark = [&](const MapUnit& u) {
    for (size_t k = u.begin; k < u.end; ++k) {
      Allocation* a = allocs[k];
      a->state = AllocState::kPaused;
      r->allocations += 1;
      r->bytes += a->aligned;
      released->push_back(a);
    }
    r->mappings += 1;
    if (u.seg) retired->push_back(&u);
  };
  if (end - begin > 1) {
    const CUdeviceptr va = units[begin].va;
    const size_t len = units[end - 1].va + units[end - 1].size - va;
    r->unmap_calls += 1;
    CUresult res = drv->cuMemUnmap(va, len);
    if (res == CUDA_SUCCESS) {
      for (size_t k = begin; k < end; ++k) mark(units[k]);
      return EBT_SUCCESS;
    }
    EBT_INFO(EBT_SUBSYS_MEM, "cuMemUnmap over %zu mappings failed (%d); one per mapping instead", end - begin, res);
  }
  const bool after_span = end - begin > 1;
  for (size_t k = begin; k < end; ++k) {
    r->unmap_calls += 1;
    CUresult res = drv->cuMemUnmap(units[k].va, units[k].size);
    // A driver that unmapped part of the span before refusing it: a unit that is no longer mapped was released
    // by that call (no handle can be retained from its VA), and must be booked as paused, not as a failure.
    if (res != CUDA_SUCCESS && after_span && !still_mapped(drv, units[k].va)) res = CUDA_SUCCESS;
    if (res != CUDA_SUCCESS) return ebt_cu_error(res, "cuMemUnmap (pause)", __FILE__, __LINE__);
    mark(units[k]);
  }
  return EBT_SUCCESS;
}

// Map h over [va, va + size) and drop the handle: from here the mapping alone keeps the physical memory (unmap
// frees it). Takes h over (released on every path). The unit's device context must be current.
ebt_status_t Engine::map_release(CUdeviceptr va, size_t size, CUmemGenericAllocationHandle h) {
  const ebt_driver_table_t* drv;
  EBT_CHECK(driver(&drv));
  CUresult res = drv->cuMemMap(va, size, 0, h, 0);
  if (res != CUDA_SUCCESS) {
    drv->cuMemRelease(h);
    return ebt_cu_error(res, "cuMemMap (resume)", __FILE__, __LINE__);
  }
  res = drv->cuMemRelease(h);
  if (res != CUDA_SUCCESS) {  // still referenced: unmap, then retry the release so nothing is left behind
    drv->cuMemUnmap(va, size);
    drv->cuMemRelease(h);
    return ebt_cu_error(res, "cuMemRelease (resume)", __FILE__, __LINE__);
  }
  return EBT_SUCCESS;
}

// Create + map + release every unit (one allocation, or a coalesced run), then grant access per VA-contiguous run
// of units. With create-ahead on, a helper thread makes the physical memory (cuMemCreate, the bulk of a discard
// resume's driver time) while this thread maps what is ready; it stops at its first failure, which this thread
// then reports in order. On failure every unit this call mapped is unmapped again.
ebt_status_t Engine::map_all(const std::vector<MapUnit>& units, ebt_mem_report_t* r) {
  const ebt_driver_table_t* drv;
  EBT_CHECK(driver(&drv));
  const size_t n = units.size();
  std::vector<Device*> devs(n);
  for (size_t i = 0; i < n; ++i) EBT_CHECK(device(units[i].device, &devs[i]));
  auto create = [drv](const MapUnit& u, CUmemGenericAllocationHandle* h) {
    CUmemAllocationProp prop = device_prop(u.device, u.shareable);
    return drv->cuMemCreate(h, u.size, &prop, 0);
  };
  bool ahead = create_ahead_min() > 0 && n >= create_ahead_min();
  std::vector<CUmemGenericAllocationHandle> handles(ahead ? n : 0, 0);
  std::vector<CUresult> results(ahead ? n : 0, CUDA_SUCCESS);
  std::atomic<size_t> created{0};  // handles[0, created) and results[0, created) are final
  std::atomic<bool> stop{false};
  double ahead_create_s = 0;
  std::thread helper;
  if (ahead) try {
    helper = std::thread([&] {
      auto t0 = Clock::now();
      for (size_t i = 0; i < n && !stop.load(std::memory_order_relaxed); ++i) {
        CtxGuard ctx(drv, devs[i]->ctx);
        results[i] = create(units[i], &handles[i]);
        created.store(i + 1, std::memory_order_release);
        if (results[i] != CUDA_SUCCESS) break;
      }
      ahead_create_s = since(t0);
    });
  } catch (const std::exception&) {  // no thread to be had: create here, in order
    ahead = false;
  }
  size_t done = 0;
  ebt_status_t st = EBT_SUCCESS;
  for (; done < n; ++done) {
    const MapUnit& u = units[done];
    CtxGuard ctx(drv, devs[done]->ctx);
    CUmemGenericAllocationHandle h = 0;
    CUresult res;
    if (ahead) {
      while (created.load(std::memory_order_acquire) <= done) std::this_thread::yield();
      res = results[done];
      std::swap(h, handles[done]);
    } else {
      auto t_create = Clock::now();
      res = create(u, &h);
      r->create_s += since(t_create);
    }
    if (res != CUDA_SUCCESS) {
      st = ebt_cu_error(res, "cuMemCreate (resume)", __FILE__, __LINE__);
      if (st == EBT_ERROR_OUT_OF_MEMORY) fill_oom(u.device, u.size, r);
      break;
    }
    st = map_release(u.va, u.size, h);
    if (st != EBT_SUCCESS) break;
  }
  if (ahead) {
    stop.store(true, std::memory_order_relaxed);
    helper.join();
    r->create_s = ahead_create_s;  // the helper's span (creates overlapped with the maps here)
    for (size_t i = done; i < n; ++i) {  // made ahead but never mapped (this op failed)
      if (!handles[i]) continue;
      CtxGuard ctx(drv, devs[i]->ctx);
      drv->cuMemRelease(handles[i]);
    }
  }
  if (st == EBT_SUCCESS) {
    auto t_access = Clock::now();
    st = set_access_units(units);
    r->access_s = since(t_access);
    if (st == EBT_SUCCESS) return EBT_SUCCESS;
  }
  {
    std::string msg = ebt_last_error();
    unmap_units(units, done);
    return ebt_set_error(st, "%s", msg.c_str());
  }
}

void Engine::unmap_units(const std::vector<MapUnit>& units, size_t count) {
  const ebt_driver_table_t* drv;
  if (driver(&drv) != EBT_SUCCESS) return;
  for (size_t i = 0; i < count && i < units.size(); ++i) {  // each mapped whole (no handle held: unmap frees it)
    Device* d;
    if (device(units[i].device, &d) != EBT_SUCCESS) continue;
    CtxGuard ctx(drv, d->ctx);
    drv->cuMemUnmap(units[i].va, units[i].size);
  }
}

// One cuMemSetAccess per VA-contiguous run of same-device units (sorted by device, va); per unit if refused.
ebt_status_t Engine::set_access_units(const std::vector<MapUnit>& units) {
  const ebt_driver_table_t* drv;
  EBT_CHECK(driver(&drv));
  size_t i = 0;
  while (i < units.size()) {
    size_t j = i + 1;
    CUdeviceptr end = units[i].va + units[i].size;
    while (j < units.size() && units[j].device == units[i].device && units[j].va == end) {
      end += units[j].size;
      ++j;
    }
    Device* d;
    EBT_CHECK(device(units[i].device, &d));
    CtxGuard ctx(drv, d->ctx);
    CUmemAccessDesc acc{{CU_MEM_LOCATION_TYPE_DEVICE, units[i].device}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CUresult res = drv->cuMemSetAccess(units[i].va, end - units[i].va, &acc, 1);
    if (res != CUDA_SUCCESS && j - i > 1) {
      // A driver that refuses a range spanning several mappings: grant access one mapping at a time.
      EBT_INFO(EBT_SUBSYS_MEM, "cuMemSetAccess over %zu mappings failed (%d); per mapping instead", j - i, res);
      res = CUDA_SUCCESS;
      for (size_t k = i; k < j && res == CUDA_SUCCESS; ++k)
        res = drv->cuMemSetAccess(units[k].va, units[k].size, &acc, 1);
    }
    if (res != CUDA_SUCCESS) return ebt_cu_error(res, "cuMemSetAccess (resume)", __FILE__, __LINE__);
    i = j;
  }
  return EBT_SUCCESS;
}

ebt_status_t Engine::run_resume(const std::vector<Allocation*>& allocs, ebt_mem_report_t* r, bool rollback) {
  const ebt_driver_table_t* drv;
  EBT_CHECK(driver(&drv));
  r->device = allocs[0]->device;
  const size_t margin = rollback ? 0 : this->margin();
  // 0. Pre-flight: enough free memory (plus the margin) on each device? (Fail before touching anything.)
  std::map<int, size_t> need;
  for (Allocation* a : allocs) need[a->device] += a->aligned;
  for (auto& kv : need) {
    Device* d;
    EBT_CHECK(device(kv.first, &d));
    CtxGuard ctx(drv, d->ctx);
    size_t free_b = 0, total = 0;
    EBT_CU_CHECK(drv->cuMemGetInfo(&free_b, &total));
    if (kv.first == r->device) r->driver_free_before = free_b;
    if (free_b < kv.second || free_b - kv.second < margin) {
      r->oom_device = kv.first;
      r->oom_needed = kv.second + margin;
      r->oom_free = free_b;
      return ebt_set_error(EBT_ERROR_OUT_OF_MEMORY,
                           "resume needs %zu bytes on device %d (+ memory margin %zu) but only %zu are free; the tag "
                           "stays paused (pause or free other memory, then retry)", kv.second, kv.first, margin, free_b);
    }
    EBT_CHECK(streams(d));
  }
  // 1. Map everything first (one mapping per unit: an allocation, or a coalesced run).
  std::vector<MapUnit> units;
  EBT_CHECK(resume_units(allocs, &units));
  auto t_map = Clock::now();
  ebt_status_t st = map_all(units, r);
  r->map_s = since(t_map);
  if (st != EBT_SUCCESS) {
    if (st == EBT_ERROR_OUT_OF_MEMORY) {
      std::string msg = ebt_last_error();
      return ebt_set_error(st, "%s: needed %zu bytes on device %d, %zu free; the tag stays paused and can be retried",
                           msg.c_str(), r->oom_needed, r->oom_device, r->oom_free);
    }
    return st;
  }
  // 2. Stream the backups back (and poison discarded memory in debug mode).
  auto t_copy = Clock::now();
  std::map<Device*, CUevent> done_events;
  for (Allocation* a : allocs) {
    Device* d;
    EBT_CHECK_GOTO(device(a->device, &d), st, undo);
    {
      CtxGuard ctx(drv, d->ctx);
      done_events.emplace(d, nullptr);  // before any copy: the undo drains every stream that got one
      if (a->backup == EBT_MEM_BACKUP_CPU && a->host_valid) {
        for (size_t off = 0; off < a->size;) {
          size_t n = std::min({chunk_bytes(), a->size - off, arena_.piece_remaining(a->host, off)});
          CUresult res = drv->cuMemcpyHtoDAsync(a->va + off, a->host.ptr + off, n, d->h2d);
          if (res != CUDA_SUCCESS) {
            st = ebt_cu_error(res, "cuMemcpyHtoDAsync (resume)", __FILE__, __LINE__);
            goto undo;
          }
          off += n;
        }
        r->bytes_copied += a->size;
      } else if (poison_enabled()) {
        drv->cuMemsetD8Async(a->va, 0xA5, a->aligned, d->h2d);
      }
    }
  }
  for (auto& kv : done_events) {
    CtxGuard ctx(drv, kv.first->ctx);
    kv.second = take_event(kv.first);
    if (!kv.second) {
      st = EBT_ERROR_DRIVER;
      goto undo;
    }
    CUresult res = drv->cuEventRecord(kv.second, kv.first->h2d);
    if (res == CUDA_SUCCESS) res = drv->cuEventSynchronize(kv.second);
    if (res != CUDA_SUCCESS) {
      st = ebt_cu_error(res, "cuEventSynchronize (resume copy)", __FILE__, __LINE__);
      goto undo;
    }
  }
  r->copy_s = since(t_copy);
  for (auto& kv : done_events) give_event(kv.first, kv.second);
  publish_segments(allocs, units);
  r->mappings += units.size();
  for (Allocation* a : allocs) {
    a->state = AllocState::kActive;
    a->host_clean = false;
    r->allocations += 1;
    r->bytes += a->aligned;
  }
  {
    Device* d;
    if (device(r->device, &d) == EBT_SUCCESS) {
      CtxGuard ctx(drv, d->ctx);
      size_t total;
      drv->cuMemGetInfo(&r->driver_free_after, &total);
    }
  }
  return EBT_SUCCESS;
undo:
  for (auto& kv : done_events) {  // copies issued before the failure must land before their memory is unmapped
    CtxGuard ctx(drv, kv.first->ctx);
    drv->cuStreamSynchronize(kv.first->h2d);
    give_event(kv.first, kv.second);
  }
  {
    std::string msg = ebt_last_error();
    unmap_units(units, units.size());
    return ebt_set_error(st, "%s (resume rolled back: the tag stays paused and can be retried)", msg.c_str());
  }
}

}  // namespace ebbtide::memory
