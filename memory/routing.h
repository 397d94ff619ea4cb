/*
 * routing.h — what the interposers ask before taking an allocation (implemented in routing.cc).
 */
#ifndef EBBTIDE_MEMORY_ROUTING_H_
#define EBBTIDE_MEMORY_ROUTING_H_

namespace ebbtide::memory {

// True in a child created by fork(): the engine is off there.
bool forked_child();
// Cheap pre-check (no lock): could this thread's next allocation be captured?
bool routing_might_capture();
// The region for this thread's next allocation: tag (EBT_MEM_TAG_MAX+1 bytes) and backup; false = none.
bool route_current(char* tag, int* backup);

}  // namespace ebbtide::memory

#endif  // EBBTIDE_MEMORY_ROUTING_H_
