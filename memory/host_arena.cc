// host_arena.cc — persistent pinned host arena (policies in host_arena.h).
#include "memory/host_arena.h"

#include <errno.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>

#include "csrc/status.h"
#include "memory/free_ranges.h"
#include "csrc/thread_pool.h"
#include "memory/settings.h"

namespace ebbtide::memory {

namespace {

constexpr size_t k2MiB = size_t(2) << 20;


}  // namespace

std::function<void()> runtime_worker_init(const ebt_driver_table_t* drv, CUcontext ctx) {
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
  return [drv, ctx, capture_mode] {
    if (ctx) EBT_CU_IGNORE(drv->cuCtxSetCurrent(ctx), "the worker's driver calls fail then, and are reported");
    if (capture_mode >= 0) {
      int m = capture_mode;
      EBT_CU_IGNORE(drv->cuThreadExchangeStreamCaptureMode(&m), "then a registration may fail (reported)");
    }
  };
}

int HostArena::register_threads() {
  if (settings().register_threads > 0) return settings().register_threads;
  int n = 1;
  ebt_cpu_affinity_count(&n);
  return std::max(1, std::min(8, n));
}

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
  const std::function<void()> init = runtime_worker_init(drv, ctx);
  {
    ThreadPool pool(static_cast<int>(std::min<size_t>(pieces, register_threads())));
    std::vector<char> ready(pool.threads(), 0);  // per worker: init ran (worker 0 is the caller: nothing to do)
    pool.run(pieces, [&](size_t i, int worker) {
      char* b = seg->base + i * kPieceBytes;
      size_t n = std::min(kPieceBytes, seg->size - i * kPieceBytes);
      for (size_t off = 0; off < n; off += static_cast<size_t>(page)) b[off] = 0;
      if (worker != 0 && !ready[worker]) {
        init();
        ready[worker] = 1;
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
          if (!seg || seg->priv || !take_first_fit(seg->free_ranges, need, &off)) continue;
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
  std::unique_ptr<Segment> dead;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Segment* seg = b.segment >= 0 && size_t(b.segment) < segments_.size() ? segments_[b.segment].get() : nullptr;
    if (!seg) {
      EBT_WARN(EBT_SUBSYS_MEM, "host arena: free of a block of a released segment (ignored)");
      return;
    }
    if (!seg->priv) {
      give_back(seg->free_ranges, static_cast<size_t>(b.ptr - seg->base), b.size);
      seg->used -= b.size;
      return;
    }
    dead = std::move(segments_[b.segment]);  // a private segment goes with its one block
  }
  const ebt_driver_table_t* drv = nullptr;
  if (ebt_driver_get(&drv) != EBT_SUCCESS) {
    ebt_clear_error();
    drv = nullptr;
  }
  unmap_segment(drv, *dead);
}

size_t HostArena::piece_remaining(const Block& b, size_t offset) const {
  // Segments start piece-aligned (piece k covers [k*piece, (k+1)*piece) of the segment).
  std::lock_guard<std::mutex> lock(mu_);
  const Segment* seg = segments_[b.segment].get();
  size_t seg_off = static_cast<size_t>(b.ptr - seg->base) + offset;
  return seg->piece - seg_off % seg->piece;
}

// ---- private segments ---------------------------------------------------------------------------------------

HostArena::Segment* HostArena::segment_of(const Block& b) const {
  std::lock_guard<std::mutex> lock(mu_);
  return b.ptr && b.segment >= 0 && size_t(b.segment) < segments_.size() ? segments_[b.segment].get() : nullptr;
}

std::pair<char*, size_t> HostArena::piece_range(const Segment& s, size_t k) const {
  const size_t off = k * s.piece;
  return {s.base + off, std::min(s.piece, s.size - off)};
}

ebt_status_t HostArena::open_private(size_t bytes, size_t piece, Block* out) {
  *out = Block{};
  auto seg = std::make_unique<Segment>();
  seg->priv = true;
  seg->piece = round_up(std::max<size_t>(piece, k2MiB), k2MiB);
  seg->size = round_up(std::max<size_t>(bytes, 1), k2MiB);
  // 2 MiB-aligned, so every piece can be backed by huge pages (faster to fault in and to pin).
  const size_t span = seg->size + k2MiB;
  void* p = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED)
    return ebt_set_error(EBT_ERROR_HOST_OUT_OF_MEMORY, "transient host copy: mmap of %zu bytes failed: %s", span,
                         std::strerror(errno));
  char* raw = static_cast<char*>(p);
  char* base = reinterpret_cast<char*>(round_up(reinterpret_cast<uintptr_t>(raw), k2MiB));
  if (base > raw) munmap(raw, static_cast<size_t>(base - raw));
  if (base + seg->size < raw + span) munmap(base + seg->size, static_cast<size_t>(raw + span - (base + seg->size)));
  madvise(base, seg->size, MADV_HUGEPAGE);  // best effort
  seg->base = base;
  seg->used = seg->size;
  seg->state.assign((seg->size + seg->piece - 1) / seg->piece, 0);
  std::lock_guard<std::mutex> lock(mu_);
  *out = Block{base, round_up(std::max<size_t>(bytes, 1), kAlign), static_cast<int>(segments_.size())};
  segments_.push_back(std::move(seg));
  return EBT_SUCCESS;
}

bool HostArena::is_private(const Block& b) const {
  const Segment* s = segment_of(b);
  return s && s->priv;
}

size_t HostArena::pieces(const Block& b) const {
  const Segment* s = segment_of(b);
  return s && s->priv ? s->state.size() : 0;
}

size_t HostArena::piece_index(const Block& b, size_t offset) const {
  const Segment* s = segment_of(b);
  return static_cast<size_t>(b.ptr - s->base + offset) / s->piece;
}

bool HostArena::piece_registered(const Block& b, size_t k) const {
  const Segment* s = segment_of(b);
  return s && s->priv && k < s->state.size() && (s->state[k] & kRegistered);
}

namespace {
// Fault a fresh range in before registering it (Settings::shadow_populate; memory/NOTES.md "Transient host copies"
// says which way measured fastest). ENOMEM means the host has no memory left for it.
ebt_status_t populate(char* p, size_t n) {
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
  const ShadowPopulate how = settings().shadow_populate;
  if (how == ShadowPopulate::kNone) return EBT_SUCCESS;  // cuMemHostRegister faults the pages in itself
  if (how == ShadowPopulate::kMadvise) {
    if (madvise(p, n, MADV_POPULATE_WRITE) == 0) return EBT_SUCCESS;
    if (errno == ENOMEM || errno == EFAULT)
      return ebt_set_error(EBT_ERROR_HOST_OUT_OF_MEMORY, "transient host copy: no host memory for %zu bytes (%s)", n,
                           std::strerror(errno));
    if (errno != EINVAL)
      return ebt_set_error(EBT_ERROR_SYSTEM, "transient host copy: madvise(MADV_POPULATE_WRITE): %s",
                           std::strerror(errno));
    // EINVAL: a kernel older than 5.14 has no MADV_POPULATE_WRITE: touch the pages instead.
  }
  const long page = sysconf(_SC_PAGESIZE);
  for (size_t off = 0; off < n; off += static_cast<size_t>(page)) p[off] = 0;
  return EBT_SUCCESS;
}
}  // namespace

ebt_status_t HostArena::prepare_piece(const ebt_driver_table_t* drv, const Block& b, size_t k) {
  Segment* s = segment_of(b);
  if (!s || !s->priv || k >= s->state.size())
    return ebt_set_error(EBT_ERROR_INTERNAL, "prepare_piece: piece %zu of a block that has none", k);
  auto r = piece_range(*s, k);
  if (!(s->state[k] & kPopulated)) {
    EBT_CHECK(populate(r.first, r.second));
    s->state[k] |= kPopulated;
    priv_mapped_ += r.second;
  }
  if (!(s->state[k] & kRegistered)) {
    CUresult res = drv->cuMemHostRegister(r.first, r.second, CU_MEMHOSTREGISTER_PORTABLE);
    if (res != CUDA_SUCCESS) {
      ebt_status_t st = ebt_cu_error(res, "cuMemHostRegister (transient host copy)", __FILE__, __LINE__);
      if (st == EBT_ERROR_OUT_OF_MEMORY) st = ebt_set_error(EBT_ERROR_HOST_OUT_OF_MEMORY, "%s", ebt_last_error());
      return st;
    }
    s->state[k] |= kRegistered;
    priv_pinned_ += r.second;
  }
  return EBT_SUCCESS;
}

ebt_status_t HostArena::unregister_piece(const ebt_driver_table_t* drv, const Block& b, size_t k) {
  Segment* s = segment_of(b);
  if (!s || !s->priv || k >= s->state.size() || !(s->state[k] & kRegistered)) return EBT_SUCCESS;
  auto r = piece_range(*s, k);
  EBT_CU_CHECK(drv->cuMemHostUnregister(r.first));
  s->state[k] &= static_cast<unsigned char>(~kRegistered);
  priv_pinned_ -= r.second;
  return EBT_SUCCESS;
}

void HostArena::release_piece(const ebt_driver_table_t* drv, const Block& b, size_t k) {
  Segment* s = segment_of(b);
  if (!s || !s->priv || k >= s->state.size() || (s->state[k] & kReleased)) return;
  auto r = piece_range(*s, k);
  if ((s->state[k] & kRegistered) && drv) {
    CUresult res = drv->cuMemHostUnregister(r.first);
    if (res != CUDA_SUCCESS)  // the pages stay pinned by the driver; unmapping them still ends our use
      EBT_WARN(EBT_SUBSYS_MEM, "cuMemHostUnregister of a transient host copy failed (%d)", static_cast<int>(res));
    priv_pinned_ -= r.second;
  }
  if (s->state[k] & kPopulated) priv_mapped_ -= r.second;
  munmap(r.first, r.second);
  s->state[k] = kReleased;
}

bool HostArena::registered(const Block& b) const {
  const Segment* s = segment_of(b);
  if (!s) return false;
  if (!s->priv) return true;
  for (unsigned char st : s->state)
    if (!(st & kRegistered)) return false;
  return true;
}

size_t HostArena::private_segments() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& s : segments_) n += s && s->priv ? 1 : 0;
  return n;
}

ebt_status_t HostArena::reserve(const ebt_driver_table_t* drv, CUcontext ctx, size_t bytes) {
  std::lock_guard<std::mutex> grow(grow_mu_);
  return add_segment(drv, ctx, bytes);
}

void HostArena::unmap_segment(const ebt_driver_table_t* drv, Segment& s) {
  if (s.priv) {
    for (size_t k = 0; k < s.state.size(); ++k) {
      if (s.state[k] & kReleased) continue;
      const size_t n = std::min(s.piece, s.size - k * s.piece);
      if ((s.state[k] & kRegistered)) {
        if (drv)
          EBT_CU_IGNORE(drv->cuMemHostUnregister(s.base + k * s.piece), "giving memory back: munmap below frees it");
        priv_pinned_ -= n;
      }
      if (s.state[k] & kPopulated) priv_mapped_ -= n;
    }
    munmap(s.base, s.size);  // released pieces are holes already: munmap skips them
    return;
  }
  for (size_t off = 0; off < s.size; off += kPieceBytes)
    EBT_CU_IGNORE(drv->cuMemHostUnregister(s.base + off), "giving memory back: munmap below frees it regardless");
  munmap(s.base, s.size);
}

size_t HostArena::release_unused(const ebt_driver_table_t* drv) {
  std::vector<std::unique_ptr<Segment>> dead;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& s : segments_)
      if (s && !s->priv && s->used == 0) dead.push_back(std::move(s));  // index stays, slot becomes null
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
  for (const auto& s : segments_) n += s && !s->priv ? s->size : 0;
  return n;
}

size_t HostArena::used() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& s : segments_) n += s && !s->priv ? s->used : 0;
  return n;
}

size_t HostArena::segments() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& s : segments_) n += s && !s->priv ? 1 : 0;
  return n;
}

double HostArena::register_seconds() const {
  std::lock_guard<std::mutex> lock(mu_);
  return register_s_;
}

}  // namespace ebbtide::memory
