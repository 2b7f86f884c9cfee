/*
 * scrub_fake_driver.c: a stand-in driver for tests/test_scrub.py, with just the entry points
 * gpupool-scrub calls, that can be told to misbehave in ways the simulated device never does:
 * fragmented memory, a failing call in any stage, a memset that does not take, a driver that
 * never runs out of memory. Device memory is not stored; each allocation only remembers whether
 * it was zeroed (reads give 0xab until then).
 *
 * Environment:
 *   FAKE_FREE, FAKE_TOTAL    bytes free / total (default 100 MiB / 128 MiB)
 *   FAKE_MAX_CHUNK           larger allocations fail with CUDA_ERROR_OUT_OF_MEMORY (fragmentation)
 *   FAKE_NEVER_OOM=1         allocations always succeed (a lying driver)
 *   FAKE_FAIL=STAGE          init | alloc | memset | sync | copy | free: that call fails;
 *                            dirty: the memset leaves each allocation's last byte as it was
 * It has no gpupoolSimLastErrorDetail: gpupool-scrub must not take it for the simulated device.
 */
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "sim_api.h"

#define MIB (1024ull * 1024)
#define MAX_ALLOCS 100000
#define BASE 0x7e0000000000ull

struct fake_alloc {
    CUdeviceptr ptr;
    size_t size;
    bool zeroed;
    bool freed;
};

/* The scrub is single-threaded, but the lock keeps this library honest for any caller. */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct fake_alloc allocs[MAX_ALLOCS];
static size_t nallocs;
static size_t used;
static CUdeviceptr next_ptr = BASE;

static uint64_t env_u64(const char *name, uint64_t def)
{
    const char *v = getenv(name);
    return v && *v ? strtoull(v, NULL, 0) : def;
}

static bool failing(const char *stage)
{
    const char *v = getenv("FAKE_FAIL");
    return v && strcmp(v, stage) == 0;
}

static void lock(void)
{
    if (pthread_mutex_lock(&mu) != 0)
        abort();
}

static CUresult unlock(CUresult rc)
{
    if (pthread_mutex_unlock(&mu) != 0)
        abort();
    return rc;
}

static struct fake_alloc *find(CUdeviceptr p, size_t n)
{
    for (size_t i = 0; i < nallocs; i++)
        if (!allocs[i].freed && p >= allocs[i].ptr && n <= allocs[i].size &&
            p - allocs[i].ptr <= allocs[i].size - n)
            return &allocs[i];
    return NULL;
}

CUresult cuInit(unsigned int flags)
{
    return failing("init") || flags != 0 ? CUDA_ERROR_NO_DEVICE : CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult e, const char **s)
{
    switch (e) {
    case CUDA_ERROR_OUT_OF_MEMORY:
        *s = "CUDA_ERROR_OUT_OF_MEMORY";
        return CUDA_SUCCESS;
    case CUDA_ERROR_NO_DEVICE:
        *s = "CUDA_ERROR_NO_DEVICE";
        return CUDA_SUCCESS;
    case CUDA_ERROR_ILLEGAL_ADDRESS:
        *s = "CUDA_ERROR_ILLEGAL_ADDRESS";
        return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_VALUE:
        *s = "CUDA_ERROR_INVALID_VALUE";
        return CUDA_SUCCESS;
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
}

CUresult cuGetErrorString(CUresult e, const char **s)
{
    switch (e) {
    case CUDA_ERROR_NO_DEVICE:
        *s = "no CUDA-capable device is detected";
        return CUDA_SUCCESS;
    case CUDA_ERROR_ILLEGAL_ADDRESS:
        *s = "an illegal memory access was encountered";
        return 0;
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
}

CUresult cuDeviceGet(CUdevice *d, int ordinal)
{
    if (ordinal != 0)
        return CUDA_ERROR_INVALID_DEVICE;
    *d = 0;
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d)
{
    *c = (CUcontext)(uintptr_t)0x1000;
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d)
{
    return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext c)
{
    return CUDA_SUCCESS;
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total)
{
    lock();
    uint64_t f = env_u64("FAKE_FREE", 100 * MIB);
    *free_bytes = used > f ? 0 : (size_t)(f - used);
    *total = (size_t)env_u64("FAKE_TOTAL", 128 * MIB);
    return unlock(CUDA_SUCCESS);
}

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t size)
{
    if (failing("alloc"))
        return CUDA_ERROR_UNKNOWN;
    lock();
    bool never_oom = env_u64("FAKE_NEVER_OOM", 0) == 1;
    if (!never_oom && (size > env_u64("FAKE_MAX_CHUNK", UINT64_MAX) ||
                       used + size > env_u64("FAKE_FREE", 100 * MIB)))
        return unlock(CUDA_ERROR_OUT_OF_MEMORY);
    if (nallocs == MAX_ALLOCS)
        return unlock(CUDA_ERROR_OUT_OF_MEMORY);
    allocs[nallocs++] = (struct fake_alloc){.ptr = next_ptr, .size = size};
    *p = next_ptr;
    next_ptr += (size + MIB - 1) / MIB * MIB + MIB;
    used += size;
    return unlock(CUDA_SUCCESS);
}

CUresult cuMemsetD8_v2(CUdeviceptr p, unsigned char v, size_t n)
{
    if (failing("memset"))
        return CUDA_ERROR_ILLEGAL_ADDRESS;
    lock();
    struct fake_alloc *a = find(p, n);
    if (!a)
        return unlock(CUDA_ERROR_INVALID_VALUE);
    a->zeroed = v == 0 && p == a->ptr && n == a->size;
    return unlock(CUDA_SUCCESS);
}

CUresult cuCtxSynchronize(void)
{
    return failing("sync") ? CUDA_ERROR_ILLEGAL_ADDRESS : CUDA_SUCCESS;
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n)
{
    if (failing("copy"))
        return CUDA_ERROR_ILLEGAL_ADDRESS;
    lock();
    struct fake_alloc *a = find(src, n);
    if (!a)
        return unlock(CUDA_ERROR_INVALID_VALUE);
    memset(dst, a->zeroed ? 0 : 0xab, n);
    /* "dirty": the last byte of the allocation kept its old contents. */
    if (a->zeroed && failing("dirty") && src + n == a->ptr + a->size)
        ((unsigned char *)dst)[n - 1] = 0xab;
    return unlock(CUDA_SUCCESS);
}

CUresult cuMemFree_v2(CUdeviceptr p)
{
    if (failing("free"))
        return CUDA_ERROR_INVALID_VALUE;
    lock();
    struct fake_alloc *a = find(p, 1);
    if (!a || a->ptr != p)
        return unlock(CUDA_ERROR_INVALID_VALUE);
    a->freed = true;
    used -= a->size;
    return unlock(CUDA_SUCCESS);
}
