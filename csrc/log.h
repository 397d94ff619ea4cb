/*
 * log.h — the one logger (implementation in log.cc, inside libebbtide.so; every component writes through
 * ebt_log_write so levels, subsystem mask, file and Python routing are set in one place).
 * Disabled lines cost one relaxed atomic load: arguments are not evaluated.
 */
#ifndef EBBTIDE_CSRC_LOG_H_
#define EBBTIDE_CSRC_LOG_H_

#include "csrc/ebbtide.h"

#define EBT_LOG_AT(level, subsys, ...)                                   \
  do {                                                                   \
    if (ebt_log_enabled((level), (subsys)))                              \
      ebt_log_write((level), (subsys), __FILE__, __LINE__, __VA_ARGS__); \
  } while (0)

#define EBT_WARN(subsys, ...) EBT_LOG_AT(EBT_LOG_WARN, (subsys), __VA_ARGS__)
#define EBT_INFO(subsys, ...) EBT_LOG_AT(EBT_LOG_INFO, (subsys), __VA_ARGS__)
#define EBT_TRACE(subsys, ...) EBT_LOG_AT(EBT_LOG_TRACE, (subsys), __VA_ARGS__)

#endif  // EBBTIDE_CSRC_LOG_H_
