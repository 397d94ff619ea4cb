// param.cc — reading and parsing environment settings (the contract: param.h).
#include "csrc/param.h"

#include <strings.h>

#include <cctype>
#include <cstdlib>
#include <string>

#include "csrc/status.h"

namespace ebbtide::param {

namespace {

std::string trim(const char* s) {
  const char* b = s;
  while (*b && isspace(static_cast<unsigned char>(*b))) ++b;
  const char* e = b + strlen(b);
  while (e > b && isspace(static_cast<unsigned char>(e[-1]))) --e;
  return std::string(b, e);
}

void log_value(const char* name, const std::string& shown, bool is_default, unsigned flags) {
  if (flags & kQuiet) return;
  EBT_INFO(EBT_SUBSYS_INIT, "setting %s = %s%s", name, shown.c_str(), is_default ? " (default)" : "");
}

std::string range_text(const char* what, uint64_t lo, uint64_t hi) {
  if (hi == UINT64_MAX) return std::string(what) + " >= " + std::to_string(lo);
  return std::string(what) + " in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
}

}  // namespace

bool raw(const char* name, unsigned flags, std::string* text) {
  const char* v = (flags & kSecure) ? secure_getenv(name) : getenv(name);
  if (!v) return false;
  *text = trim(v);
  return !text->empty();
}

ebt_status_t bad_value(const char* name, const std::string& value, const std::string& accepted,
                       const std::string& dflt) {
  return ebt_set_error_quiet(EBT_ERROR_SETTING,
                             "%s='%s' is not a valid setting: expected %s; fix it, or unset %s for the default%s%s%s",
                             name, value.c_str(), accepted.c_str(), name, dflt.empty() ? "" : " (",
                             dflt.c_str(), dflt.empty() ? "" : ")");
}

bool parse_size(const std::string& text, uint64_t lo, uint64_t hi, uint64_t* out) {
  if (text.empty() || text.size() > 20) return false;
  uint64_t v = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return false;  // no sign, no suffix, no hex: one spelling per value
    const uint64_t d = static_cast<uint64_t>(c - '0');
    if (v > (UINT64_MAX - d) / 10) return false;  // overflow
    v = v * 10 + d;
  }
  if (v < lo || v > hi) return false;
  *out = v;
  return true;
}

bool parse_bool(const std::string& text, bool* out) {
  for (const char* t : {"1", "true", "yes", "on"})
    if (strcasecmp(text.c_str(), t) == 0) return *out = true, true;
  for (const char* f : {"0", "false", "no", "off"})
    if (strcasecmp(text.c_str(), f) == 0) return *out = false, true;
  return false;
}

int parse_choice(const std::string& text, const char* const* choices, int n, bool nocase) {
  for (int i = 0; i < n; ++i)
    if ((nocase ? strcasecmp(text.c_str(), choices[i]) : strcmp(text.c_str(), choices[i])) == 0) return i;
  return -1;
}

ebt_status_t read_size(const char* name, uint64_t dflt, uint64_t lo, uint64_t hi, unsigned flags, uint64_t* out) {
  std::string text;
  if (!raw(name, flags, &text)) {
    *out = dflt;
    log_value(name, std::to_string(dflt), true, flags);
    return EBT_SUCCESS;
  }
  if (!parse_size(text, lo, hi, out))
    return bad_value(name, text, range_text("a decimal integer", lo, hi) + " (digits only)", std::to_string(dflt));
  log_value(name, std::to_string(*out), false, flags);
  return EBT_SUCCESS;
}

ebt_status_t read_bool(const char* name, bool dflt, unsigned flags, bool* out) {
  std::string text;
  if (!raw(name, flags, &text)) {
    *out = dflt;
    log_value(name, dflt ? "1" : "0", true, flags);
    return EBT_SUCCESS;
  }
  if (!parse_bool(text, out))
    return bad_value(name, text, "1/true/yes/on or 0/false/no/off (any case)", dflt ? "1" : "0");
  log_value(name, *out ? "1" : "0", false, flags);
  return EBT_SUCCESS;
}

ebt_status_t read_choice(const char* name, const char* const* choices, int n, int dflt, unsigned flags, int* out) {
  std::string text;
  if (!raw(name, flags, &text)) {
    *out = dflt;
    log_value(name, dflt >= 0 ? choices[dflt] : "unset", true, flags);
    return EBT_SUCCESS;
  }
  const int i = parse_choice(text, choices, n, (flags & kNoCase) != 0);
  if (i < 0) {
    std::string accepted = "one of ";
    for (int k = 0; k < n; ++k) accepted += (k ? ", " : "") + std::string(choices[k]);
    if (flags & kNoCase) accepted += " (any case)";
    return bad_value(name, text, accepted, dflt >= 0 ? choices[dflt] : "");
  }
  *out = i;
  log_value(name, choices[i], false, flags);
  return EBT_SUCCESS;
}

ebt_status_t read_string(const char* name, const char* dflt, std::string (*validate)(const std::string&),
                         unsigned flags, std::string* out) {
  std::string text;
  if (!raw(name, flags, &text)) {
    *out = dflt;
    log_value(name, "'" + *out + "'", true, flags);
    return EBT_SUCCESS;
  }
  if (validate) {
    const std::string accepted = validate(text);
    if (!accepted.empty()) return bad_value(name, text, accepted, *dflt ? "'" + std::string(dflt) + "'" : "");
  }
  *out = text;
  log_value(name, "'" + text + "'", false, flags);
  return EBT_SUCCESS;
}

}  // namespace ebbtide::param
