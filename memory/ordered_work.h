/*
 * ordered_work.h — steps [0, n) run on a few runtime threads, started in index order; the op that started them
 * waits for any one step (the copy of piece k waits until piece k is registered) or for all.
 *
 * Policy: each worker claims the lowest step not yet started, so step i starts no later than any step after it; a
 * step that fails stops the rest (steps not started yet are skipped and report that failure), and its error
 * message is kept for whoever waits on it (native error messages are per thread). Workers run `init` first (the
 * device context, the caller's capture mode). If no thread can be started, wait() runs the steps itself, in order.
 * The destructor joins. One OrderedWork per batch: start() once.
 */
#ifndef EBBTIDE_MEMORY_ORDERED_WORK_H_
#define EBBTIDE_MEMORY_ORDERED_WORK_H_

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "csrc/status.h"

namespace ebbtide::memory {

class OrderedWork {
 public:
  using Step = std::function<ebt_status_t(size_t)>;
  OrderedWork() = default;
  OrderedWork(const OrderedWork&) = delete;
  OrderedWork& operator=(const OrderedWork&) = delete;
  ~OrderedWork() { finish(); }  // leaves the thread's error message alone

  void start(size_t n, int threads, std::function<void()> init, Step step) {
    n_ = n;
    step_ = std::move(step);
    init_ = std::move(init);
    state_.assign(n, kPending);
    const int t = static_cast<int>(std::min<size_t>(n, threads < 1 ? 1 : threads));
    for (int w = 0; w < t; ++w) {
      try {
        threads_.emplace_back([this] { loop(); });
      } catch (const std::system_error&) {
        break;  // fewer workers (none: wait() runs the steps)
      }
    }
  }

  bool started() const { return n_ > 0; }

  // Step i's status (the first failure's, for a step skipped after it).
  ebt_status_t wait(size_t i) {
    std::unique_lock<std::mutex> lock(mu_);
    if (threads_.empty()) {  // no workers: run up to i here
      while (next_ <= i && next_ < n_) run_one(lock);
    }
    cv_.wait(lock, [&] { return state_[i] != kPending && state_[i] != kRunning; });
    return outcome(i);
  }

  // Every step; the first failure.
  ebt_status_t join() {
    finish();
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_) return EBT_SUCCESS;
    return ebt_set_error(error_, "%s", message_.c_str());
  }

 private:
  void finish() {
    if (n_ == 0) return;
    if (threads_.empty()) {
      std::unique_lock<std::mutex> lock(mu_);
      while (next_ < n_) run_one(lock);
    }
    for (auto& t : threads_) t.join();
    threads_.clear();
  }

  enum : unsigned char { kPending, kRunning, kDone, kFailed };

  ebt_status_t outcome(size_t i) {  // mu_ held
    if (state_[i] == kDone) return EBT_SUCCESS;
    return ebt_set_error(error_, "%s", message_.c_str());
  }

  // Claim the next step and run it without the lock (mu_ held on entry and on return).
  void run_one(std::unique_lock<std::mutex>& lock) {
    const size_t i = next_++;
    if (failed_) {
      state_[i] = kFailed;
      cv_.notify_all();
      return;
    }
    state_[i] = kRunning;
    lock.unlock();
    ebt_status_t st = step_(i);
    std::string msg = st == EBT_SUCCESS ? "" : ebt_last_error();
    lock.lock();
    state_[i] = st == EBT_SUCCESS ? kDone : kFailed;
    if (st != EBT_SUCCESS && !failed_) {
      failed_ = true;
      error_ = st;
      message_ = msg;
    }
    cv_.notify_all();
  }

  void loop() {
    if (init_) init_();
    std::unique_lock<std::mutex> lock(mu_);
    while (next_ < n_) run_one(lock);
  }

  size_t n_ = 0;
  Step step_;
  std::function<void()> init_;
  std::mutex mu_;               // guards everything below
  std::condition_variable cv_;  // a step finished
  std::vector<unsigned char> state_;
  size_t next_ = 0;
  bool failed_ = false;
  ebt_status_t error_ = EBT_SUCCESS;
  std::string message_;
  std::vector<std::thread> threads_;
};

}  // namespace ebbtide::memory

#endif  // EBBTIDE_MEMORY_ORDERED_WORK_H_
