/*
 * thread_pool.h — a small fixed-size pool with static or claimed task assignment, for CPU kernels (optim, the host
 * bandwidth probe). Header-only so each component owns its pool without sharing state across libraries.
 *
 * Policy: `run(n_tasks, fn)` calls fn(task, worker) for every task in [0, n_tasks); task t always goes to worker
 * t % threads (static partitioning: a given thread count gives the same assignment every call, and results that
 * depend only on each task's own range are independent of the thread count). `run(n_tasks, fn, kClaim)` hands
 * the tasks out in order to whichever worker is free (Note [Claimed tasks]). The caller's thread is worker 0.
 * Thread count is fixed at construction (never read from OMP_NUM_THREADS). One `run` at a time per pool:
 * concurrent callers are serialized by run_mu_. fn must not throw. Idle threads poll briefly before they block
 * (Note [Spin before sleeping]).
 */
#ifndef EBBTIDE_CSRC_THREAD_POOL_H_
#define EBBTIDE_CSRC_THREAD_POOL_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace ebbtide {

class ThreadPool {
 public:
  enum Schedule { kStatic, kClaim };

  explicit ThreadPool(int threads) : threads_(threads < 1 ? 1 : threads) {
    for (int w = 1; w < threads_; ++w) workers_.emplace_back([this, w] { loop(w); });
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_.store(true, std::memory_order_release);
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return threads_; }

  // Blocks until every task ran.
  void run(size_t n_tasks, const std::function<void(size_t task, int worker)>& fn, Schedule schedule = kStatic) {
    std::lock_guard<std::mutex> run_lock(run_mu_);
    if (threads_ == 1 || n_tasks <= 1) {
      for (size_t t = 0; t < n_tasks; ++t) fn(t, 0);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      n_tasks_ = n_tasks;
      claim_ = schedule == kClaim;
      next_.store(0, std::memory_order_relaxed);
      pending_.store(threads_ - 1, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);  // publishes fn_ and n_tasks_ to spinning workers
    }
    cv_.notify_all();
    work(0);
    if (!spin_until([this] { return pending_.load(std::memory_order_acquire) == 0; })) {
      std::unique_lock<std::mutex> lock(mu_);
      done_cv_.wait(lock, [this] { return pending_.load(std::memory_order_acquire) == 0; });
    }
    fn_ = nullptr;
  }

 private:
  // Note [Spin before sleeping]: a worker that finished its task, and the caller waiting for the others, poll for up to
  // kSpinNs before blocking on the condition variable. Waking a blocked thread costs a futex wake and, on virtual
  // machines, an inter-processor interrupt to an idle vCPU, of the order of kSpinNs on a 2-vCPU VM, which made a small
  // Adam step slower on 2 threads than on 1 (torch's OpenMP threads, which spin-wait, were faster than both;
  // docs/results.md has the figures). Back-to-back calls (the offloaded optimizer's per-bucket steps, a benchmark loop)
  // then find the workers awake; a pool idle for longer than the bound sleeps and costs no CPU.
  static constexpr int64_t kSpinNs = 100 * 1000;

  template <typename Pred>
  static bool spin_until(Pred done) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(kSpinNs);
    for (int i = 0;; ++i) {
      if (done()) return true;
      if ((i & 63) == 63 && std::chrono::steady_clock::now() > until) return false;
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
  }

  // Note [Claimed tasks]: with static assignment a call lasts as long as its slowest worker, and a worker the
  // scheduler preempts (another thread of the process -- the CUDA driver's, a copy launch, a cache trim -- or of
  // the host) delays every call it takes part in by the whole preemption. Claiming splits the work into more
  // tasks than workers and lets a delayed worker's remaining tasks go to the others; what a task computes still
  // depends only on its own range. What it does not remove: run() returns once every worker has checked in, so a
  // worker preempted before it saw the call still holds the call's end until it runs (it then claims nothing).
  // Returning on the tasks' completion instead would let a late worker read a finished call's fn_.
  void work(int w) {
    if (claim_) {
      for (size_t t; (t = next_.fetch_add(1, std::memory_order_relaxed)) < n_tasks_;) (*fn_)(t, w);
      return;
    }
    for (size_t t = static_cast<size_t>(w); t < n_tasks_; t += static_cast<size_t>(threads_)) (*fn_)(t, w);
  }
  void loop(int w) {
    unsigned long long seen = 0;
    for (;;) {
      if (!spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; })) {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      }
      seen = generation_.load(std::memory_order_acquire);
      if (stop_.load(std::memory_order_acquire)) return;
      work(w);
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> lock(mu_);  // the caller may be between its check and its wait
        done_cv_.notify_one();
      }
    }
  }

  const int threads_;
  std::vector<std::thread> workers_;
  // Lock order: run_mu_, then mu_; both are leaves for callers (nothing else is locked under them but what the
  // caller's own tasks take, which must not wait for another run() of this pool).
  std::mutex run_mu_;  // serializes run() callers (held for the whole run)
  std::mutex mu_;      // orders the sleeping paths: generation bumps, the last worker's notify
  std::condition_variable cv_, done_cv_;
  const std::function<void(size_t, int)>* fn_ = nullptr;  // published by the generation bump (release)
  size_t n_tasks_ = 0;
  bool claim_ = false;                               // published with fn_
  std::atomic<size_t> next_{0};                      // kClaim: the next unclaimed task
  std::atomic<int> pending_{0};                      // workers (excluding the caller) still busy with this run
  std::atomic<unsigned long long> generation_{0};    // bumped per run() and at shutdown
  std::atomic<bool> stop_{false};
};

}  // namespace ebbtide

#endif  // EBBTIDE_CSRC_THREAD_POOL_H_
