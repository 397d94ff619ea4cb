/*
 * driver.h — the CUDA driver, loaded at run time.
 *
 * libcuda.so.1 (or $EBBTIDE_LIBCUDA) is dlopen'ed once, under std::call_once, on the first ebt_driver_get();
 * every symbol in driver_symbols.h is resolved into one table through cuGetProcAddress (cudaVersion 12000, so a
 * CUDA 12 or 13 driver hands back the 12.0 ABI declared there), or by dlsym where the library has no
 * cuGetProcAddress (the test suite's fake driver). The table lives for the whole process and is never unloaded.
 * Callers: `const ebt_driver_table_t* drv; EBT_CHECK(ebt_driver_get(&drv)); EBT_CU_CHECK(drv->cuX(...));`
 * OPTIONAL entries may be null: check before calling. Every driver result is either checked (EBT_CU_CHECK*,
 * or compared where the caller handles the failure itself) or ignored on purpose with a reason (EBT_CU_IGNORE).
 */
#ifndef EBBTIDE_CSRC_DRIVER_H_
#define EBBTIDE_CSRC_DRIVER_H_

#include "csrc/cuda_driver_types.h"
#include "csrc/driver_symbols.h"
#include "csrc/ebbtide.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ebt_driver_table {
#define EBT_DRIVER_FIELD(name, args, required) CUresult(*name) args;
  EBT_DRIVER_SYMBOLS(EBT_DRIVER_FIELD)
#undef EBT_DRIVER_FIELD
  int driver_version; /* cuDriverGetVersion, e.g. 13000 */
} ebt_driver_table_t;

/* The resolved table, or EBT_ERROR_DRIVER_NOT_FOUND with the reason in ebt_last_error(). Thread-safe;
 * the first call loads and cuInit()s the driver, later calls are a load of a cached pointer. */
EBT_API ebt_status_t ebt_driver_get(const ebt_driver_table_t** table);

/* Turn a failing CUresult into a status with a message naming the call; OUT_OF_MEMORY maps to
 * EBT_ERROR_OUT_OF_MEMORY, everything else to EBT_ERROR_DRIVER. */
EBT_API ebt_status_t ebt_cu_error(CUresult result, const char* call, const char* file, int line);

/* Log a driver failure that the caller deliberately does not propagate (EBT_CU_IGNORE): one INFO line naming the
 * call, the driver error and `why`. Leaves the thread's last error as it was. */
EBT_API void ebt_cu_ignored(CUresult result, const char* call, const char* why, const char* file, int line);

#ifdef __cplusplus
}
#endif

// Check a driver call made through the table; needs `drv` in scope only for naming (ebt_cu_error looks the
// error name up itself).
#define EBT_CU_CHECK(call)                                                    \
  do {                                                                        \
    CUresult ebt_cu_ = (call);                                                \
    if (ebt_cu_ != CUDA_SUCCESS) return ebt_cu_error(ebt_cu_, #call, __FILE__, __LINE__); \
  } while (0)

#define EBT_CU_CHECK_GOTO(call, st, label)                                    \
  do {                                                                        \
    CUresult ebt_cu_ = (call);                                                \
    if (ebt_cu_ != CUDA_SUCCESS) {                                            \
      (st) = ebt_cu_error(ebt_cu_, #call, __FILE__, __LINE__);                \
      goto label;                                                             \
    }                                                                         \
  } while (0)

// A driver call whose failure is deliberately ignored (NCCL's CHECKIGNORE): cleanup on a path that already failed
// (that first error is the one reported, and ebt_last_error() keeps it), best-effort teardown, or an optional
// figure for a report. `why` (a string literal) says why ignoring it is safe; a failure is logged at INFO with it.
#define EBT_CU_IGNORE(call, why)                                                              \
  do {                                                                                        \
    CUresult ebt_cu_ = (call);                                                                \
    if (ebt_cu_ != CUDA_SUCCESS) ebt_cu_ignored(ebt_cu_, #call, (why), __FILE__, __LINE__);   \
  } while (0)

#endif  // EBBTIDE_CSRC_DRIVER_H_
