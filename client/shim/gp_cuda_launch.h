/*
 * gp_cuda_launch.h: modules, libraries, kernels, launches, function attributes and occupancy.
 *
 * Part 1 declares, in our own words, the driver API types, constants and prototypes of this
 * area that cudaapi/gp_cuda.h does not have (values are facts of the driver ABI; names match the
 * driver's so the code reads like driver code). Part 2 is the shim-internal object model shared
 * by api_module.c, api_func.c, api_launch.c and api_occupancy.c.
 */
#ifndef GP_CUDA_LAUNCH_H
#define GP_CUDA_LAUNCH_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "gp_cuda.h"
#include "gp_cuda_more.h" /* CUfunc_cache (shared with the context calls) */

/* ---- part 1: driver API declarations ---------------------------------------------------- */

enum {
    CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1,
    CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES = 2,
    CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3,
    CU_FUNC_ATTRIBUTE_CACHE_MODE_CA = 7,
    CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9,
    CU_FUNC_ATTRIBUTE_CLUSTER_SIZE_MUST_BE_SET = 10,
    CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH = 11,
    CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT = 12,
    CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH = 13,
    CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14,
    CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE = 15,
    CU_FUNC_ATTRIBUTE_MAX = 16,
};

typedef int CUfunctionLoadingState;
enum {
    CU_FUNCTION_LOADING_STATE_UNLOADED = 0,
    CU_FUNCTION_LOADING_STATE_LOADED = 1
};

enum {
    CU_LAUNCH_ATTRIBUTE_IGNORE = 0,
    CU_LAUNCH_ATTRIBUTE_COOPERATIVE = 2,
    CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4,
    CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_EVENT = 7,       /* value holds a CUevent */
    CU_LAUNCH_ATTRIBUTE_LAUNCH_COMPLETION_EVENT = 12, /* value holds a CUevent */
};

enum {
    CU_OCCUPANCY_DEFAULT = 0x0,
    CU_OCCUPANCY_DISABLE_CACHING_OVERRIDE = 0x1
};

typedef int CUjitInputType;

/* The JIT options that return something (cuModuleLoadDataEx, cuLibraryLoadData). */
enum {
    CU_JIT_WALL_TIME = 2,                   /* out: float milliseconds */
    CU_JIT_INFO_LOG_BUFFER = 3,             /* char * */
    CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES = 4,  /* in: capacity, out: bytes written */
    CU_JIT_ERROR_LOG_BUFFER = 5,            /* char * */
    CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 6, /* in: capacity, out: bytes written */
};

/* Prototypes of the entry points this area defines (the generated weak stubs are replaced by
 * these at link time; declaring them here lets the compiler check the signatures). */
CUresult cuModuleLoad(CUmodule *module, const char *fname);
CUresult cuModuleLoadData(CUmodule *module, const void *image);
CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                            CUjit_option *options, void **optionValues);
CUresult cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin);
CUresult cuModuleUnload(CUmodule hmod);
CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name);
CUresult cuModuleGetGlobal_v2(CUdeviceptr *dptr, size_t *bytes, CUmodule hmod, const char *name);
CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                           void **jitOptionsValues, unsigned int numJitOptions,
                           CUlibraryOption *libraryOptions, void **libraryOptionValues,
                           unsigned int numLibraryOptions);
CUresult cuLibraryLoadFromFile(CUlibrary *library, const char *fileName, CUjit_option *jitOptions,
                               void **jitOptionsValues, unsigned int numJitOptions,
                               CUlibraryOption *libraryOptions, void **libraryOptionValues,
                               unsigned int numLibraryOptions);
CUresult cuLibraryUnload(CUlibrary library);
CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name);
CUresult cuLibraryGetModule(CUmodule *pMod, CUlibrary library);
CUresult cuLibraryGetGlobal(CUdeviceptr *dptr, size_t *bytes, CUlibrary library, const char *name);
CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel);
CUresult cuKernelGetLibrary(CUlibrary *pLib, CUkernel kernel);
CUresult cuKernelGetName(const char **name, CUkernel hfunc);
CUresult cuFuncGetName(const char **name, CUfunction hfunc);
CUresult cuFuncGetModule(CUmodule *hmod, CUfunction hfunc);

CUresult cuLinkCreate(unsigned int numOptions, CUjit_option *options, void **optionValues,
                      CUlinkState *stateOut);
CUresult cuLinkCreate_v2(unsigned int numOptions, CUjit_option *options, void **optionValues,
                         CUlinkState *stateOut);
CUresult cuLinkAddData(CUlinkState state, CUjitInputType type, void *data, size_t size,
                       const char *name, unsigned int numOptions, CUjit_option *options,
                       void **optionValues);
CUresult cuLinkAddData_v2(CUlinkState state, CUjitInputType type, void *data, size_t size,
                          const char *name, unsigned int numOptions, CUjit_option *options,
                          void **optionValues);
CUresult cuLinkAddFile(CUlinkState state, CUjitInputType type, const char *path,
                       unsigned int numOptions, CUjit_option *options, void **optionValues);
CUresult cuLinkAddFile_v2(CUlinkState state, CUjitInputType type, const char *path,
                          unsigned int numOptions, CUjit_option *options, void **optionValues);
CUresult cuLinkComplete(CUlinkState state, void **cubinOut, size_t *sizeOut);
CUresult cuLinkDestroy(CUlinkState state);

CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                        unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                        unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                        void **kernelParams, void **extra);
CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                             unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                             unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                             void **kernelParams, void **extra);
CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                          void **extra);
CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                               void **extra);
CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                   unsigned int gridDimZ, unsigned int blockDimX,
                                   unsigned int blockDimY, unsigned int blockDimZ,
                                   unsigned int sharedMemBytes, CUstream hStream,
                                   void **kernelParams);
CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                        unsigned int gridDimZ, unsigned int blockDimX,
                                        unsigned int blockDimY, unsigned int blockDimZ,
                                        unsigned int sharedMemBytes, CUstream hStream,
                                        void **kernelParams);

CUresult cuFuncGetAttribute(int *pi, CUfunction_attribute attrib, CUfunction hfunc);
CUresult cuKernelGetAttribute(int *pi, CUfunction_attribute attrib, CUkernel kernel, CUdevice dev);
CUresult cuFuncSetAttribute(CUfunction hfunc, CUfunction_attribute attrib, int value);
CUresult cuKernelSetAttribute(CUfunction_attribute attrib, int val, CUkernel kernel, CUdevice dev);
CUresult cuFuncSetCacheConfig(CUfunction hfunc, CUfunc_cache config);
CUresult cuKernelSetCacheConfig(CUkernel kernel, CUfunc_cache config, CUdevice dev);
CUresult cuFuncGetParamInfo(CUfunction func, size_t paramIndex, size_t *paramOffset,
                            size_t *paramSize);
CUresult cuKernelGetParamInfo(CUkernel kernel, size_t paramIndex, size_t *paramOffset,
                              size_t *paramSize);
CUresult cuFuncIsLoaded(CUfunctionLoadingState *state, CUfunction function);
CUresult cuFuncLoad(CUfunction function);

CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *numBlocks, CUfunction func, int blockSize,
                                                     size_t dynamicSMemSize);
CUresult cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int *numBlocks, CUfunction func,
                                                              int blockSize, size_t dynamicSMemSize,
                                                              unsigned int flags);
CUresult cuOccupancyAvailableDynamicSMemPerBlock(size_t *dynamicSmemSize, CUfunction func,
                                                 int numBlocks, int blockSize);
CUresult cuOccupancyMaxPotentialClusterSize(int *clusterSize, CUfunction func,
                                            const CUlaunchConfig *config);
CUresult cuOccupancyMaxActiveClusters(int *numClusters, CUfunction func,
                                      const CUlaunchConfig *config);
CUresult cuOccupancyMaxPotentialBlockSize(int *minGridSize, int *blockSize, CUfunction func,
                                          CUoccupancyB2DSize blockSizeToDynamicSMemSize,
                                          size_t dynamicSMemSize, int blockSizeLimit);
CUresult cuOccupancyMaxPotentialBlockSizeWithFlags(int *minGridSize, int *blockSize,
                                                   CUfunction func,
                                                   CUoccupancyB2DSize blockSizeToDynamicSMemSize,
                                                   size_t dynamicSMemSize, int blockSizeLimit,
                                                   unsigned int flags);

/* ---- part 2: shim-internal objects (api_module.c owns them) ----------------------------- */

/* Wire kinds of module_load / get_function / get_global. */
#define GP_MODKIND_MODULE 0u
#define GP_MODKIND_LIBRARY 1u

/* Function attributes cached per function (indices below this). */
#define GP_FUNC_ATTR_CACHE 32

typedef struct gp_module gp_module;

/* A CUfunction (from cuModuleGetFunction) or a CUkernel (from cuLibraryGetKernel). A kernel
 * that cuKernelGetFunction was asked for is also registered under a CUfunction handle
 * (func_alias): both handles lead to this one object, and the wire id stays the kernel's,
 * since the worker launches kernel ids directly. */
typedef struct gp_func {
    uint64_t handle;     /* GP_H_FUNC or GP_H_KERNEL handle the object was created under */
    uint64_t wire;       /* the id the worker bound with get_function (== handle) */
    uint64_t func_alias; /* kernels: CUfunction handle given out by cuKernelGetFunction, or 0 */
    gp_module *mod;
    char *name;
    /* Parameter layout: count -1 when unknown (launch then needs `extra`). */
    int param_count;
    uint32_t param_bytes; /* max(offset + size) */
    uint32_t *param_offsets, *param_sizes;
    /* Attribute cache, written under mod->lock, read lock-free by launches. */
    _Atomic uint32_t attr_valid; /* bit a: attr_val[a] holds the server's answer */
    _Atomic int attr_val[GP_FUNC_ATTR_CACHE];
    _Atomic uint32_t attr_gen; /* bumped by every successful set: part of occupancy cache keys */
    /* bit a: the last successful set of attribute a gave it set_val[a], so setting that value
     * again changes nothing and needs no round trip (libraries set the same value before every
     * launch: docs/benchmarks.md, "Link model"). */
    _Atomic uint32_t set_known;
    _Atomic uint32_t attr_unknown; /* bit a: the driver refused to read a (INVALID_VALUE) */
    _Atomic int set_val[GP_FUNC_ATTR_CACHE];
    atomic_flag warned_params; /* the "layout unknown" message was printed */
    struct gp_func *next_hash; /* mod->funcs chain */
} gp_func;

/* The function object behind a CUfunction or CUkernel handle (any of its handles), or NULL. */
gp_func *gp_func_lookup(uint64_t h);
/* A spread lease: the thread's next frames about fn go to its module's context (its part); a
 * library's kernel is on every part and keeps the current context. After gp_ctx_enter. */
void gp_func_use_ctx(const gp_func *fn);

/* The function's attribute `attr` (from the cache, else one request). For internal users
 * (launch checks, occupancy). */
CUresult gp_func_attr(gp_func *fn, int attr, int *value);

/* gp_request's non-success answer as the program's CUresult: protocol-level codes (GP_E*,
 * >= 100000) become CUDA_ERROR_UNKNOWN with a line on stderr naming `what`; driver results and
 * transport errors pass through. */
CUresult gp_server_result(int32_t result, const char *what);

/* The lock protecting fn's module-level state (function table, attribute cache writes). */
pthread_mutex_t *gp_func_lock(gp_func *fn);

#endif /* GP_CUDA_LAUNCH_H */
