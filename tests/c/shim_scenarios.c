/*
 * shim_scenarios: a driver-API client of the shim (linked against $(BUILD)/client/libcuda.so.1),
 * for the behaviours cudart does not reach on its own: contexts, the context stack, pointer
 * attributes, host memory, cuMemcpy classification, the _ptsz/_ptds variants, fork, many threads
 * with their own contexts, exit without synchronising, and a few timings.
 * It needs a server (GPUPOOL_SERVER); tests/test_shim_core.py runs it against
 * tests/tools/mini_server.py with the simulated device, and against a scripted fake server.
 *
 *   shim_scenarios basic | fork | threads | noexit-sync | pending CODE STICKY | sync | lost |
 *                  flush | init-race | bench | init-fail
 *
 * Prints one line per failed check and ends with "PASS <scenario>: n checks" or "FAIL ...".
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "gp_cuda_more.h"

/* ---- the driver API, as cuda.h declares it (only what we call) ---------------------------- */
CUresult cuInit(unsigned int);
CUresult cuDriverGetVersion(int *);
CUresult cuGetErrorName(CUresult, const char **);
CUresult cuGetErrorString(CUresult, const char **);
CUresult cuDeviceGetCount(int *);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDeviceGetName(char *, int, CUdevice);
CUresult cuDeviceGetUuid(CUuuid *, CUdevice);
CUresult cuDeviceGetUuid_v2(CUuuid *, CUdevice);
CUresult cuDeviceTotalMem_v2(size_t *, CUdevice);
CUresult cuDeviceGetAttribute(int *, int, CUdevice);
CUresult cuDeviceGetPCIBusId(char *, int, CUdevice);
CUresult cuDeviceGetByPCIBusId(CUdevice *, const char *);
CUresult cuDeviceComputeCapability(int *, int *, CUdevice);
CUresult cuDeviceGetProperties(CUdevprop *, CUdevice);
CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *, CUdevice);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuDevicePrimaryCtxRelease(CUdevice);
CUresult cuDevicePrimaryCtxGetState(CUdevice, unsigned int *, int *);
CUresult cuCtxCreate_v2(CUcontext *, unsigned int, CUdevice);
CUresult cuCtxDestroy_v2(CUcontext);
CUresult cuCtxPushCurrent_v2(CUcontext);
CUresult cuCtxPopCurrent_v2(CUcontext *);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuCtxGetCurrent(CUcontext *);
CUresult cuCtxGetDevice(CUdevice *);
CUresult cuCtxGetDevice_v2(CUdevice *, CUcontext);
CUresult cuCtxSynchronize(void);
CUresult cuCtxSynchronize_v2(CUcontext);
CUresult cuCtxGetLimit(size_t *, int);
CUresult cuCtxSetLimit(int, size_t);
CUresult cuCtxGetStreamPriorityRange(int *, int *);
CUresult cuCtxGetApiVersion(CUcontext, unsigned int *);
CUresult cuCtxGetId(CUcontext, unsigned long long *);
CUresult cuModuleGetLoadingMode(CUmoduleLoadingMode *);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemAllocPitch_v2(CUdeviceptr *, size_t *, size_t, size_t, unsigned int);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, CUstream);
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
CUresult cuMemGetAddressRange_v2(CUdeviceptr *, size_t *, CUdeviceptr);
CUresult cuMemcpyHtoD_v2(CUdeviceptr, const void *, size_t);
CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr, const void *, size_t);
CUresult cuMemcpyDtoH_v2(void *, CUdeviceptr, size_t);
CUresult cuMemcpyDtoH_v2_ptds(void *, CUdeviceptr, size_t);
CUresult cuMemcpyDtoD_v2(CUdeviceptr, CUdeviceptr, size_t);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr, const void *, size_t, CUstream);
CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr, const void *, size_t, CUstream);
CUresult cuMemcpyDtoHAsync_v2(void *, CUdeviceptr, size_t, CUstream);
CUresult cuMemcpyDtoHAsync_v2_ptsz(void *, CUdeviceptr, size_t, CUstream);
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr, CUdeviceptr, size_t, CUstream);
CUresult cuMemcpy(CUdeviceptr, CUdeviceptr, size_t);
CUresult cuMemcpyAsync(CUdeviceptr, CUdeviceptr, size_t, CUstream);
CUresult cuMemsetD8_v2(CUdeviceptr, unsigned char, size_t);
CUresult cuMemsetD8_v2_ptds(CUdeviceptr, unsigned char, size_t);
CUresult cuMemsetD16_v2(CUdeviceptr, unsigned short, size_t);
CUresult cuMemsetD32_v2(CUdeviceptr, unsigned int, size_t);
CUresult cuMemsetD8Async(CUdeviceptr, unsigned char, size_t, CUstream);
CUresult cuMemsetD32Async(CUdeviceptr, unsigned int, size_t, CUstream);
CUresult cuMemHostAlloc(void **, size_t, unsigned int);
CUresult cuMemAllocHost_v2(void **, size_t);
CUresult cuMemFreeHost(void *);
CUresult cuMemHostRegister_v2(void *, size_t, unsigned int);
CUresult cuMemHostUnregister(void *);
CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *, void *, unsigned int);
CUresult cuMemHostGetFlags(unsigned int *, void *);
CUresult cuPointerGetAttribute(void *, int, CUdeviceptr);
CUresult cuPointerGetAttributes(unsigned int, int *, void **, CUdeviceptr);
CUresult cuStreamCreate(CUstream *, unsigned int);
CUresult cuStreamCreateWithPriority(CUstream *, unsigned int, int);
CUresult cuStreamDestroy_v2(CUstream);
CUresult cuStreamSynchronize(CUstream);
CUresult cuStreamSynchronize_ptsz(CUstream);
CUresult cuStreamQuery(CUstream);
CUresult cuStreamWaitEvent(CUstream, CUevent, unsigned int);
CUresult cuStreamGetPriority(CUstream, int *);
CUresult cuStreamGetFlags(CUstream, unsigned int *);
CUresult cuStreamGetCtx(CUstream, CUcontext *);
CUresult cuStreamGetDevice(CUstream, CUdevice *);
CUresult cuStreamGetId(CUstream, unsigned long long *);
CUresult cuStreamIsCapturing(CUstream, CUstreamCaptureStatus *);
CUresult cuEventCreate(CUevent *, unsigned int);
CUresult cuEventDestroy_v2(CUevent);
CUresult cuEventRecord(CUevent, CUstream);
CUresult cuEventQuery(CUevent);
CUresult cuEventSynchronize(CUevent);
CUresult cuEventElapsedTime_v2(float *, CUevent, CUevent);

/* ---- checks ------------------------------------------------------------------------------ */
static int checks, failures;
static pthread_mutex_t check_lock = PTHREAD_MUTEX_INITIALIZER;

static void fail_line(const char *file, int line, const char *what, long long got, long long want)
{
    pthread_mutex_lock(&check_lock);
    failures++;
    printf("  check failed at %s:%d: %s -> %lld, expected %lld\n", file, line, what, got, want);
    fflush(stdout);
    pthread_mutex_unlock(&check_lock);
}

#define EXPECT_EQ(expr, want)                                                                      \
    do {                                                                                           \
        long long got_ = (long long)(expr), want_ = (long long)(want);                             \
        __atomic_add_fetch(&checks, 1, __ATOMIC_RELAXED);                                          \
        if (got_ != want_)                                                                         \
            fail_line(__FILE__, __LINE__, #expr, got_, want_);                                     \
    } while (0)
#define OK(expr) EXPECT_EQ(expr, CUDA_SUCCESS)
#define EXPECT(cond) EXPECT_EQ(!!(cond), 1)

static int finish(const char *name)
{
    if (failures)
        printf("FAIL %s: %d of %d checks failed\n", name, failures, checks);
    else
        printf("PASS %s: %d checks\n", name, checks);
    fflush(stdout);
    return failures ? 1 : 0;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void fill(uint8_t *p, size_t n, uint32_t seed)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)((i * 2654435761u + seed) >> 13);
}

static CUcontext setup(void)
{
    OK(cuInit(0));
    CUdevice dev;
    OK(cuDeviceGet(&dev, 0));
    CUcontext ctx = NULL;
    OK(cuDevicePrimaryCtxRetain(&ctx, dev));
    OK(cuCtxSetCurrent(ctx));
    return ctx;
}

/* ========================================================================= basic == */

static void basic_devices(void)
{
    int v = 0, n = 0;
    OK(cuDriverGetVersion(&v));
    EXPECT(v >= 12000);
    EXPECT_EQ(cuDeviceGetCount(&n), CUDA_ERROR_NOT_INITIALIZED); /* before cuInit */
    EXPECT_EQ(cuInit(1), CUDA_ERROR_INVALID_VALUE);
    OK(cuInit(0));
    OK(cuInit(0)); /* idempotent */
    OK(cuDeviceGetCount(&n));
    EXPECT_EQ(n, 1);
    CUdevice dev = -1;
    OK(cuDeviceGet(&dev, 0));
    EXPECT_EQ(dev, 0);
    EXPECT_EQ(cuDeviceGet(&dev, 1), CUDA_ERROR_INVALID_DEVICE);
    char name[256] = "", tiny[4] = "xxx";
    OK(cuDeviceGetName(name, sizeof name, 0));
    EXPECT(strlen(name) > 0);
    OK(cuDeviceGetName(tiny, sizeof tiny, 0));
    EXPECT_EQ(strlen(tiny), 3);
    EXPECT_EQ(cuDeviceGetName(name, sizeof name, 5), CUDA_ERROR_INVALID_DEVICE);
    CUuuid u1, u2;
    OK(cuDeviceGetUuid(&u1, 0));
    OK(cuDeviceGetUuid_v2(&u2, 0));
    EXPECT_EQ(memcmp(&u1, &u2, 16), 0);
    size_t mem = 0;
    OK(cuDeviceTotalMem_v2(&mem, 0));
    EXPECT(mem > 0);
    int val = -1;
    OK(cuDeviceGetAttribute(&val, CU_DEVICE_ATTRIBUTE_WARP_SIZE, 0));
    EXPECT_EQ(val, 32);
    OK(cuDeviceGetAttribute(&val, CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, 0));
    EXPECT_EQ(val, 1);
    OK(cuDeviceGetAttribute(&val, CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY, 0));
    EXPECT_EQ(val, 0); /* a remote GPU cannot reach this process's memory */
    EXPECT_EQ(cuDeviceGetAttribute(&val, 0, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT_EQ(cuDeviceGetAttribute(&val, 100000, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT_EQ(cuDeviceGetAttribute(&val, -3, 0), CUDA_ERROR_INVALID_VALUE);
    int major = 0, minor = -1, am = 0, an = 0;
    OK(cuDeviceComputeCapability(&major, &minor, 0));
    OK(cuDeviceGetAttribute(&am, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0));
    OK(cuDeviceGetAttribute(&an, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0));
    EXPECT_EQ(major, am);
    EXPECT_EQ(minor, an);
    CUdevprop prop;
    OK(cuDeviceGetProperties(&prop, 0));
    EXPECT_EQ(prop.SIMDWidth, 32);
    EXPECT(prop.maxThreadsPerBlock >= 1024);
    char bus[32];
    OK(cuDeviceGetPCIBusId(bus, sizeof bus, 0));
    EXPECT_EQ(strlen(bus), 12); /* "0000:1B:00.0" */
    CUdevice back = -1;
    OK(cuDeviceGetByPCIBusId(&back, bus));
    EXPECT_EQ(back, 0);
    OK(cuDeviceGetByPCIBusId(&back, bus + 5)); /* without the domain */
    EXPECT_EQ(cuDeviceGetByPCIBusId(&back, "7777:77:1f.0"), CUDA_ERROR_INVALID_DEVICE);
    EXPECT_EQ(cuDeviceGetByPCIBusId(&back, "nonsense"), CUDA_ERROR_INVALID_VALUE);
    const char *s = NULL;
    OK(cuGetErrorName(CUDA_ERROR_INVALID_VALUE, &s));
    EXPECT(s && strcmp(s, "CUDA_ERROR_INVALID_VALUE") == 0);
    OK(cuGetErrorString(CUDA_ERROR_OUT_OF_MEMORY, &s));
    EXPECT(s && *s);
    EXPECT_EQ(cuGetErrorName(123456, &s), CUDA_ERROR_INVALID_VALUE);
    CUmoduleLoadingMode mode = 0;
    OK(cuModuleGetLoadingMode(&mode));
    EXPECT_EQ(mode, CU_MODULE_LAZY_LOADING);
}

static void basic_contexts(void)
{
    CUcontext cur = (CUcontext)1, prim = NULL, prim2 = NULL;
    OK(cuCtxGetCurrent(&cur));
    EXPECT(cur == NULL);
    CUdevice d = -1;
    EXPECT_EQ(cuCtxGetDevice_v2(&d, NULL), CUDA_ERROR_INVALID_CONTEXT);
    EXPECT_EQ(cuCtxSynchronize(), CUDA_ERROR_INVALID_CONTEXT);
    unsigned flags = 9;
    int active = 9;
    OK(cuDevicePrimaryCtxGetState(0, &flags, &active));
    EXPECT_EQ(active, 0);
    EXPECT_EQ(cuDevicePrimaryCtxRelease(0), CUDA_ERROR_INVALID_CONTEXT); /* not retained */
    OK(cuDevicePrimaryCtxRetain(&prim, 0));
    OK(cuDevicePrimaryCtxRetain(&prim2, 0));
    EXPECT(prim == prim2 && prim != NULL);
    OK(cuDevicePrimaryCtxGetState(0, &flags, &active));
    EXPECT_EQ(active, 1);
    OK(cuDevicePrimaryCtxRelease(0));
    OK(cuCtxSetCurrent(prim));
    OK(cuCtxGetCurrent(&cur));
    EXPECT(cur == prim);
    OK(cuCtxGetDevice(&d));
    EXPECT_EQ(d, 0);
    OK(cuCtxGetDevice_v2(&d, prim));
    OK(cuCtxSynchronize());
    OK(cuCtxSynchronize_v2(prim));
    EXPECT_EQ(cuCtxSetCurrent((CUcontext)(uintptr_t)0x1234), CUDA_ERROR_INVALID_CONTEXT);
    int least = 9, greatest = 9;
    OK(cuCtxGetStreamPriorityRange(&least, &greatest));
    EXPECT(greatest <= least);
    size_t lim = 0;
    OK(cuCtxGetLimit(&lim, CU_LIMIT_STACK_SIZE));
    EXPECT(lim > 0);
    OK(cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, 16 << 20));
    OK(cuCtxGetLimit(&lim, CU_LIMIT_MALLOC_HEAP_SIZE));
    EXPECT(lim >= (16u << 20));
    unsigned api = 0;
    OK(cuCtxGetApiVersion(prim, &api));
    EXPECT(api >= 3020);
    unsigned long long id1 = 0, id2 = 0;
    OK(cuCtxGetId(prim, &id1));

    /* a regular context: created current, pushed and popped, destroyed */
    CUcontext mine = NULL, popped = NULL;
    OK(cuCtxCreate_v2(&mine, 0, 0));
    EXPECT(mine != NULL && mine != prim);
    OK(cuCtxGetCurrent(&cur));
    EXPECT(cur == mine);
    OK(cuCtxGetId(mine, &id2));
    EXPECT(id1 != id2);
    CUdeviceptr p = 0;
    OK(cuMemAlloc_v2(&p, 1 << 20));
    uint8_t buf[256], out[256];
    fill(buf, sizeof buf, 7);
    OK(cuMemcpyHtoD_v2(p, buf, sizeof buf));
    OK(cuMemcpyDtoH_v2(out, p, sizeof out));
    EXPECT_EQ(memcmp(buf, out, sizeof buf), 0);
    CUcontext owner = NULL;
    OK(cuPointerGetAttribute(&owner, CU_POINTER_ATTRIBUTE_CONTEXT, p));
    EXPECT(owner == mine);
    OK(cuCtxPopCurrent_v2(&popped));
    EXPECT(popped == mine);
    OK(cuCtxGetCurrent(&cur));
    EXPECT(cur == prim);
    OK(cuCtxPushCurrent_v2(mine));
    OK(cuCtxSynchronize());
    OK(cuCtxPopCurrent_v2(NULL));
    /* destroying forgets its memory */
    OK(cuCtxDestroy_v2(mine));
    EXPECT_EQ(cuCtxDestroy_v2(mine), CUDA_ERROR_INVALID_CONTEXT);
    EXPECT_EQ(cuCtxPushCurrent_v2(mine), CUDA_ERROR_INVALID_CONTEXT);
    EXPECT_EQ(cuMemcpyHtoD_v2(p, buf, 16), CUDA_ERROR_INVALID_VALUE);
    EXPECT_EQ(cuCtxDestroy_v2(prim), CUDA_ERROR_INVALID_CONTEXT);
    OK(cuCtxGetCurrent(&cur));
    EXPECT(cur == prim);
}

static void basic_memory(void)
{
    CUdeviceptr a = 0, b = 0, c = 0;
    OK(cuMemAlloc_v2(&a, 4000));
    OK(cuMemAlloc_v2(&b, 3 << 20));
    EXPECT_EQ(cuMemAlloc_v2(&c, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(a != 0 && b != 0 && a != b);
    size_t fr = 0, tot = 0;
    OK(cuMemGetInfo_v2(&fr, &tot));
    EXPECT(tot > 0 && fr <= tot);

    /* address ranges and pointer attributes */
    CUdeviceptr base = 0;
    size_t size = 0;
    OK(cuMemGetAddressRange_v2(&base, &size, b + 12345));
    EXPECT_EQ(base, b);
    EXPECT_EQ(size, 3 << 20);
    EXPECT_EQ(cuMemGetAddressRange_v2(&base, &size, b + (3 << 20)), CUDA_ERROR_NOT_FOUND);
    unsigned mt = 0;
    OK(cuPointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, a + 10));
    EXPECT_EQ(mt, CU_MEMORYTYPE_DEVICE);
    CUdeviceptr dp = 0;
    OK(cuPointerGetAttribute(&dp, CU_POINTER_ATTRIBUTE_DEVICE_POINTER, a + 10));
    EXPECT_EQ(dp, a + 10);
    void *hp = (void *)1;
    EXPECT_EQ(cuPointerGetAttribute(&hp, CU_POINTER_ATTRIBUTE_HOST_POINTER, a),
              CUDA_ERROR_INVALID_VALUE);
    unsigned long long id_a = 0, id_b = 0;
    OK(cuPointerGetAttribute(&id_a, CU_POINTER_ATTRIBUTE_BUFFER_ID, a));
    OK(cuPointerGetAttribute(&id_b, CU_POINTER_ATTRIBUTE_BUFFER_ID, b));
    EXPECT(id_a != id_b);
    int stack_var = 0;
    EXPECT_EQ(cuPointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                    (CUdeviceptr)(uintptr_t)&stack_var),
              CUDA_ERROR_INVALID_VALUE);
    /* cuPointerGetAttributes: an unknown pointer is not an error */
    int attrs[6] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE,  CU_POINTER_ATTRIBUTE_DEVICE_POINTER,
                    CU_POINTER_ATTRIBUTE_HOST_POINTER, CU_POINTER_ATTRIBUTE_IS_MANAGED,
                    CU_POINTER_ATTRIBUTE_CONTEXT,      CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};
    unsigned a_mt = 77;
    CUdeviceptr a_dp = 77;
    void *a_hp = (void *)77;
    int a_man = 77, a_ord = 77;
    CUcontext a_ctx = (CUcontext)77;
    void *data[6] = {&a_mt, &a_dp, &a_hp, &a_man, &a_ctx, &a_ord};
    OK(cuPointerGetAttributes(6, attrs, data, (CUdeviceptr)(uintptr_t)&stack_var));
    EXPECT_EQ(a_mt, 0);
    EXPECT_EQ(a_dp, 0);
    EXPECT(a_hp == NULL);
    EXPECT_EQ(a_man, 0);
    EXPECT(a_ctx == NULL);
    OK(cuPointerGetAttributes(6, attrs, data, b + 5));
    EXPECT_EQ(a_mt, CU_MEMORYTYPE_DEVICE);
    EXPECT_EQ(a_dp, b + 5);
    EXPECT(a_hp == NULL);
    EXPECT_EQ(a_ord, 0);
    EXPECT(a_ctx != NULL);

    /* copies, checked locally */
    enum {
        N = 200000
    };
    uint8_t *h = malloc(N), *o = malloc(N);
    fill(h, N, 1);
    OK(cuMemcpyHtoD_v2(b, h, N));
    OK(cuMemcpyDtoH_v2(o, b, N));
    EXPECT_EQ(memcmp(h, o, N), 0);
    EXPECT_EQ(cuMemcpyHtoD_v2(a, h, 4001), CUDA_ERROR_INVALID_VALUE); /* past the end */
    EXPECT_EQ(cuMemcpyDtoH_v2(o, a + 3999, 2), CUDA_ERROR_INVALID_VALUE);
    EXPECT_EQ(cuMemcpyHtoD_v2((CUdeviceptr)(uintptr_t)o, h, 16), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemcpyHtoD_v2(a, h, 0)); /* nothing to do */
    OK(cuMemcpyDtoD_v2(a, b + 100, 4000));
    memset(o, 0, N);
    OK(cuMemcpyDtoH_v2_ptds(o, a, 4000));
    EXPECT_EQ(memcmp(o, h + 100, 4000), 0);
    OK(cuMemcpyHtoD_v2_ptds(a, h + 7, 100));
    OK(cuMemcpyDtoH_v2(o, a, 100));
    EXPECT_EQ(memcmp(o, h + 7, 100), 0);

    /* cuMemcpy without a direction: every combination */
    uint8_t hb[512], hc[512];
    fill(hb, sizeof hb, 3);
    OK(cuMemcpy(a, (CUdeviceptr)(uintptr_t)hb, sizeof hb)); /* H -> D */
    OK(cuMemcpy(b, a, sizeof hb));                          /* D -> D */
    memset(hc, 0, sizeof hc);
    OK(cuMemcpy((CUdeviceptr)(uintptr_t)hc, b, sizeof hc)); /* D -> H */
    EXPECT_EQ(memcmp(hb, hc, sizeof hb), 0);
    memset(hc, 0, sizeof hc);
    OK(cuMemcpy((CUdeviceptr)(uintptr_t)hc, (CUdeviceptr)(uintptr_t)hb, sizeof hc)); /* H -> H */
    EXPECT_EQ(memcmp(hb, hc, sizeof hb), 0);
    EXPECT_EQ(cuMemcpy(a, (CUdeviceptr)(uintptr_t)hb, 5000), CUDA_ERROR_INVALID_VALUE);

    /* memsets */
    OK(cuMemsetD8_v2(a, 0xab, 4000));
    OK(cuMemcpyDtoH_v2(o, a, 4000));
    int bad = 0;
    for (int i = 0; i < 4000; i++)
        bad += o[i] != 0xab;
    EXPECT_EQ(bad, 0);
    OK(cuMemsetD16_v2(a + 2, 0x1234, 10));
    OK(cuMemsetD32_v2(a + 100, 0xdeadbeef, 5));
    OK(cuMemsetD8_v2_ptds(a + 300, 0x11, 3));
    OK(cuMemcpyDtoH_v2(o, a, 400));
    EXPECT_EQ(o[0], 0xab);
    EXPECT_EQ(o[2], 0x34);
    EXPECT_EQ(o[3], 0x12);
    EXPECT_EQ(o[21], 0x12);
    EXPECT_EQ(o[22], 0xab);
    uint32_t w32;
    memcpy(&w32, o + 116, 4);
    EXPECT_EQ(w32, 0xdeadbeef);
    EXPECT_EQ(o[120], 0xab);
    EXPECT_EQ(o[302], 0x11);
    EXPECT_EQ(o[303], 0xab);
    EXPECT_EQ(cuMemsetD16_v2(a + 1, 0, 4), CUDA_ERROR_INVALID_VALUE); /* misaligned */
    EXPECT_EQ(cuMemsetD32_v2(a + 2, 0, 4), CUDA_ERROR_INVALID_VALUE);
    EXPECT_EQ(cuMemsetD8_v2(a, 0, 4001), CUDA_ERROR_INVALID_VALUE);

    /* pitch allocation */
    CUdeviceptr pd = 0;
    size_t pitch = 0;
    OK(cuMemAllocPitch_v2(&pd, &pitch, 1000, 10, 4));
    EXPECT(pitch >= 1000 && pitch % 256 == 0);
    OK(cuMemFree_v2(pd));

    /* frees */
    EXPECT_EQ(cuMemFree_v2(a + 1), CUDA_ERROR_INVALID_VALUE); /* not a base */
    EXPECT_EQ(cuMemFree_v2((CUdeviceptr)(uintptr_t)h), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemFree_v2(a));
    EXPECT_EQ(cuMemFree_v2(a), CUDA_ERROR_INVALID_VALUE); /* twice */
    EXPECT_EQ(cuMemcpyHtoD_v2(a, h, 1), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemFree_v2(b));
    OK(cuCtxSynchronize());
    free(h);
    free(o);
}

static void basic_host_memory(void)
{
    void *p = NULL, *q = NULL;
    OK(cuMemHostAlloc(&p, 10000, CU_MEMHOSTALLOC_PORTABLE));
    EXPECT(p != NULL && ((uintptr_t)p & 4095) == 0);
    memset(p, 0x5a, 10000); /* ordinary local memory */
    OK(cuMemAllocHost_v2(&q, 4));
    EXPECT_EQ(cuMemHostAlloc(&q, 16, 0x80), CUDA_ERROR_INVALID_VALUE);
    unsigned flags = 99;
    OK(cuMemHostGetFlags(&flags, (char *)p + 100));
    EXPECT_EQ(flags, CU_MEMHOSTALLOC_PORTABLE);
    unsigned mt = 0;
    OK(cuPointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (CUdeviceptr)(uintptr_t)p));
    EXPECT_EQ(mt, CU_MEMORYTYPE_HOST);
    void *hp = NULL;
    OK(cuPointerGetAttribute(&hp, CU_POINTER_ATTRIBUTE_HOST_POINTER,
                             (CUdeviceptr)(uintptr_t)p + 8));
    EXPECT(hp == (char *)p + 8);
    CUdeviceptr dp = 0;
    OK(cuMemHostGetDevicePointer_v2(&dp, p, 0));
    EXPECT_EQ(dp, (CUdeviceptr)(uintptr_t)p);

    /* async copies through pinned memory, and a pinned <-> pageable cuMemcpy */
    CUdeviceptr d = 0;
    OK(cuMemAlloc_v2(&d, 10000));
    CUstream s;
    OK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    fill(p, 10000, 9);
    OK(cuMemcpyHtoDAsync_v2(d, p, 10000, s));
    memset(p, 0, 10000); /* the data was taken when the call returned */
    void *back = NULL;
    OK(cuMemHostAlloc(&back, 10000, 0));
    OK(cuMemcpyDtoHAsync_v2(back, d, 10000, s));
    OK(cuStreamSynchronize(s));
    uint8_t ref[10000];
    fill(ref, sizeof ref, 9);
    EXPECT_EQ(memcmp(back, ref, sizeof ref), 0);
    memset(back, 0, 10000);
    OK(cuMemcpyDtoHAsync_v2(back, d, 10000, s));
    uint8_t local[10000];
    OK(cuMemcpyAsync((CUdeviceptr)(uintptr_t)local, (CUdeviceptr)(uintptr_t)back, 10000, s));
    OK(cuStreamSynchronize(s));
    EXPECT_EQ(memcmp(local, ref, sizeof ref), 0); /* host-to-host waited for the async D2H */

    /* registration */
    size_t len = 3 * 4096;
    char *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    OK(cuMemHostRegister_v2(m, len, 0));
    EXPECT_EQ(cuMemHostRegister_v2(m + 4096, 100, 0), CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
    OK(cuPointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (CUdeviceptr)(uintptr_t)m + 5));
    EXPECT_EQ(mt, CU_MEMORYTYPE_HOST);
    EXPECT_EQ(cuMemHostUnregister(m + 1), CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
    OK(cuMemHostUnregister(m));
    EXPECT_EQ(cuMemHostUnregister(m), CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
    munmap(m, len);

    EXPECT_EQ(cuMemFreeHost((char *)p + 1), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemFreeHost(p));
    EXPECT_EQ(cuMemFreeHost(p), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemFreeHost(q));
    OK(cuMemFreeHost(back));
    OK(cuMemFree_v2(d));
    OK(cuStreamDestroy_v2(s));
}

static void basic_streams_events(void)
{
    int least = 0, greatest = 0;
    OK(cuCtxGetStreamPriorityRange(&least, &greatest));
    CUstream s1, s2;
    OK(cuStreamCreate(&s1, 0));
    OK(cuStreamCreateWithPriority(&s2, CU_STREAM_NON_BLOCKING, greatest - 100)); /* clamped */
    EXPECT_EQ(cuStreamCreate(&s1, 0x10), CUDA_ERROR_INVALID_VALUE);
    int pr = 99;
    OK(cuStreamGetPriority(s2, &pr));
    EXPECT_EQ(pr, greatest);
    OK(cuStreamGetPriority(NULL, &pr));
    EXPECT_EQ(pr, 0);
    unsigned fl = 9;
    OK(cuStreamGetFlags(s2, &fl));
    EXPECT_EQ(fl, CU_STREAM_NON_BLOCKING);
    CUcontext sc = NULL, cur = NULL;
    OK(cuStreamGetCtx(s1, &sc));
    OK(cuCtxGetCurrent(&cur));
    EXPECT(sc == cur);
    CUdevice sd = -1;
    OK(cuStreamGetDevice(s1, &sd));
    EXPECT_EQ(sd, 0);
    unsigned long long i1 = 0, i2 = 0;
    OK(cuStreamGetId(s1, &i1));
    OK(cuStreamGetId(s2, &i2));
    EXPECT(i1 != i2);
    CUstreamCaptureStatus cs = 7;
    OK(cuStreamIsCapturing(s1, &cs));
    EXPECT_EQ(cs, CU_STREAM_CAPTURE_STATUS_NONE);
    CUstream bogus = (CUstream)(uintptr_t)0x6750020000999999ull;
    EXPECT_EQ(cuStreamSynchronize(bogus), CUDA_ERROR_INVALID_HANDLE);
    EXPECT_EQ(cuStreamQuery(bogus), CUDA_ERROR_INVALID_HANDLE);

    CUevent e1, e2;
    OK(cuEventCreate(&e1, 0));
    OK(cuEventCreate(&e2, CU_EVENT_BLOCKING_SYNC));
    EXPECT_EQ(cuEventCreate(&e1, CU_EVENT_INTERPROCESS), CUDA_ERROR_INVALID_VALUE);
    CUdeviceptr d;
    OK(cuMemAlloc_v2(&d, 1 << 20));
    OK(cuEventRecord(e1, s1));
    OK(cuMemsetD8Async(d, 1, 1 << 20, s1));
    OK(cuEventRecord(e2, s1));
    OK(cuStreamWaitEvent(s2, e2, 0));
    OK(cuMemsetD32Async(d, 0x02020202, 1 << 18, s2));
    OK(cuEventSynchronize(e2));
    OK(cuEventQuery(e2));
    float ms = -1;
    OK(cuEventElapsedTime_v2(&ms, e1, e2));
    EXPECT(ms >= 0);
    OK(cuStreamSynchronize(s2));
    OK(cuStreamQuery(s2));
    uint8_t b[16];
    OK(cuMemcpyDtoH_v2(b, d + 1000, 16));
    EXPECT_EQ(b[0], 2);
    EXPECT_EQ(cuEventQuery((CUevent)(uintptr_t)0x6750030000999999ull), CUDA_ERROR_INVALID_HANDLE);

    /* the per-thread default stream variants */
    uint8_t h[64], o[64];
    fill(h, sizeof h, 4);
    OK(cuMemcpyHtoDAsync_v2_ptsz(d, h, sizeof h, NULL));
    OK(cuMemcpyDtoHAsync_v2_ptsz(o, d, sizeof o, NULL));
    OK(cuStreamSynchronize_ptsz(NULL));
    EXPECT_EQ(memcmp(h, o, sizeof h), 0);
    OK(cuStreamSynchronize(CU_STREAM_PER_THREAD));
    OK(cuStreamSynchronize(CU_STREAM_LEGACY));

    /* stream-ordered allocation, default pool */
    CUdeviceptr ad = 0, pd = 0;
    OK(cuMemAllocAsync(&ad, 4096, s1));
    OK(cuMemsetD8Async(ad, 3, 4096, s1));
    CUmemoryPool pool = NULL;
    OK(cuDeviceGetDefaultMemPool(&pool, 0));
    EXPECT(pool != NULL);
    OK(cuMemAllocFromPoolAsync(&pd, 4096, pool, s1));
    CUmemoryPool got = NULL;
    OK(cuPointerGetAttribute(&got, CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, ad));
    EXPECT(got == pool);
    OK(cuMemFreeAsync(ad, s1));
    OK(cuMemFreeAsync(pd, s1));
    EXPECT_EQ(cuMemFreeAsync(ad, s1), CUDA_ERROR_INVALID_VALUE);
    OK(cuStreamSynchronize(s1));

    OK(cuEventDestroy_v2(e1));
    OK(cuEventDestroy_v2(e2));
    EXPECT_EQ(cuEventDestroy_v2(e2), CUDA_ERROR_INVALID_HANDLE);
    OK(cuStreamDestroy_v2(s1));
    OK(cuStreamDestroy_v2(s2));
    EXPECT_EQ(cuStreamDestroy_v2(s2), CUDA_ERROR_INVALID_HANDLE);
    OK(cuMemFree_v2(d));
    OK(cuCtxSynchronize());
}

static int scenario_basic(void)
{
    basic_devices();
    basic_contexts();
    basic_memory();
    basic_host_memory();
    basic_streams_events();
    OK(cuDevicePrimaryCtxRelease(0));
    return finish("basic");
}

/* ========================================================================== fork == */

static int scenario_fork(void)
{
    setup();
    CUdeviceptr d;
    OK(cuMemAlloc_v2(&d, 4096));
    uint8_t h[64], o[64];
    fill(h, sizeof h, 5);
    OK(cuMemcpyHtoD_v2(d, h, sizeof h));
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        /* the child: CUDA was initialised in the parent, so it is unusable here, quietly */
        int bad = 0;
        CUdeviceptr x;
        bad += cuMemAlloc_v2(&x, 16) != CUDA_ERROR_NOT_INITIALIZED;
        bad += cuInit(0) != CUDA_ERROR_NOT_INITIALIZED;
        bad += cuMemcpyDtoH_v2(o, d, 16) != CUDA_ERROR_NOT_INITIALIZED;
        bad += cuCtxSynchronize() != CUDA_ERROR_NOT_INITIALIZED;
        _exit(bad);
    }
    int status = -1;
    waitpid(pid, &status, 0);
    EXPECT(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0);
    /* the parent's connection is untouched */
    OK(cuMemcpyDtoH_v2(o, d, sizeof o));
    EXPECT_EQ(memcmp(h, o, sizeof h), 0);
    OK(cuMemFree_v2(d));
    OK(cuCtxSynchronize());
    return finish("fork");
}

/* ======================================================================= threads == */

/* Each thread has its own context (or the primary) and stream and checks its own data; the
 * worker's current context must follow every frame. */
static void *thread_main(void *arg)
{
    int t = (int)(uintptr_t)arg;
    CUcontext ctx = NULL;
    if (t % 2) {
        OK(cuCtxCreate_v2(&ctx, 0, 0));
    } else {
        OK(cuDevicePrimaryCtxRetain(&ctx, 0));
        OK(cuCtxSetCurrent(ctx));
    }
    CUstream s;
    OK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    enum {
        N = 70000
    }; /* above the direct-write threshold */
    uint8_t *h = malloc(N), *o = malloc(N);
    CUdeviceptr d;
    OK(cuMemAlloc_v2(&d, N));
    for (int it = 0; it < 30; it++) {
        fill(h, N, (uint32_t)(t * 1000 + it));
        size_t n = it % 2 ? N : 1000; /* batched and direct bulk */
        OK(cuMemcpyHtoDAsync_v2(d, h, n, s));
        OK(cuMemsetD8Async(d + 10, (unsigned char)t, 5, s));
        memset(o, 0, N);
        OK(cuMemcpyDtoHAsync_v2(o, d, n, s));
        OK(cuStreamSynchronize(s));
        memset(h + 10, t, 5);
        EXPECT_EQ(memcmp(h, o, n), 0);
        CUcontext owner = NULL;
        OK(cuPointerGetAttribute(&owner, CU_POINTER_ATTRIBUTE_CONTEXT, d));
        EXPECT(owner == ctx);
    }
    OK(cuMemFree_v2(d));
    OK(cuStreamDestroy_v2(s));
    if (t % 2)
        OK(cuCtxDestroy_v2(ctx));
    else
        OK(cuDevicePrimaryCtxRelease(0));
    free(h);
    free(o);
    return NULL;
}

static int scenario_threads(void)
{
    OK(cuInit(0));
    CUcontext keep;
    OK(cuDevicePrimaryCtxRetain(&keep, 0)); /* keeps the primary alive across the threads */
    pthread_t th[8];
    for (int t = 0; t < 8; t++)
        pthread_create(&th[t], NULL, thread_main, (void *)(uintptr_t)t);
    for (int t = 0; t < 8; t++)
        pthread_join(th[t], NULL);
    return finish("threads");
}

/* =================================================================== noexit-sync == */

/* Work queued and never synchronised: exit must neither hang nor lose the connection noisily. */
static int scenario_noexit_sync(void)
{
    setup();
    CUdeviceptr d;
    OK(cuMemAlloc_v2(&d, 1 << 20));
    for (int i = 0; i < 1000; i++)
        OK(cuMemsetD8Async(d, (unsigned char)i, 1 << 20, NULL));
    return finish("noexit-sync");
}

/* ======================================================================= pending == */

/* For the scripted fake server: it answers the memset with a notice (code in argv) and the next
 * synchronisations with success; the shim must return the notice's code once (or for ever, when
 * sticky). */
static int scenario_pending(int code, int sticky)
{
    setup();
    CUdeviceptr d;
    OK(cuMemAlloc_v2(&d, 4096));
    OK(cuMemsetD8Async(d, 1, 16, NULL));
    EXPECT_EQ(cuCtxSynchronize(), code);
    EXPECT_EQ(cuCtxSynchronize(), sticky ? code : CUDA_SUCCESS);
    OK(cuMemsetD8Async(d, 1, 16, NULL)); /* the same notice text again: printed once only */
    EXPECT_EQ(cuStreamSynchronize(NULL), code);
    return finish("pending");
}

/* ========================================================================== sync == */

/* Work and synchronisations that all succeed: nothing the server said before (queue notices
 * while the hello waited) may come back as an error. Written to 0x5a and read back, so against
 * the simulated device it also proves the session really ran. */
static int scenario_sync(int check_data)
{
    setup();
    CUdeviceptr d;
    OK(cuMemAlloc_v2(&d, 4096));
    OK(cuMemsetD8Async(d, 0x5a, 4096, NULL));
    EXPECT_EQ(cuCtxSynchronize(), CUDA_SUCCESS);
    EXPECT_EQ(cuStreamSynchronize(NULL), CUDA_SUCCESS);
    if (check_data) {
        uint8_t back[4096];
        OK(cuMemcpyDtoH_v2(back, d, sizeof back));
        int same = 1;
        for (size_t i = 0; i < sizeof back; i++)
            same &= back[i] == 0x5a;
        EXPECT(same);
    }
    OK(cuMemFree_v2(d));
    EXPECT_EQ(cuCtxSynchronize(), CUDA_SUCCESS);
    return finish("sync");
}

/* ===================================================================== init-race == */

static void *init_thread(void *arg)
{
    (void)arg;
    int v = 0, n = 0;
    OK(cuDriverGetVersion(&v));
    OK(cuInit(0));
    OK(cuDeviceGetCount(&n));
    EXPECT_EQ(n, 1);
    return NULL;
}

/* Many threads initialising at once: one connection, every cuInit succeeds. */
static int scenario_init_race(void)
{
    pthread_t th[16];
    for (int t = 0; t < 16; t++)
        pthread_create(&th[t], NULL, init_thread, NULL);
    for (int t = 0; t < 16; t++)
        pthread_join(th[t], NULL);
    return finish("init-race");
}

/* ========================================================================== lost == */

/* For the scripted fake server, which drops the connection at the first synchronisation: every
 * call fails with CUDA_ERROR_DEVICE_UNAVAILABLE from then on, promptly. */
static int scenario_lost(void)
{
    setup();
    CUdeviceptr d;
    OK(cuMemAlloc_v2(&d, 4096));
    EXPECT_EQ(cuCtxSynchronize(), CUDA_ERROR_DEVICE_UNAVAILABLE);
    double t = now_s();
    EXPECT_EQ(cuMemAlloc_v2(&d, 4096), CUDA_ERROR_DEVICE_UNAVAILABLE);
    EXPECT_EQ(cuMemsetD8Async(d, 1, 16, NULL), CUDA_ERROR_DEVICE_UNAVAILABLE);
    EXPECT_EQ(cuStreamSynchronize(NULL), CUDA_ERROR_DEVICE_UNAVAILABLE);
    EXPECT(now_s() - t < 1.0);
    return finish("lost");
}

/* ========================================================================= flush == */

/* A fire-and-forget call with no synchronisation after it must still reach the server soon
 * (the flusher): prints when it was posted, then idles. */
static int scenario_flush(void)
{
    setup();
    CUdeviceptr d;
    OK(cuMemAlloc_v2(&d, 4096));
    double t = now_s();
    OK(cuMemsetD8Async(d, 7, 16, NULL));
    printf("posted-at %.6f\n", t);
    fflush(stdout);
    usleep(500000);
    OK(cuCtxSynchronize());
    return finish("flush");
}

/* ========================================================================= bench == */

static int scenario_bench(void)
{
    setup();
    CUdeviceptr d;
    size_t big = 64 << 20;
    OK(cuMemAlloc_v2(&d, big));
    int iters = 5000;
    for (int i = 0; i < 100; i++)
        OK(cuCtxSynchronize());
    double t = now_s();
    for (int i = 0; i < iters; i++)
        OK(cuCtxSynchronize());
    double rtt = (now_s() - t) / iters;
    uint32_t v;
    t = now_s();
    for (int i = 0; i < iters; i++)
        OK(cuMemcpyDtoH_v2(&v, d, 4));
    double d2h4 = (now_s() - t) / iters;
    t = now_s();
    for (int i = 0; i < iters * 10; i++)
        OK(cuMemsetD8Async(d, 1, 64, NULL));
    double post = (now_s() - t) / (iters * 10);
    OK(cuCtxSynchronize());
    double postsync = (now_s() - t) / (iters * 10);
    uint8_t *h = malloc(big);
    fill(h, big, 1);
    OK(cuMemcpyHtoD_v2(d, h, big));
    OK(cuCtxSynchronize());
    t = now_s();
    for (int i = 0; i < 4; i++)
        OK(cuMemcpyHtoD_v2(d, h, big));
    OK(cuCtxSynchronize());
    double h2d = 4.0 * (double)big / (now_s() - t);
    t = now_s();
    for (int i = 0; i < 4; i++)
        OK(cuMemcpyDtoH_v2(h, d, big));
    double d2h = 4.0 * (double)big / (now_s() - t);
    printf("bench: sync round trip %.1f us; 4-byte D2H %.1f us; async post %.2f us/call "
           "(%.2f us incl. final sync); H2D %.0f MB/s; D2H %.0f MB/s\n",
           rtt * 1e6, d2h4 * 1e6, post * 1e6, postsync * 1e6, h2d / 1e6, d2h / 1e6);
    free(h);
    OK(cuMemFree_v2(d));
    return finish("bench");
}

/* ===================================================================== init-fail == */

/* The server is unreachable or refuses: cuInit says CUDA_ERROR_NO_DEVICE, everything else
 * CUDA_ERROR_NOT_INITIALIZED, the driver version is still answered. */
static int scenario_init_fail(void)
{
    int v = 0, n = 5;
    OK(cuDriverGetVersion(&v));
    EXPECT(v >= 12000);
    EXPECT_EQ(cuInit(0), CUDA_ERROR_NO_DEVICE);
    EXPECT_EQ(cuInit(0), CUDA_ERROR_NO_DEVICE);
    EXPECT_EQ(cuDeviceGetCount(&n), CUDA_ERROR_NOT_INITIALIZED);
    CUdeviceptr d;
    EXPECT_EQ(cuMemAlloc_v2(&d, 16), CUDA_ERROR_NOT_INITIALIZED);
    return finish("init-fail");
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *s = argc > 1 ? argv[1] : "basic";
    if (strcmp(s, "basic") == 0)
        return scenario_basic();
    if (strcmp(s, "fork") == 0)
        return scenario_fork();
    if (strcmp(s, "threads") == 0)
        return scenario_threads();
    if (strcmp(s, "noexit-sync") == 0)
        return scenario_noexit_sync();
    if (strcmp(s, "pending") == 0)
        return scenario_pending(argc > 2 ? atoi(argv[2]) : 700, argc > 3 && atoi(argv[3]));
    if (strcmp(s, "sync") == 0)
        return scenario_sync(argc > 2 && atoi(argv[2]));
    if (strcmp(s, "bench") == 0)
        return scenario_bench();
    if (strcmp(s, "lost") == 0)
        return scenario_lost();
    if (strcmp(s, "init-race") == 0)
        return scenario_init_race();
    if (strcmp(s, "flush") == 0)
        return scenario_flush();
    if (strcmp(s, "init-fail") == 0)
        return scenario_init_fail();
    fprintf(stderr, "unknown scenario %s\n", s);
    return 2;
}
