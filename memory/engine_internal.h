/*
 * engine_internal.h — helpers shared by the engine's translation units (engine.cc, engine_pause.cc,
 * engine_resume.cc): timing, the engine's tuning settings, tag and ordering checks.
 */
#ifndef EBBTIDE_MEMORY_ENGINE_INTERNAL_H_
#define EBBTIDE_MEMORY_ENGINE_INTERNAL_H_

#include <chrono>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "memory/engine.h"
#include "memory/ordered_work.h"

namespace ebbtide::memory {

using Clock = std::chrono::steady_clock;
inline double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Tuning settings (memory/settings.h has the variables and defaults).
size_t chunk_bytes();           // copy chunk, bytes
size_t unmap_run_copy_bytes();  // copied bytes that close a pause's unmap run
size_t create_ahead_min();      // resumes of at least this many units create ahead on a helper thread (0: never)
bool poison_enabled();          // fill discard-mode memory with 0xA5 on resume

bool tag_ok(const char* tag);
// EBT_ERROR_NOT_FOUND for `verb` on a tag no region ever named, with the tags that exist (caller holds mu_).
ebt_status_t unknown_tag(const char* verb, const char* tag, const std::map<std::string, std::unique_ptr<Tag>>& tags);

// The host side of one op's transient copies (engine_transient.cc): one step per piece, in copy order.
struct Engine::ShadowSteps {
  OrderedWork work;
  std::vector<std::pair<size_t, size_t>> steps;  // (index into the op's allocations, piece)
  std::vector<size_t> first;                      // per allocation of the op: its first step (kNone: none)
  static constexpr size_t kNone = ~size_t(0);
};

// Resume: a piece of a transient copy to give back once the copy of it has landed (`done`, on its device's H2D
// stream), after every copy of the op was issued.
struct PieceRelease {
  Allocation* a = nullptr;
  size_t piece = 0;
  Device* d = nullptr;
  CUevent done = nullptr;
};
bool by_device_va(const Allocation* a, const Allocation* b);  // sort order of an op's allocations

}  // namespace ebbtide::memory

#endif  // EBBTIDE_MEMORY_ENGINE_INTERNAL_H_
