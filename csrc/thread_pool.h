/*
 * thread_pool.h — a small fixed-size pool with static partitioning, for CPU kernels (optim, the host bandwidth
 * probe). Header-only so each component owns its pool without sharing state across libraries.
 *
 * Policy: `run(n_tasks, fn)` calls fn(task, worker) for every task in [0, n_tasks); task t always goes to worker
 * t % threads (static partitioning: a given thread count gives the same assignment every call, and results that
 * depend only on each task's own range are independent of the thread count). The caller's thread is worker 0.
 * Thread count is fixed at construction (never read from OMP_NUM_THREADS). One `run` at a time per pool:
 * concurrent callers are serialized by run_mu_. fn must not throw.
 */
#ifndef EBBTIDE_CSRC_THREAD_POOL_H_
#define EBBTIDE_CSRC_THREAD_POOL_H_

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace ebbtide {

class ThreadPool {
 public:
  explicit ThreadPool(int threads) : threads_(threads < 1 ? 1 : threads) {
    for (int w = 1; w < threads_; ++w) workers_.emplace_back([this, w] { loop(w); });
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      ++generation_;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return threads_; }

  // Blocks until every task ran.
  void run(size_t n_tasks, const std::function<void(size_t task, int worker)>& fn) {
    std::lock_guard<std::mutex> run_lock(run_mu_);
    if (threads_ == 1 || n_tasks <= 1) {
      for (size_t t = 0; t < n_tasks; ++t) fn(t, 0);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      n_tasks_ = n_tasks;
      pending_ = threads_ - 1;
      ++generation_;
    }
    cv_.notify_all();
    work(0);
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [this] { return pending_ == 0; });
    fn_ = nullptr;
  }

 private:
  void work(int w) {
    for (size_t t = static_cast<size_t>(w); t < n_tasks_; t += static_cast<size_t>(threads_)) (*fn_)(t, w);
  }
  void loop(int w) {
    unsigned long long seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (stop_) return;
      }
      work(w);
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (--pending_ == 0) done_cv_.notify_one();
      }
    }
  }

  const int threads_;
  std::vector<std::thread> workers_;
  std::mutex run_mu_;  // serializes run() callers
  std::mutex mu_;      // guards fn_, n_tasks_, pending_, generation_, stop_
  std::condition_variable cv_, done_cv_;
  const std::function<void(size_t, int)>* fn_ = nullptr;
  size_t n_tasks_ = 0;
  int pending_ = 0;                   // workers (excluding the caller) still busy with this generation
  unsigned long long generation_ = 0; // bumped per run() and at shutdown
  bool stop_ = false;
};

}  // namespace ebbtide

#endif  // EBBTIDE_CSRC_THREAD_POOL_H_
