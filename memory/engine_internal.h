/*
 * engine_internal.h — helpers shared by the engine's translation units (engine.cc, engine_pause.cc,
 * engine_resume.cc): timing, the engine's tuning settings, tag and ordering checks.
 */
#ifndef EBBTIDE_MEMORY_ENGINE_INTERNAL_H_
#define EBBTIDE_MEMORY_ENGINE_INTERNAL_H_

#include <chrono>
#include <cstddef>

#include "memory/engine.h"

namespace ebbtide::memory {

using Clock = std::chrono::steady_clock;
inline double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Tuning settings (memory/settings.h has the variables and defaults).
size_t chunk_bytes();           // copy chunk, bytes
size_t unmap_run_copy_bytes();  // copied bytes that close a pause's unmap run
size_t create_ahead_min();      // resumes of at least this many units create ahead on a helper thread (0: never)
bool poison_enabled();          // fill discard-mode memory with 0xA5 on resume

bool tag_ok(const char* tag);
bool by_device_va(const Allocation* a, const Allocation* b);  // sort order of an op's allocations

}  // namespace ebbtide::memory

#endif  // EBBTIDE_MEMORY_ENGINE_INTERNAL_H_
