/*
 * cpu_features.cc — what the CPU and OS support, read with cpuid + xgetbv (x86) or getauxval (Arm).
 * Built without ISA flags, so it runs on any CPU; it reports the machine, never the compile flags.
 * The dispatch level is computed once; EBBTIDE_CPU_ISA may lower it (for tests and for users who must avoid
 * AVX-512 frequency drops) but never raise it above what the CPU supports.
 */
#include <sched.h>
#include <strings.h>

#include <cstdlib>
#include <cstdio>
#include <mutex>

#include "csrc/param.h"
#include "csrc/status.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define EBT_X86 1
#endif
#if defined(__aarch64__)
#include <sys/auxv.h>
#endif

namespace {

#if EBT_X86
unsigned long long xgetbv0() {
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<unsigned long long>(hi) << 32) | lo;
}
#endif

unsigned detect() {
  unsigned f = 0;
#if EBT_X86
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
  if (c & (1u << 20)) f |= EBT_CPU_SSE42;
  const bool osxsave = c & (1u << 27);
  const bool fma = c & (1u << 12), f16c = c & (1u << 29), avx = c & (1u << 28);
  unsigned long long xcr0 = osxsave ? xgetbv0() : 0;
  const bool os_ymm = (xcr0 & 0x6) == 0x6;           // XMM + YMM state saved
  const bool os_zmm = (xcr0 & 0xe6) == 0xe6;         // + opmask, ZMM_Hi256, Hi16_ZMM
  if (avx && os_ymm) {
    f |= EBT_CPU_AVX;
    if (fma) f |= EBT_CPU_FMA;
    if (f16c) f |= EBT_CPU_F16C;
  }
  if (__get_cpuid_max(0, nullptr) >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    if (os_ymm && (b & (1u << 5))) f |= EBT_CPU_AVX2;
    if (os_zmm) {
      if (b & (1u << 16)) f |= EBT_CPU_AVX512F;
      if (b & (1u << 17)) f |= EBT_CPU_AVX512DQ;
      if (b & (1u << 30)) f |= EBT_CPU_AVX512BW;
      if (b & (1u << 31)) f |= EBT_CPU_AVX512VL;
      unsigned a1, b1, c1, d1;
      __cpuid_count(7, 1, a1, b1, c1, d1);
      if (a1 & (1u << 5)) f |= EBT_CPU_AVX512_BF16;
    }
    const bool os_amx = (xcr0 & (3ull << 17)) == (3ull << 17);  // XTILECFG + XTILEDATA
    if (os_amx && (d & (1u << 22))) f |= EBT_CPU_AMX_BF16;
  }
#elif defined(__aarch64__)
  f |= EBT_CPU_NEON;  // Advanced SIMD is mandatory on AArch64
#endif
  return f;
}

std::once_flag g_once;
unsigned g_features = 0;
const char* g_isa = "scalar";

// Dispatch levels from best to worst, with the features each needs. EBBTIDE_CPU_ISA picks any level the CPU
// supports (so it can only lower the choice); a known level this CPU lacks is refused with a warning.
struct Isa {
  const char* name;
  unsigned needs;
};
constexpr unsigned kAvx2 = EBT_CPU_AVX2 | EBT_CPU_FMA | EBT_CPU_F16C;
constexpr unsigned kAvx512 = kAvx2 | EBT_CPU_AVX512F | EBT_CPU_AVX512BW | EBT_CPU_AVX512VL | EBT_CPU_AVX512DQ;
constexpr Isa kIsas[] = {{"avx512_bf16", kAvx512 | EBT_CPU_AVX512_BF16},
                         {"avx512", kAvx512},
                         {"avx2", kAvx2},
                         {"neon", EBT_CPU_NEON},
                         {"scalar", 0}};

// EBBTIDE_CPU_ISA: one of the level names, any case; unset (-1) keeps the automatic choice. A name this code does
// not know is EBT_ERROR_SETTING from ebt_cpu_isa (a typo must not silently pick another kernel).
constexpr int kIsaCount = sizeof(kIsas) / sizeof(kIsas[0]);
constexpr const char* kIsaChoices[] = {"avx512_bf16", "avx512", "avx2", "neon", "scalar"};
static_assert(sizeof(kIsaChoices) / sizeof(kIsaChoices[0]) == kIsaCount, "one choice per level");
EBT_PARAM_CHOICE(isa_param, "EBBTIDE_CPU_ISA", kIsaChoices, -1, ebbtide::param::kNoCase)
ebt_status_t g_isa_status = EBT_SUCCESS;
char g_isa_error[512] = "";  // constant-initialized (init() may run from another file's load-time constructor)

void init() {
  g_features = detect();
  auto supported = [](const Isa& isa) { return (g_features & isa.needs) == isa.needs; };
  for (const auto& isa : kIsas) {
    if (supported(isa)) {
      g_isa = isa.name;
      break;
    }
  }
  int forced = -1;
  g_isa_status = isa_param(&forced);
  if (g_isa_status != EBT_SUCCESS) {
    snprintf(g_isa_error, sizeof(g_isa_error), "%s", ebt_last_error());
    return;
  }
  if (forced < 0) return;  // unset: the automatic choice
  if (supported(kIsas[forced])) g_isa = kIsas[forced].name;
  else EBT_WARN(EBT_SUBSYS_INIT, "EBBTIDE_CPU_ISA=%s: not supported by this CPU; using %s", kIsas[forced].name, g_isa);
}

}  // namespace

extern "C" {

ebt_status_t ebt_cpu_features(unsigned* features) {
  if (!features) return ebt_set_error(EBT_ERROR_INVALID_ARGUMENT, "ebt_cpu_features: features is NULL");
  std::call_once(g_once, init);
  *features = g_features;
  return EBT_SUCCESS;
}

ebt_status_t ebt_cpu_isa(const char** name) {
  if (!name) return ebt_set_error(EBT_ERROR_INVALID_ARGUMENT, "ebt_cpu_isa: name is NULL");
  std::call_once(g_once, init);
  if (g_isa_status != EBT_SUCCESS) return ebt_set_error(g_isa_status, "%s", g_isa_error);
  *name = g_isa;
  return EBT_SUCCESS;
}

ebt_status_t ebt_cpu_affinity_count(int* count) {
  if (!count) return ebt_set_error(EBT_ERROR_INVALID_ARGUMENT, "ebt_cpu_affinity_count: count is NULL");
  cpu_set_t set;
  CPU_ZERO(&set);
  EBT_SYS_CHECK(sched_getaffinity(0, sizeof(set), &set), "sched_getaffinity");
  *count = CPU_COUNT(&set);
  if (*count < 1) *count = 1;
  return EBT_SUCCESS;
}

}  // extern "C"
