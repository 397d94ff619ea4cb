/*
 * engine_pinning.cc — background pinning of host backup blocks.
 *
 * Why: pinning is the one slow part of a first CPU-backed pause (fresh cuMemHostAlloc, and cuMemHostRegister of touched
 * memory on one thread, both run well below PCIe speed), while the copies run at PCIe speed. A colocated RL job makes
 * its weights long before the first switch, so the engine pins their blocks then, on one runtime thread, and the first
 * pause only copies.
 *
 * Policy: Engine::malloc queues (va, id) of every CPU-backed allocation (EBBTIDE_MEM_PREPIN=0 or
 * set_background_pinning(false) turns this off). The worker takes the whole queue as one batch (one arena growth),
 * pins outside every engine lock, then assigns each block under mu_ only if its allocation still exists (same id),
 * has no block and is not owned by an op; otherwise the block goes back to the arena's free list, where the next
 * pause finds it. A failed batch is logged and dropped: the pause pins for itself. The worker thread lives for the
 * process (never joined: no destructor ordering at exit); a forked child never starts it.
 */
#include <cstdlib>
#include <thread>

#include "csrc/status.h"
#include "memory/engine.h"
#include "memory/settings.h"

namespace ebbtide::memory {

void Engine::set_background_pinning(bool enabled) {
  std::lock_guard<std::mutex> lock(pin_mu_);
  pin_enabled_ = enabled ? 1 : 0;
  if (!enabled) pin_queue_.clear();
}

void Engine::wait_background_pinning() {
  std::unique_lock<std::mutex> lock(pin_mu_);
  pin_cv_.wait(lock, [this] { return !pin_busy_ && pin_queue_.empty(); });
}

void Engine::enqueue_pinning(const Allocation* a) {
  std::lock_guard<std::mutex> lock(pin_mu_);
  if (pin_enabled_ < 0) pin_enabled_ = settings().prepin ? 1 : 0;
  if (!pin_enabled_) return;
  pin_queue_.emplace_back(a->va, a->id);
  if (!pin_thread_started_) {
    pin_thread_started_ = true;
    std::thread([this] { pinning_loop(); }).detach();
  }
  pin_cv_.notify_all();
}

void Engine::pinning_loop() {
  // This thread's host registrations must not invalidate a CUDA graph another thread captures meanwhile in global
  // mode (weights are pinned here while an engine captures its graphs): relaxed capture mode for this thread only.
  const ebt_driver_table_t* drv;
  if (ebt_driver_get(&drv) == EBT_SUCCESS && drv->cuThreadExchangeStreamCaptureMode) {
    int mode = 2;  // CU_STREAM_CAPTURE_MODE_RELAXED
    EBT_CU_IGNORE(drv->cuThreadExchangeStreamCaptureMode(&mode),
                  "then this thread pins in global mode: a concurrent global-mode capture may fail, not break");
  }
  for (;;) {
    std::vector<std::pair<CUdeviceptr, unsigned long long>> batch;
    {
      std::unique_lock<std::mutex> lock(pin_mu_);
      pin_cv_.wait(lock, [this] { return !pin_queue_.empty(); });
      batch.swap(pin_queue_);
      pin_busy_ = true;
    }
    pin_batch(batch);
    {
      std::lock_guard<std::mutex> lock(pin_mu_);
      pin_busy_ = false;
    }
    pin_cv_.notify_all();
  }
}

void Engine::pin_batch(const std::vector<std::pair<CUdeviceptr, unsigned long long>>& batch) {
  std::vector<std::pair<CUdeviceptr, unsigned long long>> keys;
  std::vector<size_t> sizes;
  int device_ordinal = -1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& k : batch) {
      auto it = by_va_.find(k.first);
      if (it == by_va_.end()) continue;
      const Allocation* a = it->second;
      if (a->id != k.second || a->host.ptr || a->busy || a->backup != EBT_MEM_BACKUP_CPU) continue;
      keys.push_back(k);
      sizes.push_back(a->size);
      if (device_ordinal < 0) device_ordinal = a->device;
    }
  }
  if (keys.empty()) return;
  const ebt_driver_table_t* drv;
  Device* d;
  if (driver(&drv) != EBT_SUCCESS || device(device_ordinal, &d) != EBT_SUCCESS) return;
  std::vector<HostArena::Block> blocks;
  {
    CtxGuard ctx(drv, d->ctx);  // registrations are PORTABLE: any device's context will do
    if (arena_.allocate(drv, d->ctx, sizes, &blocks, HostArena::kMinBackgroundGrowth) != EBT_SUCCESS) {
      EBT_INFO(EBT_SUBSYS_MEM, "background pinning of %zu blocks failed (the first pause pins instead): %s",
               sizes.size(), ebt_last_error());
      return;
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < keys.size(); ++i) {
    auto it = by_va_.find(keys[i].first);
    Allocation* a = it == by_va_.end() ? nullptr : it->second;
    if (a && a->id == keys[i].second && !a->host.ptr && !a->busy) {
      a->host = blocks[i];
    } else {
      arena_.free(blocks[i]);  // freed, re-made or owned by an op meanwhile: the pause will find this space
    }
  }
}

}  // namespace ebbtide::memory
