// engine_ipc.cc — shareable allocations: export an allocation's physical memory as a POSIX fd, map another
// process's exported memory (invariants: engine.cc header; contract: ebbtide_memory.h "shareable allocations").
//
// Policy: the engine keeps no handle (released right after mapping); export retains one from the mapping
// (cuMemRetainAllocationHandle), exports it and releases it again, holding mu_ across these three short calls so
// a concurrent pause cannot unmap under it (none waits on the GPU). Imports are this process's mappings of
// memory it does not own: they live in imports_ (not by_va_), are never paused, and close_import() drains the
// device before unmapping (kernels may still read them).
#include <unistd.h>

#include <cstdint>

#include "csrc/status.h"
#include "memory/engine.h"

namespace ebbtide::memory {

ebt_status_t Engine::export_fd(const void* ptr, int* fd, size_t* offset, size_t* size) {
  EBT_REQUIRE_ARG(fd && offset && size, "out-pointers must not be NULL");
  *fd = -1;
  const ebt_driver_table_t* drv;
  EBT_CHECK(driver(&drv));
  if (!drv->cuMemExportToShareableHandle || !drv->cuMemRetainAllocationHandle)
    return ebt_set_error(EBT_ERROR_UNSUPPORTED,
                         "the CUDA driver lacks cuMemExportToShareableHandle or cuMemRetainAllocationHandle");
  Device* d = nullptr;
  int dev = -1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto addr = reinterpret_cast<CUdeviceptr>(ptr);
    auto it = by_va_.upper_bound(addr);
    if (it != by_va_.begin()) --it;
    if (it == by_va_.end() || addr < it->first || addr >= it->first + it->second->size)
      return ebt_set_error(EBT_ERROR_NOT_FOUND, "%p is not in an ebbtide allocation", ptr);
    dev = it->second->device;
  }
  EBT_CHECK(device(dev, &d));  // outside mu_ (lock order: mu_ -> dev_mu_ is allowed, but keep mu_ short)
  CtxGuard ctx(drv, d->ctx);
  std::lock_guard<std::mutex> lock(mu_);
  auto addr = reinterpret_cast<CUdeviceptr>(ptr);
  auto it = by_va_.upper_bound(addr);
  if (it == by_va_.begin()) return ebt_set_error(EBT_ERROR_NOT_FOUND, "%p was freed meanwhile", ptr);
  --it;
  Allocation* a = it->second;
  if (addr >= a->va + a->size) return ebt_set_error(EBT_ERROR_NOT_FOUND, "%p was freed meanwhile", ptr);
  if (!a->shareable)
    return ebt_set_error(EBT_ERROR_INVALID_ARGUMENT, "the allocation at 0x%llx (tag '%s') was not made shareable "
                         "(region(..., shareable=True))", a->va, a->tag->name.c_str());
  if (a->busy || a->state != AllocState::kActive)
    return ebt_set_error(EBT_ERROR_INVALID_STATE, "the allocation at 0x%llx is %s: export it while it is active",
                         a->va, a->busy ? "being paused or resumed" : "paused");
  CUmemGenericAllocationHandle h = 0;
  EBT_CU_CHECK(drv->cuMemRetainAllocationHandle(&h, reinterpret_cast<void*>(a->va)));
  int out = -1;
  CUresult res = drv->cuMemExportToShareableHandle(&out, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  CUresult rel = drv->cuMemRelease(h);  // the mapping keeps the memory; the exported fd holds its own reference
  if (res != CUDA_SUCCESS) return ebt_cu_error(res, "cuMemExportToShareableHandle", __FILE__, __LINE__);
  if (rel != CUDA_SUCCESS) {
    close(out);
    return ebt_cu_error(rel, "cuMemRelease (export)", __FILE__, __LINE__);
  }
  *fd = out;
  *offset = addr - a->va;
  *size = a->aligned;
  return EBT_SUCCESS;
}

ebt_status_t Engine::import_fd(int fd, size_t size, int device_ordinal, void** ptr) {
  EBT_REQUIRE_ARG(ptr, "ptr is NULL");
  *ptr = nullptr;
  EBT_REQUIRE_ARG(fd >= 0, "fd must be a file descriptor, not %d", fd);
  EBT_REQUIRE_ARG(size > 0, "size must be > 0");
  const ebt_driver_table_t* drv;
  EBT_CHECK(driver(&drv));
  if (!drv->cuMemImportFromShareableHandle)
    return ebt_set_error(EBT_ERROR_UNSUPPORTED, "the CUDA driver lacks cuMemImportFromShareableHandle");
  Device* d;
  EBT_CHECK(device(device_ordinal, &d));
  EBT_REQUIRE_ARG(size % d->granularity == 0, "size %zu is not the exporter's mapped size (a multiple of %zu)", size,
                  d->granularity);
  CtxGuard ctx(drv, d->ctx);
  Import im;
  im.size = size;
  im.device = device_ordinal;
  void* os_handle = reinterpret_cast<void*>(static_cast<uintptr_t>(fd));
  EBT_CU_CHECK(drv->cuMemImportFromShareableHandle(&im.handle, os_handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  CUdeviceptr va = 0;
  ebt_status_t st = d->va->allocate(drv, size, &va);
  if (st != EBT_SUCCESS) {
    EBT_CU_IGNORE(drv->cuMemRelease(im.handle), "cleanup of a failed import: the VA error is reported");
    return st;
  }
  CUmemAccessDesc access{{CU_MEM_LOCATION_TYPE_DEVICE, device_ordinal}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  EBT_CU_CHECK_GOTO(drv->cuMemMap(va, size, 0, im.handle, 0), st, fail_va);
  EBT_CU_CHECK_GOTO(drv->cuMemSetAccess(va, size, &access, 1), st, fail_map);
  {
    std::lock_guard<std::mutex> lock(mu_);
    imports_[va] = im;
  }
  *ptr = reinterpret_cast<void*>(va);
  return EBT_SUCCESS;
fail_map:
  EBT_CU_IGNORE(drv->cuMemUnmap(va, size), "cleanup of a failed import: its first error is reported");
fail_va:
  EBT_CU_IGNORE(drv->cuMemRelease(im.handle), "cleanup of a failed import: its first error is reported");
  d->va->free(va, size);
  return st;
}

ebt_status_t Engine::close_import(void* ptr) {
  Import im;
  CUdeviceptr va = reinterpret_cast<CUdeviceptr>(ptr);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = imports_.find(va);
    if (it == imports_.end())
      return ebt_set_error(EBT_ERROR_NOT_FOUND, "%p is not the base of an imported mapping", ptr);
    im = it->second;
    imports_.erase(it);
  }
  const ebt_driver_table_t* drv;
  EBT_CHECK(driver(&drv));
  Device* d;
  EBT_CHECK(device(im.device, &d));
  CtxGuard ctx(drv, d->ctx);
  ebt_status_t st = EBT_SUCCESS;
  CUresult r = drv->cuCtxSynchronize();  // kernels may still read the mapping
  if (r != CUDA_SUCCESS) st = ebt_cu_error(r, "cuCtxSynchronize (close_import)", __FILE__, __LINE__);
  r = drv->cuMemUnmap(va, im.size);
  const bool unmapped = r == CUDA_SUCCESS;
  if (!unmapped) st = ebt_cu_error(r, "cuMemUnmap (close_import)", __FILE__, __LINE__);
  r = drv->cuMemRelease(im.handle);
  if (r != CUDA_SUCCESS) st = ebt_cu_error(r, "cuMemRelease (close_import)", __FILE__, __LINE__);
  if (unmapped) d->va->free(va, im.size);  // still mapped: never hand this VA out again
  return st;
}

void Engine::close_all_imports() {
  std::vector<CUdeviceptr> vas;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& kv : imports_) vas.push_back(kv.first);
  }
  for (CUdeviceptr va : vas) close_import(reinterpret_cast<void*>(va));
}

}  // namespace ebbtide::memory
