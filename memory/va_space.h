/*
 * va_space.h — virtual address space for engine allocations on one device.
 *
 * Policy: VA is reserved from the driver in large reservations (kReservationBytes, or exactly the request when
 * larger) and sub-allocated first-fit at granularity-aligned offsets, so allocations made one after another are
 * VA-contiguous: resume can then grant access to a whole contiguous run with one cuMemSetAccess.
 * Reservations are kept until release_all() (VA is cheap; keeping it keeps addresses stable and avoids
 * driver calls). Thread-safe: mu_ guards reservations_.
 */
#ifndef EBBTIDE_MEMORY_VA_SPACE_H_
#define EBBTIDE_MEMORY_VA_SPACE_H_

#include <cstddef>
#include <map>
#include <mutex>
#include <vector>

#include "csrc/driver.h"

namespace ebbtide::memory {

class VaSpace {
 public:
  static constexpr size_t kReservationBytes = size_t(64) << 30;  // 64 GiB per reservation

  // `granularity` (bytes, power of two) is the device's allocation granularity; every size is a multiple of it.
  explicit VaSpace(size_t granularity) : granularity_(granularity) {}

  // A range of `bytes` (multiple of granularity) at a granularity-aligned address. Reserves more VA from the
  // driver when no reservation has room. The caller's device context must be current.
  ebt_status_t allocate(const ebt_driver_table_t* drv, size_t bytes, CUdeviceptr* va);
  // Return a range from allocate(). Never calls the driver.
  void free(CUdeviceptr va, size_t bytes);
  // End address of the reservation holding va (0 if none): one driver mapping never crosses it.
  CUdeviceptr reservation_end(CUdeviceptr va) const;
  // Give every reservation back to the driver (all ranges must have been freed, or are abandoned).
  void release_all(const ebt_driver_table_t* drv);
  size_t reserved_bytes() const;

 private:
  struct Reservation {
    CUdeviceptr base = 0;
    size_t size = 0;                      // bytes reserved from the driver
    std::map<size_t, size_t> free_ranges;  // offset -> length, disjoint, coalesced, sorted by offset
  };
  const size_t granularity_;
  mutable std::mutex mu_;                 // guards reservations_ (lock order: memory/engine.cc, 8)
  std::vector<Reservation> reservations_;  // in creation order; never shrinks until release_all
};

}  // namespace ebbtide::memory

#endif  // EBBTIDE_MEMORY_VA_SPACE_H_
