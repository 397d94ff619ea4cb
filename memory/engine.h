/*
 * engine.h — the memory engine's internal interface (one Engine per process; C API in api.cc).
 * Invariants and the state machine: engine.cc's header comment and memory/NOTES.md.
 */
#ifndef EBBTIDE_MEMORY_ENGINE_H_
#define EBBTIDE_MEMORY_ENGINE_H_

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

#include "csrc/driver.h"
#include "memory/ebbtide_memory.h"
#include "memory/host_arena.h"
#include "memory/va_space.h"

namespace ebbtide::memory {

struct Tag;

enum class AllocState : unsigned char { kActive, kPaused };

struct Allocation {
  unsigned long long id = 0; // unique per engine lifetime (background pinning matches queued work by (va, id))
  CUdeviceptr va = 0;        // base address, granularity-aligned; fixed for the allocation's whole life
  size_t size = 0;           // bytes the caller asked for (what a backup copies)
  size_t aligned = 0;        // bytes mapped: size rounded up to the device granularity
  int device = -1;           // CUDA ordinal; every driver call for this allocation runs in its primary context
  Tag* tag = nullptr;        // owning tag (never null; tags outlive allocations)
  int backup = EBT_MEM_BACKUP_NONE;
  bool shareable = false;    // physical memory created exportable as a POSIX fd (every create, resume included)
  AllocState state = AllocState::kActive;
  bool busy = false;         // owned by an op in flight: only that op changes state/mapping/host (engine mu_)
  // No handle is kept: the handle is released right after cuMemMap, so the mapping alone holds the physical
  // memory (ACTIVE <=> mapped) and one cuMemUnmap frees it. Export retains a handle on demand.
  HostArena::Block host;     // backup block; kept across cycles once allocated (persistent arena)
  bool host_valid = false;   // host holds the device content as of the last pause (or the restore since)
  bool host_clean = false;   // caller promised the device content equals host: next pause skips the copy
};

struct Tag {
  std::string name;
  int state = EBT_MEM_TAG_ACTIVE;  // EBT_MEM_TAG_ACTIVE or EBT_MEM_TAG_PAUSED (busy is separate)
  bool busy = false;               // an op in flight owns this tag
  unsigned long long pauses = 0;   // pauses begun (failed ones too); an epoch for pool selection
  std::unordered_set<Allocation*> allocations;  // live allocations of this tag
  ebt_mem_report_t last_pause{}, last_resume{};
};

struct Device {
  int ordinal = -1;
  CUdevice dev = 0;
  CUcontext ctx = nullptr;   // the primary context (retained once, released at reset)
  size_t granularity = 0;    // cuMemGetAllocationGranularity(MINIMUM), bytes
  bool posix_fd = false;     // the device supports POSIX-fd shareable handles
  std::unique_ptr<VaSpace> va;
  std::mutex mu;             // guards d2h, h2d, free_events
  CUstream d2h = nullptr;    // runtime-owned non-blocking copy streams, created on first use
  CUstream h2d = nullptr;
  std::vector<CUevent> free_events;  // pooled timing-disabled events
};

enum class OpKind { kPause, kResume };

// What prepare() selected: the allocations are marked busy until execute() commits or aborts.
struct Plan {
  OpKind kind = OpKind::kPause;
  std::vector<Tag*> tags;            // tags this op changes (marked busy)
  std::vector<Allocation*> allocs;   // sorted by (device, va)
  bool noop = false;
};

class Engine {
 public:
  static Engine& get();  // created on first use, never destroyed (no static-destructor order at exit)

  ebt_status_t malloc(void** ptr, size_t size, int device, const char* tag, int backup);
  ebt_status_t free(void* ptr, int* found);
  bool owns(const void* ptr);  // fast check used by the interposer's cudaFree

  // Select and mark busy (under the lock); then execute without holding it (driver work, copies).
  ebt_status_t prepare(OpKind kind, const char* tag, Plan* plan, ebt_mem_report_t* report);
  ebt_status_t execute(Plan& plan, ebt_mem_report_t* report);

  ebt_status_t register_tag(const char* tag);  // a region names a tag: pause/resume of it is then valid
  ebt_status_t mark_clean(const char* tag);
  ebt_status_t tag_state(const char* tag, int* state, unsigned long long* pauses);
  void set_margin(size_t bytes) { margin_.store(bytes, std::memory_order_relaxed); }
  size_t margin() const { return margin_.load(std::memory_order_relaxed); }
  ebt_status_t stats(ebt_mem_tag_stats_t* rows, size_t capacity, size_t* count);
  ebt_status_t global_stats(ebt_mem_global_stats_t* out);
  ebt_status_t get_cpu_backup(const void* ptr, void** host, size_t* bytes_after);
  ebt_status_t lookup(const void* ptr, void** base, size_t* size, char* tag, int* paused);
  ebt_status_t paused_ranges(uintptr_t* starts, size_t* lengths, size_t capacity, size_t* count);
  ebt_status_t export_fd(const void* ptr, int* fd, size_t* offset, size_t* size);  // engine_ipc.cc
  ebt_status_t import_fd(int fd, size_t size, int device, void** ptr);
  ebt_status_t close_import(void* ptr);
  ebt_status_t reserve_host(size_t bytes);
  ebt_status_t release_host(size_t* released);
  ebt_status_t reset();

  // Background pinning (see engine_pinning.cc): CPU-backed allocations get their host blocks on a runtime thread
  // soon after they are made, so the first pause finds pinned memory waiting.
  void set_background_pinning(bool enabled);
  void wait_background_pinning();

 private:
  Engine() = default;
  ebt_status_t driver(const ebt_driver_table_t** drv);
  ebt_status_t device(int ordinal, Device** out);
 public:
  static CUmemAllocationProp device_prop(int ordinal, bool shareable);

 private:
  ebt_status_t streams(Device* d);
  CUevent take_event(Device* d);
  void give_event(Device* d, CUevent e);
  Tag* tag_locked(const std::string& name);  // find or create (mu_ held)

  ebt_status_t run_pause(Plan& plan, ebt_mem_report_t* r);
  // rollback: mapping back what a failed pause released (the memory margin does not apply).
  ebt_status_t run_resume(const std::vector<Allocation*>& allocs, ebt_mem_report_t* r, bool rollback = false);
  ebt_status_t map_all(const std::vector<Allocation*>& allocs, ebt_mem_report_t* r);
  ebt_status_t map_release(Allocation* a, CUmemGenericAllocationHandle h);  // a's device context current
  void unmap_all(const std::vector<Allocation*>& allocs);
  // Unmap allocs[begin, end) (one VA-contiguous run on one device): one call, per allocation if refused.
  // Appends what it unmapped to *released (state set to PAUSED).
  ebt_status_t unmap_run(const std::vector<Allocation*>& allocs, size_t begin, size_t end,
                         std::vector<Allocation*>* released, ebt_mem_report_t* r);
  ebt_status_t set_access_runs(const std::vector<Allocation*>& allocs);
  void commit(Plan& plan, ebt_status_t st, const ebt_mem_report_t& r);
  void fill_oom(int device, size_t needed, ebt_mem_report_t* r);
  void enqueue_pinning(const Allocation* a);  // mu_ held
  void pinning_loop();
  void pin_batch(const std::vector<std::pair<CUdeviceptr, unsigned long long>>& batch);

  std::mutex mu_;               // guards by_va_, tags_, every Allocation/Tag field, the counters below
  std::condition_variable cv_;  // signalled when an op clears busy flags (free() waits on it)
  std::map<CUdeviceptr, Allocation*> by_va_;         // live allocations by base address (O(log n) lookups)
  std::map<std::string, std::unique_ptr<Tag>> tags_;  // every tag ever named; never erased until reset
  unsigned long long allocs_total_ = 0, frees_total_ = 0;
  std::atomic<size_t> margin_{0};  // bytes an allocation or resume must leave free (0: no check)

  struct Import {
    CUmemGenericAllocationHandle handle = 0;
    size_t size = 0;
    int device = -1;
  };
  std::map<CUdeviceptr, Import> imports_;  // mappings of other processes' memory (mu_)
  void close_all_imports();                // reset()

  std::mutex dev_mu_;           // guards devices_ (the map, not the Device contents)
  std::map<int, std::unique_ptr<Device>> devices_;
  HostArena arena_;

  std::mutex pin_mu_;                // guards pin_queue_, pin_busy_, pin_thread_started_, pin_enabled_
  std::condition_variable pin_cv_;   // queue got work / worker went idle
  std::vector<std::pair<CUdeviceptr, unsigned long long>> pin_queue_;  // (va, id) of allocations to pin for
  bool pin_busy_ = false;            // the worker is pinning a batch
  bool pin_thread_started_ = false;  // the worker thread exists (started on first use, lives for the process)
  int pin_enabled_ = -1;             // -1: not read yet (EBBTIDE_MEM_PREPIN, default on); 0/1
};

// RAII: make `ctx` current on this thread for the scope (push/pop, so the caller's context is restored).
class CtxGuard {
 public:
  CtxGuard(const ebt_driver_table_t* drv, CUcontext ctx) : drv_(drv) {
    ok_ = drv_->cuCtxPushCurrent(ctx) == CUDA_SUCCESS;
  }
  ~CtxGuard() {
    CUcontext c;
    if (ok_) drv_->cuCtxPopCurrent(&c);
  }
  bool ok() const { return ok_; }

 private:
  const ebt_driver_table_t* drv_;
  bool ok_;
};

}  // namespace ebbtide::memory

#endif  // EBBTIDE_MEMORY_ENGINE_H_
