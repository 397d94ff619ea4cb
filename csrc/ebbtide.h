/*
 * ebbtide.h — the public C interface of libebbtide.so (the runtime library).
 *
 * Contract, in the NCCL manner:
 *  - Every exported call returns ebt_status_t and hands results back through out-pointers.
 *  - On failure the call leaves its objects as they were (or documents the partial state) and records a
 *    human-readable message for this thread, readable through ebt_last_error().
 *  - Nothing here exits, aborts or throws across the C boundary.
 *  - The status enum is append-only: values are part of the ABI and mirrored in python/ebbtide/errors.py
 *    (a test walks every value).
 *  - Config structs start with a size/version header; fields are only ever appended.
 */
#ifndef EBBTIDE_H_
#define EBBTIDE_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EBT_VERSION_MAJOR 0
#define EBT_VERSION_MINOR 1
#define EBT_VERSION_PATCH 0
#define EBT_VERSION_CODE (EBT_VERSION_MAJOR * 10000 + EBT_VERSION_MINOR * 100 + EBT_VERSION_PATCH)

#if defined(_WIN32)
#define EBT_API
#else
#define EBT_API __attribute__((visibility("default")))
#endif

/* Status codes. Append only; never renumber. */
typedef enum {
  EBT_SUCCESS = 0,
  EBT_ERROR_INVALID_ARGUMENT = 1,  /* bad pointer, size, dtype, shape, flag */
  EBT_ERROR_INVALID_STATE = 2,     /* operation not allowed in the object's current state */
  EBT_ERROR_OUT_OF_MEMORY = 3,     /* device memory exhausted */
  EBT_ERROR_DRIVER = 4,            /* a CUDA driver call failed */
  EBT_ERROR_DRIVER_NOT_FOUND = 5,  /* libcuda.so.1 could not be loaded, or no device */
  EBT_ERROR_UNSUPPORTED = 6,       /* not available in this build / on this driver or device */
  EBT_ERROR_NOT_FOUND = 7,         /* unknown tag, address or name */
  EBT_ERROR_SYSTEM = 8,            /* an operating-system call failed (errno in the message) */
  EBT_ERROR_NCCL = 9,              /* an NCCL call failed */
  EBT_ERROR_INTERNAL = 10,         /* a bug in ebbtide: please report it */
  EBT_ERROR_HOST_OUT_OF_MEMORY = 11, /* host (pinned) memory exhausted */
  EBT_ERROR_CUDA_RUNTIME = 12,     /* a kernel launch or CUDA runtime call failed */
  EBT_ERROR_VERSION_MISMATCH = 13, /* components of different ebbtide versions were mixed */
  EBT_ERROR_TIMEOUT = 14,          /* a wait ran past its deadline */
  EBT_ERROR_SETTING = 15,          /* an environment setting's value does not parse (the message names it) */
  EBT_STATUS_COUNT = 16            /* not a status: one past the last value */
} ebt_status_t;

/* Text for a status: what it means and what to do next. Never NULL; static storage. */
EBT_API const char* ebt_status_string(ebt_status_t status);

/* The message recorded by the last failing ebbtide call on this thread ("" if none). A successful call does not
 * clear it: read it after a call returned a failure. Thread-local storage, valid until the next ebbtide call on
 * this thread. */
EBT_API const char* ebt_last_error(void);

/* Version of the runtime library, as EBT_VERSION_CODE. Callers compare it with the header they built against. */
EBT_API ebt_status_t ebt_get_version(int* version);

/* ---- logging -------------------------------------------------------------------------------------------
 * Levels and a subsystem mask, configured from EBBTIDE_DEBUG (WARN|INFO|TRACE|NONE), EBBTIDE_DEBUG_SUBSYS
 * (comma list: INIT,MEM,SHIM,COMM,QUANT,OPTIM,ALL; a leading ^ excludes) and EBBTIDE_DEBUG_FILE (path; %p is
 * the pid) on first use, or through ebt_log_configure. Thread-safe. */
typedef enum { EBT_LOG_NONE = 0, EBT_LOG_WARN = 1, EBT_LOG_INFO = 2, EBT_LOG_TRACE = 3 } ebt_log_level_t;
typedef enum {
  EBT_SUBSYS_INIT = 1u << 0,
  EBT_SUBSYS_MEM = 1u << 1,
  EBT_SUBSYS_SHIM = 1u << 2,
  EBT_SUBSYS_COMM = 1u << 3,
  EBT_SUBSYS_QUANT = 1u << 4,
  EBT_SUBSYS_OPTIM = 1u << 5,
  EBT_SUBSYS_ALL = 0xffffffffu
} ebt_subsys_t;

/* A sink receives each formatted line (no trailing newline), on the logging thread, outside the logger's lock;
 * it must be thread-safe and must not log. NULL restores the default sink (stderr or EBBTIDE_DEBUG_FILE). */
typedef void (*ebt_log_sink_t)(int level, unsigned subsys, const char* line, void* user);

EBT_API ebt_status_t ebt_log_configure(int level, unsigned subsys_mask);
EBT_API ebt_status_t ebt_log_get(int* level, unsigned* subsys_mask);
EBT_API ebt_status_t ebt_log_set_sink(ebt_log_sink_t sink, void* user);
/* Emit one line if (level, subsys) is enabled. Used by every native component so there is one logger. */
EBT_API void ebt_log_write(int level, unsigned subsys, const char* file, int line, const char* fmt, ...)
    __attribute__((format(printf, 5, 6)));
/* 1 if a line at (level, subsys) would be written: lets callers skip formatting on hot paths. */
EBT_API int ebt_log_enabled(int level, unsigned subsys);

/* ---- CPU features (cpuid + xgetbv, independent of compile flags) ------------------------------------------ */
typedef enum {
  EBT_CPU_SSE42 = 1u << 0,
  EBT_CPU_AVX = 1u << 1,
  EBT_CPU_AVX2 = 1u << 2,
  EBT_CPU_FMA = 1u << 3,
  EBT_CPU_F16C = 1u << 4,
  EBT_CPU_AVX512F = 1u << 5,
  EBT_CPU_AVX512BW = 1u << 6,
  EBT_CPU_AVX512VL = 1u << 7,
  EBT_CPU_AVX512DQ = 1u << 8,
  EBT_CPU_AVX512_BF16 = 1u << 9,
  EBT_CPU_NEON = 1u << 10,
  EBT_CPU_AMX_BF16 = 1u << 11
} ebt_cpu_feature_t;

/* Features the CPU and OS support (the OS must save the wider registers: xgetbv is checked). */
EBT_API ebt_status_t ebt_cpu_features(unsigned* features);
/* The dispatch level for this process: "avx512_bf16", "avx512", "avx2", "neon" or "scalar": the widest the CPU
 * supports, capped on CPUs where a wider kernel measured slower (the rule table in cpu_features.cc), or any
 * supported level named by EBBTIDE_CPU_ISA. Static storage. EBT_ERROR_SETTING when EBBTIDE_CPU_ISA is not one of
 * those names (any case). */
EBT_API ebt_status_t ebt_cpu_isa(const char** name);
/* Why ebt_cpu_isa chose its level (one line of text, e.g. the rule that capped it). Static storage. */
EBT_API ebt_status_t ebt_cpu_isa_reason(const char** reason);
/* Logical CPUs this process may run on (sched_getaffinity). */
EBT_API ebt_status_t ebt_cpu_affinity_count(int* count);

/* ---- CUDA driver ------------------------------------------------------------------------------------------
 * libcuda.so.1 is opened on first use (dlopen, never linked); symbols resolved through cuGetProcAddress with
 * the driver's own version, so one binary serves CUDA 12 and 13 drivers. EBBTIDE_LIBCUDA names another
 * library: a test hook (the test suite's host-memory fake), read with secure_getenv. */
/* EBT_SUCCESS if the driver loaded and cuInit succeeded; EBT_ERROR_DRIVER_NOT_FOUND otherwise (message says
 * why). Thread-safe; the outcome is cached. */
EBT_API ebt_status_t ebt_driver_status(void);
/* Driver version as cuDriverGetVersion reports it (e.g. 13000), after ebt_driver_status succeeded. */
EBT_API ebt_status_t ebt_driver_version(int* version);
/* Path of the driver library actually loaded (static storage). */
EBT_API ebt_status_t ebt_driver_path(const char** path);
/* Device count, 0 when there is no driver (not an error). */
EBT_API ebt_status_t ebt_device_count(int* count);

/* ---- host memory bandwidth probes (the limits for CPU-side kernels) ---------------------------------------
 * Streams a mix of `elements`-long arrays walked together element by element: `f32_read` fp32 arrays read,
 * `f32_update` fp32 arrays read and written back in place, `bf16_read` / `bf16_update` the same in bf16, and
 * `bf16_write` bf16 arrays written only (non-temporal stores: no write-allocate read). Each count in [0, 4]; the
 * mix must write something. `threads` threads (0 = affinity count), best of `repeats` passes. Reports the bytes
 * the mix moves through DRAM per second (4 / 8 / 2 / 4 / 2 per element per stream of each kind). The mixes with
 * a probe: (1, 1, 0, 0, 0) the in-place triad, (1, 3, 0, 0, 0) an Adam step with fp32 grads, (0, 3, 1, 0, 1) with
 * bf16 grads and a bf16 copy-out, (0, 1, 1, 2, 1) the same with bf16 moments; another is EBT_ERROR_UNSUPPORTED.
 * Blocking; allocates (and first-touches per thread) and frees its own arrays. */
EBT_API ebt_status_t ebt_host_stream_bandwidth(int f32_read, int f32_update, int bf16_read, int bf16_update,
                                               int bf16_write, size_t elements, int threads, int repeats,
                                               double* bytes_per_second);
/* In-place triad a[i] = a[i] + s * b[i] over two float32 arrays of `bytes_per_array` bytes each: the mix
 * {1 fp32 read, 1 fp32 update} of ebt_host_stream_bandwidth (bytes moved: read a, read b, write a). */
EBT_API ebt_status_t ebt_host_triad_bandwidth(size_t bytes_per_array, int threads, int repeats,
                                              double* bytes_per_second);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* EBBTIDE_H_ */
