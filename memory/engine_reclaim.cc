// engine_reclaim.cc — giving back the memory of zombies (members freed while their coalesced mapping is live)
// when an allocation or a resume on their device runs short (invariants: engine.cc header; reasoning:
// memory/NOTES.md "Zombie reclaim").
//
// A driver mapping cannot be unmapped in part, so a zombie's memory goes back only with its whole mapping. A
// reclaim rebuilds the mapping without its zombies, at the same addresses:
//   1. select (mu_): mappings on the device holding zombies whose tag no op owns, cheapest first (fewest live
//      bytes to copy per zombie byte given back) until the shortfall is covered; their live members are marked
//      busy (free() waits) and their tag `reclaiming` (prepare() waits: a pause or resume of that tag starts
//      after the reclaim);
//   2. drain the device (cuCtxSynchronize: kernels in flight on the members finish, as before a pause);
//   3. copy each live member out: device to device into one staging mapping at a spare VA when the device has
//      room for the live bytes beside the old mapping (plus the memory margin), else to a host-arena block (a
//      CPU-backed member's own backup block, else a staging block); wait;
//   4. unmap the whole mapping: its memory, the zombies' included, goes back to the driver;
//   5. create + map + release one mapping per VA-contiguous run of live members (one per member with coalescing
//      off), grant access, copy the members back, wait;
//   6. commit (mu_): the zombies' VA is returned and their records deleted; the members point at their new
//      mappings (a run of several gets a new Segment without zombies).
// Failure before 4: nothing changed. Failure after 4: the new mappings are unmapped, the whole range is mapped
// again as one mapping and the members are copied back (segment and zombies as before; the caller's allocation
// then fails as it would have). If even that fails, the live members are left PAUSED and their tag PAUSED, with
// a CPU-backed member's content in its backup block (resume() restores it); a discard member's content is gone,
// as a pause would have left it.
#include <algorithm>
#include <string>
#include <unordered_map>

#include "csrc/status.h"
#include "memory/engine.h"
#include "memory/engine_internal.h"
#include "memory/free_ranges.h"

namespace ebbtide::memory {

size_t Engine::zombie_bytes_on(int device_ordinal) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!pending_free_) return 0;
  size_t n = 0;
  const Segment* last = nullptr;  // by_va_ is sorted: a segment's members are adjacent (zombies are unlisted)
  for (auto& kv : by_va_) {
    const Segment* s = kv.second->seg.get();
    if (!s || s == last) continue;
    last = s;
    if (s->device == device_ordinal) n += s->zombie_bytes;
  }
  return n;
}

ebt_status_t Engine::malloc(void** ptr, size_t size, int device_ordinal, const char* tag, int backup) {
  ebt_status_t st = malloc_once(ptr, size, device_ordinal, tag, backup);
  if (st != EBT_ERROR_OUT_OF_MEMORY) return st;
  const size_t held = zombie_bytes_on(device_ordinal);
  if (!held) return st;
  std::string msg = ebt_last_error();
  const ebt_driver_table_t* drv;
  Device* d;
  if (driver(&drv) != EBT_SUCCESS || device(device_ordinal, &d) != EBT_SUCCESS)
    return ebt_set_error(st, "%s", msg.c_str());
  size_t free_b = 0, total = 0;
  {
    CtxGuard ctx(drv, d->ctx);
    if (drv->cuMemGetInfo(&free_b, &total) != CUDA_SUCCESS) return ebt_set_error(st, "%s", msg.c_str());
  }
  const size_t need = round_up(size, d->granularity) + margin();
  if (free_b + held < need) return ebt_set_error(st, "%s", msg.c_str());  // the zombies would not cover it
  size_t got = 0;
  ebt_status_t rs = reclaim_zombies(device_ordinal, need > free_b ? need - free_b : held, &got);
  if (!got) {
    if (rs != EBT_SUCCESS)
      msg += " (giving back the freed members' memory failed: " + std::string(ebt_last_error()) + ")";
    return ebt_set_error(st, "%s", msg.c_str());
  }
  return malloc_once(ptr, size, device_ordinal, tag, backup);
}

void Engine::reclaim_for(int device_ordinal, size_t need, size_t* free_b) {
  const size_t held = zombie_bytes_on(device_ordinal);
  if (!held || *free_b + held < need) return;
  size_t got = 0;
  reclaim_zombies(device_ordinal, need - *free_b, &got);  // a failure leaves the shortfall for the caller to report
  if (!got) return;
  const ebt_driver_table_t* drv;
  Device* d;
  if (driver(&drv) != EBT_SUCCESS || device(device_ordinal, &d) != EBT_SUCCESS) return;
  CtxGuard ctx(drv, d->ctx);
  size_t total = 0;
  // Unchanged on failure: the pre-flight then reports a shortfall the reclaim may have covered.
  EBT_CU_IGNORE(drv->cuMemGetInfo(free_b, &total), "a refresh of the free figure after a reclaim");
}

ebt_status_t Engine::reclaim_zombies(int device_ordinal, size_t want, size_t* got) {
  *got = 0;
  std::lock_guard<std::mutex> serial(reclaim_mu_);
  struct Job {
    std::shared_ptr<Segment> seg;
    std::vector<Allocation*> live;  // sorted by va (by_va_ order)
  };
  std::vector<Job> jobs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::unordered_map<const Segment*, Job> found;
    for (auto& kv : by_va_) {
      Allocation* a = kv.second;
      if (!a->seg || a->seg->device != device_ordinal || !a->seg->zombie_bytes) continue;
      Job& j = found[a->seg.get()];
      j.seg = a->seg;
      j.live.push_back(a);
    }
    std::vector<Job> all;
    for (auto& kv : found) all.push_back(std::move(kv.second));
    // Cheapest first: the fewest live bytes copied per zombie byte given back (live x' zombie < live' x zombie),
    // then the biggest holding.
    std::sort(all.begin(), all.end(), [](const Job& x, const Job& y) {
      const Segment& a = *x.seg;
      const Segment& b = *y.seg;
      const double ca = double(a.size - a.zombie_bytes) * double(b.zombie_bytes);
      const double cb = double(b.size - b.zombie_bytes) * double(a.zombie_bytes);
      if (ca != cb) return ca < cb;
      return a.zombie_bytes != b.zombie_bytes ? a.zombie_bytes > b.zombie_bytes : a.va < b.va;
    });
    size_t planned = 0;
    for (Job& j : all) {
      if (planned >= want) break;
      bool ok = j.live.size() == j.seg->live;  // every live member listed (always; checked before moving them)
      for (const Allocation* a : j.live) ok = ok && !a->busy && !a->tag->busy;  // an op owns it: leave it
      if (!ok) continue;
      for (Allocation* a : j.live) a->busy = true;
      j.live[0]->tag->reclaiming += 1;  // a segment's live members are all of one tag
      planned += j.seg->zombie_bytes;
      jobs.push_back(std::move(j));
    }
  }
  ebt_status_t first = EBT_SUCCESS;
  std::string first_msg;
  for (Job& j : jobs) {
    size_t bytes = 0;
    ebt_status_t st = reclaim_segment(j.seg, j.live, &bytes);
    *got += bytes;
    if (st != EBT_SUCCESS && first == EBT_SUCCESS) {
      first = st;
      first_msg = ebt_last_error();
    }
  }
  return first == EBT_SUCCESS ? EBT_SUCCESS : ebt_set_error(first, "%s", first_msg.c_str());
}

namespace {
enum class Outcome { kUnchanged, kRebuilt, kLost };
}  // namespace

ebt_status_t Engine::reclaim_segment(const std::shared_ptr<Segment>& s, std::vector<Allocation*>& live,
                                     size_t* reclaimed) {
  *reclaimed = 0;
  const auto t0 = Clock::now();
  Outcome out = Outcome::kUnchanged;
  std::vector<HostArena::Block> staging(live.size());  // host path: where each member's content waits
  std::vector<bool> own(live.size(), false);           // staging[k] is the member's own backup block
  std::vector<bool> saved(live.size(), false);         // staging[k] holds the member's current content
  std::vector<MapUnit> dev_staging;                    // device path: one mapping at a spare VA
  std::vector<CUdeviceptr> dptr(live.size(), 0);       // device path: member k's place in it
  std::vector<MapUnit> units;                          // the new mappings (live runs)
  const ebt_driver_table_t* drv = nullptr;
  Device* d = nullptr;
  ebt_status_t st = driver(&drv);
  if (st == EBT_SUCCESS) st = device(s->device, &d);
  if (st == EBT_SUCCESS) {
    CtxGuard ctx(drv, d->ctx);
    // Copy every member between its address and its staging place on `stream`, then wait for the stream.
    auto copy = [&](bool out, CUstream stream) -> ebt_status_t {
      ebt_status_t cst = EBT_SUCCESS;
      const bool on_device = !dev_staging.empty();
      for (size_t k = 0; k < live.size() && cst == EBT_SUCCESS; ++k) {
        const Allocation* a = live[k];
        for (size_t off = 0; off < a->size && cst == EBT_SUCCESS;) {
          size_t n = std::min(chunk_bytes(), a->size - off);
          CUresult res;
          const char* what;
          if (on_device) {
            res = out ? drv->cuMemcpyDtoDAsync(dptr[k] + off, a->va + off, n, stream)
                      : drv->cuMemcpyDtoDAsync(a->va + off, dptr[k] + off, n, stream);
            what = "cuMemcpyDtoDAsync (reclaim)";
          } else {
            n = std::min(n, arena_.piece_remaining(staging[k], off));
            res = out ? drv->cuMemcpyDtoHAsync(staging[k].ptr + off, a->va + off, n, stream)
                      : drv->cuMemcpyHtoDAsync(a->va + off, staging[k].ptr + off, n, stream);
            what = out ? "cuMemcpyDtoHAsync (reclaim)" : "cuMemcpyHtoDAsync (reclaim)";
          }
          if (res != CUDA_SUCCESS) cst = ebt_cu_error(res, what, __FILE__, __LINE__);
          off += n;
        }
      }
      CUresult res = drv->cuStreamSynchronize(stream);  // also after a failure: no copy may still be in flight
      if (cst == EBT_SUCCESS && res != CUDA_SUCCESS)
        cst = ebt_cu_error(res, "cuStreamSynchronize (reclaim copy)", __FILE__, __LINE__);
      return cst;
    };
    // Host blocks for the members in `which` (a CPU-backed member's own backup block where it has one).
    auto host_blocks = [&](const std::vector<size_t>& which) -> ebt_status_t {
      std::vector<size_t> sizes;
      std::vector<size_t> idx;
      for (size_t k : which) {
        if (live[k]->backup == EBT_MEM_BACKUP_CPU && live[k]->host.ptr && arena_.registered(live[k]->host)) {
          staging[k] = live[k]->host;
          own[k] = true;
        } else {
          sizes.push_back(live[k]->size);
          idx.push_back(k);
        }
      }
      if (sizes.empty()) return EBT_SUCCESS;
      std::vector<HostArena::Block> blocks;
      EBT_CHECK(arena_.allocate(drv, d->ctx, sizes, &blocks));
      for (size_t i = 0; i < idx.size(); ++i) staging[idx[i]] = blocks[i];
      return EBT_SUCCESS;
    };
    // 2. Drain.
    CUresult res = drv->cuCtxSynchronize();
    if (res != CUDA_SUCCESS) st = ebt_cu_error(res, "cuCtxSynchronize (reclaim)", __FILE__, __LINE__);
    if (st == EBT_SUCCESS) st = streams(d);
    // 3. Stage on the device when it has room for the live bytes (plus the margin) beside the old mapping: two
    //    device-to-device copies, no host memory pinned. Otherwise (or if that mapping fails) on the host.
    if (st == EBT_SUCCESS) {
      size_t live_bytes = 0;
      for (const Allocation* a : live) live_bytes += a->aligned;
      size_t free_b = 0, total = 0;
      CUdeviceptr tmp = 0;
      if (drv->cuMemGetInfo(&free_b, &total) == CUDA_SUCCESS && free_b >= live_bytes + margin() &&
          d->va->allocate(drv, live_bytes, &tmp) == EBT_SUCCESS) {
        MapUnit u;
        u.va = tmp;
        u.size = live_bytes;
        u.device = s->device;
        dev_staging.push_back(u);
        ebt_mem_report_t rr{};
        if (map_all(dev_staging, &rr) != EBT_SUCCESS) {  // nothing of it stays mapped
          dev_staging.clear();
          d->va->free(tmp, live_bytes);
        } else {
          CUdeviceptr at = tmp;  // the members back to back
          for (size_t k = 0; k < live.size(); ++k) {
            dptr[k] = at;
            at += live[k]->aligned;
          }
        }
      }
      if (dev_staging.empty()) {
        std::vector<size_t> all(live.size());
        for (size_t k = 0; k < live.size(); ++k) all[k] = k;
        st = host_blocks(all);
      }
    }
    if (st == EBT_SUCCESS) st = copy(true, d->d2h);
    if (st == EBT_SUCCESS && dev_staging.empty()) saved.assign(live.size(), true);
    // 4. Unmap the whole mapping (zombies included).
    if (st == EBT_SUCCESS) {
      res = drv->cuMemUnmap(s->va, s->size);
      if (res != CUDA_SUCCESS) st = ebt_cu_error(res, "cuMemUnmap (reclaim)", __FILE__, __LINE__);
    }
    // 5. Map the live members again at their addresses (one mapping per VA-contiguous live run), copy back.
    if (st == EBT_SUCCESS) {
      const bool coalesce = coalescing();
      for (size_t k = 0; k < live.size();) {
        MapUnit u;
        u.begin = k;
        u.end = k + 1;
        u.va = live[k]->va;
        u.size = live[k]->aligned;
        u.device = s->device;
        while (coalesce && u.end < live.size() && live[u.end]->va == u.va + u.size)
          u.size += live[u.end++]->aligned;
        k = u.end;
        units.push_back(u);
      }
      ebt_mem_report_t rr{};
      st = map_all(units, &rr);  // on failure: nothing of it stays mapped
      if (st == EBT_SUCCESS) {
        st = copy(false, d->h2d);
        if (st != EBT_SUCCESS) unmap_units(units, units.size());
      }
      if (st == EBT_SUCCESS) {
        out = Outcome::kRebuilt;
      } else {  // roll back: the whole range as one mapping again, the members' content back in it
        std::string msg = ebt_last_error();
        std::vector<MapUnit> whole(1);
        whole[0].begin = 0;
        whole[0].end = live.size();
        whole[0].va = s->va;
        whole[0].size = s->size;
        whole[0].device = s->device;
        ebt_status_t rb = map_all(whole, &rr);
        if (rb == EBT_SUCCESS) {
          rb = copy(false, d->h2d);
          if (rb != EBT_SUCCESS) unmap_units(whole, 1);
        }
        if (rb != EBT_SUCCESS) {
          out = Outcome::kLost;
          if (!dev_staging.empty()) {  // CPU-backed content: from the device staging into host blocks
            std::vector<size_t> cpu;
            for (size_t k = 0; k < live.size(); ++k)
              if (live[k]->backup == EBT_MEM_BACKUP_CPU) cpu.push_back(k);
            if (!cpu.empty() && host_blocks(cpu) == EBT_SUCCESS) {
              ebt_status_t cst = EBT_SUCCESS;
              for (size_t k : cpu)
                if (cst == EBT_SUCCESS && drv->cuMemcpyDtoHAsync(staging[k].ptr, dptr[k], live[k]->size, d->d2h) !=
                                              CUDA_SUCCESS)
                  cst = EBT_ERROR_DRIVER;
              if (drv->cuStreamSynchronize(d->d2h) == CUDA_SUCCESS && cst == EBT_SUCCESS)
                for (size_t k : cpu) saved[k] = true;
            }
          }
          msg += " (rollback failed too: the mapping's live allocations are paused, their tag is PAUSED; resume() "
                 "maps them again, CPU-backed ones with their content)";
        } else {
          msg += " (rolled back: the mapping and its allocations are as before)";
        }
        units.clear();
        st = ebt_set_error(st, "%s", msg.c_str());
      }
    }
  }
  // 6. Commit.
  std::vector<Allocation*> dead;
  size_t zombie_bytes = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (out != Outcome::kUnchanged) {  // the old mapping is gone: so are its zombies
      zombie_bytes = s->zombie_bytes;
      dead = std::move(s->zombies);
      s->zombies.clear();
      pending_free_ -= s->zombie_bytes;
      s->zombie_bytes = 0;
      s->live = 0;
      for (Allocation* a : live) a->seg.reset();
    }
    if (out == Outcome::kRebuilt) {
      reclaims_ += 1;
      bytes_reclaimed_ += zombie_bytes;
      *reclaimed = zombie_bytes;
      for (const MapUnit& u : units) {
        if (u.end - u.begin < 2) continue;
        auto ns = std::make_shared<Segment>();
        ns->va = u.va;
        ns->size = u.size;
        ns->device = u.device;
        ns->live = u.end - u.begin;
        for (size_t k = u.begin; k < u.end; ++k) live[k]->seg = ns;
      }
    } else if (out == Outcome::kLost) {
      Tag* t = live[0]->tag;
      for (size_t k = 0; k < live.size(); ++k) {
        Allocation* a = live[k];
        a->state = AllocState::kPaused;
        a->host_clean = false;
        if (a->backup == EBT_MEM_BACKUP_CPU && saved[k]) {  // its content is in staging[k]: its backup now
          if (a->host.ptr && a->host.ptr != staging[k].ptr) arena_.free(a->host);  // an unpinned copy it had
          a->host = staging[k];
          a->host_valid = true;
          own[k] = true;
        } else if (a->backup == EBT_MEM_BACKUP_CPU) {
          a->host_valid = false;  // its content is gone
        }
      }
      t->state = EBT_MEM_TAG_PAUSED;
      t->pauses += 1;  // a new paused period (pool epochs)
    }
    for (Allocation* a : live) a->busy = false;
    live[0]->tag->reclaiming -= 1;
  }
  cv_.notify_all();
  for (size_t k = 0; k < live.size(); ++k)
    if (!own[k] && staging[k].ptr) arena_.free(staging[k]);
  if (!dev_staging.empty()) {  // the device staging: unmapped (its handle was released at map: memory back)
    unmap_units(dev_staging, 1);
    d->va->free(dev_staging[0].va, dev_staging[0].size);
  }
  for (Allocation* z : dead) {  // unmapped with the old mapping: the VA may be handed out again
    if (d) d->va->free(z->va, z->aligned);
    delete z;
  }
  if (out == Outcome::kRebuilt)
    EBT_INFO(EBT_SUBSYS_MEM, "reclaimed %zu bytes of freed allocations from the coalesced mapping at 0x%llx "
             "(%zu live allocations copied out and back, %zu mappings now) in %.3f ms", zombie_bytes, s->va,
             live.size(), units.size(), since(t0) * 1e3);
  return st;
}

}  // namespace ebbtide::memory
