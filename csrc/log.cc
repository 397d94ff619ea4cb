/*
 * log.cc — the logger. Configuration comes from EBBTIDE_DEBUG / EBBTIDE_DEBUG_SUBSYS / EBBTIDE_DEBUG_FILE on
 * first use (std::call_once) and can be changed at run time (ebt_log_configure). The level and mask are atomics
 * so the enabled check on hot paths is lock-free; writing a line takes the sink mutex.
 * Default: WARN for every subsystem, to stderr. The debug file is opened without following a symbolic link and
 * created with mode 0600; its path is read with secure_getenv (ignored in set-user-ID processes).
 */
#include <fcntl.h>
#include <strings.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "csrc/ebbtide.h"
#include "csrc/param.h"

namespace {

std::atomic<int> g_level{EBT_LOG_WARN};
std::atomic<unsigned> g_mask{EBT_SUBSYS_ALL};
std::once_flag g_env_once;
std::mutex g_sink_mu;           // guards g_sink, g_sink_user, g_file; a leaf (the sink is called after it is released)
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

// "MEM,SHIM" enables those; "^COMM" enables everything but COMM. False on an unknown or empty name.
bool parse_mask(const std::string& text, unsigned* out) {
  const bool invert = !text.empty() && text[0] == '^';
  std::string s = invert ? text.substr(1) : text;
  unsigned mask = 0;
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t end = s.find(',', pos);
    if (end == std::string::npos) end = s.size();
    std::string tok = s.substr(pos, end - pos);
    while (!tok.empty() && tok.back() == ' ') tok.pop_back();
    while (!tok.empty() && tok.front() == ' ') tok.erase(0, 1);
    bool known = false;
    for (const auto& e : kSubsys)
      if (strcasecmp(tok.c_str(), e.name) == 0) {
        mask |= e.bit;
        known = true;
      }
    if (!known) return false;
    pos = end + 1;
  }
  *out = invert ? ~mask : mask;
  return true;
}

std::string mask_accepted(const std::string& text) {
  unsigned m;
  return parse_mask(text, &m) ? "" : "a comma list of INIT, MEM, SHIM, COMM, QUANT, OPTIM, ALL (any case; a leading ^ "
                                     "excludes them)";
}

// The debug file: created with mode 0600 (the log may hold addresses and paths), appended to, never through a
// symbolic link (O_NOFOLLOW on the last component), close-on-exec. Null (with the reason) when it cannot be opened.
FILE* open_debug_file(std::string path, std::string* why) {
  size_t at = path.find("%p");
  if (at != std::string::npos) path.replace(at, 2, std::to_string(getpid()));
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    const int err = errno;
    *why = path + ": " + (err == ELOOP ? "is a symbolic link (refused)" : strerror(err));
    return nullptr;
  }
  FILE* f = fdopen(fd, "a");
  if (!f) {
    *why = path + ": " + strerror(errno);
    close(fd);
  }
  return f;
}

constexpr const char* kLevels[] = {"NONE", "WARN", "INFO", "TRACE"};  // index = ebt_log_level_t

// The logger's own settings (param.h readers, kQuiet: logging them from here would recurse). A bad value keeps
// that setting's default, is reported on stderr once, and makes ebt_log_get fail with EBT_ERROR_SETTING: the
// logger cannot fail the calls that log.
using ebbtide::param::kNoCase;
using ebbtide::param::kQuiet;
using ebbtide::param::kSecure;
// The first bad logging setting (written once, in read_env). A plain array, so it is constant-initialized: the
// logger may be first used by another file's load-time constructor, before this file's dynamic initializers ran.
char g_env_error[512] = "";

void read_env() {
  std::string errors;
  auto note = [&errors] {
    if (errors.empty()) errors = ebt_last_error();
  };
  int level = EBT_LOG_WARN;
  if (ebbtide::param::read_choice("EBBTIDE_DEBUG", kLevels, 4, EBT_LOG_WARN, kQuiet | kNoCase, &level) ==
      EBT_SUCCESS)
    g_level = level;
  else
    note();
  std::string sub;
  unsigned mask = EBT_SUBSYS_ALL;
  if (ebbtide::param::read_string("EBBTIDE_DEBUG_SUBSYS", "ALL", mask_accepted, kQuiet, &sub) == EBT_SUCCESS &&
      parse_mask(sub, &mask))
    g_mask = mask;
  else
    note();
  std::string path;
  if (ebbtide::param::read_string("EBBTIDE_DEBUG_FILE", "", nullptr, kQuiet | kSecure, &path) != EBT_SUCCESS) {
    note();
  } else if (!path.empty()) {
    std::string why;
    g_file = open_debug_file(path, &why);
    if (!g_file) fprintf(stderr, "ebbtide %d WARN EBBTIDE_DEBUG_FILE=%s: cannot open (%s); logging to stderr\n",
                         static_cast<int>(getpid()), path.c_str(), why.c_str());
  }
  if (!errors.empty()) {
    snprintf(g_env_error, sizeof(g_env_error), "%s", errors.c_str());
    fprintf(stderr, "ebbtide %d WARN %s (that setting keeps its default)\n", static_cast<int>(getpid()),
            errors.c_str());
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
  if (level < EBT_LOG_NONE || level > EBT_LOG_TRACE)
    return ebt_set_error_quiet(EBT_ERROR_INVALID_ARGUMENT, "ebt_log_configure: level %d is not in [%d, %d]", level,
                               EBT_LOG_NONE, EBT_LOG_TRACE);
  g_level = level;
  g_mask = subsys_mask;
  return EBT_SUCCESS;
}

ebt_status_t ebt_log_get(int* level, unsigned* subsys_mask) {
  std::call_once(g_env_once, read_env);
  if (!level || !subsys_mask)
    return ebt_set_error_quiet(EBT_ERROR_INVALID_ARGUMENT, "ebt_log_get: level and subsys_mask must not be NULL");
  if (g_env_error[0]) return ebt_set_error_quiet(EBT_ERROR_SETTING, "%s", g_env_error);
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
