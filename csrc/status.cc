// status.cc — status texts, the thread-local last error, and the version query.
#include "csrc/status.h"

#include <cstdarg>
#include <cstdio>
#include <cstring>

namespace {
thread_local char g_last_error[1024] = "";

const char* const kStatusText[] = {
    /* SUCCESS */ "success",
    /* INVALID_ARGUMENT */ "invalid argument: check dtype, shape, device, size and flags",
    /* INVALID_STATE */ "invalid state: the object does not allow this operation now (see the message)",
    /* OUT_OF_MEMORY */ "device out of memory: free or pause other regions, then retry",
    /* DRIVER */ "CUDA driver call failed (the message names the call and the driver error)",
    /* DRIVER_NOT_FOUND */ "no usable CUDA driver: libcuda.so.1 not found, cuInit failed, or no device",
    /* UNSUPPORTED */ "not supported by this build, driver or device",
    /* NOT_FOUND */ "not found: unknown tag, address or name",
    /* SYSTEM */ "operating-system call failed (errno in the message)",
    /* NCCL */ "NCCL call failed",
    /* INTERNAL */ "internal error in ebbtide: please report it with the message",
    /* HOST_OUT_OF_MEMORY */ "host memory exhausted: release pinned host memory or lower backup sizes",
    /* CUDA_RUNTIME */ "kernel launch or CUDA runtime call failed",
    /* VERSION_MISMATCH */ "ebbtide components of different versions were mixed: reinstall ebbtide",
    /* TIMEOUT */ "a wait ran past its deadline",
    /* SETTING */ "an environment setting has a value that does not parse: fix or unset the variable named",
};
static_assert(sizeof(kStatusText) / sizeof(kStatusText[0]) == EBT_STATUS_COUNT,
              "every status needs its text");
}  // namespace

extern "C" {

const char* ebt_status_string(ebt_status_t status) {
  if (static_cast<int>(status) < 0 || status >= EBT_STATUS_COUNT) return "unknown ebbtide status";
  return kStatusText[status];
}

const char* ebt_last_error(void) { return g_last_error; }

void ebt_clear_error(void) { g_last_error[0] = '\0'; }

// Formatted into a local buffer first: callers may pass ebt_last_error() itself as an argument
// (ebt_set_error(st, "%s", ebt_last_error()) re-types an error), and vsnprintf must not write into its own input.
static void set_message(const char* fmt, va_list ap) {
  char buf[sizeof(g_last_error)];
  vsnprintf(buf, sizeof(buf), fmt, ap);
  memcpy(g_last_error, buf, sizeof(buf));
}

ebt_status_t ebt_set_error(ebt_status_t status, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  set_message(fmt, ap);
  va_end(ap);
  EBT_INFO(EBT_SUBSYS_ALL, "error %d (%s): %s", static_cast<int>(status), ebt_status_string(status),
           g_last_error);
  return status;
}

ebt_status_t ebt_set_error_quiet(ebt_status_t status, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  set_message(fmt, ap);
  va_end(ap);
  return status;
}

ebt_status_t ebt_get_version(int* version) {
  if (version == nullptr) return ebt_set_error(EBT_ERROR_INVALID_ARGUMENT, "ebt_get_version: version is NULL");
  *version = EBT_VERSION_CODE;
  return EBT_SUCCESS;
}

}  // extern "C"
