/*
 * api.cc — the exported memory C API's forwarders (memory/ebbtide_memory.h): argument checks, fork safety and
 * versioned struct copies around the engine. Routing: routing.cc; pause/resume: api_ops.cc; the PyTorch
 * pluggable-allocator entry points: torch_alloc.cc.
 */
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>
#include <new>
#include <string>

#include "csrc/status.h"
#include "memory/api_internal.h"
#include "memory/engine.h"

using namespace ebbtide::memory;

namespace ebbtide::memory {

void copy_report(const ebt_mem_report_t& src, ebt_mem_report_t* dst) {
  if (!dst) return;
  size_t n = dst->struct_size && dst->struct_size < sizeof(src) ? dst->struct_size : sizeof(src);
  memcpy(dst, &src, n);
  dst->struct_size = n;
}
}  // namespace ebbtide::memory

namespace {

// The stats structs only grow by appending fields, so a caller states the size of the struct it was built with
// and gets that prefix: old callers keep working with new libraries. Fields this library does not know (a newer
// caller's) read as zero, never as stale bytes.
void copy_versioned(void* dst, size_t dst_size, const void* src, size_t src_size) {
  const size_t n = std::min(dst_size, src_size);
  memcpy(dst, src, n);
  if (dst_size > n) memset(static_cast<char*>(dst) + n, 0, dst_size - n);
}
}  // namespace

extern "C" {

ebt_status_t ebt_mem_malloc(void** ptr, size_t size, int device, const char* tag, int backup) {
  EBT_MEM_ENTRY();
  return Engine::get().malloc(ptr, size, device, tag, backup);
}

ebt_status_t ebt_mem_free(void* ptr, int* found) {
  EBT_MEM_ENTRY();
  return Engine::get().free(ptr, found);
}
ebt_status_t ebt_mem_mark_clean(const char* tag) {
  EBT_MEM_ENTRY();
  return Engine::get().mark_clean(tag);
}

ebt_status_t ebt_mem_tag_state(const char* tag, int* state, unsigned long long* pauses) {
  EBT_MEM_ENTRY();
  return Engine::get().tag_state(tag, state, pauses);
}

ebt_status_t ebt_mem_export_fd(const void* ptr, int* fd, size_t* offset, size_t* size) {
  EBT_MEM_ENTRY();
  return Engine::get().export_fd(ptr, fd, offset, size);
}

ebt_status_t ebt_mem_import_fd(int fd, size_t size, int device, void** ptr) {
  EBT_MEM_ENTRY();
  return Engine::get().import_fd(fd, size, device, ptr);
}

ebt_status_t ebt_mem_close_import(void* ptr) {
  EBT_MEM_ENTRY();
  return Engine::get().close_import(ptr);
}

ebt_status_t ebt_mem_set_memory_margin(size_t bytes) {
  EBT_MEM_ENTRY();
  Engine::get().set_margin(bytes);
  return EBT_SUCCESS;
}

ebt_status_t ebt_mem_get_memory_margin(size_t* bytes) {
  EBT_MEM_SETTINGS_OK();
  EBT_REQUIRE_ARG(bytes, "bytes is NULL");
  *bytes = Engine::get().margin();
  return EBT_SUCCESS;
}

ebt_status_t ebt_mem_set_coalescing(int enabled) {
  EBT_MEM_ENTRY();
  EBT_REQUIRE_ARG(enabled == 0 || enabled == 1, "enabled must be 0 or 1, not %d", enabled);
  Engine::get().set_coalescing(enabled != 0);
  return EBT_SUCCESS;
}

ebt_status_t ebt_mem_get_coalescing(int* enabled) {
  EBT_MEM_SETTINGS_OK();
  EBT_REQUIRE_ARG(enabled, "enabled is NULL");
  *enabled = Engine::get().coalescing() ? 1 : 0;
  return EBT_SUCCESS;
}

ebt_status_t ebt_mem_set_host_retention(int retain) {
  EBT_MEM_ENTRY();
  EBT_REQUIRE_ARG(retain == 0 || retain == 1, "retain must be 0 or 1, not %d", retain);
  Engine::get().set_host_retention(retain != 0);
  return EBT_SUCCESS;
}

ebt_status_t ebt_mem_get_host_retention(int* retain) {
  EBT_MEM_SETTINGS_OK();
  EBT_REQUIRE_ARG(retain, "retain is NULL");
  *retain = Engine::get().host_retention() ? 1 : 0;
  return EBT_SUCCESS;
}

ebt_status_t ebt_mem_set_disk_dir(const char* dir) {
  EBT_MEM_ENTRY();
  return Engine::get().set_disk_dir(dir);
}

ebt_status_t ebt_mem_get_disk_dir(char* buf, size_t len) {
  EBT_MEM_ENTRY();
  EBT_REQUIRE_ARG(buf && len, "buf is NULL or len is 0");
  std::string dir;
  EBT_CHECK(Engine::get().disk_dir(&dir));
  EBT_REQUIRE_ARG(dir.size() < len, "buf holds %zu bytes; the directory needs %zu", len, dir.size() + 1);
  memcpy(buf, dir.c_str(), dir.size() + 1);
  return EBT_SUCCESS;
}

ebt_status_t ebt_mem_stats(void* rows, size_t row_size, size_t capacity, size_t* count) {
  EBT_MEM_ENTRY();
  EBT_REQUIRE_ARG(count, "count is NULL");
  EBT_REQUIRE_ARG(capacity == 0 || rows, "rows is NULL with capacity %zu", capacity);
  EBT_REQUIRE_ARG(capacity == 0 || row_size >= offsetof(ebt_mem_tag_stats_t, bytes_pending_free),
                  "row_size %zu is smaller than any released ebt_mem_tag_stats_t", row_size);
  if (capacity == 0) return Engine::get().stats(nullptr, 0, count);
  std::unique_ptr<ebt_mem_tag_stats_t[]> full(new (std::nothrow) ebt_mem_tag_stats_t[capacity]);
  if (!full) return ebt_set_error(EBT_ERROR_HOST_OUT_OF_MEMORY, "ebt_mem_stats: no memory for %zu rows", capacity);
  ebt_status_t st = Engine::get().stats(full.get(), capacity, count);
  if (st != EBT_SUCCESS) return st;
  for (size_t i = 0; i < std::min(capacity, *count); ++i)
    copy_versioned(static_cast<char*>(rows) + i * row_size, row_size, &full[i], sizeof(full[i]));
  return EBT_SUCCESS;
}

ebt_status_t ebt_mem_global_stats(void* out, size_t size) {
  EBT_MEM_ENTRY();
  EBT_REQUIRE_ARG(out, "out is NULL");
  EBT_REQUIRE_ARG(size >= offsetof(ebt_mem_global_stats_t, coalesced_mappings),
                  "size %zu is smaller than any released ebt_mem_global_stats_t", size);
  ebt_mem_global_stats_t g;
  ebt_status_t st = Engine::get().global_stats(&g);
  if (st == EBT_SUCCESS) copy_versioned(out, size, &g, sizeof(g));
  return st;
}

ebt_status_t ebt_mem_tag_reports(const char* tag, ebt_mem_report_t* last_pause, ebt_mem_report_t* last_resume) {
  EBT_MEM_ENTRY();
  ebt_mem_report_t p, r;
  ebt_status_t st = Engine::get().tag_reports(tag, &p, &r);
  if (st != EBT_SUCCESS) return st;
  copy_report(p, last_pause);
  copy_report(r, last_resume);
  return EBT_SUCCESS;
}

ebt_status_t ebt_mem_get_cpu_backup(const void* ptr, void** host, size_t* bytes_after) {
  EBT_MEM_ENTRY();
  return Engine::get().get_cpu_backup(ptr, host, bytes_after);
}

ebt_status_t ebt_mem_lookup(const void* ptr, void** base, size_t* size, char* tag, int* paused) {
  EBT_MEM_ENTRY();
  return Engine::get().lookup(ptr, base, size, tag, paused);
}

ebt_status_t ebt_mem_paused_ranges(uintptr_t* starts, size_t* lengths, size_t capacity, size_t* count) {
  EBT_MEM_ENTRY();
  return Engine::get().paused_ranges(starts, lengths, capacity, count);
}

ebt_status_t ebt_mem_reserve_host_memory(size_t bytes) {
  EBT_MEM_ENTRY();
  return Engine::get().reserve_host(bytes);
}

ebt_status_t ebt_mem_release_host_memory(size_t* released) {
  EBT_MEM_ENTRY();
  return Engine::get().release_host(released);
}

ebt_status_t ebt_mem_set_background_pinning(int enabled) {
  EBT_MEM_ENTRY();
  Engine::get().set_background_pinning(enabled != 0);
  return EBT_SUCCESS;
}

ebt_status_t ebt_mem_wait_background_pinning(void) {
  EBT_MEM_ENTRY();
  Engine::get().wait_background_pinning();
  return EBT_SUCCESS;
}
}  // extern "C"
