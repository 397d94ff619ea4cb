/*
 * bindings.cc — ebbtide._C.memory: a thin pybind11 view of the exported ebt_mem_* C API (memory/ebbtide_memory.h).
 * The engine itself lives in libebbtide.so, which _C links, so Python, the LD_PRELOAD interposers and PyTorch's
 * pluggable allocator reach one engine. Blocking calls release the GIL. Reports and stats come back
 * as dicts; failures raise the typed ebbtide exceptions (OutOfMemoryError with needed/free filled by Python).
 */
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "csrc/log.h"
#include "csrc/py_status.h"
#include "memory/ebbtide_memory.h"

namespace py = pybind11;

namespace ebbtide::memory {
namespace {

ebt_mem_report_t empty_report() {
  ebt_mem_report_t r{};
  r.struct_size = sizeof(r);
  r.device = r.oom_device = -1;
  return r;
}

py::dict report_dict(const ebt_mem_report_t& r) {
  py::dict d;
  d["noop"] = bool(r.noop);
  d["device"] = r.device;
  d["allocations"] = r.allocations;
  d["bytes"] = r.bytes;
  d["bytes_copied"] = r.bytes_copied;
  d["bytes_skipped_clean"] = r.bytes_skipped_clean;
  d["sync_s"] = r.sync_s;
  d["copy_s"] = r.copy_s;
  d["unmap_s"] = r.unmap_s;
  d["map_s"] = r.map_s;
  d["create_s"] = r.create_s;
  d["access_s"] = r.access_s;
  d["unmap_calls"] = r.unmap_calls;
  d["mappings"] = r.mappings;
  d["bytes_pending_freed"] = r.bytes_pending_freed;
  d["meminfo_s"] = r.meminfo_s;
  d["map_call_s"] = r.map_call_s;
  d["prepare_s"] = r.prepare_s;
  d["host_wait_s"] = r.host_wait_s;
  d["host_release_s"] = r.host_release_s;
  d["disk_s"] = r.disk_s;
  d["bytes_disk"] = r.bytes_disk;
  d["total_s"] = r.total_s;
  d["driver_free_before"] = r.driver_free_before;
  d["driver_free_after"] = r.driver_free_after;
  d["oom_needed"] = r.oom_needed;
  d["oom_free"] = r.oom_free;
  d["oom_device"] = r.oom_device;
  return d;
}

// Raise for a failing op with the report attached (Python turns oom_* into OutOfMemoryError fields). The message
// is the engine's own (it names the operation); `what` goes to the debug log with the call site.
void check_op(ebt_status_t st, const char* what, const ebt_mem_report_t& r) {
  if (st == EBT_SUCCESS) return;
  EBT_INFO(EBT_SUBSYS_MEM, "%s failed: %s (%s)", what, ebt_status_string(st), ebbtide::user_message(st).c_str());
  py::object exc =
      py::module_::import("ebbtide.errors").attr("error_for")(static_cast<int>(st), ebbtide::user_message(st));
  exc.attr("report") = report_dict(r);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw py::error_already_set();
}

py::dict run(bool pause, const char* tag) {
  ebt_mem_report_t r = empty_report();
  ebt_status_t st;
  {
    py::gil_scoped_release nogil;
    st = pause ? ebt_mem_pause(tag, &r) : ebt_mem_resume(tag, &r);
  }
  check_op(st, pause ? "pause" : "resume", r);
  return report_dict(r);
}

// An async op handle owned by Python.
struct Op {
  ebt_mem_op_t op = nullptr;
  bool pause = true;
  ~Op() {
    if (op) {
      py::gil_scoped_release nogil;
      ebt_mem_op_release(op);
    }
  }
};

}  // namespace

void register_bindings(py::module_& m) {
  m.doc() = "Memory engine (VMM pause/resume): thin view of the ebt_mem_* C API.";
  m.attr("BACKUP_NONE") = static_cast<int>(EBT_MEM_BACKUP_NONE);
  m.attr("BACKUP_CPU") = static_cast<int>(EBT_MEM_BACKUP_CPU);
  m.attr("BACKUP_DISK") = static_cast<int>(EBT_MEM_BACKUP_DISK);
  m.attr("HOST_TRANSIENT") = static_cast<int>(EBT_MEM_HOST_TRANSIENT);
  m.attr("HOST_PAGEABLE") = static_cast<int>(EBT_MEM_HOST_PAGEABLE);
  m.attr("TAG_MAX") = EBT_MEM_TAG_MAX;

  m.def("region_push", [](const std::string& tag, int backup) {
    int token = 0;
    EBT_PY_CHECK(ebt_mem_region_push(tag.c_str(), backup, &token));
    return token;
  }, py::arg("tag"), py::arg("backup"), "Enter a thread-scoped region; returns the token for region_pop.");
  m.def("region_pop", [](int token) { EBT_PY_CHECK(ebt_mem_region_pop(token)); }, py::arg("token"));
  m.def("set_disabled", [](int disabled) {
    int prev = 0;
    EBT_PY_CHECK(ebt_mem_set_disabled(disabled, &prev));
    return prev;
  }, py::arg("disabled"), "Set this thread's bypass depth; returns the previous value.");
  m.def("set_default_region", [](py::object tag, int backup) {
    if (tag.is_none()) EBT_PY_CHECK(ebt_mem_set_default_region(nullptr, 0));
    else EBT_PY_CHECK(ebt_mem_set_default_region(tag.cast<std::string>().c_str(), backup));
  }, py::arg("tag"), py::arg("backup") = 0, "Process-wide region for threads without one (None clears).");
  m.def("current_region", [] {
    char tag[EBT_MEM_TAG_MAX + 1];
    int backup = 0, disabled = 0;
    EBT_PY_CHECK(ebt_mem_current_region(tag, &backup, &disabled));
    return py::make_tuple(std::string(tag), backup, disabled);
  }, "(tag, backup, disabled) that applies to this thread now.");

  m.def("malloc", [](size_t size, int device, const std::string& tag, int backup) {
    void* p = nullptr;
    ebt_status_t st;
    {
      py::gil_scoped_release nogil;
      st = ebt_mem_malloc(&p, size, device, tag.c_str(), backup);
    }
    EBT_PY_CHECK(st);
    return reinterpret_cast<uintptr_t>(p);
  }, py::arg("size"), py::arg("device"), py::arg("tag"), py::arg("backup") = 0,
     "Allocate directly from the engine; returns the device address.");
  m.def("free", [](uintptr_t ptr) {
    int found = 0;
    ebt_status_t st;
    {
      py::gil_scoped_release nogil;
      st = ebt_mem_free(reinterpret_cast<void*>(ptr), &found);
    }
    EBT_PY_CHECK(st);
    return bool(found);
  }, py::arg("ptr"), "Free an engine allocation; False if the address is not the engine's.");

  m.def("pause", [](py::object tag) {
    std::string t = tag.is_none() ? "" : tag.cast<std::string>();
    return run(true, tag.is_none() ? nullptr : t.c_str());
  }, py::arg("tag") = py::none(), "Pause a tag (None: all); returns the report dict.");
  m.def("resume", [](py::object tag) {
    std::string t = tag.is_none() ? "" : tag.cast<std::string>();
    return run(false, tag.is_none() ? nullptr : t.c_str());
  }, py::arg("tag") = py::none(), "Resume a tag (None: all); returns the report dict.");

  py::class_<Op>(m, "Op", "An asynchronous pause/resume in flight.")
      .def("wait", [](Op& self, double timeout_s) {
        ebt_mem_report_t r = empty_report();
        ebt_status_t st;
        {
          py::gil_scoped_release nogil;
          st = ebt_mem_op_wait(self.op, timeout_s, &r);
        }
        check_op(st, self.pause ? "pause" : "resume", r);
        return report_dict(r);
      }, py::arg("timeout_s") = -1.0, "Block until done (TimeoutError past timeout_s >= 0); returns the report.");
  m.def("pause_async", [](py::object tag) {
    std::string t = tag.is_none() ? "" : tag.cast<std::string>();
    auto op = std::make_unique<Op>();
    op->pause = true;
    EBT_PY_CHECK(ebt_mem_pause_async(tag.is_none() ? nullptr : t.c_str(), &op->op));
    return op;
  }, py::arg("tag") = py::none());
  m.def("resume_async", [](py::object tag) {
    std::string t = tag.is_none() ? "" : tag.cast<std::string>();
    auto op = std::make_unique<Op>();
    op->pause = false;
    EBT_PY_CHECK(ebt_mem_resume_async(tag.is_none() ? nullptr : t.c_str(), &op->op));
    return op;
  }, py::arg("tag") = py::none());

  m.def("mark_clean", [](const std::string& tag) { EBT_PY_CHECK(ebt_mem_mark_clean(tag.c_str())); }, py::arg("tag"));
  m.def("tag_state", [](const std::string& tag) {
    int state = 0;
    unsigned long long pauses = 0;
    EBT_PY_CHECK(ebt_mem_tag_state(tag.c_str(), &state, &pauses));
    const char* name = state == EBT_MEM_TAG_ACTIVE ? "active" : state == EBT_MEM_TAG_PAUSED ? "paused" : "busy";
    return py::make_tuple(std::string(name), pauses);
  }, py::arg("tag"), "(state, pauses begun) of a tag; NotFoundError if no region named it.");
  m.attr("SHAREABLE") = static_cast<int>(EBT_MEM_SHAREABLE);
  m.def("export_fd", [](uintptr_t ptr) {
    int fd = -1;
    size_t offset = 0, size = 0;
    EBT_PY_CHECK(ebt_mem_export_fd(reinterpret_cast<void*>(ptr), &fd, &offset, &size));
    return py::make_tuple(fd, offset, size);
  }, py::arg("ptr"), "(fd, offset of ptr in its allocation, mapped size) of a shareable allocation; caller owns fd.");
  m.def("import_fd", [](int fd, size_t size, int device) {
    void* p = nullptr;
    ebt_status_t st;
    {
      py::gil_scoped_release nogil;
      st = ebt_mem_import_fd(fd, size, device, &p);
    }
    EBT_PY_CHECK(st);
    return reinterpret_cast<uintptr_t>(p);
  }, py::arg("fd"), py::arg("size"), py::arg("device"), "Map another process's exported memory; returns its base.");
  m.def("close_import", [](uintptr_t ptr) {
    ebt_status_t st;
    {
      py::gil_scoped_release nogil;
      st = ebt_mem_close_import(reinterpret_cast<void*>(ptr));
    }
    EBT_PY_CHECK(st);
  }, py::arg("ptr"));
  m.def("set_memory_margin", [](size_t bytes) { EBT_PY_CHECK(ebt_mem_set_memory_margin(bytes)); }, py::arg("bytes"),
        "Allocations and resumes that would leave less than `bytes` free fail with OOM (0: off).");
  m.def("memory_margin", [] {
    size_t b = 0;
    EBT_PY_CHECK(ebt_mem_get_memory_margin(&b));
    return b;
  });
  m.def("set_coalescing", [](bool enabled) { EBT_PY_CHECK(ebt_mem_set_coalescing(enabled ? 1 : 0)); },
        py::arg("enabled"), "Resume maps each VA-contiguous run of a tag's allocations as one mapping (see NOTES).");
  m.def("coalescing", [] {
    int on = 0;
    EBT_PY_CHECK(ebt_mem_get_coalescing(&on));
    return bool(on);
  });
  m.def("stats", [] {
    size_t n = 0;
    EBT_PY_CHECK(ebt_mem_stats(nullptr, sizeof(ebt_mem_tag_stats_t), 0, &n));
    std::vector<ebt_mem_tag_stats_t> rows(n + 8);
    EBT_PY_CHECK(ebt_mem_stats(rows.data(), sizeof(ebt_mem_tag_stats_t), rows.size(), &n));
    py::list out;
    for (size_t i = 0; i < std::min(n, rows.size()); ++i) {
      const auto& s = rows[i];
      py::dict d;
      d["tag"] = std::string(s.tag);
      d["device"] = s.device;
      d["state"] = s.state == EBT_MEM_TAG_ACTIVE ? "active" : s.state == EBT_MEM_TAG_PAUSED ? "paused" : "busy";
      d["allocations"] = s.allocations;
      d["handles"] = s.handles;
      d["bytes_requested"] = s.bytes_requested;
      d["bytes_active"] = s.bytes_active;
      d["bytes_paused"] = s.bytes_paused;
      d["bytes_backed_up"] = s.bytes_backed_up;
      d["bytes_pending_free"] = s.bytes_pending_free;
      ebt_mem_report_t lp, lr;
      memset(&lp, 0, sizeof(lp));
      memset(&lr, 0, sizeof(lr));
      lp.struct_size = lr.struct_size = sizeof(lp);
      EBT_PY_CHECK(ebt_mem_tag_reports(s.tag, &lp, &lr));
      d["last_pause"] = report_dict(lp);
      d["last_resume"] = report_dict(lr);
      out.append(d);
    }
    return out;
  }, "One dict per (tag, device).");
  m.def("global_stats", [] {
    ebt_mem_global_stats_t g;
    EBT_PY_CHECK(ebt_mem_global_stats(&g, sizeof(g)));
    py::dict d;
    d["host_reserved"] = g.host_reserved;
    d["host_used"] = g.host_used;
    d["host_segments"] = g.host_segments;
    d["host_register_s"] = g.host_register_s;
    d["forwarded_allocs"] = g.forwarded_allocs;
    d["forwarded_bytes"] = g.forwarded_bytes;
    d["engine_allocs"] = g.engine_allocs;
    d["engine_frees"] = g.engine_frees;
    d["va_reserved"] = g.va_reserved;
    d["live_allocations"] = g.live_allocations;
    d["coalesced_mappings"] = g.coalesced_mappings;
    d["bytes_pending_free"] = g.bytes_pending_free;
    d["quarantined_ranges"] = g.quarantined_ranges;
    d["quarantined_bytes"] = g.quarantined_bytes;
    d["zombie_reclaims"] = g.zombie_reclaims;
    d["bytes_reclaimed"] = g.bytes_reclaimed;
    d["transient_copies"] = g.transient_copies;
    d["transient_mapped"] = g.transient_mapped;
    d["transient_pinned"] = g.transient_pinned;
    d["transient_retained"] = g.transient_retained;
    d["host_retention"] = bool(g.host_retention);
    d["disk_files"] = g.disk_files;
    d["disk_bytes"] = g.disk_bytes;
    d["disk_staging"] = g.disk_staging;
    d["disk_direct"] = bool(g.disk_direct);
    return d;
  });
  m.def("set_host_retention", [](bool on) { EBT_PY_CHECK(ebt_mem_set_host_retention(on ? 1 : 0)); }, py::arg("on"));
  m.def("host_retention", [] {
    int on = 0;
    EBT_PY_CHECK(ebt_mem_get_host_retention(&on));
    return bool(on);
  });
  m.def("set_disk_dir", [](const std::string& dir) {
    ebt_status_t st;
    {
      py::gil_scoped_release nogil;
      st = ebt_mem_set_disk_dir(dir.c_str());
    }
    EBT_PY_CHECK(st);
  }, py::arg("dir"));
  m.def("disk_dir", [] {
    std::vector<char> buf(4096);
    EBT_PY_CHECK(ebt_mem_get_disk_dir(buf.data(), buf.size()));
    return std::string(buf.data());
  });
  m.def("get_cpu_backup", [](uintptr_t ptr) {
    void* host = nullptr;
    size_t after = 0;
    EBT_PY_CHECK(ebt_mem_get_cpu_backup(reinterpret_cast<void*>(ptr), &host, &after));
    return py::make_tuple(reinterpret_cast<uintptr_t>(host), after);
  }, py::arg("ptr"), "(host address or 0, bytes from there to the backup's end).");
  m.def("lookup", [](uintptr_t ptr) {
    void* base = nullptr;
    size_t size = 0;
    char tag[EBT_MEM_TAG_MAX + 1];
    int paused = 0;
    EBT_PY_CHECK(ebt_mem_lookup(reinterpret_cast<void*>(ptr), &base, &size, tag, &paused));
    return py::make_tuple(reinterpret_cast<uintptr_t>(base), size, std::string(tag), bool(paused));
  }, py::arg("ptr"), "(base, size, tag, paused) of the allocation containing ptr.");
  m.def("paused_ranges", [] {
    size_t n = 0;
    EBT_PY_CHECK(ebt_mem_paused_ranges(nullptr, nullptr, 0, &n));
    std::vector<uintptr_t> starts(n + 16);
    std::vector<size_t> lens(n + 16);
    EBT_PY_CHECK(ebt_mem_paused_ranges(starts.data(), lens.data(), starts.size(), &n));
    py::list out;
    for (size_t i = 0; i < std::min(n, starts.size()); ++i) out.append(py::make_tuple(starts[i], lens[i]));
    return out;
  });
  m.def("reserve_host_memory", [](size_t bytes) {
    ebt_status_t st;
    {
      py::gil_scoped_release nogil;
      st = ebt_mem_reserve_host_memory(bytes);
    }
    EBT_PY_CHECK(st);
  }, py::arg("bytes"));
  m.def("release_host_memory", [] {
    size_t n = 0;
    EBT_PY_CHECK(ebt_mem_release_host_memory(&n));
    return n;
  });
  m.def("set_background_pinning", [](bool enabled) { EBT_PY_CHECK(ebt_mem_set_background_pinning(enabled)); },
        py::arg("enabled"));
  m.def("wait_background_pinning", [] {
    ebt_status_t st;
    {
      py::gil_scoped_release nogil;
      st = ebt_mem_wait_background_pinning();
    }
    EBT_PY_CHECK(st);
  });
  m.def("reset_for_testing", [] { EBT_PY_CHECK(ebt_mem_reset_for_testing()); });
  m.def("shim_active", [] {
    int a = 0;
    EBT_PY_CHECK(ebt_mem_shim_active(&a));
    return bool(a);
  }, "True if this process resolves cudaMalloc to libebbtide.so (it was preloaded).");
}

}  // namespace ebbtide::memory
