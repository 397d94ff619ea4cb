/*
 * status.h — internal error plumbing shared by every native component (not part of the public header).
 *
 * Policy: a failing call records a message for its thread (ebt_set_error, which logs it at INFO too) and returns
 * a status; no failing status goes out without a message recorded with it. Callers up the stack propagate the
 * status unchanged with EBT_CHECK, logging one INFO line per frame so a trace shows the path; a caller that adds
 * context records the message again (ebt_set_error(st, "%s ...", ebt_last_error()) is safe). A successful call
 * leaves the message as it was, so it is read only after a failure; ebt_clear_error() is for a call that absorbs
 * a failure of its own and succeeds (no driver means zero devices). A driver failure that is deliberately not
 * propagated goes through EBT_CU_IGNORE (csrc/driver.h). Nothing exits; nothing throws across extern "C".
 */
#ifndef EBBTIDE_CSRC_STATUS_H_
#define EBBTIDE_CSRC_STATUS_H_

#include <cerrno>
#include <cstring>

#include "csrc/ebbtide.h"
#include "csrc/log.h"

extern "C" {
/* Record `fmt` as this thread's last error and return `status` (so `return ebt_set_error(...)` reads well).
 * Exported so the Python extension's components share the runtime library's thread-local message. */
EBT_API ebt_status_t ebt_set_error(ebt_status_t status, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
/* Same, without the INFO line: for failures found where the logger may itself be being set up (the logger's own
 * calls, and setting parses, csrc/param.cc, which the logger's settings go through). */
EBT_API ebt_status_t ebt_set_error_quiet(ebt_status_t status, const char* fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Forget this thread's last error: for a call that absorbs a failure of its own and succeeds, so that failure's
 * message does not outlive it. Other successful calls leave the message as it was. */
EBT_API void ebt_clear_error(void);
}

// Propagate a failing status from a callee, with one trace line per frame.
#define EBT_CHECK(expr)                                                                \
  do {                                                                                 \
    ebt_status_t ebt_st_ = (expr);                                                     \
    if (ebt_st_ != EBT_SUCCESS) {                                                      \
      EBT_INFO(EBT_SUBSYS_ALL, "%s failed: %s", #expr, ebt_status_string(ebt_st_));    \
      return ebt_st_;                                                                  \
    }                                                                                  \
  } while (0)

// Same, but jump to a cleanup label with `st` set (the NCCL GOTO form).
#define EBT_CHECK_GOTO(expr, st, label)                                                \
  do {                                                                                 \
    (st) = (expr);                                                                     \
    if ((st) != EBT_SUCCESS) {                                                         \
      EBT_INFO(EBT_SUBSYS_ALL, "%s failed: %s", #expr, ebt_status_string(st));         \
      goto label;                                                                      \
    }                                                                                  \
  } while (0)

// Argument validation in native code (Python asserts vanish under -O).
#define EBT_REQUIRE_ARG(cond, ...)                                                     \
  do {                                                                                 \
    if (!(cond)) return ebt_set_error(EBT_ERROR_INVALID_ARGUMENT, __VA_ARGS__);        \
  } while (0)

// An OS call returning -1/errno.
#define EBT_SYS_CHECK(call, what)                                                      \
  do {                                                                                 \
    if ((call) == -1)                                                                  \
      return ebt_set_error(EBT_ERROR_SYSTEM, "%s: %s", (what), std::strerror(errno));  \
  } while (0)

#endif  // EBBTIDE_CSRC_STATUS_H_
