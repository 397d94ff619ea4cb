// bindings.cc — ebbtide._C.optim: the Adam engine over raw pointers (Python passes tensor.data_ptr()). Every
// argument is validated natively (adam.cc); the GIL is released while the kernel runs.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "csrc/py_status.h"
#include "csrc/status.h"
#include "optim/adam.h"

namespace py = pybind11;

namespace ebbtide::optim {
namespace {

template <typename T>
T* ptr(uint64_t v) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(v));
}

bool engine_step(AdamEngine& eng, const AdamHyper& h, const std::vector<uint64_t>& params,
                 const std::vector<uint64_t>& exp_avgs, const std::vector<uint64_t>& exp_avg_sqs,
                 const std::vector<uint64_t>& max_exp_avg_sqs, const std::vector<uint64_t>& grads,
                 const std::vector<bool>& grad_bf16, const std::vector<uint64_t>& outs,
                 const std::vector<int64_t>& numels, const std::vector<uint64_t>& step_counters,
                 const std::vector<double>& steps, const std::vector<bool>& moments_bf16) {
  const size_t n = params.size();
  auto same = [n](size_t k) { return k == n; };
  if (!same(exp_avgs.size()) || !same(exp_avg_sqs.size()) || !same(grads.size()) || !same(grad_bf16.size()) ||
      !same(numels.size()) || (!max_exp_avg_sqs.empty() && !same(max_exp_avg_sqs.size())) ||
      (!outs.empty() && !same(outs.size())) || (!step_counters.empty() && !same(step_counters.size())) ||
      (!steps.empty() && !same(steps.size())) || (!moments_bf16.empty() && !same(moments_bf16.size())))
    EBT_PY_CHECK(ebt_set_error(EBT_ERROR_INVALID_ARGUMENT, "adam step: per-span lists differ in length"));
  std::vector<AdamSpan> spans(n);
  for (size_t i = 0; i < n; ++i) {
    AdamSpan& s = spans[i];
    s.p = ptr<float>(params[i]);
    s.m = ptr<void>(exp_avgs[i]);
    s.v = ptr<void>(exp_avg_sqs[i]);
    s.moments_bf16 = !moments_bf16.empty() && moments_bf16[i];
    s.vmax = max_exp_avg_sqs.empty() ? nullptr : ptr<float>(max_exp_avg_sqs[i]);
    s.g = ptr<const void>(grads[i]);
    s.grad_bf16 = grad_bf16[i];
    s.out = outs.empty() ? nullptr : ptr<uint16_t>(outs[i]);
    s.n = numels[i];
    s.step_counter = step_counters.empty() ? nullptr : ptr<float>(step_counters[i]);
    s.step = steps.empty() ? 0.0 : steps[i];
  }
  bool applied = true;
  ebt_status_t st;
  {
    py::gil_scoped_release nogil;
    st = eng.step(h, spans.data(), n, &applied);
  }
  EBT_PY_CHECK(st);
  return applied;
}

}  // namespace

void register_bindings(py::module_& m) {
  m.doc() = "CPU Adam/AdamW kernels (SIMD, own thread pool); see ebbtide.optim";
  m.def("available_isas", &available_isas, "Kernel ISAs this CPU can run, best first.");

  m.def(
      "sqrt_flavor_eval",
      [](int flavor, uint64_t x, uint64_t out, int64_t n) {
        EBT_PY_CHECK(sqrt_flavor_eval(flavor, ptr<const float>(x), ptr<float>(out), n));
      },
      py::arg("flavor"), py::arg("x"), py::arg("out"), py::arg("n"),
      "out[i] = sqrt(x[i]) in a sqrt flavor (0 correctly rounded, 1 MKL's AVX-512 vsSqrt, 2 MKL's generic SSE2 vsSqrt); fp32 pointers.");

  py::class_<AdamHyper>(m, "AdamHyper", "Hyper-parameters of one Adam step (see optim/adam.h).")
      .def(py::init<>())
      .def_readwrite("lr", &AdamHyper::lr)
      .def_readwrite("lr_f32", &AdamHyper::lr_f32)
      .def_readwrite("beta1", &AdamHyper::beta1)
      .def_readwrite("beta2", &AdamHyper::beta2)
      .def_readwrite("eps", &AdamHyper::eps)
      .def_readwrite("weight_decay", &AdamHyper::weight_decay)
      .def_readwrite("adamw", &AdamHyper::adamw)
      .def_readwrite("amsgrad", &AdamHyper::amsgrad)
      .def_readwrite("maximize", &AdamHyper::maximize)
      .def_readwrite("exact", &AdamHyper::exact)
      .def_readwrite("grad_scale", &AdamHyper::grad_scale)
      .def_readwrite("skip_non_finite", &AdamHyper::skip_non_finite)
      .def_readwrite("sqrt_flavor", &AdamHyper::sqrt_flavor)
      .def_readwrite("bc2_sqrt_pow", &AdamHyper::bc2_sqrt_pow);

  py::class_<AdamEngine>(m, "AdamEngine", "A CPU Adam kernel with its own thread pool.")
      .def(py::init([](int threads, const std::string& isa, int tasks_per_thread) {
             std::unique_ptr<AdamEngine> e;
             EBT_PY_CHECK(AdamEngine::create(threads, isa, tasks_per_thread, &e));
             return e;
           }),
           py::arg("threads") = 0, py::arg("isa") = "", py::arg("tasks_per_thread") = 16,
           "threads <= 0: the process's CPU affinity count. isa '': the best this CPU runs (EBBTIDE_CPU_ISA lowers "
           "it); or one of available_isas(). tasks_per_thread (1..256): a step is split into up to threads x "
           "this many ranges, claimed by whichever thread is free when more than one per thread.")
      .def_property_readonly("threads", &AdamEngine::threads)
      .def_property_readonly("tasks_per_thread", &AdamEngine::tasks_per_thread)
      .def_property_readonly("isa", &AdamEngine::isa)
      .def("step", &engine_step, py::arg("hyper"), py::arg("params"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
           py::arg("max_exp_avg_sqs"), py::arg("grads"), py::arg("grad_bf16"), py::arg("outs"), py::arg("numels"),
           py::arg("step_counters"), py::arg("steps"), py::arg("moments_bf16") = std::vector<bool>{},
           "One Adam step over spans given as data pointers (fp32 params/states, fp32 or bf16 grads, optional bf16 "
           "outs; empty optional lists mean none). Per span, step_counters (float32 scalars, incremented) or steps "
           "(the step number). moments_bf16 (empty: all fp32): per span, exp_avg and exp_avg_sq are bf16 bits. Returns False when skip_non_finite found a bad gradient (nothing changed). "
           "Blocking; releases the GIL.");
}

}  // namespace ebbtide::optim
