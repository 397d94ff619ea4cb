/*
 * cpu_features.cc — what the CPU and OS support, read with cpuid + xgetbv (x86) or getauxval (Arm).
 * Built without ISA flags, so it runs on any CPU; it reports the machine, never the compile flags.
 * The dispatch level is computed once: the widest level the CPU and OS support (Note [Widest is fastest]);
 * EBBTIDE_CPU_ISA then picks any level the CPU supports, never one it does not. The choice and the reason for it
 * are reported (ebt_cpu_isa, ebt_cpu_isa_reason; `ebbtide info`).
 */
#include <sched.h>
#include <strings.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
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

// Vendor and display family/model (family = base + extended where base is 0xF; model likewise for 6 and 0xF).
struct CpuId {
  char vendor[13] = "";
  unsigned family = 0, model = 0;
};

CpuId identify() {
  CpuId id;
#if EBT_X86
  unsigned a, b, c, d;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return id;
  std::memcpy(id.vendor, &b, 4);
  std::memcpy(id.vendor + 4, &d, 4);
  std::memcpy(id.vendor + 8, &c, 4);
  id.vendor[12] = '\0';
  if (!__get_cpuid(1, &a, &b, &c, &d)) return id;
  const unsigned base_family = (a >> 8) & 0xF, base_model = (a >> 4) & 0xF;
  id.family = base_family == 0xF ? base_family + ((a >> 20) & 0xFF) : base_family;
  id.model = (base_family == 0x6 || base_family == 0xF) ? (((a >> 16) & 0xF) << 4) | base_model : base_model;
#endif
  return id;
}

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
unsigned g_features = 0;     // written once under g_once
const char* g_isa = "scalar";  // written once under g_once (and by the override below, also under g_once)
char g_reason[256] = "";      // why g_isa was chosen; written once under g_once

// Dispatch levels from widest to narrowest, with the features each needs. EBBTIDE_CPU_ISA picks any level the
// CPU supports (a supported level this CPU lacks is refused with a warning; a name not listed is an error).
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
// Note [Widest is fastest]: the automatic level is the widest one supported, on every CPU measured (fast-mode
// Adam, the one CPU kernel family; `ebbtide bench optim` with the level forced, AMD Zen 4 and Zen 5 included:
// docs/results.md, "Measurements behind design choices in the sources"). With fp32 moments the step is
// memory-bound and the levels tie; with bf16 moments AVX2's integer bf16 rounding makes one thread compute-bound,
// where AVX-512-BF16 is faster. Both AMD cores run 512-bit operations as two 256-bit halves; what made AVX-512
// slower there was a kernel that masked every load and store (a loop of masked 512-bit loads/stores runs at half
// speed on Zen 4/5), which the AVX-512 kernel no longer does (only the tail vector is masked). A CPU found slower
// at its widest level is to be capped here, in init(), with its measurement recorded in docs/results.md.

void init() {
  g_features = detect();
  const CpuId id = identify();
  auto supported = [](const Isa& isa) { return (g_features & isa.needs) == isa.needs; };
  for (const auto& isa : kIsas) {
    if (supported(isa)) {
      g_isa = isa.name;
      break;
    }
  }
  char why[160];
  snprintf(why, sizeof(why), "the widest level this CPU and OS support (%s family 0x%x model 0x%x)",
           id.vendor[0] ? id.vendor : "unknown vendor", id.family, id.model);
  snprintf(g_reason, sizeof(g_reason), "%s", why);
  const char* automatic = g_isa;
  int forced = -1;
  g_isa_status = isa_param(&forced);
  if (g_isa_status != EBT_SUCCESS) {
    snprintf(g_isa_error, sizeof(g_isa_error), "%s", ebt_last_error());
    return;
  }
  if (forced >= 0) {  // set: any level this CPU supports
    if (supported(kIsas[forced])) g_isa = kIsas[forced].name;
    else EBT_WARN(EBT_SUBSYS_INIT, "EBBTIDE_CPU_ISA=%s: not supported by this CPU; using %s", kIsas[forced].name, g_isa);
  }
  if (std::strcmp(g_isa, automatic) != 0)
    snprintf(g_reason, sizeof(g_reason), "set by EBBTIDE_CPU_ISA (automatic choice: %s, because %s)", automatic,
             why);
  EBT_INFO(EBT_SUBSYS_INIT, "CPU dispatch level %s: %s", g_isa, g_reason);
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

ebt_status_t ebt_cpu_isa_reason(const char** reason) {
  if (!reason) return ebt_set_error(EBT_ERROR_INVALID_ARGUMENT, "ebt_cpu_isa_reason: reason is NULL");
  std::call_once(g_once, init);
  if (g_isa_status != EBT_SUCCESS) return ebt_set_error(g_isa_status, "%s", g_isa_error);
  *reason = g_reason;
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
