/*
 * host_arena.h — the persistent pinned host arena that holds CPU backups.
 *
 * Policies:
 *  - Pinned once, reused every cycle: segments are anonymous mmap()s, pre-touched and registered with
 *    cuMemHostRegister(PORTABLE) by several threads at once (one registration per kPieceBytes piece), because
 *    pinning fresh memory (cuMemHostAlloc) runs several times slower than registering touched memory
 *    per thread.
 *  - Exact sizes: backups are sub-allocated first-fit at 256-byte granularity from the segments' free lists;
 *    no power-of-two rounding. When the free lists cannot hold a batch, ONE new segment sized to the batch's
 *    shortfall (rounded up to 2 MiB) is added.
 *  - A block never straddles two segments; it may straddle registration pieces, so copy planners cut copies
 *    at piece boundaries (piece_remaining) and each copy lies inside one registration.
 *  - Memory goes back to the OS only through release_unused() (explicit) or release_all() (reset).
 *  - Private segments (transient host copies, memory/NOTES.md "Transient host copies") are the exception: one
 *    per allocation, never sub-allocated, populated and registered piece by piece while the copies run
 *    (prepare_piece) and unregistered and unmapped piece by piece as the copies back land (release_piece); free()
 *    of their block gives back whatever is left. A piece is touched by one thread at a time (the op that owns the
 *    allocation hands each piece to one worker), so its state needs no lock.
 * Thread-safety: mu_ guards segments_ and the counters; registration runs outside the lock on a private pool.
 */
#ifndef EBBTIDE_MEMORY_HOST_ARENA_H_
#define EBBTIDE_MEMORY_HOST_ARENA_H_

#include <atomic>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "csrc/driver.h"

namespace ebbtide::memory {

// The setup of a runtime worker thread that makes driver calls for the caller: `ctx` current (PORTABLE
// registrations serve every context) and the caller's stream-capture mode (read now, on the caller's thread).
std::function<void()> runtime_worker_init(const ebt_driver_table_t* drv, CUcontext ctx);

class HostArena {
 public:
  static constexpr size_t kPieceBytes = size_t(256) << 20;  // one cuMemHostRegister per piece
  static constexpr size_t kAlign = 256;                     // sub-allocation alignment (copy engines like it)

  struct Block {
    char* ptr = nullptr;  // null: no block
    size_t size = 0;      // bytes (exact request rounded to kAlign)
    int segment = -1;     // index into segments_
  };

  // All blocks of `sizes` or none (HOST_OUT_OF_MEMORY / SYSTEM / DRIVER with nothing allocated). `ctx` is made
  // current on the registering threads (PORTABLE registrations serve every context).
  // `min_growth`: grow by at least this many bytes (background pinning passes kMinBackgroundGrowth so allocations
  // trickling in one at a time do not each add a tiny segment; the rest stays free for the next ones).
  ebt_status_t allocate(const ebt_driver_table_t* drv, CUcontext ctx, const std::vector<size_t>& sizes,
                        std::vector<Block>* out, size_t min_growth = 0);
  static constexpr size_t kMinBackgroundGrowth = size_t(64) << 20;
  // Threads that populate and register host memory: EBBTIDE_MEM_REGISTER_THREADS, else min(8, CPUs).
  static int register_threads();
  void free(const Block& b);  // a private segment's block: unregister what is registered, unmap it all

  // ---- private segments (transient host copies) ----
  // A fresh mapping for `bytes` (2 MiB-aligned, advised for huge pages, nothing populated or registered yet) cut
  // into pieces of `piece` bytes (a multiple of 2 MiB). SYSTEM when the address space cannot be had.
  ebt_status_t open_private(size_t bytes, size_t piece, Block* out);
  bool is_private(const Block& b) const;
  size_t pieces(const Block& b) const;                  // private: how many pieces; arena block: 0
  size_t piece_index(const Block& b, size_t offset) const;  // private: the piece holding b.ptr + offset
  bool piece_registered(const Block& b, size_t k) const;
  bool registered(const Block& b) const;  // copies may use it as pinned memory (an arena block; a private one whole)
  // Populate piece k (how: Settings::shadow_populate) and register it; no-op for what is done already.
  // HOST_OUT_OF_MEMORY when the host has no memory for it. The caller's thread has a context current.
  ebt_status_t prepare_piece(const ebt_driver_table_t* drv, const Block& b, size_t k);
  ebt_status_t unregister_piece(const ebt_driver_table_t* drv, const Block& b, size_t k);  // stays resident
  void release_piece(const ebt_driver_table_t* drv, const Block& b, size_t k);  // unregister, then unmap
  // Bytes of private segments resident (populated, not released) and registered now; private segments held.
  size_t private_mapped() const { return priv_mapped_.load(); }
  size_t private_pinned() const { return priv_pinned_.load(); }
  size_t private_segments() const;
  // Bytes from `b.ptr + offset` to the end of its registration piece (copies must not cross it).
  size_t piece_remaining(const Block& b, size_t offset) const;
  // Grow by one segment of `bytes` (rounded up to 2 MiB), pinned now.
  ebt_status_t reserve(const ebt_driver_table_t* drv, CUcontext ctx, size_t bytes);
  // Unregister and unmap every segment with no live block; returns the bytes given back.
  size_t release_unused(const ebt_driver_table_t* drv);
  void release_all(const ebt_driver_table_t* drv);

  size_t reserved() const;
  size_t used() const;
  size_t segments() const;
  double register_seconds() const;

 private:
  struct Segment {
    char* base = nullptr;
    size_t size = 0;                       // bytes mapped and registered (multiple of 2 MiB)
    size_t used = 0;                       // bytes in live blocks
    std::map<size_t, size_t> free_ranges;  // offset -> length, coalesced
    size_t piece = kPieceBytes;            // registration piece (a chunk never crosses one)
    bool priv = false;                     // a private segment (one block, pieces prepared one by one)
    std::vector<unsigned char> state;      // private: per piece, kPopulated | kRegistered | kReleased
  };
  static constexpr unsigned char kPopulated = 1, kRegistered = 2, kReleased = 4;
  Segment* segment_of(const Block& b) const;  // takes mu_ briefly; the segment outlives its block's owner's use
  std::pair<char*, size_t> piece_range(const Segment& s, size_t k) const;
  ebt_status_t add_segment(const ebt_driver_table_t* drv, CUcontext ctx, size_t bytes);  // mu_ NOT held
  void unmap_segment(const ebt_driver_table_t* drv, Segment& s);

  mutable std::mutex mu_;                       // guards segments_, register_s_ (lock order: engine.cc, 7)
  std::vector<std::unique_ptr<Segment>> segments_;  // index = Block::segment; null once released
  double register_s_ = 0;                       // cumulative seconds spent touching + registering
  std::mutex grow_mu_;  // serializes segment creation, one pinning job at a time (lock order: engine.cc, 6)
  std::atomic<size_t> priv_mapped_{0}, priv_pinned_{0};  // private segments: resident / registered bytes
};

}  // namespace ebbtide::memory

#endif  // EBBTIDE_MEMORY_HOST_ARENA_H_
