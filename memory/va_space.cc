// va_space.cc — first-fit sub-allocation of reserved device VA (see va_space.h).
#include "memory/va_space.h"

#include <algorithm>

#include "csrc/status.h"
#include "memory/free_ranges.h"

namespace ebbtide::memory {

ebt_status_t VaSpace::allocate(const ebt_driver_table_t* drv, size_t bytes, CUdeviceptr* va) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& r : reservations_) {
    size_t off = 0;
    if (take_first_fit(r.free_ranges, bytes, &off)) {
      *va = r.base + off;
      return EBT_SUCCESS;
    }
  }
  Reservation r;
  r.size = std::max(bytes, kReservationBytes);
  EBT_CU_CHECK(drv->cuMemAddressReserve(&r.base, r.size, granularity_, 0, 0));
  if (bytes < r.size) r.free_ranges.emplace(bytes, r.size - bytes);
  *va = r.base;
  reservations_.push_back(std::move(r));
  return EBT_SUCCESS;
}

void VaSpace::free(CUdeviceptr va, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& r : reservations_) {
    if (va >= r.base && va + bytes <= r.base + r.size) {
      give_back(r.free_ranges, va - r.base, bytes);
      return;
    }
  }
  EBT_WARN(EBT_SUBSYS_MEM, "VaSpace::free: 0x%llx (+%zu) is in no reservation (ignored)", va, bytes);
}

CUdeviceptr VaSpace::reservation_end(CUdeviceptr va) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& r : reservations_)
    if (va >= r.base && va < r.base + r.size) return r.base + r.size;
  return 0;
}

void VaSpace::release_all(const ebt_driver_table_t* drv) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& r : reservations_) {
    CUresult res = drv->cuMemAddressFree(r.base, r.size);
    if (res != CUDA_SUCCESS) EBT_WARN(EBT_SUBSYS_MEM, "cuMemAddressFree(0x%llx) failed: %d", r.base, res);
  }
  reservations_.clear();
}

size_t VaSpace::reserved_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& r : reservations_) n += r.size;
  return n;
}

}  // namespace ebbtide::memory
