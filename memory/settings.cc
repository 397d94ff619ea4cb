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

constexpr const char* kBackups[] = {"none", "cpu"};  // index = ebt_mem_backup_t
static_assert(EBT_MEM_BACKUP_NONE == 0 && EBT_MEM_BACKUP_CPU == 1, "kBackups is indexed by ebt_mem_backup_t");

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
// written for it (slime) runs unchanged under this shim. Its own parser accepts the same spellings.
EBT_PARAM_BOOL(tms_enable_param, "TMS_INIT_ENABLE", false, 0)
EBT_PARAM_BOOL(tms_cpu_backup_param, "TMS_INIT_ENABLE_CPU_BACKUP", false, 0)

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
  std::string tag;
  int backup = EBT_MEM_BACKUP_NONE;
  bool tms = false, tms_cpu = false;
  EBT_CHECK(default_tag_param(&tag));
  EBT_CHECK(default_backup_param(&backup));
  EBT_CHECK(tms_enable_param(&tms));
  EBT_CHECK(tms_cpu_backup_param(&tms_cpu));
  if (!tag.empty()) {
    s->default_tag = tag;
    s->default_backup = backup;
  } else if (tms) {
    s->default_tag = "default";
    s->default_backup = tms_cpu ? EBT_MEM_BACKUP_CPU : EBT_MEM_BACKUP_NONE;
  }
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

}  // namespace ebbtide::memory
