// settings.cc — every environment setting the memory engine reads, one declaration each (rules: csrc/param.h;
// meanings: docs/native.md).
#include "memory/settings.h"

#include <cstdint>
#include <mutex>

#include "csrc/param.h"
#include "csrc/status.h"

namespace ebbtide::memory {

namespace {

using ebbtide::param::kNoCase;

std::string tag_accepted(const std::string& text) {
  return text.size() <= EBT_MEM_TAG_MAX ? "" : "a tag of 1.." + std::to_string(EBT_MEM_TAG_MAX) + " bytes";
}

constexpr const char* kBackups[] = {"none", "cpu", "disk"};  // index = ebt_mem_backup_t
static_assert(EBT_MEM_BACKUP_NONE == 0 && EBT_MEM_BACKUP_CPU == 1 && EBT_MEM_BACKUP_DISK == 2,
              "kBackups is indexed by ebt_mem_backup_t");
// torch_memory_saver's boolean spellings, exactly (its parser rejects anything else): index < 5 is false.
constexpr const char* kTmsBools[] = {"0", "false", "FALSE", "no", "NO", "1", "true", "TRUE", "yes", "YES"};
constexpr int kTmsFirstTrue = 5;
constexpr const char* kTmsBackends[] = {"pinned", "mmap"};  // its cpu_backup_backend values
constexpr const char* kPopulate[] = {"madvise", "touch", "none"};  // index = ShadowPopulate

// Bytes an allocation or resume must leave free on its device (0: no check).
EBT_PARAM_SIZE(margin_param, "EBBTIDE_MEM_MARGIN_BYTES", Settings().margin_bytes, 0, SIZE_MAX, 0)
// Resume maps each VA-contiguous run of a tag's allocations as one physical allocation.
EBT_PARAM_BOOL(coalesce_param, "EBBTIDE_MEM_COALESCE", Settings().coalesce, 0)
// Largest coalesced mapping: a failed cuMemCreate of a run then wastes little, and the pre-flight's free-memory
// figure stays meaningful for the runs that follow.
EBT_PARAM_SIZE(coalesce_max_param, "EBBTIDE_MEM_COALESCE_MAX_BYTES", Settings().coalesce_max_bytes, 1, SIZE_MAX, 0)
// Copy chunk: as fast as one large copy, and unmap can start early.
EBT_PARAM_SIZE(chunk_param, "EBBTIDE_MEM_CHUNK_BYTES", Settings().chunk_bytes, 1, SIZE_MAX, 0)
// A pause's unmap run with CPU-backed copies closes once it holds this many copied bytes, so unmapping still
// overlaps the later copies.
EBT_PARAM_SIZE(unmap_run_param, "EBBTIDE_MEM_UNMAP_RUN_BYTES", Settings().unmap_run_bytes, 1, SIZE_MAX, 0)
// Resumes of at least this many mappings create physical memory on a helper thread ahead of the maps (0: never;
// off by default until hardware measurements show the driver overlaps creates with maps).
EBT_PARAM_SIZE(create_ahead_param, "EBBTIDE_MEM_CREATE_AHEAD", Settings().create_ahead, 0, SIZE_MAX, 0)
// Debug: fill discard-mode allocations with 0xA5 on resume so stale reads show.
EBT_PARAM_BOOL(poison_param, "EBBTIDE_MEM_POISON", Settings().poison, 0)
// CPU-backed allocations get their pinned host blocks on a runtime thread soon after they are made.
EBT_PARAM_BOOL(prepin_param, "EBBTIDE_MEM_PREPIN", Settings().prepin, 0)
// Threads that touch and register a new pinned host segment (0: min(8, CPUs)).
EBT_PARAM_SIZE(register_threads_param, "EBBTIDE_MEM_REGISTER_THREADS", uint64_t(Settings().register_threads), 0, 1024, 0)
// The process default region at load (a process started under the shim captures every allocation from its start).
EBT_PARAM_STRING(default_tag_param, "EBBTIDE_MEM_DEFAULT_TAG", "", tag_accepted, 0)
EBT_PARAM_CHOICE(default_backup_param, "EBBTIDE_MEM_DEFAULT_BACKUP", kBackups, EBT_MEM_BACKUP_NONE, 0)
// torch_memory_saver's equivalents (tag "default"), honoured when EBBTIDE_MEM_DEFAULT_TAG is unset, so a launcher
// written for it (slime) runs unchanged under this shim; with its spellings and its meanings (CPU copies are
// transient: made at pause, given back at resume unless retained).
EBT_PARAM_CHOICE(tms_enable_param, "TMS_INIT_ENABLE", kTmsBools, 0, 0)
EBT_PARAM_CHOICE(tms_cpu_backup_param, "TMS_INIT_ENABLE_CPU_BACKUP", kTmsBools, 0, 0)
EBT_PARAM_CHOICE(tms_disk_backup_param, "TMS_INIT_ENABLE_DISK_BACKUP", kTmsBools, 0, 0)
EBT_PARAM_CHOICE(tms_backend_param, "TMS_INIT_CPU_BACKUP_BACKEND", kTmsBackends, 0, 0)
EBT_PARAM_CHOICE(tms_retain_param, "TMS_RETAIN_CPU_BACKUP", kTmsBools, 0, 0)
// A transient host copy is populated and registered in pieces of this many bytes (multiple of 2 MiB): small
// enough that the first copy starts soon, large enough that the driver calls cost little.
EBT_PARAM_SIZE(shadow_piece_param, "EBBTIDE_MEM_SHADOW_PIECE_BYTES", Settings().shadow_piece_bytes, 2 << 20,
               size_t(1) << 40, 0)
EBT_PARAM_CHOICE(shadow_populate_param, "EBBTIDE_MEM_SHADOW_POPULATE", kPopulate,
                 static_cast<int>(Settings().shadow_populate), 0)

std::string path_accepted(const std::string& text) { return text.empty() || text[0] != '/' ? "an absolute path" : ""; }
EBT_PARAM_STRING(disk_dir_param, "EBBTIDE_MEM_DISK_DIR", "", path_accepted, 0)
EBT_PARAM_STRING(tms_disk_dir_param, "TMS_DISK_BACKUP_DIR", "", path_accepted, 0)
EBT_PARAM_SIZE(disk_chunk_param, "EBBTIDE_MEM_DISK_CHUNK_BYTES", 0, 0, size_t(4) << 30, 0)
EBT_PARAM_SIZE(tms_disk_chunk_param, "TMS_DISK_BACKUP_CHUNK_MB", 0, 0, 4096, 0)
EBT_PARAM_SIZE(disk_threads_param, "EBBTIDE_MEM_DISK_THREADS", uint64_t(DiskSettings().threads), 1, 64, 0)

// Function-local: the library's load-time setup (routing.cc) may ask before this file's globals are built.
struct State {
  std::once_flag once;
  ebt_status_t status = EBT_SUCCESS;
  std::string message;
  Settings settings;  // parsed values once status is EBT_SUCCESS; the defaults otherwise
};
State& state() {
  static State s;
  return s;
}

ebt_status_t load_all(Settings* s) {
  uint64_t v = 0;
  EBT_CHECK(margin_param(&v));
  s->margin_bytes = static_cast<size_t>(v);
  EBT_CHECK(coalesce_param(&s->coalesce));
  EBT_CHECK(coalesce_max_param(&v));
  s->coalesce_max_bytes = static_cast<size_t>(v);
  EBT_CHECK(chunk_param(&v));
  s->chunk_bytes = static_cast<size_t>(v);
  EBT_CHECK(unmap_run_param(&v));
  s->unmap_run_bytes = static_cast<size_t>(v);
  EBT_CHECK(create_ahead_param(&v));
  s->create_ahead = static_cast<size_t>(v);
  EBT_CHECK(poison_param(&s->poison));
  EBT_CHECK(prepin_param(&s->prepin));
  EBT_CHECK(register_threads_param(&v));
  s->register_threads = static_cast<int>(v);
  EBT_CHECK(shadow_piece_param(&v));
  if (v % (2u << 20) != 0)
    return ::ebbtide::param::bad_value("EBBTIDE_MEM_SHADOW_PIECE_BYTES", std::to_string(v), "a multiple of 2 MiB");
  s->shadow_piece_bytes = static_cast<size_t>(v);
  int populate = 0;
  EBT_CHECK(shadow_populate_param(&populate));
  s->shadow_populate = static_cast<ShadowPopulate>(populate);
  std::string tag;
  int backup = EBT_MEM_BACKUP_NONE, tms = 0, tms_cpu = 0, tms_disk = 0, backend = 0, retain = 0;
  EBT_CHECK(default_tag_param(&tag));
  EBT_CHECK(default_backup_param(&backup));
  EBT_CHECK(tms_enable_param(&tms));
  EBT_CHECK(tms_cpu_backup_param(&tms_cpu));
  EBT_CHECK(tms_disk_backup_param(&tms_disk));
  EBT_CHECK(tms_backend_param(&backend));
  EBT_CHECK(tms_retain_param(&retain));
  s->default_pageable = backend == 1;
  s->host_retain = retain >= kTmsFirstTrue;
  if (tms_cpu >= kTmsFirstTrue && tms_disk >= kTmsFirstTrue)
    return ebt_set_error(EBT_ERROR_SETTING, "TMS_INIT_ENABLE_CPU_BACKUP and TMS_INIT_ENABLE_DISK_BACKUP are both "
                         "set: a region backs its memory up to the CPU or to disk, not both");
  if (!tag.empty()) {
    s->default_tag = tag;
    s->default_backup = backup;
  } else if (tms >= kTmsFirstTrue) {
    s->default_tag = "default";
    if (tms_cpu >= kTmsFirstTrue)
      s->default_backup =
          EBT_MEM_BACKUP_CPU | EBT_MEM_HOST_TRANSIENT | (s->default_pageable ? EBT_MEM_HOST_PAGEABLE : 0);
    else if (tms_disk >= kTmsFirstTrue)
      s->default_backup = EBT_MEM_BACKUP_DISK;
    else
      s->default_backup = EBT_MEM_BACKUP_NONE;
  }
  return EBT_SUCCESS;
}

ebt_status_t load_disk(DiskSettings* d) {
  std::string dir;
  EBT_CHECK(disk_dir_param(&dir));
  if (dir.empty()) EBT_CHECK(tms_disk_dir_param(&dir));
  if (!dir.empty()) d->dir = dir;
  uint64_t bytes = 0, mb = 0, threads = 0;
  EBT_CHECK(disk_chunk_param(&bytes));
  EBT_CHECK(tms_disk_chunk_param(&mb));
  if (bytes == 0 && mb != 0) bytes = mb << 20;
  if (bytes != 0) {
    if (bytes % 4096 != 0)
      return ::ebbtide::param::bad_value("EBBTIDE_MEM_DISK_CHUNK_BYTES", std::to_string(bytes),
                                         "a multiple of 4096 (direct I/O), or 0 for the default");
    d->chunk_bytes = static_cast<size_t>(bytes);
  }
  EBT_CHECK(disk_threads_param(&threads));
  d->threads = static_cast<int>(threads);
  return EBT_SUCCESS;
}

void ensure_loaded(State& st) {
  std::call_once(st.once, [&st] {
    Settings s;
    st.status = load_all(&s);
    if (st.status == EBT_SUCCESS) st.settings = s;
    else st.message = ebt_last_error();
  });
}

}  // namespace

ebt_status_t load_settings() {
  State& st = state();
  ensure_loaded(st);
  if (st.status != EBT_SUCCESS) return ebt_set_error(st.status, "%s", st.message.c_str());
  return EBT_SUCCESS;
}

const Settings& settings() {
  State& st = state();
  ensure_loaded(st);
  return st.settings;
}

ebt_status_t disk_settings(DiskSettings* out) {
  static ::ebbtide::param::Cached<DiskSettings> cache;
  return cache.get(load_disk, out);
}

}  // namespace ebbtide::memory
