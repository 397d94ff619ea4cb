// engine_segments.cc — which driver mappings an op makes or unmaps, and the bookkeeping of coalesced mappings
// (invariants: engine.cc header; reasoning: memory/NOTES.md "Coalesced mappings").
//
// Policy: without coalescing every allocation is its own mapping (one MapUnit each). With coalescing on (the
// default; EBBTIDE_MEM_COALESCE=0 / ebt_mem_set_coalescing(0) off), a resume maps each VA-contiguous run of
// same-device, same-tag, non-shareable paused allocations (inside one VA reservation, at most
// EBBTIDE_MEM_COALESCE_MAX_BYTES) with ONE cuMemCreate + cuMemMap, and records a Segment shared by its members.
// A pause unmaps a Segment whole (the driver cannot unmap a sub-range of a mapping). A member freed while active
// becomes a zombie of its Segment: unlisted at once, its VA and memory held until the mapping goes (next pause of
// the tag, the last live member's free, or a reclaim when memory runs short: engine_reclaim.cc).
// Shareable allocations never join a run: an export must expose exactly one allocation's memory.
#include <memory>
#include <string>

#include "csrc/status.h"
#include "memory/engine.h"
#include "memory/settings.h"

namespace ebbtide::memory {

namespace {

// Largest coalesced mapping (EBBTIDE_MEM_COALESCE_MAX_BYTES, memory/settings.h).
size_t coalesce_max_bytes() { return settings().coalesce_max_bytes; }

// The unit of allocs[i] mapped on its own (its own physical allocation).
MapUnit single_unit(size_t i, const Allocation* a) {
  MapUnit u;
  u.begin = i;
  u.end = i + 1;
  u.va = a->va;
  u.size = a->aligned;
  u.device = a->device;
  u.shareable = a->shareable;
  return u;
}

}  // namespace

ebt_status_t Engine::resume_units(const std::vector<Allocation*>& allocs, std::vector<MapUnit>* units) {
  units->clear();
  const bool on = coalescing();
  const size_t cap = coalesce_max_bytes();
  for (size_t i = 0; i < allocs.size();) {
    const Allocation* a = allocs[i];
    MapUnit u = single_unit(i, a);
    if (on && !a->shareable) {
      Device* d;
      EBT_CHECK(device(a->device, &d));
      const CUdeviceptr limit = d->va->reservation_end(a->va);  // a mapping never spans two reservations
      while (u.end < allocs.size()) {
        const Allocation* b = allocs[u.end];
        if (b->device != a->device || b->tag != a->tag || b->shareable || b->va != u.va + u.size ||
            u.size + b->aligned > cap || b->va + b->aligned > limit)
          break;
        u.size += b->aligned;
        ++u.end;
      }
    }
    i = u.end;
    units->push_back(std::move(u));
  }
  return EBT_SUCCESS;
}

// The op owns every allocation in `allocs` (busy): a->seg changes only under mu_ by that owner, so reading it here
// without mu_ is safe. Every live member of a segment is ACTIVE and in the segment's tag, hence in this plan, and
// no other allocation lies inside its range (zombies keep their VA): its members are consecutive here. The first
// live member need not sit at the segment's base: a member freed there is a zombie, still inside the unit.
ebt_status_t Engine::pause_units(const std::vector<Allocation*>& allocs, std::vector<MapUnit>* units) {
  units->clear();
  for (size_t i = 0; i < allocs.size();) {
    Allocation* a = allocs[i];
    MapUnit u = single_unit(i, a);
    if (a->seg) {
      while (u.end < allocs.size() && allocs[u.end]->seg == a->seg) ++u.end;
      if (u.end - u.begin != a->seg->live || a->va < a->seg->va || a->va >= a->seg->va + a->seg->size)
        return ebt_set_error(EBT_ERROR_INTERNAL, "coalesced mapping at 0x%llx: %zu of its %zu live members in this "
                             "pause (bug: please report it)", a->seg->va, u.end - u.begin, a->seg->live);
      u.va = a->seg->va;
      u.size = a->seg->size;
      u.seg = a->seg;
    }
    i = u.end;
    units->push_back(std::move(u));
  }
  return EBT_SUCCESS;
}

void Engine::publish_segments(const std::vector<Allocation*>& allocs, const std::vector<MapUnit>& units) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const MapUnit& u : units) {
    if (u.end - u.begin < 2) continue;
    auto s = std::make_shared<Segment>();
    s->va = u.va;
    s->size = u.size;
    s->device = u.device;
    s->live = u.end - u.begin;
    for (size_t k = u.begin; k < u.end; ++k) allocs[k]->seg = s;
  }
}

void Engine::retire_segments(const std::vector<Allocation*>& allocs, const std::vector<const MapUnit*>& retired,
                             ebt_mem_report_t* r) {
  std::vector<Allocation*> dead;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const MapUnit* u : retired) {
      for (size_t k = u->begin; k < u->end; ++k) allocs[k]->seg.reset();
      Segment& s = *u->seg;
      r->bytes_pending_freed += s.zombie_bytes;
      pending_free_ -= s.zombie_bytes;
      dead.insert(dead.end(), s.zombies.begin(), s.zombies.end());
      s.zombies.clear();
      s.zombie_bytes = 0;
      s.live = 0;
    }
  }
  for (Allocation* z : dead) {  // unmapped with their segment: the VA may be handed out again
    Device* d;
    if (device(z->device, &d) == EBT_SUCCESS) d->va->free(z->va, z->aligned);
    delete z;
  }
}

ebt_status_t Engine::free_member(Allocation* a, std::unique_lock<std::mutex>& lock) {
  std::shared_ptr<Segment> s = std::move(a->seg);
  a->seg.reset();
  HostArena::Block host = a->host;  // the backup is of no use any more
  a->host = HostArena::Block{};
  if (--s->live > 0) {  // a zombie: nothing to unmap yet (a sub-range of a mapping cannot be unmapped)
    s->zombies.push_back(a);
    s->zombie_bytes += a->aligned;
    pending_free_ += a->aligned;
    const CUdeviceptr va = a->va;  // once mu_ is dropped the segment owns `a`: a pause may delete it at once
    lock.unlock();
    arena_.free(host);
    EBT_TRACE(EBT_SUBSYS_MEM, "free 0x%llx: inside a coalesced mapping (0x%llx, %zu bytes); memory held until it is "
              "unmapped", va, s->va, s->size);
    return EBT_SUCCESS;
  }
  // The last live member: unmap the whole mapping, then every member's VA goes back.
  std::vector<Allocation*> members = std::move(s->zombies);
  s->zombies.clear();
  pending_free_ -= s->zombie_bytes;
  s->zombie_bytes = 0;
  members.push_back(a);
  lock.unlock();
  arena_.free(host);
  ebt_status_t st = EBT_SUCCESS;
  const ebt_driver_table_t* drv;
  Device* d = nullptr;
  st = driver(&drv);
  if (st == EBT_SUCCESS) st = device(s->device, &d);
  if (st == EBT_SUCCESS) {
    CtxGuard ctx(drv, d->ctx);
    CUresult res = drv->cuCtxSynchronize();  // kernels still using any member must finish before unmap
    if (res != CUDA_SUCCESS) st = ebt_cu_error(res, "cuCtxSynchronize (free)", __FILE__, __LINE__);
    const ebt_status_t ust = unmap_or_quarantine(drv, s->device, s->va, s->size, "free of a coalesced mapping");
    if (ust != EBT_SUCCESS) st = ust;  // quarantined: still mapped, these VAs are never handed out again
    else for (Allocation* m : members) d->va->free(m->va, m->aligned);
  }
  for (Allocation* m : members) delete m;
  return st;
}

ebt_status_t Engine::oom_hint(ebt_status_t st) {
  if (st != EBT_ERROR_OUT_OF_MEMORY) return st;
  size_t held;
  {
    std::lock_guard<std::mutex> lock(mu_);
    held = pending_free_;
  }
  if (!held) return st;
  std::string msg = ebt_last_error();
  return ebt_set_error(st, "%s (%zu bytes of freed allocations are still held inside coalesced mappings, too few "
                       "to cover it or owned by a pause/resume in flight: they go back at their tag's next pause)",
                       msg.c_str(), held);
}

}  // namespace ebbtide::memory
