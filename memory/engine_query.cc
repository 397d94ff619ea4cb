// engine_query.cc — the engine's introspection, host-arena control and reset (invariants: engine.cc header).
#include <algorithm>
#include <cstring>
#include <unordered_set>

#include "csrc/status.h"
#include "memory/engine.h"

extern "C" ebt_status_t ebt_shim_forwarded(unsigned long long* allocs, unsigned long long* bytes);

namespace ebbtide::memory {

ebt_status_t unknown_tag(const char* verb, const char* tag, const std::map<std::string, std::unique_ptr<Tag>>& tags) {
  std::string known;
  for (const auto& kv : tags) known += (known.empty() ? "" : ", ") + kv.first;
  if (known.size() > 400) known = known.substr(0, 400) + ", ...";
  return ebt_set_error(EBT_ERROR_NOT_FOUND, "%s: no region has used tag '%s' (%s%s): name a tag that a region "
                       "allocated in", verb, tag, known.empty() ? "no tag exists yet" : "tags: ", known.c_str());
}

ebt_status_t Engine::mark_clean(const char* tag) {
  EBT_REQUIRE_ARG(tag && *tag && strlen(tag) <= EBT_MEM_TAG_MAX, "tag must be 1..%d bytes", EBT_MEM_TAG_MAX);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = tags_.find(tag);
  if (it == tags_.end()) return unknown_tag("mark_clean", tag, tags_);
  if (it->second->busy)
    return ebt_set_error(EBT_ERROR_INVALID_STATE, "mark_clean: tag '%s' has a pause/resume in flight", tag);
  for (Allocation* a : it->second->allocations)
    if (a->state == AllocState::kActive && a->host_valid) a->host_clean = true;
  return EBT_SUCCESS;
}

ebt_status_t Engine::tag_state(const char* tag, int* state, unsigned long long* pauses) {
  EBT_REQUIRE_ARG(tag && *tag && strlen(tag) <= EBT_MEM_TAG_MAX, "tag must be 1..%d bytes", EBT_MEM_TAG_MAX);
  EBT_REQUIRE_ARG(state && pauses, "out-pointers must not be NULL");
  std::lock_guard<std::mutex> lock(mu_);
  auto it = tags_.find(tag);
  if (it == tags_.end()) return unknown_tag("tag state", tag, tags_);
  *state = it->second->busy ? EBT_MEM_TAG_BUSY : it->second->state;
  *pauses = it->second->pauses;
  return EBT_SUCCESS;
}

ebt_status_t Engine::stats(ebt_mem_tag_stats_t* rows, size_t capacity, size_t* count) {
  EBT_REQUIRE_ARG(count, "count is NULL");
  EBT_REQUIRE_ARG(rows || capacity == 0, "rows is NULL with capacity > 0");
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<ebt_mem_tag_stats_t> out;
  for (auto& kv : tags_) {
    Tag* t = kv.second.get();
    std::map<int, ebt_mem_tag_stats_t> per_dev;
    std::unordered_set<const Segment*> seen;  // a coalesced mapping is one handle, counted once
    for (Allocation* a : t->allocations) {
      auto ins = per_dev.emplace(a->device, ebt_mem_tag_stats_t{});
      ebt_mem_tag_stats_t& s = ins.first->second;
      s.allocations += 1;
      s.bytes_requested += a->size;
      if (a->state == AllocState::kActive) {
        if (!a->seg) {
          s.handles += 1;
        } else if (seen.insert(a->seg.get()).second) {
          s.handles += 1;
          s.bytes_pending_free += a->seg->zombie_bytes;
        }
        s.bytes_active += a->aligned;
      } else {
        s.bytes_paused += a->aligned;
      }
      if (a->host.ptr) s.bytes_backed_up += a->host.size;
    }
    if (per_dev.empty()) per_dev.emplace(-1, ebt_mem_tag_stats_t{});  // a named tag with no allocation yet
    for (auto& d : per_dev) {
      ebt_mem_tag_stats_t s = d.second;
      snprintf(s.tag, sizeof(s.tag), "%s", t->name.c_str());
      s.device = d.first;
      s.state = t->busy ? EBT_MEM_TAG_BUSY : t->state;
      out.push_back(s);
    }
  }
  *count = out.size();
  for (size_t i = 0; i < std::min(capacity, out.size()); ++i) rows[i] = out[i];
  return EBT_SUCCESS;
}

ebt_status_t Engine::tag_reports(const char* tag, ebt_mem_report_t* last_pause, ebt_mem_report_t* last_resume) {
  EBT_REQUIRE_ARG(tag, "tag is NULL");
  std::lock_guard<std::mutex> lock(mu_);
  auto it = tags_.find(tag);
  if (it == tags_.end()) return ebt_set_error(EBT_ERROR_NOT_FOUND, "no region ever named tag '%s'", tag);
  if (last_pause) *last_pause = it->second->last_pause;
  if (last_resume) *last_resume = it->second->last_resume;
  return EBT_SUCCESS;
}

ebt_status_t Engine::global_stats(ebt_mem_global_stats_t* out) {
  EBT_REQUIRE_ARG(out, "out is NULL");
  memset(out, 0, sizeof(*out));
  out->host_reserved = arena_.reserved();
  out->host_used = arena_.used();
  out->host_segments = arena_.segments();
  out->host_register_s = arena_.register_seconds();
  ebt_shim_forwarded(&out->forwarded_allocs, &out->forwarded_bytes);
  out->transient_copies = arena_.private_segments();
  out->transient_mapped = arena_.private_mapped();
  out->transient_pinned = arena_.private_pinned();
  out->host_retention = host_retention() ? 1 : 0;
  disk_stats(out);
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& kv : by_va_) {
      const Allocation* a = kv.second;
      if (a->state == AllocState::kActive && a->transient && a->host.ptr) out->transient_retained += a->host.size;
    }
    out->engine_allocs = allocs_total_;
    out->engine_frees = frees_total_;
    out->live_allocations = by_va_.size();
    out->zombie_reclaims = reclaims_;
    out->bytes_reclaimed = bytes_reclaimed_;
    std::unordered_set<const Segment*> seen;
    for (auto& kv : by_va_) {
      const Segment* seg = kv.second->seg.get();
      if (!seg || !seen.insert(seg).second) continue;
      out->coalesced_mappings += 1;
      out->bytes_pending_free += seg->zombie_bytes;
    }
    out->quarantined_ranges = quarantine_.size();
    for (const Quarantined& q : quarantine_) out->quarantined_bytes += q.size;
  }
  std::lock_guard<std::mutex> lock(dev_mu_);
  for (auto& kv : devices_) out->va_reserved += kv.second->va->reserved_bytes();
  return EBT_SUCCESS;
}

namespace {
// The allocation whose [va, va+size) holds p, or null (mu_ held by the caller).
Allocation* containing(std::map<CUdeviceptr, Allocation*>& by_va, const void* p) {
  auto addr = reinterpret_cast<CUdeviceptr>(p);
  auto it = by_va.upper_bound(addr);
  if (it == by_va.begin()) return nullptr;
  --it;
  Allocation* a = it->second;
  return addr < a->va + a->size ? a : nullptr;
}
}  // namespace

ebt_status_t Engine::get_cpu_backup(const void* ptr, void** host, size_t* bytes_after) {
  EBT_REQUIRE_ARG(host && bytes_after, "host and bytes_after must not be NULL");
  std::lock_guard<std::mutex> lock(mu_);
  Allocation* a = containing(by_va_, ptr);
  if (!a) return ebt_set_error(EBT_ERROR_NOT_FOUND, "%p is not in an ebbtide allocation", ptr);
  size_t off = reinterpret_cast<CUdeviceptr>(ptr) - a->va;
  *host = a->host.ptr && a->host_valid ? a->host.ptr + off : nullptr;
  *bytes_after = *host ? a->size - off : 0;
  return EBT_SUCCESS;
}

ebt_status_t Engine::lookup(const void* ptr, void** base, size_t* size, char* tag, int* paused) {
  EBT_REQUIRE_ARG(base && size && tag && paused, "out-pointers must not be NULL");
  std::lock_guard<std::mutex> lock(mu_);
  Allocation* a = containing(by_va_, ptr);
  if (!a) return ebt_set_error(EBT_ERROR_NOT_FOUND, "%p is not in an ebbtide allocation", ptr);
  *base = reinterpret_cast<void*>(a->va);
  *size = a->size;
  snprintf(tag, EBT_MEM_TAG_MAX + 1, "%s", a->tag->name.c_str());
  *paused = a->state == AllocState::kPaused ? 1 : 0;
  return EBT_SUCCESS;
}

ebt_status_t Engine::paused_ranges(uintptr_t* starts, size_t* lengths, size_t capacity, size_t* count) {
  EBT_REQUIRE_ARG(count, "count is NULL");
  EBT_REQUIRE_ARG((starts && lengths) || capacity == 0, "starts/lengths NULL with capacity > 0");
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (auto& kv : by_va_) {
    Allocation* a = kv.second;
    if (a->state != AllocState::kPaused) continue;
    if (n < capacity) {
      starts[n] = static_cast<uintptr_t>(a->va);
      lengths[n] = a->aligned;
    }
    ++n;
  }
  *count = n;
  return EBT_SUCCESS;
}

ebt_status_t Engine::reserve_host(size_t bytes) {
  EBT_REQUIRE_ARG(bytes > 0, "bytes must be > 0");
  const ebt_driver_table_t* drv;
  EBT_CHECK(driver(&drv));
  Device* d;
  EBT_CHECK(device(0, &d));  // registrations are PORTABLE: any context will do
  CtxGuard ctx(drv, d->ctx);
  return arena_.reserve(drv, d->ctx, bytes);
}

ebt_status_t Engine::release_host(size_t* released) {
  EBT_REQUIRE_ARG(released, "released is NULL");
  *released = 0;
  wait_background_pinning();
  std::vector<HostArena::Block> drop;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& kv : by_va_) {
      Allocation* a = kv.second;
      if (a->busy || a->state != AllocState::kActive || !a->host.ptr) continue;
      drop.push_back(a->host);
      a->host = HostArena::Block{};
      a->host_valid = a->host_clean = false;
    }
  }
  for (const auto& b : drop) arena_.free(b);  // transient copies (private segments) go back whole
  {
    std::lock_guard<std::mutex> lock(disk_mu_);  // no disk phase runs: its staging is idle
    for (const auto& b : disk_staging_) arena_.free(b);
    disk_staging_.clear();
    disk_staging_chunk_ = 0;
  }
  const ebt_driver_table_t* drv;
  if (ebt_driver_get(&drv) != EBT_SUCCESS) {
    ebt_clear_error();
    return EBT_SUCCESS;  // no driver: the arena cannot hold anything
  }
  *released = arena_.release_unused(drv);
  return EBT_SUCCESS;
}

ebt_status_t Engine::reset() {
  const ebt_driver_table_t* drv;
  EBT_CHECK(driver(&drv));
  {
    std::lock_guard<std::mutex> plock(pin_mu_);
    pin_queue_.clear();
  }
  wait_background_pinning();
  std::unique_lock<std::mutex> lock(mu_);
  for (auto& kv : tags_)
    if (kv.second->busy) return ebt_set_error(EBT_ERROR_INVALID_STATE, "reset: tag '%s' has an op in flight",
                                              kv.first.c_str());
  lock.unlock();
  close_all_imports();
  lock.lock();
  std::vector<Allocation*> all;
  for (auto& kv : by_va_) all.push_back(kv.second);
  by_va_.clear();
  std::vector<Quarantined> quarantined = std::move(quarantine_);
  quarantine_.clear();
  tags_.clear();
  pending_free_ = 0;
  allocs_total_ = frees_total_ = 0;
  reclaims_ = 0;
  bytes_reclaimed_ = 0;
  lock.unlock();
  {
    std::lock_guard<std::mutex> dk(disk_mu_);  // before dev_mu_ (lock order); no disk phase runs (no op in flight)
    disk_staging_.clear();  // arena blocks: release_all below returns them
    disk_staging_chunk_ = 0;
    disk_dir_.clear();
    disk_dir_checked_ = false;
  }
  std::lock_guard<std::mutex> dlock(dev_mu_);
  std::unordered_set<const Segment*> unmapped;  // coalesced mappings: one unmap each, of the whole range
  std::vector<Allocation*> zombies;
  for (Allocation* a : all) {
    auto it = devices_.find(a->device);
    if (it != devices_.end() && a->state == AllocState::kActive && (!a->seg || unmapped.insert(a->seg.get()).second)) {
      CtxGuard ctx(drv, it->second->ctx);
      EBT_CU_IGNORE(drv->cuCtxSynchronize(), "reset is best effort: it forgets every allocation regardless");
      // frees the memory: the engine holds no handle reference
      if (a->seg) EBT_CU_IGNORE(drv->cuMemUnmap(a->seg->va, a->seg->size), "reset is best effort");
      else EBT_CU_IGNORE(drv->cuMemUnmap(a->va, a->aligned), "reset is best effort");
    }
    if (a->seg) {
      zombies.insert(zombies.end(), a->seg->zombies.begin(), a->seg->zombies.end());
      a->seg->zombies.clear();
    }
  }
  for (const Quarantined& q : quarantined) {  // one more try: the reservations below go back to the driver
    auto it = devices_.find(q.device);
    if (it == devices_.end()) continue;
    CtxGuard ctx(drv, it->second->ctx);
    EBT_CU_IGNORE(drv->cuMemUnmap(q.va, q.size), "a quarantined range's last try: reset forgets it regardless");
  }
  for (Allocation* a : all) {  // after the loop: unmapped holds segment addresses until then
    if (!a->disk_path.empty()) disk_forget(a);
    delete a;
  }
  for (Allocation* z : zombies) delete z;
  for (auto& kv : devices_) {
    Device* d = kv.second.get();
    {
      CtxGuard ctx(drv, d->ctx);
      for (CUevent e : d->free_events) EBT_CU_IGNORE(drv->cuEventDestroy(e), "reset is best effort");
      if (d->d2h) EBT_CU_IGNORE(drv->cuStreamDestroy(d->d2h), "reset is best effort");
      if (d->h2d) EBT_CU_IGNORE(drv->cuStreamDestroy(d->h2d), "reset is best effort");
      d->va->release_all(drv);
    }
    EBT_CU_IGNORE(drv->cuDevicePrimaryCtxRelease(d->dev), "reset is best effort");
  }
  devices_.clear();
  arena_.release_all(drv);
  return EBT_SUCCESS;
}

}  // namespace ebbtide::memory
