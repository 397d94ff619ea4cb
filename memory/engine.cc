/*
 * engine.cc — the VMM pause/resume engine: devices, tags, allocate and free (pause: engine_pause.cc, resume:
 * engine_resume.cc, queries: engine_query.cc, coalesced mappings: engine_segments.cc).
 *
 * Policies and invariants (state machine drawn in memory/NOTES.md):
 *  - Every allocation is mapped at a VA taken from the device's VaSpace; the VA never changes until free.
 *    ACTIVE <=> mapped read-write; PAUSED <=> nothing mapped, VA kept. An allocation is its own physical
 *    allocation, except with coalescing on (the default): a resume then maps each VA-contiguous run of one tag's
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
 *    VA reserved and memory mapped until the Segment is unmapped (the tag's next pause, its last live member's
 *    free, which drains and unmaps the whole range, or a zombie reclaim when an allocation or resume on its device
 *    runs short: engine_reclaim.cc). a->seg and Segment fields change only under mu_.
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
 *
 * Lock order (the one statement of it; every mutex declaration points here). A thread holding one of these takes
 * only those listed after it, and never one listed before:
 *   1. Engine::reclaim_mu_    one zombie reclaim at a time, held across all of it (which takes the others in
 *                             turn and calls the driver); taken with no other lock held (malloc, resume's
 *                             pre-flight).
 *   1a. Engine::disk_mu_      the disk tier's directory and staging; held across a disk phase (which takes 4-7 and
 *                             calls the driver and the filesystem); taken with no other engine lock held (a
 *                             pause's or resume's execute, the directory calls, release_host after mu_, reset
 *                             before dev_mu_).
 *   2. Engine::mu_            allocations, tags, counters. The only driver calls under it are export_fd's
 *                             retain/export/release (the allocation must stay mapped meanwhile); reset() drops it
 *                             before its driver work.
 *   3. Engine::pin_mu_        the background-pinning queue and worker state; taken under mu_ by malloc
 *                             (enqueue_pinning); nothing is locked under it.
 *   4. Engine::dev_mu_        the device map (not the Devices' contents); no path takes it under mu_, though the
 *                             order allows it; reset() holds it across its driver teardown.
 *   5. Device::mu             one device's copy streams and event pool; held across cuStreamCreate.
 *   6. HostArena::grow_mu_    one arena growth at a time; held across the pinning (a ThreadPool run).
 *   7. HostArena::mu_         the arena's segments and counters; taken under mu_ (a block given back) and under
 *                             grow_mu_ (the new segment published).
 *   8. VaSpace::mu_           one device's VA reservations; held across cuMemAddressReserve/Free; taken under
 *                             dev_mu_ (stats, reset) and reclaim_mu_.
 *   Leaves, under any of the above: csrc's ThreadPool (run_mu_, then its mu_), OrderedWork::mu_ (released while a
 *   step runs), DiskHandoff::mu, disk_file.cc's registry of files to remove at exit, the logger's sink mutex
 *   (csrc/log.cc), the test fake driver's g_mu and g_delay_mu (memory/testing/fake_cuda.cc: the driver is called
 *   under 1, 2, 4, 5 and 8).
 *   Apart from the engine (never held while it is called, nor taken under its locks): ebt_mem_op::mu (api_ops.cc,
 *   one async op's outcome), routing.cc's g_default_mu (the process default region).
 * Log lines are written with any of these held (an error recorded under mu_ logs at INFO): a log sink must take no
 * lock that a thread may hold while it calls into the engine. The Python sink (_C.set_log_sink; the package never
 * installs it) takes the GIL, which a Python thread holds while torch allocates through the shim: with it
 * installed, a line logged under an engine lock can deadlock against such a thread.
 */
#include "memory/engine.h"

#include <cstring>

#include "csrc/status.h"
#include "memory/engine_internal.h"
#include "memory/free_ranges.h"
#include "memory/settings.h"

namespace ebbtide::memory {

size_t chunk_bytes() { return settings().chunk_bytes; }
size_t unmap_run_copy_bytes() { return settings().unmap_run_bytes; }
size_t create_ahead_min() { return settings().create_ahead; }
bool poison_enabled() { return settings().poison; }

bool tag_ok(const char* tag) { return tag && *tag && strlen(tag) <= EBT_MEM_TAG_MAX; }

bool by_device_va(const Allocation* a, const Allocation* b) {
  return a->device != b->device ? a->device < b->device : a->va < b->va;
}

ebt_status_t check_backup_code(int backup) {
  const int base = backup & EBT_MEM_BACKUP_MASK;
  const int flags = backup & ~EBT_MEM_BACKUP_MASK;
  EBT_REQUIRE_ARG(base == EBT_MEM_BACKUP_NONE || base == EBT_MEM_BACKUP_CPU || base == EBT_MEM_BACKUP_DISK,
                  "backup must be NONE(0), CPU(1) or DISK(2) (optionally | flags), not %d", backup);
  EBT_REQUIRE_ARG((flags & ~(EBT_MEM_SHAREABLE | EBT_MEM_HOST_TRANSIENT | EBT_MEM_HOST_PAGEABLE)) == 0,
                  "backup 0x%x has unknown flag bits", backup);
  EBT_REQUIRE_ARG(!(flags & (EBT_MEM_HOST_TRANSIENT | EBT_MEM_HOST_PAGEABLE)) || base == EBT_MEM_BACKUP_CPU,
                  "EBT_MEM_HOST_TRANSIENT / EBT_MEM_HOST_PAGEABLE go with a CPU backup only (backup 0x%x)", backup);
  EBT_REQUIRE_ARG(!(flags & EBT_MEM_HOST_PAGEABLE) || (flags & EBT_MEM_HOST_TRANSIENT),
                  "EBT_MEM_HOST_PAGEABLE needs EBT_MEM_HOST_TRANSIENT (backup 0x%x)", backup);
  return EBT_SUCCESS;
}

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

ebt_status_t Engine::malloc_once(void** ptr, size_t size, int device_ordinal, const char* tag, int backup) {
  EBT_REQUIRE_ARG(ptr, "ptr is NULL");
  *ptr = nullptr;
  EBT_REQUIRE_ARG(size > 0, "size must be > 0");
  EBT_REQUIRE_ARG(tag_ok(tag), "tag must be 1..%d bytes", EBT_MEM_TAG_MAX);
  EBT_CHECK(check_backup_code(backup));
  const bool shareable = (backup & EBT_MEM_SHAREABLE) != 0;
  const bool transient = (backup & EBT_MEM_HOST_TRANSIENT) != 0;
  const bool pageable = (backup & EBT_MEM_HOST_PAGEABLE) != 0;
  backup &= EBT_MEM_BACKUP_MASK;
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
  a->transient = transient;
  a->pageable = pageable;
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
    if (backup == EBT_MEM_BACKUP_CPU && !transient) enqueue_pinning(a.get());  // transient: made at pause
  }
  *ptr = reinterpret_cast<void*>(a->va);
  EBT_TRACE(EBT_SUBSYS_MEM, "malloc %zu (mapped %zu) on device %d tag %s -> 0x%llx", size, a->aligned,
            device_ordinal, tag, a->va);
  a.release();
  return EBT_SUCCESS;
fail_map:
  EBT_CU_IGNORE(drv->cuMemUnmap(a->va, a->aligned), "cleanup of a failed allocation: its first error is reported");
fail_handle:
  // the last reference: with the mapping gone, this frees the memory
  EBT_CU_IGNORE(drv->cuMemRelease(h), "cleanup of a failed allocation: its first error is reported");
fail_va:
  d->va->free(a->va, a->aligned);
  return oom_hint(st);
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
  if (a->state == AllocState::kActive) {  // a paused allocation has nothing mapped: no driver call
    CtxGuard ctx(drv, d->ctx);
    CUresult r = drv->cuCtxSynchronize();  // kernels still using it must finish before its memory goes
    if (r != CUDA_SUCCESS) st = ebt_cu_error(r, "cuCtxSynchronize (free)", __FILE__, __LINE__);
    // The last unmap frees the memory (its handle was released at map).
    const ebt_status_t ust = unmap_or_quarantine(drv, a->device, a->va, a->aligned, "free");
    if (ust != EBT_SUCCESS) {
      st = ust;
      va_free = false;  // quarantined: still mapped, never handed out again
    }
  }
  if (va_free) d->va->free(a->va, a->aligned);
  arena_.free(a->host);  // a transient copy's private segment goes back whole
  if (!a->disk_path.empty()) disk_forget(a);
  return st;
}

ebt_status_t Engine::unmap_or_quarantine(const ebt_driver_table_t* drv, int device_ordinal, CUdeviceptr va,
                                         size_t size, const char* what) {
  CUresult r = drv->cuMemUnmap(va, size);
  if (r == CUDA_SUCCESS) return EBT_SUCCESS;
  EBT_INFO(EBT_SUBSYS_MEM, "cuMemUnmap(0x%llx, %zu) in %s failed (%d); retrying once", va, size, what, r);
  r = drv->cuMemUnmap(va, size);
  if (r == CUDA_SUCCESS) return EBT_SUCCESS;
  ebt_cu_error(r, "cuMemUnmap", __FILE__, __LINE__);
  const std::string msg = ebt_last_error();
  {
    std::lock_guard<std::mutex> lock(mu_);
    quarantine_.push_back(Quarantined{va, size, device_ordinal});
  }
  EBT_WARN(EBT_SUBSYS_MEM, "%s: %s, twice; range 0x%llx + %zu bytes on device %d quarantined (never reused)", what,
           msg.c_str(), va, size, device_ordinal);
  return ebt_set_error(EBT_ERROR_DRIVER, "%s (%s, twice): the range 0x%llx + %zu bytes on device %d is quarantined: "
                       "its address range is never reused and its memory may stay mapped until the process ends "
                       "(global stats: quarantined_ranges, quarantined_bytes)", msg.c_str(), what, va, size,
                       device_ordinal);
}

}  // namespace ebbtide::memory
