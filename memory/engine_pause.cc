// engine_pause.cc — an op's two steps (prepare: select and mark busy; execute: run, then commit) and the pause
// itself: drain, back up, unmap in VA-contiguous runs, roll back on failure (invariants: engine.cc header).
#include <algorithm>
#include <cstring>
#include <string>
#include <unordered_set>

#include "csrc/status.h"
#include "memory/engine.h"
#include "memory/engine_internal.h"

namespace ebbtide::memory {

ebt_status_t Engine::prepare(OpKind kind, const char* tag, Plan* plan, ebt_mem_report_t* r) {
  EBT_REQUIRE_ARG(tag == nullptr || tag_ok(tag), "tag must be NULL or 1..%d bytes", EBT_MEM_TAG_MAX);
  const auto t0 = Clock::now();
  plan->kind = kind;
  plan->tags.clear();
  plan->allocs.clear();
  plan->noop = false;
  const char* verb = kind == OpKind::kPause ? "pause" : "resume";
  const int from = kind == OpKind::kPause ? EBT_MEM_TAG_ACTIVE : EBT_MEM_TAG_PAUSED;
  std::unique_lock<std::mutex> lock(mu_);
  std::vector<Tag*> candidates;
  if (tag) {
    auto it = tags_.find(tag);
    if (it == tags_.end())
      return unknown_tag(verb, tag, tags_);
    candidates.push_back(it->second.get());
  } else {
    for (auto& kv : tags_) candidates.push_back(kv.second.get());
  }
  // A zombie reclaim moving one of these tags' members finishes first (it is short and never waits for an op).
  cv_.wait(lock, [&candidates] {
    for (Tag* t : candidates)
      if (t->reclaiming) return false;
    return true;
  });
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
  plan->prepare_s = since(t0);
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
  r.prepare_s = plan.prepare_s;
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
    if (i == 0) {
      auto t_info = Clock::now();
      EBT_CU_IGNORE(drv->cuMemGetInfo(&r->driver_free_before, &total), "a report figure only");
      r->meminfo_s += since(t_info);
    }
    EBT_CU_CHECK(drv->cuCtxSynchronize());
    EBT_CHECK(streams(devs[i]));
  }
  r->sync_s = since(t_sync) - r->meminfo_s;
  // 2. Disk backups first, whole (engine_disk.cc): a failure there has released nothing.
  EBT_CHECK(disk_phase(allocs, false, r));
  // 3. Host blocks for backups that have none yet (one arena growth for the whole batch); transient copies get a
  //    private segment each, prepared piece by piece on runtime threads while the copies run (engine_transient.cc).
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
    if (!a->host.ptr && !a->transient) {
      need_sizes.push_back(a->size);
      need_idx.push_back(i);
    }
  }
  ShadowSteps shadow;
  std::vector<bool> made;  // transient copies this pause made (given back again if it fails)
  auto forget_disk = [&] {  // a failed pause: the files of what stays mapped are of no use
    for (Allocation* a : allocs)
      if (a->state == AllocState::kActive && !a->disk_path.empty()) disk_forget(a);
  };
  if (!need_sizes.empty()) {
    // A background batch may be pinning for these very allocations: let it finish (it hands its blocks back to the
    // arena when it finds them busy), so the arena is not grown twice.
    wait_background_pinning();
    std::vector<HostArena::Block> blocks;
    CtxGuard ctx(drv, devs[0]->ctx);
    ebt_status_t ast = arena_.allocate(drv, devs[0]->ctx, need_sizes, &blocks);
    if (ast != EBT_SUCCESS) {
      forget_disk();
      return ast;
    }
    for (size_t k = 0; k < need_idx.size(); ++k) allocs[need_idx[k]]->host = blocks[k];
  }
  {
    CtxGuard ctx(drv, devs[0]->ctx);
    ebt_status_t sst = shadow_prepare(allocs, copy, devs[0]->ctx, &shadow, &made);
    if (sst != EBT_SUCCESS) {
      forget_disk();
      return sst;
    }
  }
  // 4. Issue every copy (chunked, cut at registration pieces), one event per allocation; a transient copy's chunk
  //    is issued once its piece is ready.
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
      if (a->transient) {
        auto t_wait = Clock::now();
        st = shadow_ready(&shadow, i, a, off);
        r->host_wait_s += since(t_wait);
        if (st != EBT_SUCCESS) break;
      }
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
  // 5. Unmap VA-contiguous runs of same-device mappings, one driver call per run, each as soon as its copies
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
        EBT_CU_IGNORE(drv->cuStreamSynchronize(devs[k]->d2h), "draining a failed pause: its first error is reported");
      }
  }
  for (size_t k = 0; k < allocs.size(); ++k) {
    if (!events[k]) continue;
    if (st != EBT_SUCCESS)
      EBT_CU_IGNORE(drv->cuEventSynchronize(events[k]), "draining a failed pause: its first error is reported");
    give_event(devs[k], events[k]);
  }
  {
    std::string msg = st != EBT_SUCCESS ? ebt_last_error() : "";
    ebt_status_t wst = shadow.work.join();  // no worker may still touch a host copy below
    if (st == EBT_SUCCESS && wst != EBT_SUCCESS) st = wst;
    else if (st != EBT_SUCCESS) ebt_set_error(st, "%s", msg.c_str());
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
    for (size_t k = 0; k < allocs.size(); ++k)  // what stays mapped needs no copy this pause made
      if (made[k] && allocs[k]->state == AllocState::kActive) shadow_drop(allocs[k]);
    forget_disk();
    return ebt_set_error(st, "%s", msg.c_str());
  }
  {
    std::vector<Allocation*> pageable;  // registered only while the copies ran
    for (size_t k = 0; k < allocs.size(); ++k)
      if (copy[k] && allocs[k]->pageable) pageable.push_back(allocs[k]);
    CtxGuard ctx(drv, devs[0]->ctx);
    shadow_unregister(pageable, devs[0]->ctx);
  }
  {
    CtxGuard ctx(drv, devs[0]->ctx);
    size_t total = 0;
    auto t_info = Clock::now();
    EBT_CU_IGNORE(drv->cuMemGetInfo(&r->driver_free_after, &total), "a report figure only (the pause is done)");
    r->meminfo_s += since(t_info);
  }
  return EBT_SUCCESS;
}

// Whether VA `va` is still backed by a mapping: cuMemRetainAllocationHandle succeeds only on mapped memory.
static bool still_mapped(const ebt_driver_table_t* drv, CUdeviceptr va) {
  if (!drv->cuMemRetainAllocationHandle) return true;  // cannot tell: keep the driver's error
  CUmemGenericAllocationHandle h = 0;
  if (drv->cuMemRetainAllocationHandle(&h, reinterpret_cast<void*>(va)) != CUDA_SUCCESS) return false;
  EBT_CU_IGNORE(drv->cuMemRelease(h), "the probe's own reference; the mapping keeps the memory");
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

}  // namespace ebbtide::memory
