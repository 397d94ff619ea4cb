/*
 * api_internal.h — what the C API's translation units share (api.cc, api_ops.cc, routing.cc).
 */
#ifndef EBBTIDE_MEMORY_API_INTERNAL_H_
#define EBBTIDE_MEMORY_API_INTERNAL_H_

#include "csrc/status.h"
#include "memory/ebbtide_memory.h"
#include "memory/routing.h"

// Every ebt_mem_* entry that touches the engine starts with this: a forked child's engine is off.
#define EBT_NOT_IN_FORK()                                                                              \
  do {                                                                                                 \
    if (ebbtide::memory::forked_child())                                                               \
      return ebt_set_error(EBT_ERROR_INVALID_STATE, "ebbtide memory is disabled in a forked child"); \
  } while (0)

namespace ebbtide::memory {

// Copy a report into a caller's struct of dst->struct_size bytes (0: the whole struct); sets dst->struct_size.
void copy_report(const ebt_mem_report_t& src, ebt_mem_report_t* dst);

}  // namespace ebbtide::memory

#endif  // EBBTIDE_MEMORY_API_INTERNAL_H_
