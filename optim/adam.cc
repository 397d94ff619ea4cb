// adam.cc — the step driver: validation, per-span scalars (torch's roundings), the task split over the
// engine's pool, and the one place where the ISA kernel table is chosen. Policies: optim/adam.h.
#include "optim/adam.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "csrc/log.h"
#include "csrc/status.h"

namespace ebbtide::optim {
namespace {

constexpr int64_t kGrain = int64_t(1) << 15;  // elements per task below which fewer tasks are made
constexpr int64_t kAlign = 32;                // range boundaries: 128 B of fp32, a whole 64 B line of bf16

struct IsaEntry {
  const char* name;
  unsigned needs;
  const KernelTable& (*table)();
};
constexpr unsigned kAvx512Base = EBT_CPU_AVX512F | EBT_CPU_AVX512BW | EBT_CPU_AVX512VL | EBT_CPU_AVX512DQ |
                                 EBT_CPU_FMA | EBT_CPU_AVX2;
#if defined(__x86_64__)
const IsaEntry kIsas[] = {
    {"avx512_bf16", kAvx512Base | EBT_CPU_AVX512_BF16, &kernels_avx512_bf16},
    {"avx512", kAvx512Base, &kernels_avx512},
    {"avx2", EBT_CPU_AVX2 | EBT_CPU_FMA, &kernels_avx2},
    {"scalar", 0u, &kernels_scalar},
};
#else
const IsaEntry kIsas[] = {{"scalar", 0u, &kernels_scalar}};
#endif

unsigned cpu_features() {
  unsigned f = 0;
  if (ebt_cpu_features(&f) != EBT_SUCCESS) return 0;
  return f;
}

// Maps ebt_cpu_isa()'s level (dispatch rules, or EBBTIDE_CPU_ISA) to the best kernel at or below it. A failed
// lookup (an EBBTIDE_CPU_ISA value that does not parse) is the caller's error, never a quiet scalar kernel.
ebt_status_t default_isa(const IsaEntry** out) {
  const char* level = nullptr;
  EBT_CHECK(ebt_cpu_isa(&level));
  const unsigned f = cpu_features();
  bool reached = false;
  for (const IsaEntry& e : kIsas) {
    if (std::strcmp(e.name, level) == 0) reached = true;
    if (reached && (f & e.needs) == e.needs) {
      *out = &e;
      return EBT_SUCCESS;
    }
  }
  *out = &kIsas[sizeof(kIsas) / sizeof(kIsas[0]) - 1];  // "neon": the portable kernel
  return EBT_SUCCESS;
}

// Runs fn with IEEE-default MXCSR (round to nearest, no FTZ/DAZ, exceptions masked), restoring the caller's.
template <typename F>
void with_ieee_fp(F&& fn) {
#if defined(__x86_64__) || defined(__i386__)
  const unsigned saved = _mm_getcsr();
  _mm_setcsr(0x1F80u);
  fn();
  _mm_setcsr(saved);
#else
  fn();
#endif
}

ebt_status_t check_flavor(int flavor) {
  EBT_REQUIRE_ARG(flavor >= int(SqrtFlavor::kCorrectlyRounded) && flavor <= int(SqrtFlavor::kMklSse),
                  "unknown sqrt flavor %d", flavor);
#if !defined(__x86_64__)
  if (flavor != int(SqrtFlavor::kCorrectlyRounded))
    return ebt_set_error(EBT_ERROR_UNSUPPORTED, "MKL's sqrt flavors exist on x86-64 only");
#endif
  constexpr unsigned kNeeds = EBT_CPU_AVX512F | EBT_CPU_AVX512VL;
  if (flavor == int(SqrtFlavor::kMklAvx512) && (cpu_features() & kNeeds) != kNeeds)
    return ebt_set_error(EBT_ERROR_UNSUPPORTED, "the MKL AVX-512 sqrt flavor needs an AVX-512 CPU");
  return EBT_SUCCESS;
}

bool spans_overlap(const AdamSpan& s) {
  // The state arrays of a span must be distinct buffers (aliasing would silently corrupt); byte ranges, since
  // bf16 moments are half the size of the fp32 master.
  const uintptr_t mom = s.moments_bf16 ? 2 : 4;
  const uintptr_t lo[4] = {uintptr_t(s.p), uintptr_t(s.m), uintptr_t(s.v), uintptr_t(s.vmax)};
  const uintptr_t size[4] = {4, mom, mom, 4};
  for (int i = 0; i < 4; ++i)
    for (int j = i + 1; j < 4; ++j)
      if (lo[i] && lo[j] && lo[i] < lo[j] + size[j] * s.n && lo[j] < lo[i] + size[i] * s.n) return true;
  return false;
}

// Every array at a multiple of its element size (what a tensor's data pointer always is).
bool spans_aligned(const AdamSpan& s) {
  const uintptr_t mom = s.moments_bf16 ? 2 : 4, gsz = s.grad_bf16 ? 2 : 4;
  return uintptr_t(s.p) % 4 == 0 && uintptr_t(s.m) % mom == 0 && uintptr_t(s.v) % mom == 0 &&
         uintptr_t(s.vmax) % 4 == 0 && uintptr_t(s.g) % gsz == 0 && uintptr_t(s.out) % 2 == 0;
}

ebt_status_t validate(const AdamHyper& h, const AdamSpan* spans, size_t n_spans) {
  EBT_REQUIRE_ARG(std::isfinite(h.lr) && h.lr >= 0, "lr must be finite and >= 0 (got %g)", h.lr);
  EBT_REQUIRE_ARG(h.beta1 >= 0 && h.beta1 < 1, "beta1 must be in [0, 1) (got %g)", h.beta1);
  EBT_REQUIRE_ARG(h.beta2 >= 0 && h.beta2 < 1, "beta2 must be in [0, 1) (got %g)", h.beta2);
  EBT_REQUIRE_ARG(std::isfinite(h.eps) && h.eps >= 0, "eps must be finite and >= 0 (got %g)", h.eps);
  EBT_REQUIRE_ARG(std::isfinite(h.weight_decay) && h.weight_decay >= 0, "weight_decay must be finite and >= 0 (got %g)",
                  h.weight_decay);
  EBT_REQUIRE_ARG(std::isfinite(h.grad_scale), "grad_scale must be finite (got %g)", h.grad_scale);
  EBT_REQUIRE_ARG(n_spans == 0 || spans != nullptr, "spans is null");
  EBT_CHECK(check_flavor(h.sqrt_flavor));
  for (size_t i = 0; i < n_spans; ++i) {
    const AdamSpan& s = spans[i];
    EBT_REQUIRE_ARG(s.n >= 0, "span %zu: negative size %lld", i, (long long)s.n);
    if (s.n == 0) continue;
    EBT_REQUIRE_ARG(s.p && s.m && s.v && s.g, "span %zu: null param/exp_avg/exp_avg_sq/grad pointer", i);
    EBT_REQUIRE_ARG(!h.amsgrad || s.vmax, "span %zu: amsgrad needs max_exp_avg_sq", i);
    EBT_REQUIRE_ARG(!(h.amsgrad && s.moments_bf16), "span %zu: amsgrad needs fp32 moments (bf16 moments refused)", i);
    EBT_REQUIRE_ARG(spans_aligned(s), "span %zu: a buffer is not aligned to its element size", i);
    EBT_REQUIRE_ARG(!spans_overlap(s), "span %zu: param and state buffers overlap", i);
    EBT_REQUIRE_ARG(s.step_counter || (std::isfinite(s.step) && s.step >= 1 && s.step == std::floor(s.step)),
                    "span %zu: step must be an integer >= 1 (got %g)", i, s.step);
    if (s.step_counter)
      EBT_REQUIRE_ARG(std::isfinite(*s.step_counter) && *s.step_counter >= 0 &&
                          *s.step_counter == std::floor(*s.step_counter) && *s.step_counter < 16777216.f,
                      "span %zu: step counter must be an integer in [0, 2^24) (got %g)", i, (double)*s.step_counter);
  }
  return EBT_SUCCESS;
}

// Per-span scalars, rounded exactly as torch's _single_tensor_adam rounds them (see adam.h policies).
KernelArgs resolve(const AdamHyper& h, const AdamSpan& s, double step) {
  KernelArgs a;
  a.p = s.p, a.m = s.m, a.v = s.v, a.vmax = h.amsgrad ? s.vmax : nullptr, a.g = s.g, a.out = s.out;
  a.grad_bf16 = s.grad_bf16;
  a.moments_bf16 = s.moments_bf16;
  a.sqrt_flavor = static_cast<SqrtFlavor>(h.sqrt_flavor);
  a.wd_kind = h.weight_decay == 0 ? WeightDecay::kNone : (h.adamw ? WeightDecay::kDecoupled : WeightDecay::kL2);
  a.gs = static_cast<float>(h.maximize ? -h.grad_scale : h.grad_scale);
  const double bc1 = 1.0 - std::pow(h.beta1, step);
  const double bc2 = 1.0 - std::pow(h.beta2, step);
  // Python's `bias_correction2 ** 0.5` is pow, not sqrt (older torch used math.sqrt: h.bc2_sqrt_pow = false).
  const double bc2s = h.bc2_sqrt_pow ? std::pow(bc2, 0.5) : std::sqrt(bc2);
  if (h.lr_f32) {
    const float lr = static_cast<float>(h.lr);
    a.decay = 1.0f - lr * static_cast<float>(h.weight_decay);
    a.ss = -(lr / static_cast<float>(bc1));
    a.neg_lrwd = -(lr * static_cast<float>(h.weight_decay));
  } else {
    a.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
    a.ss = static_cast<float>(-(h.lr / bc1));
    a.neg_lrwd = static_cast<float>(-(h.lr * h.weight_decay));
  }
  a.wd = static_cast<float>(h.weight_decay);
  a.lerp_w = static_cast<float>(1.0 - h.beta1);
  a.lerp_small = std::fabs(a.lerp_w) < 0.5f;
  a.lerp_coeff = a.lerp_small ? a.lerp_w : a.lerp_w - 1.0f;
  a.b2 = static_cast<float>(h.beta2);
  a.c2 = static_cast<float>(1.0 - h.beta2);
  a.bc2s = static_cast<float>(bc2s);
  a.eps = static_cast<float>(h.eps);
  a.b1 = static_cast<float>(h.beta1);
  a.c1 = static_cast<float>(1.0 - h.beta1);
  a.rbc2s = static_cast<float>(1.0 / bc2s);
  return a;
}

// The partition: [bounds[t], bounds[t+1]) of the concatenated spans goes to task t.
std::vector<int64_t> partition(int64_t total, int64_t max_tasks) {
  int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(max_tasks, (total + kGrain - 1) / kGrain));
  std::vector<int64_t> b(tasks + 1);
  for (int64_t t = 0; t <= tasks; ++t) b[t] = t == tasks ? total : (total * t / tasks) / kAlign * kAlign;
  return b;
}

// Calls fn(span_index, begin, end) for the pieces of [lo, hi) of the concatenation (prefix = span starts).
template <typename F>
void for_range(const std::vector<int64_t>& prefix, int64_t lo, int64_t hi, F&& fn) {
  if (lo >= hi) return;
  size_t s = std::upper_bound(prefix.begin(), prefix.end(), lo) - prefix.begin() - 1;
  for (; s + 1 < prefix.size() && prefix[s] < hi; ++s) {
    const int64_t b = std::max(lo, prefix[s]) - prefix[s], e = std::min(hi, prefix[s + 1]) - prefix[s];
    if (b < e) fn(s, b, e);
  }
}

}  // namespace

std::vector<std::string> available_isas() {
  std::vector<std::string> out;
  const unsigned f = cpu_features();
  for (const IsaEntry& e : kIsas)
    if ((f & e.needs) == e.needs) out.emplace_back(e.name);
  return out;
}

ebt_status_t sqrt_flavor_eval(int flavor, const float* x, float* out, int64_t n) {
  EBT_CHECK(check_flavor(flavor));
  EBT_REQUIRE_ARG(n >= 0 && (n == 0 || (x && out)), "bad buffers");
  with_ieee_fp([&] {
#if defined(__x86_64__)
    if (flavor == int(SqrtFlavor::kMklAvx512)) return sqrt_mkl_avx512(x, out, n);
    if (flavor == int(SqrtFlavor::kMklSse)) return sqrt_mkl_sse(x, out, n);
#endif
    for (int64_t i = 0; i < n; ++i) out[i] = std::sqrt(x[i]);
  });
  return EBT_SUCCESS;
}

AdamEngine::AdamEngine(int threads, int tasks_per_thread, const KernelTable* k)
    : pool_(new ThreadPool(threads)), kernels_(k), tasks_per_thread_(tasks_per_thread) {}

ebt_status_t AdamEngine::create(int threads, const std::string& isa, int tasks_per_thread,
                                std::unique_ptr<AdamEngine>* out) {
  EBT_REQUIRE_ARG(out != nullptr, "out is null");
  EBT_REQUIRE_ARG(threads <= 4096, "threads=%d is out of range", threads);
  EBT_REQUIRE_ARG(tasks_per_thread >= 1 && tasks_per_thread <= kMaxTasksPerThread,
                  "tasks_per_thread=%d is out of range [1, %d]", tasks_per_thread, kMaxTasksPerThread);
  if (threads <= 0) {
    int n = 1;
    if (ebt_cpu_affinity_count(&n) != EBT_SUCCESS || n < 1) n = 1;
    threads = n;
  }
  const IsaEntry* chosen = nullptr;
  if (isa.empty()) {
    EBT_CHECK(default_isa(&chosen));
  } else {
    for (const IsaEntry& e : kIsas)
      if (isa == e.name) chosen = &e;
    if (!chosen)
      return ebt_set_error(EBT_ERROR_INVALID_ARGUMENT,
                           "isa='%s' is not a CPU Adam kernel: expected one of avx512_bf16, avx512, avx2, scalar; "
                           "pass one of those or None (the best this CPU runs; available_isas() lists them)",
                           isa.c_str());
    if ((cpu_features() & chosen->needs) != chosen->needs)
      return ebt_set_error(EBT_ERROR_UNSUPPORTED,
                           "isa='%s' needs CPU features this CPU lacks: pass an isa that "
                           "ebbtide.optim.available_isas() lists, or None for the best this CPU runs", isa.c_str());
  }
  out->reset(new AdamEngine(threads, tasks_per_thread, &chosen->table()));
  EBT_INFO(EBT_SUBSYS_OPTIM, "adam engine: %d threads, isa %s, %d tasks per thread", threads, chosen->name,
           tasks_per_thread);
  return EBT_SUCCESS;
}

ebt_status_t AdamEngine::step(const AdamHyper& h, const AdamSpan* spans, size_t n_spans, bool* applied) {
  EBT_CHECK(validate(h, spans, n_spans));
  if (applied) *applied = true;
  std::vector<int64_t> prefix(n_spans + 1, 0);
  for (size_t i = 0; i < n_spans; ++i) prefix[i + 1] = prefix[i] + spans[i].n;
  const int64_t total = prefix[n_spans];
  const std::vector<int64_t> bounds = partition(total, int64_t(pool_->threads()) * tasks_per_thread_);
  const size_t tasks = bounds.size() - 1;
  const ThreadPool::Schedule schedule =
      tasks > size_t(pool_->threads()) ? ThreadPool::kClaim : ThreadPool::kStatic;
  const KernelTable& k = *kernels_;
  const float gs = static_cast<float>(h.maximize ? -h.grad_scale : h.grad_scale);

  if (h.skip_non_finite && total > 0) {
    std::vector<char> bad(tasks, 0);
    pool_->run(tasks, [&](size_t t, int) {
      with_ieee_fp([&] {
        for_range(prefix, bounds[t], bounds[t + 1], [&](size_t s, int64_t b, int64_t e) {
          if (!bad[t] && k.non_finite(spans[s].g, spans[s].grad_bf16, gs, b, e)) bad[t] = 1;
        });
      });
    }, schedule);
    if (std::any_of(bad.begin(), bad.end(), [](char c) { return c != 0; })) {
      if (applied) *applied = false;
      EBT_INFO(EBT_SUBSYS_OPTIM, "adam step skipped: non-finite gradient");
      return EBT_SUCCESS;
    }
  }

  std::vector<KernelArgs> args(n_spans);
  for (size_t i = 0; i < n_spans; ++i) {
    double step = spans[i].step;
    if (spans[i].step_counter) {
      *spans[i].step_counter += 1.0f;  // torch: step_t += 1 (float32), even for empty tensors
      step = *spans[i].step_counter;
    }
    args[i] = resolve(h, spans[i], step);
  }
  const KernelFn fn = h.exact ? k.exact : k.fast;
  pool_->run(tasks, [&](size_t t, int) {
    with_ieee_fp([&] {
      for_range(prefix, bounds[t], bounds[t + 1], [&](size_t s, int64_t b, int64_t e) { fn(args[s], b, e); });
    });
  }, schedule);
  return EBT_SUCCESS;
}

}  // namespace ebbtide::optim
