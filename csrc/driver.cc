// driver.cc — load libcuda at run time and resolve the symbol table (see driver.h for the contract).
#include "csrc/driver.h"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "csrc/param.h"
#include "csrc/status.h"

namespace {

typedef CUresult (*GetProcAddressV2)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
typedef CUresult (*GetProcAddressV1)(const char*, void**, int, cuuint64_t);

constexpr int kAbiVersion = 12000;  // the ABI of every prototype in driver_symbols.h

std::once_flag g_once;
ebt_driver_table_t g_table;
ebt_status_t g_status = EBT_ERROR_DRIVER_NOT_FOUND;
std::string g_reason;  // why loading failed (kept so every later caller gets the same message)
std::string g_path;    // the library actually opened

void* resolve(void* lib, GetProcAddressV2 gpa2, GetProcAddressV1 gpa1, const char* name) {
  void* fn = nullptr;
  if (gpa2) {
    CUdriverProcAddressQueryResult q;
    if (gpa2(name, &fn, kAbiVersion, CU_GET_PROC_ADDRESS_DEFAULT, &q) == CUDA_SUCCESS && fn) return fn;
  } else if (gpa1) {
    if (gpa1(name, &fn, kAbiVersion, CU_GET_PROC_ADDRESS_DEFAULT) == CUDA_SUCCESS && fn) return fn;
  }
  // No cuGetProcAddress (or it refused): the exported names, newest ABI suffix first.
  std::string v2 = std::string(name) + "_v2";
  fn = dlsym(lib, v2.c_str());
  return fn ? fn : dlsym(lib, name);
}

// EBBTIDE_LIBCUDA: a test hook (the CPU tests point it at a host-memory fake driver). It names a library to
// load into the process, so it is read with secure_getenv: a set-user-ID or file-capability process ignores it.
EBT_PARAM_STRING(libcuda_param, "EBBTIDE_LIBCUDA", "libcuda.so.1", nullptr, ebbtide::param::kSecure)

void load() {
  std::string chosen;
  g_status = libcuda_param(&chosen);
  if (g_status != EBT_SUCCESS) {
    g_reason = ebt_last_error();
    return;
  }
  g_status = EBT_ERROR_DRIVER_NOT_FOUND;
  const char* path = chosen.c_str();
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* e = dlerror();
    g_reason = std::string("cannot load ") + path + ": " + (e ? e : "unknown dlopen error");
    return;
  }
  g_path = path;
  auto gpa2 = reinterpret_cast<GetProcAddressV2>(dlsym(lib, "cuGetProcAddress_v2"));
  auto gpa1 = gpa2 ? nullptr : reinterpret_cast<GetProcAddressV1>(dlsym(lib, "cuGetProcAddress"));
#define EBT_DRIVER_RESOLVE(name, args, required)                                              \
  g_table.name = reinterpret_cast<decltype(g_table.name)>(resolve(lib, gpa2, gpa1, #name));   \
  if (!g_table.name && (required)) {                                                          \
    g_reason = std::string(path) + " lacks the required symbol " #name;                       \
    return;                                                                                   \
  }
  EBT_DRIVER_SYMBOLS(EBT_DRIVER_RESOLVE)
#undef EBT_DRIVER_RESOLVE
  CUresult r = g_table.cuInit(0);
  if (r != CUDA_SUCCESS) {
    const char* name = nullptr;
    g_table.cuGetErrorName(r, &name);
    g_reason = std::string("cuInit failed: ") + (name ? name : "unknown error") + " (" + std::to_string(r) +
               "): no usable GPU or driver";
    return;
  }
  g_table.cuDriverGetVersion(&g_table.driver_version);
  g_status = EBT_SUCCESS;
  EBT_INFO(EBT_SUBSYS_INIT, "loaded CUDA driver %s, version %d", path, g_table.driver_version);
}

}  // namespace

extern "C" {

ebt_status_t ebt_driver_get(const ebt_driver_table_t** table) {
  if (!table) return ebt_set_error(EBT_ERROR_INVALID_ARGUMENT, "ebt_driver_get: table is NULL");
  std::call_once(g_once, load);
  if (g_status != EBT_SUCCESS) return ebt_set_error(g_status, "%s", g_reason.c_str());
  *table = &g_table;
  return EBT_SUCCESS;
}

ebt_status_t ebt_driver_status(void) {
  const ebt_driver_table_t* t;
  return ebt_driver_get(&t);
}

ebt_status_t ebt_driver_version(int* version) {
  if (!version) return ebt_set_error(EBT_ERROR_INVALID_ARGUMENT, "ebt_driver_version: version is NULL");
  const ebt_driver_table_t* t;
  EBT_CHECK(ebt_driver_get(&t));
  *version = t->driver_version;
  return EBT_SUCCESS;
}

ebt_status_t ebt_driver_path(const char** path) {
  if (!path) return ebt_set_error(EBT_ERROR_INVALID_ARGUMENT, "ebt_driver_path: path is NULL");
  const ebt_driver_table_t* t;
  EBT_CHECK(ebt_driver_get(&t));
  *path = g_path.c_str();
  return EBT_SUCCESS;
}

ebt_status_t ebt_device_count(int* count) {
  if (!count) return ebt_set_error(EBT_ERROR_INVALID_ARGUMENT, "ebt_device_count: count is NULL");
  *count = 0;
  const ebt_driver_table_t* t;
  if (ebt_driver_get(&t) != EBT_SUCCESS) {
    ebt_clear_error();  // no driver means zero devices, not an error
    return EBT_SUCCESS;
  }
  EBT_CU_CHECK(t->cuDeviceGetCount(count));
  return EBT_SUCCESS;
}

ebt_status_t ebt_cu_error(CUresult result, const char* call, const char* file, int line) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (g_status == EBT_SUCCESS) {
    g_table.cuGetErrorName(result, &name);
    g_table.cuGetErrorString(result, &text);
  }
  const char* base = strrchr(file, '/');
  ebt_status_t st = result == CUDA_ERROR_OUT_OF_MEMORY ? EBT_ERROR_OUT_OF_MEMORY : EBT_ERROR_DRIVER;
  return ebt_set_error(st, "%s failed: %s (%d: %s) at %s:%d", call, name ? name : "CUDA error", result,
                       text ? text : "", base ? base + 1 : file, line);
}

void ebt_cu_ignored(CUresult result, const char* call, const char* why, const char* file, int line) {
  if (!ebt_log_enabled(EBT_LOG_INFO, EBT_SUBSYS_ALL)) return;
  const char* name = nullptr;
  if (g_status == EBT_SUCCESS) g_table.cuGetErrorName(result, &name);
  ebt_log_write(EBT_LOG_INFO, EBT_SUBSYS_ALL, file, line, "%s failed (%s, %d), ignored: %s", call,
                name ? name : "CUDA error", result, why);
}

}  // extern "C"
