// host_arena.cc — persistent pinned host arena (policies in host_arena.h).
#include "memory/host_arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>

#include "csrc/status.h"
#include "memory/free_ranges.h"
#include "csrc/thread_pool.h"
#include "memory/settings.h"

namespace ebbtide::memory {

namespace {

constexpr size_t k2MiB = size_t(2) << 20;


// Threads that touch and register a new segment: EBBTIDE_MEM_REGISTER_THREADS, else min(8, CPUs).
int register_threads() {
  if (settings().register_threads > 0) return settings().register_threads;
  int n = 1;
  ebt_cpu_affinity_count(&n);
  return std::max(1, std::min(8, n));
}

}  // namespace

ebt_status_t HostArena::add_segment(const ebt_driver_table_t* drv, CUcontext ctx, size_t bytes) {
  auto t0 = std::chrono::steady_clock::now();
  auto seg = std::make_unique<Segment>();
  seg->size = round_up(bytes, k2MiB);
  void* p = mmap(nullptr, seg->size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED)
    return ebt_set_error(EBT_ERROR_HOST_OUT_OF_MEMORY, "host arena: mmap of %zu bytes failed: %s", seg->size,
                         std::strerror(errno));
  madvise(p, seg->size, MADV_HUGEPAGE);  // best effort: fewer pages to pin
  seg->base = static_cast<char*>(p);

  // Touch then register each piece, pieces spread over a private pool (first-cycle speed).
  const size_t pieces = (seg->size + kPieceBytes - 1) / kPieceBytes;
  std::vector<CUresult> results(pieces, CUDA_SUCCESS);
  const long page = sysconf(_SC_PAGESIZE);
  // Workers register in the caller's stream-capture mode. Fresh threads start in global mode, so while another
  // thread captures a CUDA graph in global mode their cuMemHostRegister would fail and break that capture, though
  // the caller (the background pinning thread) runs relaxed precisely to avoid it.
  int capture_mode = -1;
  if (drv->cuThreadExchangeStreamCaptureMode) {
    int m = 0;  // CU_STREAM_CAPTURE_MODE_GLOBAL, swapped straight back: this reads the caller's mode
    if (drv->cuThreadExchangeStreamCaptureMode(&m) == CUDA_SUCCESS) {
      capture_mode = m;
      EBT_CU_IGNORE(drv->cuThreadExchangeStreamCaptureMode(&m), "restoring a mode the call just read: cannot fail");
    }
  }
  {
    ThreadPool pool(static_cast<int>(std::min<size_t>(pieces, register_threads())));
    pool.run(pieces, [&](size_t i, int worker) {
      char* b = seg->base + i * kPieceBytes;
      size_t n = std::min(kPieceBytes, seg->size - i * kPieceBytes);
      for (size_t off = 0; off < n; off += static_cast<size_t>(page)) b[off] = 0;
      if (ctx && worker != 0)  // worker 0 is the caller: its context is current
        EBT_CU_IGNORE(drv->cuCtxSetCurrent(ctx), "the registration below fails then, and is reported");
      if (capture_mode >= 0 && worker != 0) {
        int m = capture_mode;
        EBT_CU_IGNORE(drv->cuThreadExchangeStreamCaptureMode(&m), "then the registration below may fail (reported)");
      }
      results[i] = drv->cuMemHostRegister(b, n, CU_MEMHOSTREGISTER_PORTABLE);
    });
  }
  ebt_status_t st = EBT_SUCCESS;
  for (size_t i = 0; i < pieces; ++i) {
    if (results[i] == CUDA_SUCCESS) continue;
    if (st == EBT_SUCCESS) {
      st = ebt_cu_error(results[i], "cuMemHostRegister (host arena)", __FILE__, __LINE__);
      if (st == EBT_ERROR_OUT_OF_MEMORY) st = ebt_set_error(EBT_ERROR_HOST_OUT_OF_MEMORY, "%s", ebt_last_error());
    }
  }
  if (st != EBT_SUCCESS) {
    for (size_t i = 0; i < pieces; ++i)
      if (results[i] == CUDA_SUCCESS) drv->cuMemHostUnregister(seg->base + i * kPieceBytes);
    munmap(seg->base, seg->size);
    return st;
  }
  seg->free_ranges.emplace(0, seg->size);
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EBT_INFO(EBT_SUBSYS_MEM, "host arena: pinned %zu bytes in %.3f s (%.1f GB/s)", seg->size, secs,
           seg->size / secs / 1e9);
  std::lock_guard<std::mutex> lock(mu_);
  register_s_ += secs;
  segments_.push_back(std::move(seg));
  return EBT_SUCCESS;
}

ebt_status_t HostArena::allocate(const ebt_driver_table_t* drv, CUcontext ctx, const std::vector<size_t>& sizes,
                                 std::vector<Block>* out, size_t min_growth) {
  out->assign(sizes.size(), Block{});
  auto undo = [&] {
    for (const Block& b : *out)
      if (b.ptr) free(b);
    out->assign(sizes.size(), Block{});
  };
  // Pass 1: existing free ranges. Pass 2 (after one growth by the shortfall): the rest.
  for (int pass = 0; pass < 2; ++pass) {
    size_t shortfall = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = 0; i < sizes.size(); ++i) {
        if ((*out)[i].ptr) continue;
        size_t need = round_up(std::max<size_t>(sizes[i], 1), kAlign);
        bool placed = false;
        for (size_t s = 0; s < segments_.size() && !placed; ++s) {
          Segment* seg = segments_[s].get();
          size_t off;
          if (!seg || !take_first_fit(seg->free_ranges, need, &off)) continue;
          seg->used += need;
          (*out)[i] = Block{seg->base + off, need, static_cast<int>(s)};
          placed = true;
        }
        if (!placed) shortfall += need;
      }
    }
    if (shortfall == 0) return EBT_SUCCESS;
    if (pass == 1) break;
    std::lock_guard<std::mutex> grow(grow_mu_);
    ebt_status_t st = add_segment(drv, ctx, std::max(shortfall, min_growth));
    if (st != EBT_SUCCESS) {
      undo();
      return st;
    }
  }
  undo();  // another thread took the new segment's space: report, the caller may retry
  return ebt_set_error(EBT_ERROR_HOST_OUT_OF_MEMORY, "host arena: concurrent growth consumed the new segment");
}

void HostArena::free(const Block& b) {
  if (!b.ptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  Segment* seg = b.segment >= 0 && size_t(b.segment) < segments_.size() ? segments_[b.segment].get() : nullptr;
  if (!seg) {
    EBT_WARN(EBT_SUBSYS_MEM, "host arena: free of a block of a released segment (ignored)");
    return;
  }
  give_back(seg->free_ranges, static_cast<size_t>(b.ptr - seg->base), b.size);
  seg->used -= b.size;
}

size_t HostArena::piece_remaining(const Block& b, size_t offset) const {
  // Segments start piece-aligned (piece k covers [k*kPieceBytes, (k+1)*kPieceBytes) of the segment).
  std::lock_guard<std::mutex> lock(mu_);
  const Segment* seg = segments_[b.segment].get();
  size_t seg_off = static_cast<size_t>(b.ptr - seg->base) + offset;
  return kPieceBytes - seg_off % kPieceBytes;
}

ebt_status_t HostArena::reserve(const ebt_driver_table_t* drv, CUcontext ctx, size_t bytes) {
  std::lock_guard<std::mutex> grow(grow_mu_);
  return add_segment(drv, ctx, bytes);
}

void HostArena::unmap_segment(const ebt_driver_table_t* drv, Segment& s) {
  for (size_t off = 0; off < s.size; off += kPieceBytes)
    EBT_CU_IGNORE(drv->cuMemHostUnregister(s.base + off), "giving memory back: munmap below frees it regardless");
  munmap(s.base, s.size);
}

size_t HostArena::release_unused(const ebt_driver_table_t* drv) {
  std::vector<std::unique_ptr<Segment>> dead;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& s : segments_)
      if (s && s->used == 0) dead.push_back(std::move(s));  // index stays, slot becomes null
  }
  size_t n = 0;
  for (auto& s : dead) {
    n += s->size;
    unmap_segment(drv, *s);
  }
  return n;
}

void HostArena::release_all(const ebt_driver_table_t* drv) {
  std::vector<std::unique_ptr<Segment>> dead;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& s : segments_)
      if (s) dead.push_back(std::move(s));
    segments_.clear();
    register_s_ = 0;
  }
  for (auto& s : dead) unmap_segment(drv, *s);
}

size_t HostArena::reserved() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& s : segments_) n += s ? s->size : 0;
  return n;
}

size_t HostArena::used() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& s : segments_) n += s ? s->used : 0;
  return n;
}

size_t HostArena::segments() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& s : segments_) n += s ? 1 : 0;
  return n;
}

double HostArena::register_seconds() const {
  std::lock_guard<std::mutex> lock(mu_);
  return register_s_;
}

}  // namespace ebbtide::memory
