/*
 * sim_api.h: the driver entry points that libgpupool-sim.so exports, with the real driver's
 * names and signatures (the worker dlsym()s them exactly as it does from libcuda.so.1).
 *
 * The sim's own sources include this header so that the compiler checks every definition against
 * the declared signature; the tests include it to call the sim directly.
 */
#ifndef GP_SIM_API_H
#define GP_SIM_API_H

#include "gp_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The build hides every symbol (-fvisibility=hidden); only these are exported. */
#define SIM_API __attribute__((visibility("default")))

/* Extra, not a driver function: the detail behind the calling thread's last error (the name of a
 * kernel that cannot run, the address a kernel touched that is not device memory, ...), or "".
 * The worker forwards it to the client next to the CUresult. */
SIM_API const char *gpupoolSimLastErrorDetail(void);

/* Extra, not a driver function: the host address backing the device range [dptr, dptr + size)
 * when all of it is device memory (*host = that address, CUDA_SUCCESS); otherwise
 * CUDA_ERROR_INVALID_VALUE (with an error detail) and *host untouched. Needs a current, usable
 * context, like a copy. The worker uses it, when present, to move copy data straight between the
 * socket and the simulated device memory: the CPU pass that stands in for a real GPU's DMA engine
 * is skipped (streams are synchronous in the sim, so stream order holds). */
SIM_API CUresult gpupoolSimHostPointer(CUdeviceptr dptr, size_t size, void **host);

/* Extra, not a driver function: the configuration keys (sim_config.c), for the table of
 * worker/sim/README.md: key `key`'s name (field 0), default (1) or meaning (2), as Markdown;
 * NULL past the last key or for another field. */
SIM_API const char *gpupoolSimConfigKey(int key, int field);

/* Extra, not a driver function: nanoseconds the calling thread has waited so far, in all, for its
 * kernels' turns on a GPU shared with other processes (key shared_dir, sim_shared.c); 0 without
 * it. A caller timing a launch subtracts the growth of this to get the time its kernel ran. */
SIM_API uint64_t gpupoolSimTurnWaitNs(void);

/* ---- initialisation, errors, devices ----------------------------------------------------- */
SIM_API CUresult cuInit(unsigned int Flags);
SIM_API CUresult cuDriverGetVersion(int *driverVersion);
SIM_API CUresult cuGetErrorName(CUresult error, const char **pStr);
SIM_API CUresult cuGetErrorString(CUresult error, const char **pStr);
SIM_API CUresult cuDeviceGetCount(int *count);
SIM_API CUresult cuDeviceGet(CUdevice *device, int ordinal);
SIM_API CUresult cuDeviceGetName(char *name, int len, CUdevice dev);
SIM_API CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev);
SIM_API CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev);
SIM_API CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev);
SIM_API CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev);
SIM_API CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev);
SIM_API CUresult cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev);
SIM_API CUresult cuDeviceGetP2PAttribute(int *value, int attrib, CUdevice srcDevice,
                                         CUdevice dstDevice);

/* ---- contexts ---------------------------------------------------------------------------- */
SIM_API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
SIM_API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev);
SIM_API CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev);
SIM_API CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active);
SIM_API CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev);
SIM_API CUresult cuCtxDestroy_v2(CUcontext ctx);
SIM_API CUresult cuCtxSetCurrent(CUcontext ctx);
SIM_API CUresult cuCtxGetCurrent(CUcontext *pctx);
SIM_API CUresult cuCtxSynchronize(void);
SIM_API CUresult cuCtxGetLimit(size_t *pvalue, CUlimit limit);
SIM_API CUresult cuCtxSetLimit(CUlimit limit, size_t value);
SIM_API CUresult cuCtxGetStreamPriorityRange(int *leastPriority, int *greatestPriority);

/* ---- memory ------------------------------------------------------------------------------ */
SIM_API CUresult cuMemGetInfo_v2(size_t *free, size_t *total);
SIM_API CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
                                     CUdeviceptr addr, unsigned long long flags);
SIM_API CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size);
SIM_API CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                             const CUmemAllocationProp *prop, unsigned long long flags);
SIM_API CUresult cuMemRelease(CUmemGenericAllocationHandle handle);
SIM_API CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                          CUmemGenericAllocationHandle handle, unsigned long long flags);
SIM_API CUresult cuMemUnmap(CUdeviceptr ptr, size_t size);
SIM_API CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
                                size_t count);
SIM_API CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                               int option);
SIM_API CUresult cuMemExportToShareableHandle(void *shareableHandle,
                                              CUmemGenericAllocationHandle handle, int handleType,
                                              unsigned long long flags);
SIM_API CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle,
                                                void *osHandle, int shHandleType);
SIM_API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
SIM_API CUresult cuMemFree_v2(CUdeviceptr dptr);
SIM_API CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags);
SIM_API CUresult cuMemFreeHost(void *p);

SIM_API CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount);
SIM_API CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount);
SIM_API CUresult cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount);
SIM_API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                      CUstream hStream);
SIM_API CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                                      CUstream hStream);
SIM_API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice,
                                      size_t ByteCount, CUstream hStream);
SIM_API CUresult cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N);
SIM_API CUresult cuMemsetD16_v2(CUdeviceptr dstDevice, unsigned short us, size_t N);
SIM_API CUresult cuMemsetD32_v2(CUdeviceptr dstDevice, unsigned int ui, size_t N);
SIM_API CUresult cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N,
                                 CUstream hStream);
SIM_API CUresult cuMemsetD16Async(CUdeviceptr dstDevice, unsigned short us, size_t N,
                                  CUstream hStream);
SIM_API CUresult cuMemsetD32Async(CUdeviceptr dstDevice, unsigned int ui, size_t N,
                                  CUstream hStream);
/* Not in the worker's required list, but it calls them when present (cudaMemset2D). */
SIM_API CUresult cuMemsetD2D8Async(CUdeviceptr dstDevice, size_t dstPitch, unsigned char uc,
                                   size_t Width, size_t Height, CUstream hStream);
SIM_API CUresult cuMemsetD2D16Async(CUdeviceptr dstDevice, size_t dstPitch, unsigned short us,
                                    size_t Width, size_t Height, CUstream hStream);
SIM_API CUresult cuMemsetD2D32Async(CUdeviceptr dstDevice, size_t dstPitch, unsigned int ui,
                                    size_t Width, size_t Height, CUstream hStream);

/* ---- streams and events ------------------------------------------------------------------ */
SIM_API CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority);
SIM_API CUresult cuStreamDestroy_v2(CUstream hStream);
SIM_API CUresult cuStreamSynchronize(CUstream hStream);
SIM_API CUresult cuStreamQuery(CUstream hStream);
SIM_API CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags);
SIM_API CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags);
SIM_API CUresult cuEventDestroy_v2(CUevent hEvent);
SIM_API CUresult cuEventRecord(CUevent hEvent, CUstream hStream);
SIM_API CUresult cuEventRecordWithFlags(CUevent hEvent, CUstream hStream, unsigned int flags);
SIM_API CUresult cuEventQuery(CUevent hEvent);
SIM_API CUresult cuEventSynchronize(CUevent hEvent);
SIM_API CUresult cuEventElapsedTime_v2(float *pMilliseconds, CUevent hStart, CUevent hEnd);
SIM_API CUresult cuIpcGetEventHandle(CUipcEventHandle *pHandle, CUevent event);
SIM_API CUresult cuIpcOpenEventHandle(CUevent *phEvent, CUipcEventHandle handle);

/* ---- modules, libraries, functions ------------------------------------------------------- */
SIM_API CUresult cuModuleLoadData(CUmodule *module, const void *image);
SIM_API CUresult cuModuleUnload(CUmodule hmod);
SIM_API CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name);
SIM_API CUresult cuModuleGetGlobal_v2(CUdeviceptr *dptr, size_t *bytes, CUmodule hmod,
                                      const char *name);
SIM_API CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                                   void **jitOptionsValues, unsigned int numJitOptions,
                                   CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                   unsigned int numLibraryOptions);
SIM_API CUresult cuLibraryUnload(CUlibrary library);
SIM_API CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name);
SIM_API CUresult cuLibraryGetGlobal(CUdeviceptr *dptr, size_t *bytes, CUlibrary library,
                                    const char *name);
SIM_API CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel);

/* ---- export tables (sim_export.c) -------------------------------------------------------- */
SIM_API CUresult cuGetExportTable(const void **ppExportTable, const CUuuid *pExportTableId);
SIM_API CUresult cuFuncGetParamInfo(CUfunction func, size_t paramIndex, size_t *paramOffset,
                                    size_t *paramSize);
SIM_API CUresult cuKernelGetParamInfo(CUkernel kernel, size_t paramIndex, size_t *paramOffset,
                                      size_t *paramSize);
SIM_API CUresult cuFuncGetAttribute(int *pi, CUfunction_attribute attrib, CUfunction hfunc);
SIM_API CUresult cuFuncSetAttribute(CUfunction hfunc, CUfunction_attribute attrib, int value);
SIM_API CUresult cuKernelGetAttribute(int *pi, CUfunction_attribute attrib, CUkernel kernel,
                                      CUdevice dev);
SIM_API CUresult cuKernelSetAttribute(CUfunction_attribute attrib, int val, CUkernel kernel,
                                      CUdevice dev);
/* config is a CUfunc_cache value (gp_cuda.h does not declare that enum). */
SIM_API CUresult cuFuncSetCacheConfig(CUfunction hfunc, int config);
SIM_API CUresult cuKernelSetCacheConfig(CUkernel kernel, int config, CUdevice dev);

/* ---- occupancy --------------------------------------------------------------------------- */
SIM_API CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *numBlocks, CUfunction func,
                                                             int blockSize, size_t dynamicSMemSize);
SIM_API CUresult cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(
    int *numBlocks, CUfunction func, int blockSize, size_t dynamicSMemSize, unsigned int flags);
SIM_API CUresult cuOccupancyAvailableDynamicSMemPerBlock(size_t *dynamicSmemSize, CUfunction func,
                                                         int numBlocks, int blockSize);
SIM_API CUresult cuOccupancyMaxPotentialClusterSize(int *clusterSize, CUfunction func,
                                                    const CUlaunchConfig *config);
SIM_API CUresult cuOccupancyMaxActiveClusters(int *numClusters, CUfunction func,
                                              const CUlaunchConfig *config);

/* ---- tensor maps (sim_tensormap.c) ------------------------------------------------------- */
SIM_API CUresult cuTensorMapEncodeTiled(
    CUtensorMap *tensorMap, CUtensorMapDataType tensorDataType, cuuint32_t tensorRank,
    void *globalAddress, const cuuint64_t *globalDim, const cuuint64_t *globalStrides,
    const cuuint32_t *boxDim, const cuuint32_t *elementStrides, CUtensorMapInterleave interleave,
    CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2Promotion,
    CUtensorMapFloatOOBfill oobFill);
SIM_API CUresult cuTensorMapEncodeIm2col(
    CUtensorMap *tensorMap, CUtensorMapDataType tensorDataType, cuuint32_t tensorRank,
    void *globalAddress, const cuuint64_t *globalDim, const cuuint64_t *globalStrides,
    const int *pixelBoxLowerCorner, const int *pixelBoxUpperCorner, cuuint32_t channelsPerPixel,
    cuuint32_t pixelsPerColumn, const cuuint32_t *elementStrides, CUtensorMapInterleave interleave,
    CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2Promotion,
    CUtensorMapFloatOOBfill oobFill);
SIM_API CUresult cuTensorMapEncodeIm2colWide(
    CUtensorMap *tensorMap, CUtensorMapDataType tensorDataType, cuuint32_t tensorRank,
    void *globalAddress, const cuuint64_t *globalDim, const cuuint64_t *globalStrides,
    int pixelBoxLowerCornerWidth, int pixelBoxUpperCornerWidth, cuuint32_t channelsPerPixel,
    cuuint32_t pixelsPerColumn, const cuuint32_t *elementStrides, CUtensorMapInterleave interleave,
    CUtensorMapIm2ColWideMode mode, CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2Promotion,
    CUtensorMapFloatOOBfill oobFill);
SIM_API CUresult cuTensorMapReplaceAddress(CUtensorMap *tensorMap, void *globalAddress);

/* ---- launches ---------------------------------------------------------------------------- */
SIM_API CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                unsigned int gridDimZ, unsigned int blockDimX,
                                unsigned int blockDimY, unsigned int blockDimZ,
                                unsigned int sharedMemBytes, CUstream hStream, void **kernelParams,
                                void **extra);
SIM_API CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                                  void **extra);

/* Stream capture and graphs (sim_stream.c, sim_graph.c). Modes: 0 global, 1 thread local,
 * 2 relaxed. */
SIM_API CUresult cuStreamBeginCapture_v2(CUstream hStream, int mode);
SIM_API CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph);
SIM_API CUresult cuStreamIsCapturing(CUstream hStream, int *captureStatus);
SIM_API CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
                                             unsigned long long flags);
SIM_API CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream);
SIM_API CUresult cuGraphUpload(CUgraphExec hGraphExec, CUstream hStream);
SIM_API CUresult cuGraphExecDestroy(CUgraphExec hGraphExec);
SIM_API CUresult cuGraphDestroy(CUgraph hGraph);
SIM_API CUresult cuGraphGetNodes(CUgraph hGraph, void **nodes, size_t *numNodes);

/* ---- process checkpoints (sim_checkpoint.c) ---------------------------------------------- */
SIM_API CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state);
SIM_API CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid);
SIM_API CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args);
SIM_API CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args);
SIM_API CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args);
SIM_API CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args);

#ifdef __cplusplus
}
#endif
#endif /* GP_SIM_API_H */
