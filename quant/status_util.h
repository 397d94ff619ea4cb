/*
 * status_util.h — how quant code reports a failure: record a formatted message as this thread's
 * ebt_last_error() and return the status (errors are values; nothing here throws or exits).
 */
#ifndef EBBTIDE_QUANT_STATUS_UTIL_H_
#define EBBTIDE_QUANT_STATUS_UTIL_H_

#include "csrc/ebbtide.h"

namespace ebbtide::quant {

ebt_status_t quant_error(ebt_status_t status, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

}  // namespace ebbtide::quant

#endif  // EBBTIDE_QUANT_STATUS_UTIL_H_
