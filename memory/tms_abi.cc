/*
 * tms_abi.cc — torch_memory_saver's C functions (tms_*), exported by libebbtide.so with that library's names,
 * argument conventions and return types, so code that calls them (through ctypes.CDLL(None) in a preloaded
 * process, or through torch_memory_saver's own binary wrapper) reaches ebbtide's engine:
 *
 *   int  tms_pause(const char* tag)          / tms_resume: NULL = every tag; 0 on success (a tag no region ever
 *                                              named: nothing to do, 0); else the ebt_status_t, reason logged
 *   void tms_set_interesting_region(bool)    / bool tms_get_interesting_region(void)
 *   void tms_set_current_tag(const char*)    / const char* tms_get_current_tag(void)   (a per-thread copy)
 *   void tms_set_enable_cpu_backup(bool)     / bool tms_get_enable_cpu_backup(void)
 *   void tms_set_cpu_backup_backend(const char* "pinned"|"mmap") / const char* tms_get_cpu_backup_backend(void)
 *   void tms_set_enable_disk_backup(bool)    / bool tms_get_enable_disk_backup(void)
 *   void tms_set_disk_backup_dir(const char*)
 *   void tms_set_retain_cpu_backup(bool)     / bool tms_get_retain_cpu_backup(void)
 *   uint8_t* tms_get_cpu_backup_pointer(const uint8_t* gpu_ptr, uint64_t size): the host copy of
 *                                              [gpu_ptr, gpu_ptr + size), or NULL where there is none
 *
 * The configuration functions act on the calling thread's routing, as there (memory/routing.h TmsView): the
 * innermost region, else the thread's own configuration, else the process default region (TMS_INIT_*). A CPU backup
 * set through them is a transient host copy (its semantics). Where the original aborts the process on bad input,
 * these log a warning and change nothing (void functions have no other way to say so).
 */
#include <cstdint>
#include <cstring>

#include "csrc/log.h"
#include "csrc/status.h"
#include "memory/api_internal.h"
#include "memory/engine.h"
#include "memory/routing.h"

using namespace ebbtide::memory;

namespace {

// The memory settings parse and this is not a forked child; else warn once per call site kind and refuse.
bool usable(const char* fn) {
  if (forked_child()) {
    EBT_WARN(EBT_SUBSYS_MEM, "%s: ebbtide memory is disabled in a forked child", fn);
    return false;
  }
  if (load_settings() != EBT_SUCCESS) {
    EBT_WARN(EBT_SUBSYS_MEM, "%s: %s", fn, ebt_last_error());
    return false;
  }
  return true;
}

TmsView view() {
  TmsView v;
  tms_view(&v);
  return v;
}

int run_op(bool pause, const char* tag) {
  const char* fn = pause ? "tms_pause" : "tms_resume";
  if (!usable(fn)) return EBT_ERROR_INVALID_STATE;
  ebt_status_t st = pause ? ebt_mem_pause(tag, nullptr) : ebt_mem_resume(tag, nullptr);
  if (st == EBT_ERROR_NOT_FOUND) return 0;  // no region ever named the tag: nothing of it to pause or resume
  if (st != EBT_SUCCESS) EBT_WARN(EBT_SUBSYS_MEM, "%s(%s): %s", fn, tag ? tag : "NULL", ebt_last_error());
  return st;
}

}  // namespace

extern "C" {

EBT_API int tms_pause(const char* tag) { return run_op(true, tag); }
EBT_API int tms_resume(const char* tag) { return run_op(false, tag); }

EBT_API void tms_set_interesting_region(bool on) {
  if (usable("tms_set_interesting_region")) tms_set_interesting(on);
}
EBT_API bool tms_get_interesting_region(void) { return usable("tms_get_interesting_region") && view().interesting; }

EBT_API void tms_set_current_tag(const char* tag) {
  if (usable("tms_set_current_tag") && !tms_set_tag(tag))
    EBT_WARN(EBT_SUBSYS_MEM, "tms_set_current_tag: %s (unchanged)", ebt_last_error());
}
EBT_API const char* tms_get_current_tag(void) {
  static thread_local char tag[EBT_MEM_TAG_MAX + 1];
  TmsView v = view();
  memcpy(tag, v.tag, sizeof(tag));
  return tag;
}

EBT_API void tms_set_enable_cpu_backup(bool on) {
  if (usable("tms_set_enable_cpu_backup")) tms_set_backup(EBT_MEM_BACKUP_CPU, on);
}
EBT_API bool tms_get_enable_cpu_backup(void) {
  return (view().backup & EBT_MEM_BACKUP_MASK) == EBT_MEM_BACKUP_CPU;
}

EBT_API void tms_set_cpu_backup_backend(const char* backend) {
  if (!usable("tms_set_cpu_backup_backend")) return;
  if (backend && (!strcmp(backend, "pinned") || !strcmp(backend, "mmap"))) tms_set_pageable(!strcmp(backend, "mmap"));
  else EBT_WARN(EBT_SUBSYS_MEM, "tms_set_cpu_backup_backend('%s'): expected pinned or mmap (unchanged)",
                backend ? backend : "NULL");
}
EBT_API const char* tms_get_cpu_backup_backend(void) { return view().pageable ? "mmap" : "pinned"; }

EBT_API void tms_set_enable_disk_backup(bool on) {
  if (usable("tms_set_enable_disk_backup")) tms_set_backup(EBT_MEM_BACKUP_DISK, on);
}
EBT_API bool tms_get_enable_disk_backup(void) {
  return (view().backup & EBT_MEM_BACKUP_MASK) == EBT_MEM_BACKUP_DISK;
}

EBT_API void tms_set_disk_backup_dir(const char* dir) {
  if (usable("tms_set_disk_backup_dir") && ebt_mem_set_disk_dir(dir) != EBT_SUCCESS)
    EBT_WARN(EBT_SUBSYS_MEM, "tms_set_disk_backup_dir: %s (unchanged)", ebt_last_error());
}

EBT_API void tms_set_retain_cpu_backup(bool on) {
  if (usable("tms_set_retain_cpu_backup")) ebt_mem_set_host_retention(on ? 1 : 0);
}
EBT_API bool tms_get_retain_cpu_backup(void) {
  int on = 0;
  return ebt_mem_get_host_retention(&on) == EBT_SUCCESS && on != 0;
}

EBT_API uint8_t* tms_get_cpu_backup_pointer(const uint8_t* gpu_ptr, uint64_t size) {
  void* host = nullptr;
  size_t after = 0;
  if (!usable("tms_get_cpu_backup_pointer") || ebt_mem_get_cpu_backup(gpu_ptr, &host, &after) != EBT_SUCCESS)
    return nullptr;
  return host && after >= size ? static_cast<uint8_t*>(host) : nullptr;
}

}  // extern "C"
