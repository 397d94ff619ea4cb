/*
 * driver_symbols.h — the one list of CUDA driver symbols ebbtide calls, as an X-macro:
 *   X(name, return-less prototype arguments, required)
 * REQUIRED symbols must resolve or the driver counts as unusable; OPTIONAL ones may be null and callers check
 * (`if (!ebt_drv()->cuFoo) return EBT_ERROR_UNSUPPORTED`). Each prototype is the CUDA 12.0 ABI of that name
 * (what cuGetProcAddress returns for cudaVersion 12000): e.g. cuMemGetInfo is cuMemGetInfo_v2.
 * To add a symbol: append a line here; nothing else changes.
 */
#ifndef EBBTIDE_CSRC_DRIVER_SYMBOLS_H_
#define EBBTIDE_CSRC_DRIVER_SYMBOLS_H_

#define EBT_DRIVER_REQUIRED 1
#define EBT_DRIVER_OPTIONAL 0

#define EBT_DRIVER_SYMBOLS(X)                                                                              \
  X(cuInit, (unsigned int flags), EBT_DRIVER_REQUIRED)                                                     \
  X(cuDriverGetVersion, (int* version), EBT_DRIVER_REQUIRED)                                               \
  X(cuGetErrorName, (CUresult error, const char** str), EBT_DRIVER_REQUIRED)                               \
  X(cuGetErrorString, (CUresult error, const char** str), EBT_DRIVER_REQUIRED)                             \
  X(cuDeviceGet, (CUdevice * device, int ordinal), EBT_DRIVER_REQUIRED)                                    \
  X(cuDeviceGetCount, (int* count), EBT_DRIVER_REQUIRED)                                                   \
  X(cuDeviceGetName, (char* name, int len, CUdevice dev), EBT_DRIVER_REQUIRED)                             \
  X(cuDeviceTotalMem, (size_t * bytes, CUdevice dev), EBT_DRIVER_REQUIRED)                                 \
  X(cuDeviceGetAttribute, (int* pi, int attrib, CUdevice dev), EBT_DRIVER_REQUIRED)                        \
  X(cuDevicePrimaryCtxRetain, (CUcontext * pctx, CUdevice dev), EBT_DRIVER_REQUIRED)                       \
  X(cuDevicePrimaryCtxRelease, (CUdevice dev), EBT_DRIVER_REQUIRED)                                        \
  X(cuCtxGetCurrent, (CUcontext * pctx), EBT_DRIVER_REQUIRED)                                              \
  X(cuCtxSetCurrent, (CUcontext ctx), EBT_DRIVER_REQUIRED)                                                 \
  X(cuCtxPushCurrent, (CUcontext ctx), EBT_DRIVER_REQUIRED)                                                \
  X(cuCtxPopCurrent, (CUcontext * pctx), EBT_DRIVER_REQUIRED)                                              \
  X(cuCtxGetDevice, (CUdevice * device), EBT_DRIVER_REQUIRED)                                              \
  X(cuCtxSynchronize, (void), EBT_DRIVER_REQUIRED)                                                         \
  X(cuMemGetInfo, (size_t * free_bytes, size_t * total_bytes), EBT_DRIVER_REQUIRED)                        \
  X(cuMemAlloc, (CUdeviceptr * dptr, size_t bytes), EBT_DRIVER_REQUIRED)                                   \
  X(cuMemFree, (CUdeviceptr dptr), EBT_DRIVER_REQUIRED)                                                    \
  X(cuMemHostAlloc, (void** pp, size_t bytes, unsigned int flags), EBT_DRIVER_REQUIRED)                    \
  X(cuMemFreeHost, (void* p), EBT_DRIVER_REQUIRED)                                                         \
  X(cuMemHostRegister, (void* p, size_t bytes, unsigned int flags), EBT_DRIVER_REQUIRED)                   \
  X(cuMemHostUnregister, (void* p), EBT_DRIVER_REQUIRED)                                                   \
  X(cuMemcpyDtoHAsync, (void* dst, CUdeviceptr src, size_t bytes, CUstream s), EBT_DRIVER_REQUIRED)        \
  X(cuMemcpyHtoDAsync, (CUdeviceptr dst, const void* src, size_t bytes, CUstream s), EBT_DRIVER_REQUIRED)  \
  X(cuMemcpyDtoDAsync, (CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream s), EBT_DRIVER_REQUIRED)  \
  X(cuMemsetD8Async, (CUdeviceptr dst, unsigned char value, size_t n, CUstream s), EBT_DRIVER_REQUIRED)    \
  X(cuStreamCreate, (CUstream * s, unsigned int flags), EBT_DRIVER_REQUIRED)                               \
  X(cuStreamDestroy, (CUstream s), EBT_DRIVER_REQUIRED)                                                    \
  X(cuStreamSynchronize, (CUstream s), EBT_DRIVER_REQUIRED)                                                \
  X(cuStreamQuery, (CUstream s), EBT_DRIVER_REQUIRED)                                                      \
  X(cuStreamWaitEvent, (CUstream s, CUevent e, unsigned int flags), EBT_DRIVER_REQUIRED)                   \
  X(cuEventCreate, (CUevent * e, unsigned int flags), EBT_DRIVER_REQUIRED)                                 \
  X(cuEventDestroy, (CUevent e), EBT_DRIVER_REQUIRED)                                                      \
  X(cuEventRecord, (CUevent e, CUstream s), EBT_DRIVER_REQUIRED)                                           \
  X(cuEventQuery, (CUevent e), EBT_DRIVER_REQUIRED)                                                        \
  X(cuEventSynchronize, (CUevent e), EBT_DRIVER_REQUIRED)                                                  \
  X(cuEventElapsedTime, (float* ms, CUevent start, CUevent end), EBT_DRIVER_REQUIRED)                      \
  X(cuPointerGetAttribute, (void* data, int attribute, CUdeviceptr ptr), EBT_DRIVER_REQUIRED)              \
  X(cuMemAddressReserve, (CUdeviceptr * ptr, size_t size, size_t alignment, CUdeviceptr addr,              \
                          unsigned long long flags), EBT_DRIVER_OPTIONAL)                                  \
  X(cuMemAddressFree, (CUdeviceptr ptr, size_t size), EBT_DRIVER_OPTIONAL)                                 \
  X(cuMemCreate, (CUmemGenericAllocationHandle * handle, size_t size, const CUmemAllocationProp* prop,     \
                  unsigned long long flags), EBT_DRIVER_OPTIONAL)                                          \
  X(cuMemRelease, (CUmemGenericAllocationHandle handle), EBT_DRIVER_OPTIONAL)                              \
  X(cuMemMap, (CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,           \
               unsigned long long flags), EBT_DRIVER_OPTIONAL)                                             \
  X(cuMemUnmap, (CUdeviceptr ptr, size_t size), EBT_DRIVER_OPTIONAL)                                       \
  X(cuMemSetAccess, (CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count),             \
    EBT_DRIVER_OPTIONAL)                                                                                   \
  X(cuMemGetAllocationGranularity, (size_t * granularity, const CUmemAllocationProp* prop, int option),    \
    EBT_DRIVER_OPTIONAL)                                                                                   \
  X(cuMemExportToShareableHandle, (void* shareable, CUmemGenericAllocationHandle handle, int type,         \
                                   unsigned long long flags), EBT_DRIVER_OPTIONAL)                         \
  X(cuMemImportFromShareableHandle, (CUmemGenericAllocationHandle * handle, void* shareable, int type),    \
    EBT_DRIVER_OPTIONAL)                                                                                   \
  X(cuMemRetainAllocationHandle, (CUmemGenericAllocationHandle * handle, void* addr), EBT_DRIVER_OPTIONAL)   \
  X(cuThreadExchangeStreamCaptureMode, (int* mode), EBT_DRIVER_OPTIONAL)

#endif  // EBBTIDE_CSRC_DRIVER_SYMBOLS_H_
