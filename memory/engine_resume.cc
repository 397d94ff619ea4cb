// engine_resume.cc — the resume: pre-flight memory check, create + map + release every mapping unit, grant
// access, stream the backups back; on failure unmap what this op mapped (invariants: engine.cc header).
#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <map>
#include <string>
#include <thread>

#include "csrc/status.h"
#include "memory/engine.h"
#include "memory/engine_internal.h"

namespace ebbtide::memory {

// Map h over [va, va + size) and drop the handle: from here the mapping alone keeps the physical memory (unmap
// frees it). Takes h over (released on every path). The unit's device context must be current.
ebt_status_t Engine::map_release(CUdeviceptr va, size_t size, CUmemGenericAllocationHandle h) {
  const ebt_driver_table_t* drv;
  EBT_CHECK(driver(&drv));
  CUresult res = drv->cuMemMap(va, size, 0, h, 0);
  if (res != CUDA_SUCCESS) {
    EBT_CU_IGNORE(drv->cuMemRelease(h), "the handle of a failed map: the map's error is reported");
    return ebt_cu_error(res, "cuMemMap (resume)", __FILE__, __LINE__);
  }
  res = drv->cuMemRelease(h);
  if (res != CUDA_SUCCESS) {  // still referenced: unmap, then retry the release so nothing is left behind
    EBT_CU_IGNORE(drv->cuMemUnmap(va, size), "undoing a map whose release failed: that error is reported");
    EBT_CU_IGNORE(drv->cuMemRelease(h), "undoing a map whose release failed: that error is reported");
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
    auto t_map_call = Clock::now();
    st = map_release(u.va, u.size, h);
    r->map_call_s += since(t_map_call);
    if (st != EBT_SUCCESS) break;
  }
  if (ahead) {
    stop.store(true, std::memory_order_relaxed);
    helper.join();
    r->create_s = ahead_create_s;  // the helper's span (creates overlapped with the maps here)
    for (size_t i = done; i < n; ++i) {  // made ahead but never mapped (this op failed)
      if (!handles[i]) continue;
      CtxGuard ctx(drv, devs[i]->ctx);
      EBT_CU_IGNORE(drv->cuMemRelease(handles[i]), "a handle made ahead for a failed resume: its error is reported");
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
    EBT_CU_IGNORE(drv->cuMemUnmap(units[i].va, units[i].size), "rollback of a failed resume: its error is reported");
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
  EBT_CHECK(disk_check(allocs));  // every disk backup is this process's and whole, before anything is mapped
  // 0. Pre-flight: enough free memory (plus the margin) on each device? (Fail before touching anything.)
  std::map<int, size_t> need;
  for (Allocation* a : allocs) need[a->device] += a->aligned;
  for (auto& kv : need) {
    Device* d;
    EBT_CHECK(device(kv.first, &d));
    CtxGuard ctx(drv, d->ctx);
    size_t free_b = 0, total = 0;
    auto t_info = Clock::now();
    EBT_CU_CHECK(drv->cuMemGetInfo(&free_b, &total));
    r->meminfo_s += since(t_info);
    // Short of memory while freed members of coalesced mappings hold some: give those back first.
    if (!rollback && (free_b < kv.second || free_b - kv.second < margin))
      reclaim_for(kv.first, kv.second + margin, &free_b);
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
  // 2. Stream the backups back (and poison discarded memory in debug mode). Transient copies that this resume
  //    gives back (no retention) get an event per piece, and the pieces go back as those land, once every copy
  //    was issued (engine_transient.cc); pageable ones are registered again first, piece by piece.
  const bool retain = host_retention();
  ShadowSteps reg;
  std::vector<PieceRelease> release;
  OrderedWork releasing;
  auto t_copy = Clock::now();
  std::map<Device*, CUevent> done_events;
  {
    Device* d0;
    EBT_CHECK_GOTO(device(allocs[0]->device, &d0), st, undo);
    CtxGuard ctx(drv, d0->ctx);
    EBT_CHECK_GOTO(shadow_register(allocs, d0->ctx, &reg), st, undo);
  }
  for (size_t i = 0; i < allocs.size(); ++i) {
    Allocation* a = allocs[i];
    Device* d;
    EBT_CHECK_GOTO(device(a->device, &d), st, undo);
    {
      CtxGuard ctx(drv, d->ctx);
      done_events.emplace(d, nullptr);  // before any copy: the undo drains every stream that got one
      if (a->backup == EBT_MEM_BACKUP_CPU && a->host_valid) {
        const bool give_back = a->transient && !retain && arena_.is_private(a->host);
        for (size_t off = 0; off < a->size;) {
          const size_t left_in_piece = arena_.piece_remaining(a->host, off);
          size_t n = std::min({chunk_bytes(), a->size - off, left_in_piece});
          if (a->pageable) EBT_CHECK_GOTO(shadow_ready(&reg, i, a, off), st, undo);
          CUresult res = drv->cuMemcpyHtoDAsync(a->va + off, a->host.ptr + off, n, d->h2d);
          if (res != CUDA_SUCCESS) {
            st = ebt_cu_error(res, "cuMemcpyHtoDAsync (resume)", __FILE__, __LINE__);
            goto undo;
          }
          if (give_back && (n == left_in_piece || off + n == a->size)) {  // the piece's last chunk
            PieceRelease p{a, arena_.piece_index(a->host, off), d, take_event(d)};
            if (!p.done) {
              st = EBT_ERROR_DRIVER;
              goto undo;
            }
            release.push_back(p);
            res = drv->cuEventRecord(p.done, d->h2d);
            if (res != CUDA_SUCCESS) {
              st = ebt_cu_error(res, "cuEventRecord (resume)", __FILE__, __LINE__);
              goto undo;
            }
          }
          off += n;
        }
        r->bytes_copied += a->size;
      } else if (poison_enabled()) {
        drv->cuMemsetD8Async(a->va, 0xA5, a->aligned, d->h2d);
      }
    }
  }
  EBT_CHECK_GOTO(reg.work.join(), st, undo);
  // The disk backups: read, checked and copied through pinned staging (engine_disk.cc); nothing given back yet.
  EBT_CHECK_GOTO(disk_phase(allocs, true, r), st, undo);
  if (!release.empty()) {
    CtxGuard ctx(drv, release[0].d->ctx);
    shadow_release(release, release[0].d->ctx, &releasing);
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
  r->copy_s = since(t_copy) - r->disk_s;
  for (auto& kv : done_events) give_event(kv.first, kv.second);
  {
    auto t_release = Clock::now();
    if (releasing.join() != EBT_SUCCESS)  // the content is on the device: warn, the pieces go back at free
      EBT_WARN(EBT_SUBSYS_MEM, "giving back a transient host copy after resume: %s", ebt_last_error());
    r->host_release_s = since(t_release);
    for (const PieceRelease& p : release) give_event(p.d, p.done);
    std::vector<Allocation*> pageable;
    for (Allocation* a : allocs) {
      if (a->backup != EBT_MEM_BACKUP_CPU || !a->transient || !a->host.ptr) continue;
      if (!retain) shadow_drop(a);  // its pieces went back above (an arena block left by a reclaim: here)
      else if (a->pageable) pageable.push_back(a);
    }
    if (!pageable.empty()) {
      Device* d;
      if (device(pageable[0]->device, &d) == EBT_SUCCESS) {
        CtxGuard ctx(drv, d->ctx);
        shadow_unregister(pageable, d->ctx);
      }
    }
    r->host_release_s = since(t_release);
  }
  publish_segments(allocs, units);
  r->mappings += units.size();
  for (Allocation* a : allocs) {
    a->state = AllocState::kActive;
    a->host_clean = false;
    if (!a->disk_path.empty()) disk_forget(a);  // restored: the file goes
    r->allocations += 1;
    r->bytes += a->aligned;
  }
  {
    Device* d;
    if (device(r->device, &d) == EBT_SUCCESS) {
      CtxGuard ctx(drv, d->ctx);
      size_t total;
      auto t_info = Clock::now();
      EBT_CU_IGNORE(drv->cuMemGetInfo(&r->driver_free_after, &total), "a report figure only (the resume is done)");
      r->meminfo_s += since(t_info);
    }
  }
  return EBT_SUCCESS;
undo:
  for (auto& kv : done_events) {  // copies issued before the failure must land before their memory is unmapped
    CtxGuard ctx(drv, kv.first->ctx);
    EBT_CU_IGNORE(drv->cuStreamSynchronize(kv.first->h2d), "draining a failed resume: its first error is reported");
    give_event(kv.first, kv.second);
  }
  {
    std::string msg = ebt_last_error();
    reg.work.join();
    releasing.join();  // started only once every copy was issued: an asynchronous copy failure (sticky)
    for (const PieceRelease& p : release) give_event(p.d, p.done);
    std::vector<Allocation*> pageable;  // back to pageable while the tag stays paused
    for (Allocation* a : allocs)
      if (a->pageable && a->host.ptr) pageable.push_back(a);
    Device* d;
    if (!pageable.empty() && device(pageable[0]->device, &d) == EBT_SUCCESS) {
      CtxGuard ctx(drv, d->ctx);
      shadow_unregister(pageable, d->ctx);
    }
    ebt_set_error(st, "%s", msg.c_str());
  }
  {
    std::string msg = ebt_last_error();
    unmap_units(units, units.size());
    return ebt_set_error(st, "%s (resume rolled back: the tag stays paused and can be retried)", msg.c_str());
  }
}
}  // namespace ebbtide::memory
