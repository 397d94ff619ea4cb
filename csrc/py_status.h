/*
 * py_status.h — carrying a failing ebt_status_t out of pybind11 bindings as a C++ exception that the module
 * entry (python/ebbtide/_module.cc) translates into the typed Python exception from ebbtide.errors. Only
 * bindings use this; native cores return statuses. No pybind11 dependency here.
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

inline void py_check(ebt_status_t st, const char* what) {
  if (st == EBT_SUCCESS) return;
  std::string msg = what;
  const char* last = ebt_last_error();
  if (last && *last) msg += std::string(": ") + last;
  else msg += std::string(": ") + ebt_status_string(st);
  throw StatusError(st, msg);
}

}  // namespace ebbtide

#define EBT_PY_CHECK(expr) ::ebbtide::py_check((expr), #expr)

#endif  // EBBTIDE_CSRC_PY_STATUS_H_
