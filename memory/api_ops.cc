/*
 * api_ops.cc — pause and resume through the C API: synchronous, or asynchronous on a runtime thread with an
 * ebt_mem_op handle to wait on. Both select and mark their allocations busy before returning (Engine::prepare).
 */
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "csrc/status.h"
#include "memory/api_internal.h"
#include "memory/engine.h"

using namespace ebbtide::memory;

// An asynchronous op: the runtime thread fills the outcome; waiters block on cv.
struct ebt_mem_op {
  std::mutex mu;               // guards done, status, message, report (a leaf: lock order in engine.cc)
  std::condition_variable cv;  // signalled once when done
  bool done = false;
  ebt_status_t status = EBT_SUCCESS;
  std::string message;         // ebt_last_error() of the failing op
  ebt_mem_report_t report{};
};

namespace {

ebt_status_t run_sync(OpKind kind, const char* tag, ebt_mem_report_t* report) {
  EBT_MEM_ENTRY();
  Plan plan;
  ebt_mem_report_t scratch;
  memset(&scratch, 0, sizeof(scratch));
  EBT_CHECK(Engine::get().prepare(kind, tag, &plan, &scratch));
  return Engine::get().execute(plan, report);
}

ebt_status_t run_async(OpKind kind, const char* tag, ebt_mem_op_t* out) {
  EBT_REQUIRE_ARG(out, "op is NULL");
  *out = nullptr;
  EBT_MEM_ENTRY();
  auto plan = std::make_shared<Plan>();
  ebt_mem_report_t scratch;
  memset(&scratch, 0, sizeof(scratch));
  EBT_CHECK(Engine::get().prepare(kind, tag, plan.get(), &scratch));  // busy marks taken before we return
  auto* op = new ebt_mem_op();
  std::thread([op, plan] {
    ebt_mem_report_t r;
    memset(&r, 0, sizeof(r));
    r.struct_size = sizeof(r);
    ebt_status_t st = Engine::get().execute(*plan, &r);
    std::lock_guard<std::mutex> lock(op->mu);
    op->status = st;
    op->message = st == EBT_SUCCESS ? "" : ebt_last_error();
    op->report = r;
    op->done = true;
    op->cv.notify_all();
  }).detach();
  *out = op;
  return EBT_SUCCESS;
}
}  // namespace

extern "C" {

ebt_status_t ebt_mem_pause(const char* tag, ebt_mem_report_t* report) { return run_sync(OpKind::kPause, tag, report); }
ebt_status_t ebt_mem_resume(const char* tag, ebt_mem_report_t* report) { return run_sync(OpKind::kResume, tag, report); }
ebt_status_t ebt_mem_pause_async(const char* tag, ebt_mem_op_t* op) { return run_async(OpKind::kPause, tag, op); }
ebt_status_t ebt_mem_resume_async(const char* tag, ebt_mem_op_t* op) { return run_async(OpKind::kResume, tag, op); }

// No settings check in op_wait/op_release: an op exists only if its start passed one.
ebt_status_t ebt_mem_op_wait(ebt_mem_op_t op, double timeout_s, ebt_mem_report_t* report) {
  EBT_REQUIRE_ARG(op, "op is NULL");
  std::unique_lock<std::mutex> lock(op->mu);
  if (timeout_s < 0) {
    op->cv.wait(lock, [op] { return op->done; });
  } else if (!op->cv.wait_for(lock, std::chrono::duration<double>(timeout_s), [op] { return op->done; })) {
    return ebt_set_error(EBT_ERROR_TIMEOUT, "pause/resume still running after %.3f s", timeout_s);
  }
  copy_report(op->report, report);
  if (op->status != EBT_SUCCESS) return ebt_set_error(op->status, "%s", op->message.c_str());
  return EBT_SUCCESS;
}

ebt_status_t ebt_mem_op_release(ebt_mem_op_t op) {
  if (!op) return EBT_SUCCESS;
  {
    std::unique_lock<std::mutex> lock(op->mu);
    op->cv.wait(lock, [op] { return op->done; });
  }
  delete op;
  return EBT_SUCCESS;
}
}  // extern "C"
