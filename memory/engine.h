/*
 * engine.h — the memory engine's internal interface (one Engine per process; C API in api.cc).
 * Invariants and the state machine: engine.cc's header comment and memory/NOTES.md.
 */
#ifndef EBBTIDE_MEMORY_ENGINE_H_
#define EBBTIDE_MEMORY_ENGINE_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

#include "csrc/driver.h"
#include "memory/ebbtide_memory.h"
#include "memory/host_arena.h"
#include "memory/settings.h"
#include "memory/va_space.h"

namespace ebbtide::memory {

struct Tag;
struct Allocation;

// A coalesced mapping (on by default; EBBTIDE_MEM_COALESCE=0 / ebt_mem_set_coalescing(0) off): resume made ONE physical
// allocation for a VA-contiguous run of same-device, same-tag, non-shareable allocations and mapped it once, so
// the driver sees one mapping instead of one per allocation (Note "Coalesced mappings" in memory/NOTES.md).
// Exists only while mapped: the pause that unmaps it (always whole: the driver cannot unmap a sub-range of a
// mapping) dissolves it. Every field is guarded by the engine's mu_.
struct Segment {
  CUdeviceptr va = 0;  // base of the mapping (= the first member's va)
  size_t size = 0;     // bytes mapped (sum of the members' aligned sizes)
  int device = -1;
  size_t live = 0;     // members not freed yet (all in one tag, all ACTIVE; > 0 while the segment exists)
  // Freed members ("zombies"): gone for the user (not in by_va_ or their tag), their VA still reserved and their
  // memory still mapped until the whole mapping is unmapped (next pause of the tag, or the last live member's
  // free); then their VA goes back and they are deleted. Owned here.
  std::vector<Allocation*> zombies;
  size_t zombie_bytes = 0;  // sum of the zombies' aligned sizes (stats: bytes_pending_free)
};

enum class AllocState : unsigned char { kActive, kPaused };

struct Allocation {
  unsigned long long id = 0; // unique per engine lifetime (background pinning matches queued work by (va, id))
  CUdeviceptr va = 0;        // base address, granularity-aligned; fixed for the allocation's whole life
  size_t size = 0;           // bytes the caller asked for (what a backup copies)
  size_t aligned = 0;        // bytes mapped: size rounded up to the device granularity
  int device = -1;           // CUDA ordinal; every driver call for this allocation runs in its primary context
  Tag* tag = nullptr;        // owning tag (never null; tags outlive allocations)
  int backup = EBT_MEM_BACKUP_NONE;  // NONE, CPU or DISK (the flags are the fields below)
  bool transient = false;    // CPU: EBT_MEM_HOST_TRANSIENT (a host copy of its own per pause; NOTES "Transient ...")
  bool pageable = false;     // CPU transient: EBT_MEM_HOST_PAGEABLE (registered only while copies run)
  bool shareable = false;    // physical memory created exportable as a POSIX fd (every create, resume included)
  AllocState state = AllocState::kActive;
  bool busy = false;         // owned by an op in flight: only that op changes state/mapping/host (engine mu_)
  // No handle is kept: the handle is released right after cuMemMap, so the mapping alone holds the physical
  // memory (ACTIVE <=> mapped) and one cuMemUnmap frees it. Export retains a handle on demand.
  HostArena::Block host;     // backup block; kept across cycles once allocated (persistent arena); transient: a
                             // private segment, made by a pause and given back by a resume unless retained
  bool host_valid = false;   // host holds the device content as of the last pause (or the restore since)
  bool host_clean = false;   // caller promised the device content equals host: next pause skips the copy
  std::string disk_path;     // DISK: the backup file while paused ("" otherwise); written by the owning op
  std::vector<uint32_t> disk_crc;  // DISK: CRC32C of each chunk of that file (memory/disk_file.h)
  // The coalesced mapping this ACTIVE allocation lies in (null: its own mapping). Set by a resume's commit of
  // its mappings and cleared when that mapping is unmapped; written only under mu_ (by the op owning the
  // allocation, or by free()).
  std::shared_ptr<Segment> seg;
};

struct Tag {
  std::string name;
  int state = EBT_MEM_TAG_ACTIVE;  // EBT_MEM_TAG_ACTIVE or EBT_MEM_TAG_PAUSED (busy is separate)
  bool busy = false;               // an op in flight owns this tag
  int reclaiming = 0;              // zombie reclaims moving this tag's members (prepare() waits for 0)
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
  std::mutex mu;             // guards d2h, h2d, free_events (lock order: memory/engine.cc, 5)
  CUstream d2h = nullptr;    // runtime-owned non-blocking copy streams, created on first use
  CUstream h2d = nullptr;
  std::vector<CUevent> free_events;  // pooled timing-disabled events
};

enum class OpKind { kPause, kResume };

// One driver mapping of an op: allocs[begin, end) of its sorted allocation list, covering [va, va + size).
// Without coalescing every unit is one allocation.
struct MapUnit {
  size_t begin = 0, end = 0;
  CUdeviceptr va = 0;
  size_t size = 0;
  int device = -1;
  bool shareable = false;
  std::shared_ptr<Segment> seg;  // pause: the coalesced mapping being unmapped (null: a single allocation)
};

// What prepare() selected: the allocations are marked busy until execute() commits or aborts.
struct Plan {
  OpKind kind = OpKind::kPause;
  std::vector<Tag*> tags;            // tags this op changes (marked busy)
  std::vector<Allocation*> allocs;   // sorted by (device, va)
  bool noop = false;
  double prepare_s = 0;              // selection time (report.prepare_s)
};

// A check of a `backup` argument (base + flags): INVALID_ARGUMENT naming what is wrong.
ebt_status_t check_backup_code(int backup);

struct PieceRelease;  // engine_internal.h
struct DiskCopies;    // engine_disk.cc
class OrderedWork;   // memory/ordered_work.h

class Engine {
 public:
  static Engine& get();  // created on first use, never destroyed (no static-destructor order at exit)

  // Allocate; on OUT_OF_MEMORY with zombies on the device that would cover the shortfall, reclaim them
  // (engine_reclaim.cc) and try once more.
  ebt_status_t malloc(void** ptr, size_t size, int device, const char* tag, int backup);
  // *found = 1 where ptr is an engine allocation's base (then freed); 0: not ours (the shim's cudaFree forwards it).
  ebt_status_t free(void* ptr, int* found);

  // Select and mark busy (under the lock); then execute without holding it (driver work, copies).
  ebt_status_t prepare(OpKind kind, const char* tag, Plan* plan, ebt_mem_report_t* report);
  ebt_status_t execute(Plan& plan, ebt_mem_report_t* report);

  ebt_status_t register_tag(const char* tag);  // a region names a tag: pause/resume of it is then valid
  ebt_status_t mark_clean(const char* tag);
  ebt_status_t tag_state(const char* tag, int* state, unsigned long long* pauses);
  void set_margin(size_t bytes) { margin_.store(bytes, std::memory_order_relaxed); }
  size_t margin() const { return margin_.load(std::memory_order_relaxed); }
  // Coalesced resume (on by default): see Segment and memory/NOTES.md "Coalesced mappings".
  void set_coalescing(bool on) { coalesce_.store(on, std::memory_order_relaxed); }
  bool coalescing() const { return coalesce_.load(std::memory_order_relaxed); }
  // Transient host copies (engine_transient.cc): kept by a resume while retention is on.
  void set_host_retention(bool on) { retain_host_.store(on, std::memory_order_relaxed); }
  bool host_retention() const { return retain_host_.load(std::memory_order_relaxed); }
  // The disk tier (engine_disk.cc): its directory, validated (created, writable, not tmpfs/ramfs).
  ebt_status_t set_disk_dir(const char* dir);
  ebt_status_t disk_dir(std::string* out);
  ebt_status_t stats(ebt_mem_tag_stats_t* rows, size_t capacity, size_t* count);
  ebt_status_t global_stats(ebt_mem_global_stats_t* out);
  ebt_status_t tag_reports(const char* tag, ebt_mem_report_t* last_pause, ebt_mem_report_t* last_resume);
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
  ebt_status_t malloc_once(void** ptr, size_t size, int device, const char* tag, int backup);  // no reclaim
 public:
  static CUmemAllocationProp device_prop(int ordinal, bool shareable);

 private:
  ebt_status_t streams(Device* d);
  CUevent take_event(Device* d);
  void give_event(Device* d, CUevent e);
  Tag* tag_locked(const std::string& name);  // find or create (mu_ held)

  ebt_status_t run_pause(Plan& plan, ebt_mem_report_t* r);
  // engine_transient.cc: the host side of transient copies (Note "Transient host copies" in memory/NOTES.md).
  struct ShadowSteps;
  // Pause: give each transient allocation that copies (copy[i]) a private segment if it has none, check the host
  // has room, and start preparing (populating + registering) their pieces in copy order. Allocations given a new
  // segment are marked in *made.
  ebt_status_t shadow_prepare(const std::vector<Allocation*>& allocs, const std::vector<bool>& copy, CUcontext ctx,
                              ShadowSteps* steps, std::vector<bool>* made);
  // Before copying allocs[i] (= a) at `offset`: its piece is ready (registered).
  ebt_status_t shadow_ready(ShadowSteps* steps, size_t i, const Allocation* a, size_t offset);
  // Resume: register the pageable copies' pieces again (in copy order) before they are copied back.
  ebt_status_t shadow_register(const std::vector<Allocation*>& allocs, CUcontext ctx, ShadowSteps* steps);
  // Unregister every piece of the pageable copies among allocs (they stay resident, pageable).
  void shadow_unregister(const std::vector<Allocation*>& allocs, CUcontext ctx);
  // Resume: give back each listed piece once its copy landed, on runtime threads (join `work` before commit).
  void shadow_release(std::vector<PieceRelease>& list, CUcontext ctx, OrderedWork* work);
  // Give back a's host copy (its content is safe elsewhere, or not needed).
  void shadow_drop(Allocation* a);
  // disk tier (engine_disk.cc)
  // The disk part of a pause (write every DISK allocation's file; resume = false) or of a resume (read them back).
  ebt_status_t disk_phase(const std::vector<Allocation*>& allocs, bool resume, ebt_mem_report_t* r);
  ebt_status_t disk_write(const std::vector<Allocation*>& disk, const std::vector<Device*>& devs,
                          const ebt_driver_table_t* drv, const DiskSettings& ds, const std::string& dir);
  ebt_status_t disk_read(const std::vector<Allocation*>& disk, const std::vector<Device*>& devs,
                         const ebt_driver_table_t* drv, const DiskSettings& ds);  // disk_mu_ held (both)
  // The op's disk allocations (a resume's: those with a file) with their devices; the driver and the disk settings
  // where there is any.
  ebt_status_t disk_members(const std::vector<Allocation*>& allocs, bool resume, std::vector<Allocation*>* disk,
                            std::vector<Device*>* devs, const ebt_driver_table_t** drv, DiskSettings* ds);
  ebt_status_t disk_check(const std::vector<Allocation*>& allocs);  // resume pre-flight: every file valid
  void disk_forget(Allocation* a);  // remove a's file (free, resume commit, failed pause)
  void disk_stats(ebt_mem_global_stats_t* out);
  ebt_status_t disk_staging(size_t chunk, size_t slots, CUcontext ctx, std::vector<char*>* out);  // disk_mu_ held
  // The staging slots of a disk phase: 2 x ds.threads of ds.chunk_bytes, 4 KiB-aligned (disk_mu_ held).
  ebt_status_t disk_slots(const DiskSettings& ds, Device* d, std::vector<char*>* out);
  ebt_status_t disk_copy(DiskCopies& p, size_t chunk, bool to_host);  // one chunk's copy + event (disk_mu_ held)
  // The end of a disk phase: stop the I/O threads (after a failure), wait for every copy, return the events.
  ebt_status_t disk_finish(DiskCopies& p, OrderedWork& io, ebt_status_t st);
  // rollback: mapping back what a failed pause released (the memory margin does not apply).
  ebt_status_t run_resume(const std::vector<Allocation*>& allocs, ebt_mem_report_t* r, bool rollback = false);
  // Create + map + release every unit, then grant access; on failure nothing stays mapped.
  ebt_status_t map_all(const std::vector<MapUnit>& units, ebt_mem_report_t* r);
  ebt_status_t map_release(CUdeviceptr va, size_t size, CUmemGenericAllocationHandle h);  // unit's ctx current
  void unmap_units(const std::vector<MapUnit>& units, size_t count);  // units[0, count), each one call
  // Unmap units[begin, end) (one VA-contiguous run on one device): one call, per unit if refused. Appends the
  // members it unmapped to *released (state set to PAUSED) and the coalesced mappings among them to *retired.
  ebt_status_t unmap_run(const std::vector<Allocation*>& allocs, const std::vector<MapUnit>& units, size_t begin,
                         size_t end, std::vector<Allocation*>* released, std::vector<const MapUnit*>* retired,
                         ebt_mem_report_t* r);
  ebt_status_t set_access_units(const std::vector<MapUnit>& units);
  // engine_segments.cc: grouping an op's sorted allocations into driver mappings, and segment bookkeeping.
  ebt_status_t resume_units(const std::vector<Allocation*>& allocs, std::vector<MapUnit>* units);
  ebt_status_t pause_units(const std::vector<Allocation*>& allocs, std::vector<MapUnit>* units);
  void publish_segments(const std::vector<Allocation*>& allocs, const std::vector<MapUnit>& units);  // takes mu_
  // The coalesced mappings a pause unmapped: detach their members, return the zombies' VA (takes mu_).
  void retire_segments(const std::vector<Allocation*>& allocs, const std::vector<const MapUnit*>& retired,
                       ebt_mem_report_t* r);
  // free(): unmap [va, va + size) (the device's context current), once more if the driver refuses; if it refuses
  // again the range is quarantined (never reused, counted in global stats) and the status is EBT_ERROR_DRIVER.
  // Takes mu_.
  ebt_status_t unmap_or_quarantine(const ebt_driver_table_t* drv, int device, CUdeviceptr va, size_t size,
                                   const char* what);
  // free() of an ACTIVE member of a coalesced mapping (mu_ held via `lock`, a already unlisted).
  ebt_status_t free_member(Allocation* a, std::unique_lock<std::mutex>& lock);
  void commit(Plan& plan, ebt_status_t st, const ebt_mem_report_t& r);
  void fill_oom(int device, size_t needed, ebt_mem_report_t* r);
  void enqueue_pinning(const Allocation* a);  // mu_ held
  void pinning_loop();
  void pin_batch(const std::vector<std::pair<CUdeviceptr, unsigned long long>>& batch);

  std::mutex mu_;               // guards by_va_, tags_, every Allocation/Tag field, the counters below (lock
                                // order: memory/engine.cc, 2)
  std::condition_variable cv_;  // signalled when an op clears busy flags (free() waits on it)
  std::map<CUdeviceptr, Allocation*> by_va_;         // live allocations by base address (O(log n) lookups)
  std::map<std::string, std::unique_ptr<Tag>> tags_;  // every tag ever named; never erased until reset
  unsigned long long allocs_total_ = 0, frees_total_ = 0;
  std::atomic<size_t> margin_{0};  // bytes an allocation or resume must leave free (0: no check)
  // Resume coalesces VA-contiguous runs into one mapping each. The default is Settings::coalesce (on;
  // EBBTIDE_MEM_COALESCE=0 at load, or ebt_mem_set_coalescing(0), turns it off; memory/NOTES.md "Coalesced
  // mappings" says why it is safe on).
  std::atomic<bool> coalesce_{Settings{}.coalesce};
  size_t pending_free_ = 0;  // aligned bytes of zombies (freed, still mapped in coalesced mappings); mu_
  // An OOM status gets a hint when zombies hold memory (nothing else can give it back before their tag's pause).
  ebt_status_t oom_hint(ebt_status_t st);

  // Ranges a free could not unmap (twice): their VA stays reserved and is never handed out again; their memory
  // may stay mapped. Counted in global stats; reset() tries to unmap them once more and forgets them. mu_.
  struct Quarantined {
    CUdeviceptr va = 0;
    size_t size = 0;
    int device = -1;
  };
  std::vector<Quarantined> quarantine_;
  // engine_reclaim.cc: zombies' memory given back while their mappings' live members stay usable. The live
  // members are copied out (to a spare device mapping when there is room, else through the host arena), the whole
  // mapping is unmapped, the live members are mapped again at the same addresses (one mapping per VA-contiguous
  // live run) and copied back; all or nothing.
  size_t zombie_bytes_on(int device);  // zombies' aligned bytes on `device` (takes mu_)
  // Reclaim zombies on `device` until at least `want` bytes came back (or every eligible mapping was done);
  // *got = bytes given back. Drains the device first. Serialised by reclaim_mu_ (taken before mu_).
  ebt_status_t reclaim_zombies(int device, size_t want, size_t* got);
  // One mapping; `live` are its live members (busy, sorted by va); *reclaimed = zombie bytes given back.
  ebt_status_t reclaim_segment(const std::shared_ptr<Segment>& s, std::vector<Allocation*>& live, size_t* reclaimed);
  // Resume pre-flight: reclaim zombies when the device lacks `need` (+ margin) bytes; refreshes *free_b.
  void reclaim_for(int device, size_t need, size_t* free_b);
  std::mutex reclaim_mu_;  // serialises reclaim_zombies (lock order: memory/engine.cc, 1: outermost)
  unsigned long long reclaims_ = 0;  // segments reclaimed (mu_)
  size_t bytes_reclaimed_ = 0;       // zombie bytes they gave back (mu_)

  struct Import {
    CUmemGenericAllocationHandle handle = 0;
    size_t size = 0;
    int device = -1;
  };
  std::map<CUdeviceptr, Import> imports_;  // mappings of other processes' memory (mu_)
  void close_all_imports();                // reset()

  std::atomic<bool> retain_host_{false};  // host retention (TMS_RETAIN_CPU_BACKUP at load)

  // Disk tier state (engine_disk.cc). disk_mu_ serialises the disk phases of ops (they share the staging and the
  // directory's bandwidth) and guards the fields below (lock order: engine.cc, 1a).
  std::mutex disk_mu_;
  std::string disk_dir_;             // "" until set or first used (then the setting's, checked)
  bool disk_dir_checked_ = false;
  std::vector<HostArena::Block> disk_staging_;  // pinned chunks (+4 KiB for alignment), kept between ops
  size_t disk_staging_chunk_ = 0;
  std::atomic<int> disk_direct_{1};

  std::mutex dev_mu_;           // guards devices_ (the map, not the Device contents; lock order: engine.cc, 4)
  std::map<int, std::unique_ptr<Device>> devices_;
  HostArena arena_;

  std::mutex pin_mu_;                // guards pin_queue_, pin_busy_, pin_thread_started_, pin_enabled_ (lock
                                     // order: memory/engine.cc, 3)
  std::condition_variable pin_cv_;   // queue got work / worker went idle
  std::vector<std::pair<CUdeviceptr, unsigned long long>> pin_queue_;  // (va, id) of allocations to pin for
  bool pin_busy_ = false;            // the worker is pinning a batch
  bool pin_thread_started_ = false;  // the worker thread exists (started on first use, lives for the process)
  int pin_enabled_ = -1;             // -1: not set yet (then EBBTIDE_MEM_PREPIN, default on); 0/1
};

// RAII: make `ctx` current on this thread for the scope (push/pop, so the caller's context is restored).
class CtxGuard {
 public:
  CtxGuard(const ebt_driver_table_t* drv, CUcontext ctx) : drv_(drv) {
    ok_ = drv_->cuCtxPushCurrent(ctx) == CUDA_SUCCESS;
  }
  ~CtxGuard() {
    CUcontext c;
    if (ok_) EBT_CU_IGNORE(drv_->cuCtxPopCurrent(&c), "popping the context this guard pushed: cannot fail");
  }
  bool ok() const { return ok_; }

 private:
  const ebt_driver_table_t* drv_;
  bool ok_;
};

}  // namespace ebbtide::memory

#endif  // EBBTIDE_MEMORY_ENGINE_H_
