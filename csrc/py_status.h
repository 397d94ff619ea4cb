/*
 * py_status.h — carrying a failing ebt_status_t out of pybind11 bindings as a C++ exception that the module
 * entry (python/ebbtide/_module.cc) translates into the typed Python exception from ebbtide.errors. Only
 * bindings use this; native cores return statuses. No pybind11 dependency here.
 *
 * The exception's message is the user's: the thread's last error (which names the setting, value or argument and
 * what is accepted), or the status text when none was recorded. The native call that failed and its source line
 * are implementation detail: they go to the debug log (INFO, EBBTIDE_DEBUG=INFO), never into the message.
 */
#ifndef EBBTIDE_CSRC_PY_STATUS_H_
#define EBBTIDE_CSRC_PY_STATUS_H_

#include <exception>
#include <string>

#include "csrc/ebbtide.h"

namespace ebbtide {

struct StatusError : std::exception {
  ebt_status_t status;
  std::string message;
  StatusError(ebt_status_t s, std::string m) : status(s), message(std::move(m)) {}
  const char* what() const noexcept override { return message.c_str(); }
};

// What a user reads for a failing status: the last error recorded on this thread, else the status text.
inline std::string user_message(ebt_status_t st) {
  const char* last = ebt_last_error();
  return (last && *last) ? std::string(last) : std::string(ebt_status_string(st));
}

// Throw StatusError for a failing status. `call` (the native call, or the binding's own context) and the call
// site (the caller's file and line, filled in by the compiler) are logged at INFO, not put in the message.
inline void py_check(ebt_status_t st, const char* call, const char* file = __builtin_FILE(),
                     int line = __builtin_LINE()) {
  if (st == EBT_SUCCESS) return;
  if (ebt_log_enabled(EBT_LOG_INFO, EBT_SUBSYS_ALL))
    ebt_log_write(EBT_LOG_INFO, EBT_SUBSYS_ALL, file, line, "%s failed: %s (%s)", call, ebt_status_string(st),
                  user_message(st).c_str());
  throw StatusError(st, user_message(st));
}

}  // namespace ebbtide

#define EBT_PY_CHECK(expr) ::ebbtide::py_check((expr), #expr)

#endif  // EBBTIDE_CSRC_PY_STATUS_H_
