/*
 * gp_cuda_more.h: driver API types and constants the shim core needs beyond cudaapi/gp_cuda.h,
 * declared in our own words (values and layouts are facts of the driver ABI, checked against
 * the toolkit's cuda.h by tests/c/probe_cuda_more.c when a toolkit is present).
 */
#ifndef GP_CUDA_MORE_H
#define GP_CUDA_MORE_H

#include "gp_cuda.h"

/* ---- CUresult values ----------------------------------------------------------------------- */
enum {
    CUDA_ERROR_UNSUPPORTED_LIMIT = 215,
    CUDA_ERROR_PEER_ACCESS_UNSUPPORTED = 217,
    CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704,
    CUDA_ERROR_PEER_ACCESS_NOT_ENABLED = 705,
};

/* ---- device attributes ---------------------------------------------------------------------- */
enum {
    CU_DEVICE_ATTRIBUTE_MAX_PITCH = 11,
    CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT = 14,
    CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT = 51,
    CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED = 86,
    CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS = 88,
    CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91,
    CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES = 100,
    CU_DEVICE_ATTRIBUTE_DIRECT_MANAGED_MEM_ACCESS_FROM_HOST = 101,
};

/* ---- pointer attributes --------------------------------------------------------------------- */
enum {
    CU_POINTER_ATTRIBUTE_IS_HW_DECOMPRESS_CAPABLE = 21
};

/* ---- contexts ------------------------------------------------------------------------------- */
enum {
    CU_CTX_SCHED_MASK = 0x07,
    CU_CTX_MAP_HOST = 0x08,
    CU_CTX_FLAGS_MASK = 0xFF,
};

typedef enum CUfunc_cache_enum {
    CU_FUNC_CACHE_PREFER_NONE = 0x00,
    CU_FUNC_CACHE_PREFER_SHARED = 0x01,
    CU_FUNC_CACHE_PREFER_L1 = 0x02,
    CU_FUNC_CACHE_PREFER_EQUAL = 0x03,
} CUfunc_cache;

typedef enum CUsharedconfig_enum {
    CU_SHARED_MEM_CONFIG_DEFAULT_BANK_SIZE = 0x00,
    CU_SHARED_MEM_CONFIG_FOUR_BYTE_BANK_SIZE = 0x01,
    CU_SHARED_MEM_CONFIG_EIGHT_BYTE_BANK_SIZE = 0x02,
} CUsharedconfig;

/* Only ever passed through by pointer: the shim refuses non-empty affinity / CIG parameters. */
typedef struct CUexecAffinityParam_st CUexecAffinityParam;
typedef struct CUctxCigParam_st CUctxCigParam;
typedef struct CUctxCreateParams_st {
    CUexecAffinityParam *execAffinityParams;
    int numExecAffinityParams;
    CUctxCigParam *cigParams;
} CUctxCreateParams;

typedef struct CUgreenCtx_st *CUgreenCtx;

/* The legacy device properties (cuDeviceGetProperties). */
typedef struct CUdevprop_st {
    int maxThreadsPerBlock;
    int maxThreadsDim[3];
    int maxGridSize[3];
    int sharedMemPerBlock;
    int totalConstantMemory;
    int SIMDWidth;
    int memPitch;
    int regsPerBlock;
    int clockRate;
    int textureAlign;
} CUdevprop;

/* ---- streams and events --------------------------------------------------------------------- */
typedef enum CUstreamCaptureStatus_enum {
    CU_STREAM_CAPTURE_STATUS_NONE = 0,
    CU_STREAM_CAPTURE_STATUS_ACTIVE = 1,
    CU_STREAM_CAPTURE_STATUS_INVALIDATED = 2,
} CUstreamCaptureStatus;

enum {
    CU_EVENT_RECORD_DEFAULT = 0x0,
    CU_EVENT_RECORD_EXTERNAL = 0x1
};
enum {
    CU_EVENT_WAIT_DEFAULT = 0x0,
    CU_EVENT_WAIT_EXTERNAL = 0x1
};

/* ---- logs ----------------------------------------------------------------------------------- */
typedef int CUlogLevel;
typedef struct CUlogsCallbackEntry_st *CUlogsCallbackHandle;
typedef void (*CUlogsCallback)(void *data, CUlogLevel logLevel, char *message, size_t length);

#endif /* GP_CUDA_MORE_H */
