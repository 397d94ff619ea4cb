/*
 * log.cc — the logger. Configuration comes from EBBTIDE_DEBUG / EBBTIDE_DEBUG_SUBSYS / EBBTIDE_DEBUG_FILE on
 * first use (std::call_once) and can be changed at run time (ebt_log_configure). The level and mask are atomics
 * so the enabled check on hot paths is lock-free; writing a line takes the sink mutex.
 * Default: WARN for every subsystem, to stderr.
 */
#include <strings.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "csrc/ebbtide.h"

namespace {

std::atomic<int> g_level{EBT_LOG_WARN};
std::atomic<unsigned> g_mask{EBT_SUBSYS_ALL};
std::once_flag g_env_once;
std::mutex g_sink_mu;           // guards g_sink, g_sink_user, g_file
ebt_log_sink_t g_sink = nullptr;
void* g_sink_user = nullptr;
FILE* g_file = nullptr;         // EBBTIDE_DEBUG_FILE, opened once; stderr when null

struct SubsysName {
  const char* name;
  unsigned bit;
};
constexpr SubsysName kSubsys[] = {{"INIT", EBT_SUBSYS_INIT},   {"MEM", EBT_SUBSYS_MEM},
                                  {"SHIM", EBT_SUBSYS_SHIM},   {"COMM", EBT_SUBSYS_COMM},
                                  {"QUANT", EBT_SUBSYS_QUANT}, {"OPTIM", EBT_SUBSYS_OPTIM},
                                  {"ALL", EBT_SUBSYS_ALL}};

const char* subsys_name(unsigned s) {
  for (const auto& e : kSubsys)
    if (e.bit == s) return e.name;
  return "ALL";
}

// "MEM,SHIM" enables those; "^COMM" enables everything but COMM.
unsigned parse_mask(const char* spec) {
  bool invert = spec[0] == '^';
  if (invert) ++spec;
  unsigned mask = 0;
  std::string s(spec);
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t end = s.find(',', pos);
    if (end == std::string::npos) end = s.size();
    std::string tok = s.substr(pos, end - pos);
    for (const auto& e : kSubsys)
      if (strcasecmp(tok.c_str(), e.name) == 0) mask |= e.bit;
    pos = end + 1;
  }
  return invert ? ~mask : mask;
}

void read_env() {
  if (const char* lv = getenv("EBBTIDE_DEBUG")) {
    if (!strcasecmp(lv, "NONE")) g_level = EBT_LOG_NONE;
    else if (!strcasecmp(lv, "WARN")) g_level = EBT_LOG_WARN;
    else if (!strcasecmp(lv, "INFO")) g_level = EBT_LOG_INFO;
    else if (!strcasecmp(lv, "TRACE")) g_level = EBT_LOG_TRACE;
  }
  if (const char* sub = getenv("EBBTIDE_DEBUG_SUBSYS")) g_mask = parse_mask(sub);
  if (const char* path = getenv("EBBTIDE_DEBUG_FILE")) {
    std::string p(path);
    size_t at = p.find("%p");
    if (at != std::string::npos) p.replace(at, 2, std::to_string(getpid()));
    g_file = fopen(p.c_str(), "a");  // on failure lines go to stderr
  }
}

const char* level_name(int level) {
  switch (level) {
    case EBT_LOG_WARN: return "WARN";
    case EBT_LOG_INFO: return "INFO";
    default: return "TRACE";
  }
}

}  // namespace

extern "C" {

int ebt_log_enabled(int level, unsigned subsys) {
  std::call_once(g_env_once, read_env);
  return level <= g_level.load(std::memory_order_relaxed) && (subsys & g_mask.load(std::memory_order_relaxed));
}

void ebt_log_write(int level, unsigned subsys, const char* file, int line, const char* fmt, ...) {
  if (!ebt_log_enabled(level, subsys)) return;
  char msg[1536];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  const char* base = strrchr(file, '/');
  char out[2048];
  snprintf(out, sizeof(out), "ebbtide %d:%ld %s %s %s:%d %s", static_cast<int>(getpid()),
           static_cast<long>(syscall(SYS_gettid)), level_name(level), subsys_name(subsys), base ? base + 1 : file,
           line, msg);
  ebt_log_sink_t sink;
  void* user;
  {
    std::lock_guard<std::mutex> lock(g_sink_mu);
    sink = g_sink;
    user = g_sink_user;
    if (!sink) {
      FILE* f = g_file ? g_file : stderr;
      fprintf(f, "%s\n", out);
      fflush(f);
      return;
    }
  }
  // Outside the lock: a sink that takes another lock (Python's GIL) cannot deadlock against a thread that
  // holds that lock and logs.
  sink(level, subsys, out, user);
}

ebt_status_t ebt_log_configure(int level, unsigned subsys_mask) {
  std::call_once(g_env_once, read_env);
  if (level < EBT_LOG_NONE || level > EBT_LOG_TRACE) return EBT_ERROR_INVALID_ARGUMENT;
  g_level = level;
  g_mask = subsys_mask;
  return EBT_SUCCESS;
}

ebt_status_t ebt_log_get(int* level, unsigned* subsys_mask) {
  std::call_once(g_env_once, read_env);
  if (!level || !subsys_mask) return EBT_ERROR_INVALID_ARGUMENT;
  *level = g_level.load();
  *subsys_mask = g_mask.load();
  return EBT_SUCCESS;
}

ebt_status_t ebt_log_set_sink(ebt_log_sink_t sink, void* user) {
  std::lock_guard<std::mutex> lock(g_sink_mu);
  g_sink = sink;
  g_sink_user = user;
  return EBT_SUCCESS;
}

}  // extern "C"
