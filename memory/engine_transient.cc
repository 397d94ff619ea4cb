/*
 * engine_transient.cc — the host side of transient CPU copies (EBT_MEM_HOST_TRANSIENT; torch_memory_saver's
 * semantics): each pause makes the copy in fresh host memory, each resume gives it back (unless host retention is
 * on). Getting and pinning fresh host memory is slower than PCIe, so it is done piece by piece on a few runtime
 * threads while earlier pieces copy, and given back piece by piece as the copies back land. The design and its
 * measurements: Note "Transient host copies" in memory/NOTES.md.
 *
 * Policies:
 *  - Pause: the host must have room (MemAvailable, and the cgroup's memory.max) for every fresh copy before
 *    anything is touched: HOST_OUT_OF_MEMORY otherwise, nothing released. A piece that still cannot be had
 *    (populate or register fails) fails the pause, which rolls back like any failed pause.
 *  - Pieces are prepared in the order the copies need them; a copy waits only for its own piece.
 *  - A pageable copy (EBT_MEM_HOST_PAGEABLE) is registered only while copies run: unregistered after the pause's
 *    copies landed, registered again (in pieces, in copy order) by the resume.
 *  - Resume gives pieces back only after EVERY copy of the op was issued: an issue failure rolls the resume back
 *    with the host copies intact (the tag stays paused, retryable). A copy that fails later, asynchronously, is a
 *    sticky CUDA error: the context and the device content are lost then anyway.
 */
#include <sys/sysinfo.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include "csrc/status.h"
#include "memory/engine.h"
#include "memory/engine_internal.h"
#include "memory/free_ranges.h"

namespace ebbtide::memory {

namespace {

constexpr size_t k2MiB = size_t(2) << 20;

// A number from a cgroup v2 file ("max" or unreadable: none).
bool read_cgroup_bytes(const std::string& path, size_t* out) {
  std::ifstream f(path);
  std::string text;
  if (!(f >> text) || text == "max") return false;
  char* end = nullptr;
  unsigned long long v = strtoull(text.c_str(), &end, 10);
  if (end == text.c_str()) return false;
  *out = static_cast<size_t>(v);
  return true;
}

// Host memory a pause may still take: MemAvailable, and what this process's cgroup (v2) leaves under its limit.
size_t host_available() {
  size_t avail = ~size_t(0);
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  unsigned long long kb = 0;
  std::string unit;
  while (meminfo >> key >> kb) {
    std::getline(meminfo, unit);
    if (key == "MemAvailable:") {
      avail = static_cast<size_t>(kb) * 1024;
      break;
    }
  }
  std::ifstream cg("/proc/self/cgroup");
  std::string line;
  while (std::getline(cg, line)) {
    if (line.rfind("0::", 0) != 0) continue;
    const std::string dir = "/sys/fs/cgroup" + line.substr(3);
    size_t max = 0, cur = 0;
    if (read_cgroup_bytes(dir + "/memory.max", &max) && read_cgroup_bytes(dir + "/memory.current", &cur))
      avail = std::min(avail, max > cur ? max - cur : size_t(0));
    break;
  }
  return avail;
}

}  // namespace

ebt_status_t Engine::shadow_prepare(const std::vector<Allocation*>& allocs, const std::vector<bool>& copy,
                                    CUcontext ctx, ShadowSteps* ss, std::vector<bool>* made) {
  const ebt_driver_table_t* drv;
  EBT_CHECK(driver(&drv));
  made->assign(allocs.size(), false);
  ss->first.assign(allocs.size(), ShadowSteps::kNone);
  size_t fresh = 0, count = 0;
  for (size_t i = 0; i < allocs.size(); ++i)
    if (copy[i] && allocs[i]->transient && !allocs[i]->host.ptr) {
      fresh += round_up(allocs[i]->size, k2MiB);
      ++count;
    }
  if (fresh) {
    const size_t avail = host_available();
    if (fresh > avail)
      return ebt_set_error(EBT_ERROR_HOST_OUT_OF_MEMORY,
                           "pause needs %zu bytes of fresh host memory for %zu transient CPU copies but the host has "
                           "%zu available (MemAvailable, cgroup memory.max); nothing was released", fresh, count,
                           avail);
  }
  for (size_t i = 0; i < allocs.size(); ++i) {
    Allocation* a = allocs[i];
    if (!copy[i] || !a->transient) continue;
    if (!a->host.ptr) {
      ebt_status_t st = arena_.open_private(a->size, settings().shadow_piece_bytes, &a->host);
      if (st != EBT_SUCCESS) {
        for (size_t j = 0; j < i; ++j)
          if ((*made)[j]) shadow_drop(allocs[j]);
        made->assign(allocs.size(), false);
        return st;
      }
      (*made)[i] = true;
    }
    const size_t n = arena_.pieces(a->host);  // 0: an arena block (a reclaim left one): pinned already
    if (n == 0) continue;
    ss->first[i] = ss->steps.size();
    for (size_t k = 0; k < n; ++k) ss->steps.emplace_back(i, k);  // done parts are no-ops
  }
  if (ss->steps.empty()) return EBT_SUCCESS;
  ss->work.start(ss->steps.size(), HostArena::register_threads(), runtime_worker_init(drv, ctx),
                 [this, drv, &allocs, ss](size_t j) {
                   const auto& s = ss->steps[j];
                   return arena_.prepare_piece(drv, allocs[s.first]->host, s.second);
                 });
  return EBT_SUCCESS;
}

ebt_status_t Engine::shadow_ready(ShadowSteps* ss, size_t i, const Allocation* a, size_t offset) {
  if (ss->first.empty() || ss->first[i] == ShadowSteps::kNone) return EBT_SUCCESS;
  return ss->work.wait(ss->first[i] + arena_.piece_index(a->host, offset));
}

ebt_status_t Engine::shadow_register(const std::vector<Allocation*>& allocs, CUcontext ctx, ShadowSteps* ss) {
  std::vector<bool> pageable(allocs.size(), false);
  bool any = false;
  for (size_t i = 0; i < allocs.size(); ++i) {
    const Allocation* a = allocs[i];
    pageable[i] = a->backup == EBT_MEM_BACKUP_CPU && a->pageable && a->host_valid && arena_.is_private(a->host);
    any = any || pageable[i];
  }
  if (!any) return EBT_SUCCESS;
  std::vector<bool> made;
  EBT_CHECK(shadow_prepare(allocs, pageable, ctx, ss, &made));  // every block exists: nothing is made here
  return EBT_SUCCESS;
}

void Engine::shadow_unregister(const std::vector<Allocation*>& allocs, CUcontext ctx) {
  const ebt_driver_table_t* drv;
  if (driver(&drv) != EBT_SUCCESS) return;
  std::vector<std::pair<const Allocation*, size_t>> pieces;
  for (const Allocation* a : allocs) {
    if (!a->pageable || !arena_.is_private(a->host)) continue;
    for (size_t k = 0, n = arena_.pieces(a->host); k < n; ++k) pieces.emplace_back(a, k);
  }
  if (pieces.empty()) return;
  OrderedWork work;
  work.start(pieces.size(), HostArena::register_threads(), runtime_worker_init(drv, ctx), [&](size_t j) {
    return arena_.unregister_piece(drv, pieces[j].first->host, pieces[j].second);
  });
  if (work.join() != EBT_SUCCESS)  // the copy stays resident and pinned; freeing it gives it back
    EBT_WARN(EBT_SUBSYS_MEM, "unregistering a pageable host copy failed: %s", ebt_last_error());
}

void Engine::shadow_release(std::vector<PieceRelease>& list, CUcontext ctx, OrderedWork* work) {
  const ebt_driver_table_t* drv;
  if (list.empty() || driver(&drv) != EBT_SUCCESS) return;
  work->start(list.size(), HostArena::register_threads(), runtime_worker_init(drv, ctx), [this, drv, &list](size_t j) {
    const PieceRelease& p = list[j];
    CtxGuard guard(drv, p.d->ctx);
    CUresult res = drv->cuEventSynchronize(p.done);
    if (res != CUDA_SUCCESS) return ebt_cu_error(res, "cuEventSynchronize (resume copy)", __FILE__, __LINE__);
    arena_.release_piece(drv, p.a->host, p.piece);
    return EBT_SUCCESS;
  });
}

void Engine::shadow_drop(Allocation* a) {
  arena_.free(a->host);
  a->host = HostArena::Block{};
  a->host_valid = a->host_clean = false;
}

}  // namespace ebbtide::memory
