/*
 * torch_alloc.cc — the PyTorch pluggable-allocator entry points (torch.cuda.memory.CUDAPluggableAllocator):
 * every block PyTorch's caching allocator asks for is engine memory in the calling thread's region (tag
 * "default", backup none, where no region applies: this pool asked for VMM memory, there is nothing to forward to).
 */
#include <sys/types.h>

#include <cstdio>

#include "csrc/log.h"
#include "csrc/status.h"
#include "memory/ebbtide_memory.h"
#include "memory/engine.h"
#include "memory/routing.h"
#include "memory/settings.h"

using namespace ebbtide::memory;

extern "C" {

void* ebt_torch_malloc(ssize_t size, int device, void* stream) {
  if (forked_child() || size <= 0) return nullptr;
  if (load_settings() != EBT_SUCCESS) {  // torch raises its OutOfMemoryError; the reason goes to the log
    EBT_WARN(EBT_SUBSYS_MEM, "ebt_torch_malloc(%zd, device %d) refused: %s", size, device, ebt_last_error());
    return nullptr;
  }
  char tag[EBT_MEM_TAG_MAX + 1];
  int backup = EBT_MEM_BACKUP_NONE;
  if (!route_current(tag, &backup)) {
    snprintf(tag, sizeof(tag), "default");
    backup = EBT_MEM_BACKUP_NONE;
  }
  void* p = nullptr;
  ebt_status_t st = Engine::get().malloc(&p, static_cast<size_t>(size), device, tag, backup);
  if (st != EBT_SUCCESS) {
    // NULL makes the caching allocator free its cache and retry, then raise torch.OutOfMemoryError.
    EBT_INFO(EBT_SUBSYS_MEM, "ebt_torch_malloc(%zd, device %d) failed: %s", size, device, ebt_last_error());
    return nullptr;
  }
  return p;
}

void ebt_torch_free(void* ptr, ssize_t size, int device, void* stream) {
  if (forked_child() || !ptr) return;
  int found = 0;
  if (Engine::get().free(ptr, &found) != EBT_SUCCESS)
    EBT_WARN(EBT_SUBSYS_MEM, "ebt_torch_free(%p): %s", ptr, ebt_last_error());
  else if (!found)
    EBT_WARN(EBT_SUBSYS_MEM, "ebt_torch_free(%p): not an ebbtide allocation (ignored)", ptr);
}

}  // extern "C"
