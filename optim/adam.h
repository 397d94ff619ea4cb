/*
 * adam.h — CPU Adam/AdamW over many spans in one call: the engine behind ebbtide.optim.CPUAdam and
 * OffloadedAdam (component-internal C++ API; Python reaches it through optim/bindings.cc).
 *
 * Policies:
 *  - One pass per element: fp32 master/exp_avg/exp_avg_sq (and max_exp_avg_sq) updated in place, gradient fp32
 *    or bf16 read once and never written, optional bf16 copy-out of the new master written in the same pass.
 *    With `moments_bf16` a span's exp_avg and exp_avg_sq are bf16 bits: read as fp32, the step computed exactly
 *    as in fp32, the new moments stored rounded to nearest even (adam_kernel.h Note [bf16 moments]); 20 instead of
 *    28 bytes of host traffic per element. amsgrad with bf16 moments is refused.
 *  - Numerics: `exact` is bit-identical to torch.optim.Adam/AdamW(foreach=False) in fp32; `fast` fuses
 *    (adam_kernel.h, Notes [Exact mode] and [Fast mode]). Both give the same bits on every ISA and thread count.
 *  - Step counts are integers carried in float32 (torch's state['step']); bias corrections are computed per span
 *    in double with std::pow, as torch does in Python; lr may be a Python float (double arithmetic) or a float32
 *    tensor (torch then rounds lr*wd and lr/bc1 to float32; `lr_f32` replicates that).
 *  - Threads: the engine's own pool (csrc/thread_pool.h), size fixed at creation (default: the process's CPU
 *    affinity count), never OMP_NUM_THREADS. The concatenated spans are cut into up to threads x tasks_per_thread
 *    equal ranges aligned to 32 elements (a whole 64-byte line of bf16: no line is shared by two ranges); with one
 *    range per thread range t runs on worker t, with more each goes to whichever worker is free. Workers run with
 *    IEEE default FP state (no FTZ/DAZ).
 *  - ISA: chosen once per engine from ebt_cpu_isa() (dispatch rules, EBBTIDE_CPU_ISA) or named explicitly for tests;
 *    a name the CPU cannot run is refused, never silently downgraded.
 *  - Errors: bad input returns EBT_ERROR_INVALID_ARGUMENT before anything is touched. With skip_non_finite, a
 *    non-finite scaled gradient anywhere leaves every span (and step counter) unchanged and reports applied=false.
 *
 * Caller's contract: pointers stay valid and are not resized for the duration of step(); spans do not overlap
 * each other; step() is blocking and may be called from any thread (calls on one engine are serialized).
 */
#ifndef EBBTIDE_OPTIM_ADAM_H_
#define EBBTIDE_OPTIM_ADAM_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "csrc/ebbtide.h"
#include "csrc/thread_pool.h"
#include "optim/adam_kernel.h"

namespace ebbtide::optim {

struct AdamHyper {
  double lr = 1e-3;
  bool lr_f32 = false;          // lr came from a float32 tensor (see policies)
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  bool adamw = true;            // decoupled weight decay (AdamW) or L2 (Adam)
  bool amsgrad = false, maximize = false;
  bool exact = false;           // exact (torch-identical) or fast numerics
  double grad_scale = 1.0;      // gradients are multiplied by this (e.g. 1/loss_scale or a clip coefficient)
  bool skip_non_finite = false; // check every scaled gradient first; skip the whole step if any is Inf/NaN
  int sqrt_flavor = 0;          // exact mode: SqrtFlavor of torch on this machine (adam_kernel.h Note [torch's sqrt])
  bool bc2_sqrt_pow = true;     // torch computes sqrt(1 - beta2^t) as `** 0.5` (pow; torch >= 2.5) or math.sqrt
};

struct AdamSpan {
  float* p = nullptr;
  void* m = nullptr;              // exp_avg: fp32, or bf16 bits when moments_bf16
  void* v = nullptr;              // exp_avg_sq: same dtype as m
  float* vmax = nullptr;          // required iff amsgrad (fp32 moments only)
  const void* g = nullptr;        // fp32, or bf16 bits when grad_bf16
  uint16_t* out = nullptr;        // optional bf16 copy-out of the new p
  int64_t n = 0;                  // elements
  bool grad_bf16 = false;
  bool moments_bf16 = false;      // m and v are bf16 (uint16 bits, 2-byte aligned)
  float* step_counter = nullptr;  // torch's float32 state['step']: incremented by one per applied step
  double step = 0;                // used when step_counter is null: the step number of this update (>= 1)
};

// The ISAs this CPU can run, best first ("avx512_bf16", "avx512", "avx2", "scalar").
std::vector<std::string> available_isas();

// out[i] = sqrt(x[i]) in the given SqrtFlavor (how Python finds the flavor torch.sqrt has on this machine).
ebt_status_t sqrt_flavor_eval(int flavor, const float* x, float* out, int64_t n);

class AdamEngine {
 public:
  static constexpr int kMaxTasksPerThread = 256;

  // threads <= 0: the process's CPU affinity count. isa empty: ebt_cpu_isa() (honours EBBTIDE_CPU_ISA).
  // tasks_per_thread in [1, kMaxTasksPerThread]: a step's elements are split into up to threads x this many
  // ranges; 1 gives each thread one contiguous range, more are claimed by whichever thread is free
  // (csrc/thread_pool.h Note [Claimed tasks]). Results never depend on either count.
  static ebt_status_t create(int threads, const std::string& isa, int tasks_per_thread,
                             std::unique_ptr<AdamEngine>* out);

  int threads() const { return pool_->threads(); }
  int tasks_per_thread() const { return tasks_per_thread_; }
  const char* isa() const { return kernels_->isa; }

  // Blocking. `applied` (may be null) is false when skip_non_finite found a bad gradient.
  ebt_status_t step(const AdamHyper& h, const AdamSpan* spans, size_t n_spans, bool* applied);

 private:
  AdamEngine(int threads, int tasks_per_thread, const KernelTable* k);
  std::unique_ptr<ThreadPool> pool_;
  const KernelTable* kernels_;  // immutable after construction
  const int tasks_per_thread_;
};

}  // namespace ebbtide::optim

#endif  // EBBTIDE_OPTIM_ADAM_H_
