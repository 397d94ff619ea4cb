/*
 * routing.h — what the interposers ask before taking an allocation (implemented in routing.cc).
 */
#ifndef EBBTIDE_MEMORY_ROUTING_H_
#define EBBTIDE_MEMORY_ROUTING_H_

#include "memory/ebbtide_memory.h"

namespace ebbtide::memory {

// True in a child created by fork(): the engine is off there.
bool forked_child();
// Cheap pre-check (no lock): could this thread's next allocation be captured?
bool routing_might_capture();
// The region for this thread's next allocation: tag (EBT_MEM_TAG_MAX+1 bytes) and backup; false = none.
bool route_current(char* tag, int* backup);

// torch_memory_saver's per-thread configuration (its tms_get_* / tms_set_* C functions, tms_abi.cc), as a view of
// this thread's routing: the innermost region, else the thread's own configuration (made by a tms_set_* call with
// no region open), else the process default region. `pageable`: its cpu_backup_backend is "mmap".
struct TmsView {
  char tag[EBT_MEM_TAG_MAX + 1];
  int backup;        // EBT_MEM_BACKUP_* | flags
  bool pageable;
  bool interesting;  // an allocation of this thread would be captured now
};
void tms_view(TmsView* out);
// Each changes the configuration the view shows (the innermost region, or the thread's own), as
// torch_memory_saver's setter of the same name does. false: bad argument (message set).
bool tms_set_interesting(bool on);
bool tms_set_tag(const char* tag);
bool tms_set_backup(int base, bool on);  // base: EBT_MEM_BACKUP_CPU or EBT_MEM_BACKUP_DISK
bool tms_set_pageable(bool pageable);

}  // namespace ebbtide::memory

#endif  // EBBTIDE_MEMORY_ROUTING_H_
