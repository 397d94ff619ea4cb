/*
 * ebbtide_memory.h — the public C interface of the memory engine (part of libebbtide.so; see csrc/ebbtide.h for
 * the conventions every call follows: status return, out-pointers, thread-local ebt_last_error()).
 *
 * The engine backs allocations with CUDA virtual memory (cuMemCreate + cuMemMap at a reserved VA). pause(tag)
 * releases the physical memory of a tag's allocations (optionally copying their content to a persistent pinned
 * host arena first) and keeps every virtual address; resume(tag) maps new memory at the same addresses and
 * copies the content back. One engine per process: the LD_PRELOAD interposers (cudaMalloc/cudaFree), the PyTorch
 * pluggable-allocator entry points (ebt_torch_malloc/ebt_torch_free) and this API all reach the same state.
 *
 * Thread safety: every call is thread-safe. Blocking: pause/resume block until the copies finished (the _async
 * forms return at once). In a forked child every call fails with EBT_ERROR_INVALID_STATE and the interposers
 * forward to the real CUDA runtime (the child must not touch the parent's bookkeeping).
 */
#ifndef EBBTIDE_MEMORY_H_
#define EBBTIDE_MEMORY_H_

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "csrc/ebbtide.h"

#ifdef __cplusplus
extern "C" {
#endif

#define EBT_MEM_TAG_MAX 63 /* longest tag, in bytes (no NUL); tags are non-empty UTF-8 without NUL */

/* NONE: a pause discards the content. CPU: a pause copies it to host memory, a resume copies it back. DISK: a pause
 * writes it to a file in the disk-backup directory (ebt_mem_set_disk_dir) through pinned staging, a resume reads it
 * back and removes the file. */
typedef enum { EBT_MEM_BACKUP_NONE = 0, EBT_MEM_BACKUP_CPU = 1, EBT_MEM_BACKUP_DISK = 2 } ebt_mem_backup_t;
#define EBT_MEM_BACKUP_MASK 0xFF /* the ebt_mem_backup_t part of a `backup` argument; flags below go above it */
/* OR'd into a `backup` argument (regions, default region, malloc): the allocation's physical memory is created
 * exportable as a POSIX file descriptor (ebt_mem_export_fd), for CUDA IPC of region memory. UNSUPPORTED on a
 * device without POSIX-fd handle support. */
#define EBT_MEM_SHAREABLE 0x100
/* OR'd into a CPU backup: where its host copy lives (memory/NOTES.md "Transient host copies").
 * Without a flag: ebbtide's persistent pinned host arena. The copy's block is kept across cycles (warm cycles
 * allocate nothing; it is pinned in the background soon after the allocation is made), until the allocation is
 * freed or ebt_mem_release_host_memory() runs: fastest, and it holds host memory while the tensor is active.
 * EBT_MEM_HOST_TRANSIENT: a host copy of the allocation's own, made by each pause (fresh memory populated and
 * registered piece by piece while the copies stream) and given back by the resume (each piece unregistered and
 * unmapped as its copy lands, before the resume returns), unless host retention is on at that resume
 * (ebt_mem_set_host_retention): then it is kept, at the same address, until the allocation is freed, a resume
 * without retention, or ebt_mem_release_host_memory(). torch_memory_saver's semantics.
 * EBT_MEM_HOST_PAGEABLE (with TRANSIENT): the copy is registered only while copies run, pageable while the tensor
 * is paused (torch_memory_saver's "mmap" backend). */
#define EBT_MEM_HOST_TRANSIENT 0x200
#define EBT_MEM_HOST_PAGEABLE 0x400
typedef enum { EBT_MEM_TAG_ACTIVE = 0, EBT_MEM_TAG_PAUSED = 1, EBT_MEM_TAG_BUSY = 2 } ebt_mem_tag_state_t;

/* What one pause or resume did. Times in seconds, sizes in bytes. Phases: sync = draining the allocations'
 * devices before unmap; copy = first copy issued to last copy finished (unmap of finished chunks runs inside
 * it); unmap / map = time spent in driver unmap+release / create+map+set-access calls. driver_free_* =
 * cuMemGetInfo free bytes of the first device touched, before and after. On an OUT_OF_MEMORY resume,
 * oom_needed / oom_free / oom_device describe the shortfall. */
typedef struct {
  size_t struct_size;        /* set by the caller to sizeof(ebt_mem_report_t) (fields are only appended) */
  int noop;                  /* 1: nothing to do (double pause/resume, unknown-but-valid empty tag) */
  int device;                /* first device touched (-1: none) */
  size_t allocations;        /* allocations paused or resumed */
  size_t bytes;              /* physical bytes released or mapped (granularity-aligned) */
  size_t bytes_copied;       /* bytes copied to or from the host arena */
  size_t bytes_skipped_clean;/* backup bytes not copied because the host copy was marked current */
  double sync_s, copy_s, unmap_s, map_s, total_s;
  size_t driver_free_before, driver_free_after;
  size_t oom_needed, oom_free;
  int oom_device;
  /* Breakdown (appended): resume's cuMemCreate and cuMemSetAccess time (both inside map_s); driver unmap calls
   * a pause made (one per VA-contiguous run when the driver accepts it, else one per allocation). */
  double create_s, access_s;
  size_t unmap_calls;
  /* Appended (coalescing): driver mappings the op unmapped or created (= allocations, unless resume coalesced
   * runs of them: see ebt_mem_set_coalescing), and bytes of freed members of coalesced mappings that this pause
   * gave back to the driver (not counted in `bytes`). */
  size_t mappings;
  size_t bytes_pending_freed;
  /* Appended (breakdown): time in cuMemGetInfo (pre-flight and the driver_free_* figures), resume's cuMemMap +
   * cuMemRelease calls (inside map_s, beside create_s and access_s), and the op's selection under the engine lock
   * before it ran (prepare_s: outside total_s). total_s minus the named phases is the op's own bookkeeping. */
  double meminfo_s, map_call_s, prepare_s;
  /* Appended (transient host copies, disk tier). host_wait_s: pause, time the copies waited for fresh host pieces
   * to be populated and registered (inside copy_s). host_release_s: resume, time from the last copy landing to the
   * last transient host piece given back (inside total_s). disk_s: the disk tier's part of the op (writes or
   * reads with their device copies; outside copy_s); bytes_disk: bytes written or read. */
  double host_wait_s, host_release_s, disk_s;
  size_t bytes_disk;
} ebt_mem_report_t;

/* Per (tag, device) statistics; see ebt_mem_stats. */
typedef struct {
  char tag[EBT_MEM_TAG_MAX + 1];
  int device;
  int state;                /* ebt_mem_tag_state_t of the tag */
  size_t allocations;       /* live allocations (active + paused) */
  size_t handles;           /* physical allocations mapped: one per active allocation, one per coalesced run (the
                               engine releases each handle right after mapping it: the mapping alone keeps it) */
  size_t bytes_requested;   /* sum of requested sizes of live allocations */
  size_t bytes_active;      /* physical bytes mapped now (aligned) */
  size_t bytes_paused;      /* physical bytes released by pause (aligned) */
  size_t bytes_backed_up;   /* host arena bytes holding this tag's backups (kept across cycles) */
  size_t bytes_pending_free;  /* freed allocations of this tag still mapped inside a coalesced mapping (aligned
                                 bytes; given back at the tag's next pause or when the mapping empties) */
  /* Fields are only appended. The tag's last reports are not embedded (a report that grows would shift every
   * field after it): read them with ebt_mem_tag_reports. */
} ebt_mem_tag_stats_t;

/* Host arena and interposer counters. */
typedef struct {
  size_t host_reserved;      /* pinned host bytes held by the arena (all segments) */
  size_t host_used;          /* of which sub-allocated to backups */
  size_t host_segments;      /* registered segments */
  double host_register_s;    /* total time spent touching + registering host memory */
  unsigned long long forwarded_allocs;  /* cudaMalloc calls the shim forwarded to the real runtime */
  unsigned long long forwarded_bytes;
  unsigned long long engine_allocs;     /* allocations the engine made since start */
  unsigned long long engine_frees;
  size_t va_reserved;        /* virtual address space reserved from the driver */
  size_t live_allocations;
  size_t coalesced_mappings; /* mappings now holding several allocations (coalesced resume) */
  size_t bytes_pending_free; /* freed allocations still mapped inside them (see ebt_mem_set_coalescing) */
  size_t quarantined_ranges; /* freed ranges the driver refused to unmap (twice): never reused, may stay mapped */
  size_t quarantined_bytes;
  unsigned long long zombie_reclaims; /* coalesced mappings rebuilt to give their freed members' memory back
                                         (an allocation or a resume ran short while they held memory) */
  size_t bytes_reclaimed;    /* bytes those reclaims gave back to the driver */
  /* Appended (transient host copies, disk tier): host memory held outside the arena, and files on disk. */
  size_t transient_copies;   /* EBT_MEM_HOST_TRANSIENT copies held now (paused allocations, or retained) */
  size_t transient_mapped;   /* their bytes in host memory (resident: populated) */
  size_t transient_pinned;   /* of which registered (page-locked) now */
  size_t transient_retained; /* bytes of copies held by ACTIVE allocations (host retention on) */
  int host_retention;        /* ebt_mem_get_host_retention */
  size_t disk_files;         /* disk backups on disk now (one file per paused DISK allocation) */
  size_t disk_bytes;         /* their size on disk (header, data, checksums) */
  size_t disk_staging;       /* pinned staging the disk tier holds (arena blocks, counted in host_reserved) */
  int disk_direct;           /* 1: the last disk op used O_DIRECT; 0: buffered (the filesystem refused it) */
} ebt_mem_global_stats_t;

typedef struct ebt_mem_op* ebt_mem_op_t; /* an asynchronous pause or resume */

/* ---- routing: which allocations the engine takes ----------------------------------------------------------
 * A region is thread-scoped: allocations made by this thread through the interposers or ebt_torch_malloc land
 * in `tag` with backup policy `backup`. Regions nest; pop restores the previous one (token from push). */
EBT_API ebt_status_t ebt_mem_region_push(const char* tag, int backup, int* token);
EBT_API ebt_status_t ebt_mem_region_pop(int token);
/* Thread-scoped bypass (nests with regions): while disabled, this thread's cudaMalloc goes to the real runtime. */
EBT_API ebt_status_t ebt_mem_set_disabled(int disabled, int* previous);
/* Process-wide default region for threads that have none (autograd's device threads, NCCL threads): NULL tag
 * clears it. Takes effect for allocations made after the call. */
EBT_API ebt_status_t ebt_mem_set_default_region(const char* tag, int backup);
/* The region that applies to the calling thread now (tag "" if none). `tag` must hold EBT_MEM_TAG_MAX+1 bytes. */
EBT_API ebt_status_t ebt_mem_current_region(char* tag, int* backup, int* disabled);

/* ---- allocation (what the hooks call; also usable directly) -----------------------------------------------
 * Allocate `size` bytes (> 0) on `device` in `tag`: VA reserved, physical memory created and mapped read-write.
 * OUT_OF_MEMORY when the device is full (nothing is left behind) — after giving back, when that covers the
 * shortfall, the memory that freed allocations still hold inside coalesced mappings (see coalesced resume below).
 * Blocking, thread-safe. */
EBT_API ebt_status_t ebt_mem_malloc(void** ptr, size_t size, int device, const char* tag, int backup);
/* Free an engine allocation (active or paused). Synchronizes the allocation's device before unmapping an
 * active one. *found = 0 and SUCCESS when the pointer is not the engine's (the caller forwards it). Waits for a
 * pause/resume in flight on that allocation. If the driver refuses the unmap twice, the allocation is gone all the
 * same but its range is quarantined (never reused; counted in ebt_mem_global_stats_t) and DRIVER is returned. */
EBT_API ebt_status_t ebt_mem_free(void* ptr, int* found);

/* ---- pause / resume ----------------------------------------------------------------------------------------
 * pause: drain the devices, copy CPU-backed allocations to the host arena, release their physical memory; VAs
 * are kept. resume: re-create and map memory at the same VAs (all first), then copy backups back. tag NULL =
 * every tag. Pausing a paused tag (or resuming an active one) is a no-op with a warning (report->noop = 1).
 * Failure rolls back: the tag keeps its previous state and the call can be retried (OOM at resume: report's
 * oom_* fields say how much was needed and free). `report` may be NULL. */
EBT_API ebt_status_t ebt_mem_pause(const char* tag, ebt_mem_report_t* report);
EBT_API ebt_status_t ebt_mem_resume(const char* tag, ebt_mem_report_t* report);
/* Same, on a runtime thread: returns at once with an op to wait on (and release). A pause and a resume of
 * different tags (or processes) overlap; a second op on a tag that is busy fails with INVALID_STATE. */
EBT_API ebt_status_t ebt_mem_pause_async(const char* tag, ebt_mem_op_t* op);
EBT_API ebt_status_t ebt_mem_resume_async(const char* tag, ebt_mem_op_t* op);
/* Wait up to timeout_s (< 0: forever) for an op; TIMEOUT if still running. On completion returns the op's
 * status (and its error message) and fills `report`. Waiting again returns the same outcome. */
EBT_API ebt_status_t ebt_mem_op_wait(ebt_mem_op_t op, double timeout_s, ebt_mem_report_t* report);
/* Release an op (waits for it first). The op must not be used afterwards. */
EBT_API ebt_status_t ebt_mem_op_release(ebt_mem_op_t op);

/* Declare that the host copies of `tag`'s CPU-backed allocations are current (their device content was not
 * modified since they were restored): the next pause skips their copies. Cleared by the next pause. */
EBT_API ebt_status_t ebt_mem_mark_clean(const char* tag);

/* ---- introspection -----------------------------------------------------------------------------------------
 * Per (tag, device) rows: writes min(capacity, n) rows to `rows` and the total n to *count (rows may be NULL
 * with capacity 0 to ask for n). Versioned by size: pass sizeof(ebt_mem_tag_stats_t) / sizeof(ebt_mem_global_stats_t)
 * as your build sees it; rows are laid out with that stride and each gets that many leading bytes (fields are only
 * ever appended, so an older caller reads exactly the fields it knows). */
EBT_API ebt_status_t ebt_mem_stats(void* rows, size_t row_size, size_t capacity, size_t* count);
EBT_API ebt_status_t ebt_mem_global_stats(void* out, size_t size);
/* The tag's last successful pause and resume reports (either pointer may be NULL; each versioned by its own
 * struct_size, as for ebt_mem_pause). NOT_FOUND for a tag no region ever named. */
EBT_API ebt_status_t ebt_mem_tag_reports(const char* tag, ebt_mem_report_t* last_pause, ebt_mem_report_t* last_resume);
/* The host backup of the allocation containing `ptr`: *host = backup address of ptr (NULL if the allocation
 * has no host copy), *bytes_after = bytes of the backup from there to its end. NOT_FOUND if ptr is not an
 * engine allocation. O(log n). The backup is current only while the allocation is paused. */
EBT_API ebt_status_t ebt_mem_get_cpu_backup(const void* ptr, void** host, size_t* bytes_after);
/* The allocation containing `ptr`: base address, requested size, tag (EBT_MEM_TAG_MAX+1 bytes), paused flag. */
EBT_API ebt_status_t ebt_mem_lookup(const void* ptr, void** base, size_t* size, char* tag, int* paused);
/* Paused VA ranges (for checkers): up to `capacity` (base, length) pairs into starts/lengths, total in *count. */
EBT_API ebt_status_t ebt_mem_paused_ranges(uintptr_t* starts, size_t* lengths, size_t capacity, size_t* count);

/* State of one tag: ebt_mem_tag_state_t (busy while an op owns it) and how many pauses it has begun, failed
 * ones included (an epoch: the Python layer gives a region entered while its tag is paused, or being paused, a
 * pool that holds no block that pause releases).
 * NOT_FOUND for a tag no region ever named. O(log tags). */
EBT_API ebt_status_t ebt_mem_tag_state(const char* tag, int* state, unsigned long long* pauses);

/* ---- shareable allocations (CUDA IPC through POSIX file descriptors) -------------------------------------------
 * export: a new fd (the caller owns it; send it with SCM_RIGHTS) for the physical memory of the ACTIVE shareable
 * allocation containing `ptr`; *offset = ptr - base, *size = the mapped (granularity-aligned) size the importer
 * passes to import. INVALID_STATE if paused or busy, INVALID_ARGUMENT if not made shareable, NOT_FOUND if not the
 * engine's. The physical memory changes at every pause/resume: an importer keeps the old memory alive (the
 * driver frees it only when every mapping is gone), so importers close before the exporter pauses and import
 * again after it resumes.
 * import: map the memory behind `fd` (from another process's export; this call does not take ownership of fd) at a
 * new VA on `device`, read-write; *ptr = its base. close_import: unmap and release (drains the device first). */
EBT_API ebt_status_t ebt_mem_export_fd(const void* ptr, int* fd, size_t* offset, size_t* size);
EBT_API ebt_status_t ebt_mem_import_fd(int fd, size_t size, int device, void** ptr);
EBT_API ebt_status_t ebt_mem_close_import(void* ptr);

/* ---- memory margin -------------------------------------------------------------------------------------------
 * An allocation that would leave less than `bytes` free on its device (cuMemGetInfo) fails with OUT_OF_MEMORY
 * (the hooks return NULL / cudaErrorMemoryAllocation, so PyTorch frees its cache and retries), and a resume that
 * would leave less than `bytes` free fails before touching anything (the tag stays paused). 0 (the default) turns
 * the check off; it then costs nothing. EBBTIDE_MEM_MARGIN_BYTES sets it at library load. */
EBT_API ebt_status_t ebt_mem_set_memory_margin(size_t bytes);
EBT_API ebt_status_t ebt_mem_get_memory_margin(size_t* bytes);

/* ---- coalesced resume ------------------------------------------------------------------------------------------
 * On by default (EBBTIDE_MEM_COALESCE=0 turns it off at library load; this call at any time). On: a resume maps
 * each VA-contiguous run of a tag's paused, non-shareable allocations on one device (at most
 * EBBTIDE_MEM_COALESCE_MAX_BYTES, default 4 GiB) as ONE physical allocation and mapping, and the next pause unmaps
 * it with one call: the driver's cost is per mapping, so 1024 allocations then cost a few mappings. Freeing one
 * allocation of such a run while it is active cannot unmap part of the mapping: the allocation disappears at once
 * (lookup, stats), its memory and VA are held (stats: bytes_pending_free) until the run is unmapped — at the tag's
 * next pause, when the run's last allocation is freed, or when an allocation or a resume on that device runs out
 * of memory: the engine then drains the device, copies the run's live allocations out through the host arena,
 * maps them again at the same addresses without the freed ones, and copies them back (all or nothing; global
 * stats zombie_reclaims / bytes_reclaimed). Range queries (cuMemGetAddressRange, cuMemRetainAllocationHandle) on
 * an allocation of a run answer for the whole run. Takes effect at the next resume; mappings made earlier keep
 * their shape. */
EBT_API ebt_status_t ebt_mem_set_coalescing(int enabled);
EBT_API ebt_status_t ebt_mem_get_coalescing(int* enabled);

/* ---- transient host copies ----------------------------------------------------------------------------------
 * Host retention: 1 = a resume keeps the EBT_MEM_HOST_TRANSIENT copies it restored from (same address: the next
 * pause copies into them again); 0 (the default; TMS_RETAIN_CPU_BACKUP=1 sets 1 at load) = a resume gives them
 * back. Read by each resume when it starts. */
EBT_API ebt_status_t ebt_mem_set_host_retention(int retain);
EBT_API ebt_status_t ebt_mem_get_host_retention(int* retain);

/* ---- disk tier ------------------------------------------------------------------------------------------------
 * The directory DISK backups go to (one file per allocation, removed at resume, at free and at exit). Created if
 * missing; refused (INVALID_ARGUMENT, naming it) when it is on tmpfs or ramfs (the files would live in host memory)
 * or not writable. Default: EBBTIDE_MEM_DISK_DIR, else TMS_DISK_BACKUP_DIR, else /tmp, checked the same way at the
 * first disk pause. A file is only ever read back by the process that wrote it: its header carries a per-process
 * nonce, the allocation's identity and size, and every chunk a CRC32C; anything else is refused at resume (the tag
 * stays paused and retryable). get: `buf` holds `len` bytes (NUL-terminated; INVALID_ARGUMENT if too short). */
EBT_API ebt_status_t ebt_mem_set_disk_dir(const char* dir);
EBT_API ebt_status_t ebt_mem_get_disk_dir(char* buf, size_t len);

/* ---- host arena ---------------------------------------------------------------------------------------------
 * Pin `bytes` more host memory now (pre-touched, registered by several threads), so the first pause does not
 * pay for pinning. Blocking; call it from a background thread to pin ahead of time. */
EBT_API ebt_status_t ebt_mem_reserve_host_memory(size_t bytes);
/* Background pinning (default on; EBBTIDE_MEM_PREPIN=0 turns it off): a CPU-backed allocation gets its pinned host
 * block on a runtime thread soon after it is made, so the first pause only copies. set: on/off from now on (off
 * also drops queued work). wait: block until queued work is done. */
EBT_API ebt_status_t ebt_mem_set_background_pinning(int enabled);
EBT_API ebt_status_t ebt_mem_wait_background_pinning(void);
/* Give back pinned host memory that holds no paused content: backups of active allocations are dropped (their
 * next pause copies again; retained transient copies included), the disk tier's idle staging is returned, and
 * empty segments unregistered and unmapped. *released = bytes returned. */
EBT_API ebt_status_t ebt_mem_release_host_memory(size_t* released);

/* ---- testing -------------------------------------------------------------------------------------------------
 * Free every allocation, VA reservation, copy stream and host segment, and clear regions and stats: the state
 * of a fresh process. Fails with INVALID_STATE while an op is in flight. For tests and benchmarks only. */
EBT_API ebt_status_t ebt_mem_reset_for_testing(void);
/* 1 if this library's cudaMalloc is the one the process resolves (it was preloaded). */
EBT_API ebt_status_t ebt_mem_shim_active(int* active);

/* ---- PyTorch CUDAPluggableAllocator entry points (torch's signatures; not status-returning) -----------------
 * malloc: the calling thread's region (or the process default, else tag "default"); NULL on failure, so the
 * caching allocator frees its cache and retries. free: of a pointer ebt_torch_malloc returned. */
EBT_API void* ebt_torch_malloc(ssize_t size, int device, void* stream);
EBT_API void ebt_torch_free(void* ptr, ssize_t size, int device, void* stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* EBBTIDE_MEMORY_H_ */
