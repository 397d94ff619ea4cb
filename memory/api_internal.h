/*
 * api_internal.h — what the C API's translation units share (api.cc, api_ops.cc, routing.cc, torch_alloc.cc).
 */
#ifndef EBBTIDE_MEMORY_API_INTERNAL_H_
#define EBBTIDE_MEMORY_API_INTERNAL_H_

#include "csrc/status.h"
#include "memory/ebbtide_memory.h"
#include "memory/routing.h"
#include "memory/settings.h"

// Every ebt_mem_* entry starts with this: a forked child's engine is off (INVALID_STATE), and so is the engine
// of a process whose memory settings do not parse (EBT_ERROR_SETTING naming the variable).
#define EBT_MEM_ENTRY()                                                                                \
  do {                                                                                                 \
    if (ebbtide::memory::forked_child())                                                               \
      return ebt_set_error(EBT_ERROR_INVALID_STATE, "ebbtide memory is disabled in a forked child"); \
    EBT_CHECK(ebbtide::memory::load_settings());                                                       \
  } while (0)

// The entries that only read or unwind this thread's routing state (region pop, disable, current region) or a
// value: usable in a forked child, but not under memory settings that do not parse.
#define EBT_MEM_SETTINGS_OK() EBT_CHECK(ebbtide::memory::load_settings())

namespace ebbtide::memory {

// Copy a report into a caller's struct of dst->struct_size bytes (0: the whole struct); sets dst->struct_size.
void copy_report(const ebt_mem_report_t& src, ebt_mem_report_t* dst);

}  // namespace ebbtide::memory

#endif  // EBBTIDE_MEMORY_API_INTERNAL_H_
