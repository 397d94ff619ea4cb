/*
 * param.h — the one way native code reads an environment setting (implementation: param.cc).
 *
 * Every EBBTIDE_* and TMS_* variable read in native code is declared with one of the EBT_PARAM_* macros below,
 * in the file that owns the setting, the way NCCL declares its NCCL_PARAMs:
 *
 *   EBT_PARAM_SIZE(chunk_bytes_param, "EBBTIDE_MEM_CHUNK_BYTES", size_t(64) << 20, 1, SIZE_MAX)
 *
 * defines `ebt_status_t chunk_bytes_param(uint64_t* out)`. Rules that hold for every setting:
 *  - It is read and parsed on the first call, once (thread-safe); later calls return the cached outcome, the
 *    error included, so every caller sees the same value or the same error.
 *  - Unset, or set to the empty string (or only blanks): the default. Leading and trailing blanks are ignored.
 *  - A value that does not parse fails with EBT_ERROR_SETTING and the message
 *      NAME='value' is not a valid setting: expected <what is accepted>; fix it, or unset NAME for the default (D)
 *    never a silent default (Python maps the status to ebbtide.errors.SettingError).
 *  - The value in force is logged once at INFO on the INIT subsystem (not the logger's own settings: kQuiet).
 *  - kSecure reads the variable with secure_getenv: in a set-user-ID or set-group-ID process (or one with file
 *    capabilities) the variable counts as unset. For settings that name a file to load or to write.
 * Kinds: SIZE (decimal unsigned integer in [lo, hi]), BOOL (1/true/yes/on or 0/false/no/off, any case),
 * CHOICE (one of a fixed list: an index, the default may be -1 for "unset"; case-sensitive unless kNoCase), STRING (any text, optionally checked
 * by a validator that says what it accepts).
 */
#ifndef EBBTIDE_CSRC_PARAM_H_
#define EBBTIDE_CSRC_PARAM_H_

#include <stdint.h>

#include <mutex>
#include <string>

#include "csrc/ebbtide.h"
#include "csrc/status.h"

namespace ebbtide::param {

enum Flags : unsigned {
  kSecure = 1u << 0,  // read with secure_getenv
  kQuiet = 1u << 1,   // do not log the value (the logger's own settings: logging them would recurse)
  kNoCase = 1u << 2,  // CHOICE: compare case-insensitively
};

// The variable's text with surrounding blanks removed; false when unset or blank (the default applies).
bool raw(const char* name, unsigned flags, std::string* text);
// Record "NAME='value' is not a valid setting: expected <accepted>; fix it, or unset NAME for the default (<dflt>)"
// and return EBT_ERROR_SETTING (`dflt` empty: the default is not named).
ebt_status_t bad_value(const char* name, const std::string& value, const std::string& accepted,
                       const std::string& dflt = "");

// Parsers (text already trimmed, never empty). False: not accepted.
bool parse_size(const std::string& text, uint64_t lo, uint64_t hi, uint64_t* out);
bool parse_bool(const std::string& text, bool* out);
// Index of text in choices[0, n), or -1.
int parse_choice(const std::string& text, const char* const* choices, int n, bool nocase);

// Readers: the value (or the default) in *out, or EBT_ERROR_SETTING. They read the environment every call:
// use them through the EBT_PARAM_* macros, which cache.
ebt_status_t read_size(const char* name, uint64_t dflt, uint64_t lo, uint64_t hi, unsigned flags, uint64_t* out);
ebt_status_t read_bool(const char* name, bool dflt, unsigned flags, bool* out);
ebt_status_t read_choice(const char* name, const char* const* choices, int n, int dflt, unsigned flags, int* out);
// validate (may be null) returns "" when the text is accepted, else what is accepted.
ebt_status_t read_string(const char* name, const char* dflt, std::string (*validate)(const std::string&),
                         unsigned flags, std::string* out);

// The cached outcome of one setting: the first get() runs `load`; every call returns the same value or error.
template <typename T>
class Cached {
 public:
  template <typename Load>
  ebt_status_t get(Load load, T* out) {
    std::call_once(once_, [&] {
      status_ = load(&value_);
      if (status_ != EBT_SUCCESS) message_ = ebt_last_error();
    });
    if (status_ != EBT_SUCCESS) return ebt_set_error(status_, "%s", message_.c_str());
    *out = value_;
    return EBT_SUCCESS;
  }

 private:
  std::once_flag once_;
  ebt_status_t status_ = EBT_SUCCESS;
  std::string message_;
  T value_{};
};

}  // namespace ebbtide::param

// Each macro defines `ebt_status_t fn(T* out)` returning the cached value (or the cached EBT_ERROR_SETTING).
#define EBT_PARAM_SIZE(fn, env, dflt, lo, hi, flags)                                                         \
  ebt_status_t fn(uint64_t* out) {                                                                           \
    static ::ebbtide::param::Cached<uint64_t> cache;                                                         \
    return cache.get([](uint64_t* v) { return ::ebbtide::param::read_size(env, dflt, lo, hi, flags, v); }, \
                     out);                                                                                   \
  }

#define EBT_PARAM_BOOL(fn, env, dflt, flags)                                                                   \
  ebt_status_t fn(bool* out) {                                                                                 \
    static ::ebbtide::param::Cached<bool> cache;                                                               \
    return cache.get([](bool* v) { return ::ebbtide::param::read_bool(env, dflt, flags, v); }, out);          \
  }

// choices: a static array of C strings; the value is an index into it.
#define EBT_PARAM_CHOICE(fn, env, choices, dflt, flags)                                                       \
  ebt_status_t fn(int* out) {                                                                                 \
    static ::ebbtide::param::Cached<int> cache;                                                               \
    return cache.get(                                                                                         \
        [](int* v) {                                                                                          \
          return ::ebbtide::param::read_choice(env, choices, int(sizeof(choices) / sizeof(choices[0])), dflt, \
                                               flags, v);                                                     \
        },                                                                                                    \
        out);                                                                                                 \
  }

#define EBT_PARAM_STRING(fn, env, dflt, validate, flags)                                                         \
  ebt_status_t fn(std::string* out) {                                                                            \
    static ::ebbtide::param::Cached<std::string> cache;                                                          \
    return cache.get([](std::string* v) { return ::ebbtide::param::read_string(env, dflt, validate, flags, v); }, \
                     out);                                                                                       \
  }

#endif  // EBBTIDE_CSRC_PARAM_H_
