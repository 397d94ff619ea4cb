/*
 * settings.h — the memory engine's environment settings, declared once each in settings.cc (csrc/param.h rules:
 * parsed strictly on first use, cached, a bad value is EBT_ERROR_SETTING naming variable, value and what is
 * accepted). Every ebt_mem_* entry point checks them first (EBT_MEM_ENTRY), so a bad memory setting makes every
 * memory call fail with that error instead of running with a silent default; the interposers forward nothing
 * into the engine then and return a CUDA initialization error.
 */
#ifndef EBBTIDE_MEMORY_SETTINGS_H_
#define EBBTIDE_MEMORY_SETTINGS_H_

#include <cstddef>
#include <string>

#include "memory/ebbtide_memory.h"

namespace ebbtide::memory {

// How a transient host copy's fresh pages are faulted in before cuMemHostRegister pins them.
enum class ShadowPopulate { kMadvise = 0, kTouch = 1, kNone = 2 };

// The member initializers are the defaults (the declarations in settings.cc take them from here).
struct Settings {
  size_t margin_bytes = 0;                         // EBBTIDE_MEM_MARGIN_BYTES (0: no check)
  bool coalesce = true;                            // EBBTIDE_MEM_COALESCE (0: one mapping per allocation)
  size_t coalesce_max_bytes = size_t(4) << 30;     // EBBTIDE_MEM_COALESCE_MAX_BYTES
  size_t chunk_bytes = size_t(64) << 20;           // EBBTIDE_MEM_CHUNK_BYTES
  size_t unmap_run_bytes = size_t(256) << 20;      // EBBTIDE_MEM_UNMAP_RUN_BYTES
  size_t create_ahead = 0;                         // EBBTIDE_MEM_CREATE_AHEAD (0: never)
  bool poison = false;                             // EBBTIDE_MEM_POISON
  bool prepin = true;                              // EBBTIDE_MEM_PREPIN
  int register_threads = 0;                        // EBBTIDE_MEM_REGISTER_THREADS (0: min(8, CPUs))
  std::string default_tag;             // EBBTIDE_MEM_DEFAULT_TAG, else "default" under TMS_INIT_ENABLE ("" none)
  // EBBTIDE_MEM_DEFAULT_BACKUP, or torch_memory_saver's TMS_INIT_ENABLE_CPU_BACKUP (a transient copy, pageable
  // under TMS_INIT_CPU_BACKUP_BACKEND=mmap) / TMS_INIT_ENABLE_DISK_BACKUP
  int default_backup = EBT_MEM_BACKUP_NONE;
  bool default_pageable = false;       // TMS_INIT_CPU_BACKUP_BACKEND=mmap: the process's default CPU-copy backend
  bool host_retain = false;            // TMS_RETAIN_CPU_BACKUP: host retention at load
  size_t shadow_piece_bytes = size_t(32) << 20;       // EBBTIDE_MEM_SHADOW_PIECE_BYTES
  ShadowPopulate shadow_populate = ShadowPopulate::kMadvise;  // EBBTIDE_MEM_SHADOW_POPULATE
};

// The disk tier's settings, read at its first use (a disk region, the directory's first query or change, or a
// disk pause), the way torch_memory_saver reads its own: a program may set them after importing the library.
struct DiskSettings {
  std::string dir = "/tmp";            // EBBTIDE_MEM_DISK_DIR, else TMS_DISK_BACKUP_DIR
  size_t chunk_bytes = size_t(64) << 20;  // EBBTIDE_MEM_DISK_CHUNK_BYTES, else TMS_DISK_BACKUP_CHUNK_MB MiB
  int threads = 2;                     // EBBTIDE_MEM_DISK_THREADS: I/O threads (each keeps one chunk in flight)
};
// EBT_ERROR_SETTING (message names the variable) if one does not parse; cached after the first call.
ebt_status_t disk_settings(DiskSettings* out);

// Parse every memory setting (first call; cached after). EBT_ERROR_SETTING (message set) if any is bad.
ebt_status_t load_settings();
// The settings in force: parsed ones after load_settings() succeeded (every entry point has checked it by the
// time the engine runs), the defaults otherwise.
const Settings& settings();

}  // namespace ebbtide::memory

#endif  // EBBTIDE_MEMORY_SETTINGS_H_
