/*
 * driver.h: the table of driver entry points the worker calls, filled by dlsym() from the
 * library named by --driver (the real libcuda.so.1 or the simulated device).
 *
 * We never link against libcuda: the same binary must run against either library, and a missing
 * optional entry point must become CUDA_ERROR_NOT_SUPPORTED for that one call instead of a load
 * failure. Each entry lists the exported names to try, in order. The versioned name comes first
 * because the real driver still exports the unversioned one with the old (32-bit) ABI; the
 * unversioned fallback is only reached in a library that has no versioned name at all.
 */
#ifndef GP_WORKER_DRIVER_H
#define GP_WORKER_DRIVER_H

#include "gp_cuda.h"

/* X(required, field, parameter list, "name [alternative ...]") */
#define GP_DRIVER_FUNCS(X)                                                                         \
    X(1, cuInit, (unsigned int), "cuInit")                                                         \
    X(0, cuDriverGetVersion, (int *), "cuDriverGetVersion")                                        \
    X(0, cuGetErrorName, (CUresult, const char **), "cuGetErrorName")                              \
    X(1, cuDeviceGet, (CUdevice *, int), "cuDeviceGet")                                            \
    X(0, cuDeviceGetName, (char *, int, CUdevice), "cuDeviceGetName")                              \
    X(0, cuDeviceGetUuid, (CUuuid *, CUdevice), "cuDeviceGetUuid_v2 cuDeviceGetUuid")              \
    X(0, cuDeviceTotalMem, (size_t *, CUdevice), "cuDeviceTotalMem_v2 cuDeviceTotalMem")           \
    X(1, cuDeviceGetAttribute, (int *, CUdevice_attribute, CUdevice), "cuDeviceGetAttribute")      \
    X(1, cuDevicePrimaryCtxRetain, (CUcontext *, CUdevice), "cuDevicePrimaryCtxRetain")            \
    X(0, cuDevicePrimaryCtxRelease, (CUdevice),                                                    \
      "cuDevicePrimaryCtxRelease_v2 cuDevicePrimaryCtxRelease")                                    \
    X(0, cuDevicePrimaryCtxReset, (CUdevice),                                                      \
      "cuDevicePrimaryCtxReset_v2 cuDevicePrimaryCtxReset")                                        \
    X(1, cuCtxSetCurrent, (CUcontext), "cuCtxSetCurrent")                                          \
    X(0, cuCtxCreate, (CUcontext *, unsigned int, CUdevice), "cuCtxCreate_v2")                     \
    X(0, cuCtxCreate_v4, (CUcontext *, void *, unsigned int, CUdevice), "cuCtxCreate_v4")          \
    X(0, cuCtxDestroy, (CUcontext), "cuCtxDestroy_v2 cuCtxDestroy")                                \
    X(0, cuCtxSynchronize, (void), "cuCtxSynchronize")                                             \
    X(0, cuCtxSetLimit, (CUlimit, size_t), "cuCtxSetLimit")                                        \
    X(0, cuCtxGetLimit, (size_t *, CUlimit), "cuCtxGetLimit")                                      \
    X(0, cuCtxGetStreamPriorityRange, (int *, int *), "cuCtxGetStreamPriorityRange")               \
    X(0, cuMemGetInfo, (size_t *, size_t *), "cuMemGetInfo_v2")                                    \
    X(1, cuMemGetAllocationGranularity, (size_t *, const CUmemAllocationProp *, int),              \
      "cuMemGetAllocationGranularity")                                                             \
    X(1, cuMemAddressReserve, (CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long),    \
      "cuMemAddressReserve")                                                                       \
    X(1, cuMemAddressFree, (CUdeviceptr, size_t), "cuMemAddressFree")                              \
    X(1, cuMemCreate,                                                                              \
      (CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long),   \
      "cuMemCreate")                                                                               \
    X(1, cuMemRelease, (CUmemGenericAllocationHandle), "cuMemRelease")                             \
    X(1, cuMemMap,                                                                                 \
      (CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long), "cuMemMap") \
    X(1, cuMemUnmap, (CUdeviceptr, size_t), "cuMemUnmap")                                          \
    X(1, cuMemSetAccess, (CUdeviceptr, size_t, const CUmemAccessDesc *, size_t), "cuMemSetAccess") \
    X(0, cuMemHostAlloc, (void **, size_t, unsigned int), "cuMemHostAlloc")                        \
    X(0, cuMemFreeHost, (void *), "cuMemFreeHost")                                                 \
    X(0, cuMemcpyHtoDAsync, (CUdeviceptr, const void *, size_t, CUstream), "cuMemcpyHtoDAsync_v2") \
    X(0, cuMemcpyDtoHAsync, (void *, CUdeviceptr, size_t, CUstream), "cuMemcpyDtoHAsync_v2")       \
    X(0, cuMemcpyDtoDAsync, (CUdeviceptr, CUdeviceptr, size_t, CUstream), "cuMemcpyDtoDAsync_v2")  \
    X(0, cuMemsetD8Async, (CUdeviceptr, unsigned char, size_t, CUstream), "cuMemsetD8Async")       \
    X(0, cuMemsetD16Async, (CUdeviceptr, unsigned short, size_t, CUstream), "cuMemsetD16Async")    \
    X(0, cuMemsetD32Async, (CUdeviceptr, unsigned int, size_t, CUstream), "cuMemsetD32Async")      \
    X(0, cuMemsetD2D8Async, (CUdeviceptr, size_t, unsigned char, size_t, size_t, CUstream),        \
      "cuMemsetD2D8Async")                                                                         \
    X(0, cuMemsetD2D16Async, (CUdeviceptr, size_t, unsigned short, size_t, size_t, CUstream),      \
      "cuMemsetD2D16Async")                                                                        \
    X(0, cuMemsetD2D32Async, (CUdeviceptr, size_t, unsigned int, size_t, size_t, CUstream),        \
      "cuMemsetD2D32Async")                                                                        \
    X(0, cuStreamCreateWithPriority, (CUstream *, unsigned int, int),                              \
      "cuStreamCreateWithPriority")                                                                \
    X(0, cuStreamDestroy, (CUstream), "cuStreamDestroy_v2 cuStreamDestroy")                        \
    X(0, cuStreamSynchronize, (CUstream), "cuStreamSynchronize")                                   \
    X(0, cuStreamQuery, (CUstream), "cuStreamQuery")                                               \
    X(0, cuStreamWaitEvent, (CUstream, CUevent, unsigned int), "cuStreamWaitEvent")                \
    X(0, cuEventCreate, (CUevent *, unsigned int), "cuEventCreate")                                \
    X(0, cuEventDestroy, (CUevent), "cuEventDestroy_v2 cuEventDestroy")                            \
    X(0, cuEventRecord, (CUevent, CUstream), "cuEventRecord")                                      \
    X(0, cuEventRecordWithFlags, (CUevent, CUstream, unsigned int), "cuEventRecordWithFlags")      \
    X(0, cuEventQuery, (CUevent), "cuEventQuery")                                                  \
    X(0, cuEventSynchronize, (CUevent), "cuEventSynchronize")                                      \
    X(0, cuEventElapsedTime, (float *, CUevent, CUevent),                                          \
      "cuEventElapsedTime_v2 cuEventElapsedTime")                                                  \
    X(0, cuModuleLoadData, (CUmodule *, const void *), "cuModuleLoadData")                         \
    X(0, cuModuleUnload, (CUmodule), "cuModuleUnload")                                             \
    X(0, cuModuleGetFunction, (CUfunction *, CUmodule, const char *), "cuModuleGetFunction")       \
    X(0, cuModuleGetGlobal, (CUdeviceptr *, size_t *, CUmodule, const char *),                     \
      "cuModuleGetGlobal_v2")                                                                      \
    X(0, cuLibraryLoadData,                                                                        \
      (CUlibrary *, const void *, CUjit_option *, void **, unsigned int, CUlibraryOption *,        \
       void **, unsigned int),                                                                     \
      "cuLibraryLoadData")                                                                         \
    X(0, cuLibraryUnload, (CUlibrary), "cuLibraryUnload")                                          \
    X(0, cuLibraryGetKernel, (CUkernel *, CUlibrary, const char *), "cuLibraryGetKernel")          \
    X(0, cuLibraryGetGlobal, (CUdeviceptr *, size_t *, CUlibrary, const char *),                   \
      "cuLibraryGetGlobal")                                                                        \
    X(0, cuFuncGetParamInfo, (CUfunction, size_t, size_t *, size_t *), "cuFuncGetParamInfo")       \
    X(0, cuKernelGetParamInfo, (CUkernel, size_t, size_t *, size_t *), "cuKernelGetParamInfo")     \
    X(0, cuFuncGetAttribute, (int *, CUfunction_attribute, CUfunction), "cuFuncGetAttribute")      \
    X(0, cuFuncSetAttribute, (CUfunction, CUfunction_attribute, int), "cuFuncSetAttribute")        \
    X(0, cuFuncSetCacheConfig, (CUfunction, int), "cuFuncSetCacheConfig")                          \
    X(0, cuKernelGetAttribute, (int *, CUfunction_attribute, CUkernel, CUdevice),                  \
      "cuKernelGetAttribute")                                                                      \
    X(0, cuKernelSetAttribute, (CUfunction_attribute, int, CUkernel, CUdevice),                    \
      "cuKernelSetAttribute")                                                                      \
    X(0, cuKernelSetCacheConfig, (CUkernel, int, CUdevice), "cuKernelSetCacheConfig")              \
    X(0, cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags,                                     \
      (int *, CUfunction, int, size_t, unsigned int),                                              \
      "cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags")                                      \
    X(0, cuOccupancyAvailableDynamicSMemPerBlock, (size_t *, CUfunction, int, int),                \
      "cuOccupancyAvailableDynamicSMemPerBlock")                                                   \
    X(0, cuOccupancyMaxPotentialClusterSize, (int *, CUfunction, const CUlaunchConfig *),          \
      "cuOccupancyMaxPotentialClusterSize")                                                        \
    X(0, cuOccupancyMaxActiveClusters, (int *, CUfunction, const CUlaunchConfig *),                \
      "cuOccupancyMaxActiveClusters")                                                              \
    X(0, cuLaunchKernel,                                                                           \
      (CUfunction, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,           \
       unsigned int, unsigned int, CUstream, void **, void **),                                    \
      "cuLaunchKernel")                                                                            \
    X(0, cuLaunchKernelEx, (const CUlaunchConfig *, CUfunction, void **, void **),                 \
      "cuLaunchKernelEx")                                                                          \
    GP_DRIVER_GRAPH_FUNCS(X)

/* Stream capture and graphs (h_graph.c). The capture mode is a CUstreamCaptureMode (an enum). */
#define GP_DRIVER_GRAPH_FUNCS(X)                                                                   \
    X(0, cuStreamBeginCapture, (CUstream, int), "cuStreamBeginCapture_v2")                         \
    X(0, cuStreamEndCapture, (CUstream, CUgraph *), "cuStreamEndCapture")                          \
    X(0, cuGraphInstantiateWithFlags, (CUgraphExec *, CUgraph, unsigned long long),                \
      "cuGraphInstantiateWithFlags")                                                               \
    X(0, cuGraphLaunch, (CUgraphExec, CUstream), "cuGraphLaunch")                                  \
    X(0, cuGraphUpload, (CUgraphExec, CUstream), "cuGraphUpload")                                  \
    X(0, cuGraphExecDestroy, (CUgraphExec), "cuGraphExecDestroy")                                  \
    X(0, cuGraphDestroy, (CUgraph), "cuGraphDestroy")                                              \
    X(0, cuGraphGetNodes, (CUgraph, void **, size_t *), "cuGraphGetNodes")

struct gp_driver {
    void *lib; /* dlopen() handle */
#define GP_DRIVER_FIELD(req_, name_, params_, syms_) CUresult(*name_) params_;
    GP_DRIVER_FUNCS(GP_DRIVER_FIELD)
#undef GP_DRIVER_FIELD
    /* Not a driver function: the simulated device's explanation of its last error. */
    const char *(*sim_last_error_detail)(void);
    /* Not a driver function either: the simulated device's gpupoolSimHostPointer (the host
     * address backing a device range), used by h_copy.c to skip the staging copy. NULL on a real
     * driver. */
    CUresult (*sim_host_pointer)(CUdeviceptr, size_t, void **);
};

/* dlopen() path and fill the table. Returns 0, or -1 with a one-line reason in err. */
int wk_driver_load(struct gp_driver *d, const char *path, char *err, size_t errlen);

/* Calls an optional entry point, or yields CUDA_ERROR_NOT_SUPPORTED when the library lacks it. */
#define DRV(w_, fn_, ...) ((w_)->drv.fn_ ? (w_)->drv.fn_(__VA_ARGS__) : CUDA_ERROR_NOT_SUPPORTED)

#endif /* GP_WORKER_DRIVER_H */
