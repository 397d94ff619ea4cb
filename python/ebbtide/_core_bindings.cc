// _core_bindings.cc — Python view of the core (csrc/ebbtide.h): versions, build info, CPU features, driver,
// logging, the host bandwidth probe.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <mutex>
#include <string>

#include "csrc/ebbtide.h"
#include "csrc/py_status.h"
#include "ebbtide_build_info.h"

namespace py = pybind11;

namespace ebbtide {
namespace {

// The Python log sink. Native lines may come from any thread: take the GIL, and drop lines once the
// interpreter is finalizing.
std::mutex g_sink_mu;
py::object* g_py_sink = nullptr;  // guarded by g_sink_mu; leaked on purpose at exit (no destructor at shutdown)

void log_to_python(int level, unsigned subsys, const char* line, void*) {
  #if PY_VERSION_HEX >= 0x030D0000
  if (!Py_IsInitialized() || Py_IsFinalizing()) return;
#else
  if (!Py_IsInitialized() || _Py_IsFinalizing()) return;
#endif
  py::gil_scoped_acquire gil;
  py::object fn;
  {
    std::lock_guard<std::mutex> lock(g_sink_mu);
    if (!g_py_sink) return;
    fn = *g_py_sink;
  }
  try {
    fn(level, subsys, line);
  } catch (py::error_already_set& e) {
    e.discard_as_unraisable("ebbtide log sink");
  }
}

py::dict cpu_features_dict() {
  unsigned f = 0;
  EBT_PY_CHECK(ebt_cpu_features(&f));
  py::dict d;
  const std::pair<const char*, unsigned> names[] = {
      {"sse4_2", EBT_CPU_SSE42},       {"avx", EBT_CPU_AVX},           {"avx2", EBT_CPU_AVX2},
      {"fma", EBT_CPU_FMA},            {"f16c", EBT_CPU_F16C},         {"avx512f", EBT_CPU_AVX512F},
      {"avx512bw", EBT_CPU_AVX512BW},  {"avx512vl", EBT_CPU_AVX512VL}, {"avx512dq", EBT_CPU_AVX512DQ},
      {"avx512_bf16", EBT_CPU_AVX512_BF16}, {"neon", EBT_CPU_NEON},    {"amx_bf16", EBT_CPU_AMX_BF16}};
  for (const auto& n : names) d[n.first] = bool(f & n.second);
  return d;
}

}  // namespace

void register_core_bindings(py::module_& m) {
  m.def("status_string", [](int s) { return std::string(ebt_status_string(static_cast<ebt_status_t>(s))); },
        py::arg("status"), "Text of a native status code.");
  m.def("last_error", [] { return std::string(ebt_last_error()); }, "This thread's last native error message.");
  m.def("status_count", [] { return static_cast<int>(EBT_STATUS_COUNT); }, "One past the last status value.");
  m.def("runtime_version", [] {
    int v = 0;
    EBT_PY_CHECK(ebt_get_version(&v));
    return v;
  }, "EBT_VERSION_CODE of the loaded libebbtide.so.");
  m.attr("EXTENSION_VERSION_CODE") = EBT_VERSION_CODE;
  m.def("build_info", [] {
    py::dict d;
    d["version"] = EBBTIDE_BUILD_VERSION;
    d["cuda"] = bool(EBBTIDE_BUILD_WITH_CUDA);
    std::string archs = EBBTIDE_BUILD_CUDA_ARCHS;
    py::list arch_list;
    size_t pos = 0;
    while (!archs.empty() && pos <= archs.size()) {
      size_t end = archs.find(',', pos);
      if (end == std::string::npos) end = archs.size();
      arch_list.append(archs.substr(pos, end - pos));
      pos = end + 1;
    }
    d["cuda_archs"] = arch_list;
    d["nvcc_version"] = EBBTIDE_BUILD_CUDA_COMPILER_VERSION;
    d["cxx_compiler"] = EBBTIDE_BUILD_CXX_COMPILER;
    d["build_type"] = EBBTIDE_BUILD_TYPE;
    d["components"] = EBBTIDE_BUILD_COMPONENTS;
    return d;
  }, "What this build contains: CUDA kernels yes/no and archs, compilers, components.");
  m.def("cpu_features", &cpu_features_dict, "CPU features supported by this CPU and OS (cpuid + xgetbv).");
  m.def("cpu_isa", [] {
    const char* n = nullptr;
    EBT_PY_CHECK(ebt_cpu_isa(&n));
    return std::string(n);
  }, "The dispatch level CPU kernels use (after EBBTIDE_CPU_ISA).");
  m.def("cpu_isa_reason", [] {
    const char* r = nullptr;
    EBT_PY_CHECK(ebt_cpu_isa_reason(&r));
    return std::string(r ? r : "");
  }, "Why cpu_isa() chose its level (the dispatch rule, or EBBTIDE_CPU_ISA).");
  m.def("cpu_affinity_count", [] {
    int n = 0;
    EBT_PY_CHECK(ebt_cpu_affinity_count(&n));
    return n;
  }, "Logical CPUs this process may run on.");
  m.def("driver_status", [] {
    ebt_status_t st = ebt_driver_status();
    return py::make_tuple(static_cast<int>(st), std::string(st == EBT_SUCCESS ? "" : ebt_last_error()));
  }, "(status, reason): whether libcuda loaded and cuInit succeeded.");
  m.def("driver_version", [] {
    int v = 0;
    EBT_PY_CHECK(ebt_driver_version(&v));
    return v;
  }, "cuDriverGetVersion (raises DriverNotFoundError without a driver).");
  m.def("driver_path", [] {
    const char* p = nullptr;
    EBT_PY_CHECK(ebt_driver_path(&p));
    return std::string(p);
  }, "The driver library that was loaded.");
  m.def("device_count", [] {
    int n = 0;
    EBT_PY_CHECK(ebt_device_count(&n));
    return n;
  }, "CUDA devices the driver sees (0 without a driver).");
  m.def("host_triad_bandwidth", [](size_t bytes_per_array, int threads, int repeats) {
    double bw = 0;
    ebt_status_t st;
    {
      py::gil_scoped_release nogil;
      st = ebt_host_triad_bandwidth(bytes_per_array, threads, repeats, &bw);
    }
    ::ebbtide::py_check(st, "ebt_host_triad_bandwidth");
    return bw;
  }, py::arg("bytes_per_array"), py::arg("threads") = 0, py::arg("repeats") = 5,
        "In-place triad a += s*b over two float32 arrays; best bytes/s (read a, read b, write a).");
  m.def("host_stream_bandwidth", [](int f32_read, int f32_update, int bf16_read, int bf16_update, int bf16_write,
                                    size_t elements, int threads, int repeats) {
    double bw = 0;
    ebt_status_t st;
    {
      py::gil_scoped_release nogil;
      st = ebt_host_stream_bandwidth(f32_read, f32_update, bf16_read, bf16_update, bf16_write, elements, threads,
                                     repeats, &bw);
    }
    ::ebbtide::py_check(st, "ebt_host_stream_bandwidth");
    return bw;
  }, py::arg("f32_read"), py::arg("f32_update"), py::arg("bf16_read"), py::arg("bf16_update"),
        py::arg("bf16_write"), py::arg("elements"), py::arg("threads") = 0, py::arg("repeats") = 5,
        "Best bytes/s of a mix of streams walked together (ebt_host_stream_bandwidth: fp32 read / updated in place, "
        "bf16 read / updated / written with non-temporal stores).");
  m.def("log_configure", [](int level, unsigned mask) { EBT_PY_CHECK(ebt_log_configure(level, mask)); },
        py::arg("level"), py::arg("subsys_mask"), "Set the native log level (0-3) and subsystem mask.");
  m.def("log_get", [] {
    int level = 0;
    unsigned mask = 0;
    EBT_PY_CHECK(ebt_log_get(&level, &mask));
    return py::make_tuple(level, mask);
  }, "(level, subsystem mask) of the native logger.");
  m.def("set_log_sink", [](py::object fn) {
    std::lock_guard<std::mutex> lock(g_sink_mu);
    if (fn.is_none()) {
      EBT_PY_CHECK(ebt_log_set_sink(nullptr, nullptr));
      delete g_py_sink;
      g_py_sink = nullptr;
    } else {
      if (!g_py_sink) g_py_sink = new py::object();
      *g_py_sink = fn;
      EBT_PY_CHECK(ebt_log_set_sink(&log_to_python, nullptr));
    }
  }, py::arg("fn"), "Route native log lines to fn(level, subsys, line); None restores stderr.");
}

}  // namespace ebbtide
