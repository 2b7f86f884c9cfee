/*
 * multi_gpu: a driver-API client of the shim with a lease of several GPUs (issue 37), run by
 * tests/test_multi_gpu_native.py (the worker driven directly, by tests/tools/mini_server.py
 * --devices) and by the pool's end-to-end test (gpupoold, GPUPOOL_GPUS=N).
 *
 *   multi_gpu [count] [bytes]     (default 4 devices, 1 MiB + 123 bytes per buffer)
 *
 * Checks: cuDeviceGetCount is `count`; every device has a name, total memory, and a UUID and PCI
 * bus id of its own; a primary context per device (cuCtxGetDevice names it); cuMemAlloc in each
 * gives ranges that never overlap, and cuPointerGetAttribute (DEVICE_ORDINAL, CONTEXT) names the
 * right device and context for each; cuDeviceCanAccessPeer and the P2P access attribute agree
 * and say every other device is a peer (as on the simulated device); cuCtxEnablePeerAccess /
 * DisablePeerAccess give the driver's answers for twice and for the context's own device; copies
 * between every ordered pair of devices are bit-exact with cuMemcpyPeer, cuMemcpyPeerAsync and a
 * plain cuMemcpyDtoD; cuCtxCreate on the last device allocates there.
 * Ends with "PASS multi_gpu: n checks" or "FAIL multi_gpu: k of n checks failed".
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gp_cuda_more.h"

CUresult cuInit(unsigned int);
CUresult cuDeviceGetCount(int *);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDeviceGetName(char *, int, CUdevice);
CUresult cuDeviceGetUuid(CUuuid *, CUdevice);
CUresult cuDeviceTotalMem_v2(size_t *, CUdevice);
CUresult cuDeviceGetPCIBusId(char *, int, CUdevice);
CUresult cuDeviceCanAccessPeer(int *, CUdevice, CUdevice);
CUresult cuDeviceGetP2PAttribute(int *, int, CUdevice, CUdevice);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuCtxGetDevice(CUdevice *);
CUresult cuCtxCreate_v2(CUcontext *, unsigned int, CUdevice);
CUresult cuCtxDestroy_v2(CUcontext);
CUresult cuCtxSynchronize(void);
CUresult cuCtxEnablePeerAccess(CUcontext, unsigned int);
CUresult cuCtxDisablePeerAccess(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemsetD8_v2(CUdeviceptr, unsigned char, size_t);
CUresult cuMemcpyHtoD_v2(CUdeviceptr, const void *, size_t);
CUresult cuMemcpyDtoH_v2(void *, CUdeviceptr, size_t);
CUresult cuMemcpyDtoD_v2(CUdeviceptr, CUdeviceptr, size_t);
CUresult cuMemcpyPeer(CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, size_t);
CUresult cuMemcpyPeerAsync(CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, size_t, CUstream);
CUresult cuStreamCreate(CUstream *, unsigned int);
CUresult cuStreamSynchronize(CUstream);
CUresult cuStreamDestroy_v2(CUstream);
CUresult cuPointerGetAttribute(void *, int, CUdeviceptr);

#define MAX_DEV 16
#define P2P_ACCESS_SUPPORTED 2 /* CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED */

static int checks, failed;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        checks++;                                                                                  \
        if (!(cond)) {                                                                             \
            failed++;                                                                              \
            printf("check failed (line %d): %s: ", __LINE__, #cond);                               \
            printf(__VA_ARGS__);                                                                   \
            printf("\n");                                                                          \
        }                                                                                          \
    } while (0)

#define MUST(call)                                                                                 \
    do {                                                                                           \
        CUresult r_ = (call);                                                                      \
        if (r_ != CUDA_SUCCESS) {                                                                  \
            printf("%s failed: %d\nFAIL multi_gpu: setup failed\n", #call, (int)r_);               \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static unsigned char pattern(size_t i, unsigned seed)
{
    return (unsigned char)((i * 131u + seed * 77u + (i >> 9)) & 0xffu);
}

/* The first index where p differs from seed's pattern, or n. */
static size_t first_diff(const unsigned char *p, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++)
        if (p[i] != pattern(i, seed))
            return i;
    return n;
}

/* Device j's scratch buffer holds device i's pattern, read back to the host. */
static void expect_copy(const char *how, CUdeviceptr scratch, unsigned char *host, size_t n, int i,
                        int j)
{
    memset(host, 0, n);
    MUST(cuMemcpyDtoH_v2(host, scratch, n));
    size_t at = first_diff(host, n, (unsigned)i);
    CHECK(at == n, "%s %d -> %d: byte %zu of %zu differs", how, i, j, at, n);
}

int main(int argc, char **argv)
{
    int want = argc > 1 ? atoi(argv[1]) : 4;
    size_t n = argc > 2 ? (size_t)strtoull(argv[2], NULL, 0) : (1u << 20) + 123;
    if (want < 1 || want > MAX_DEV || n == 0) {
        printf("usage: multi_gpu [count 1..%d] [bytes]\nFAIL multi_gpu: bad arguments\n", MAX_DEV);
        return 2;
    }
    MUST(cuInit(0));
    int count = 0;
    MUST(cuDeviceGetCount(&count));
    CHECK(count == want, "cuDeviceGetCount %d, expected %d", count, want);
    if (count != want) {
        printf("FAIL multi_gpu: %d of %d checks failed\n", failed, checks);
        return 1;
    }

    CUdevice dev[MAX_DEV];
    CUcontext ctx[MAX_DEV];
    CUuuid uuid[MAX_DEV];
    char bus[MAX_DEV][32];
    for (int d = 0; d < count; d++) {
        MUST(cuDeviceGet(&dev[d], d));
        char name[256] = "";
        size_t total = 0;
        MUST(cuDeviceGetName(name, sizeof name, dev[d]));
        MUST(cuDeviceTotalMem_v2(&total, dev[d]));
        MUST(cuDeviceGetUuid(&uuid[d], dev[d]));
        MUST(cuDeviceGetPCIBusId(bus[d], sizeof bus[d], dev[d]));
        CHECK(name[0] != '\0' && total > 0, "device %d: name '%s', %zu bytes", d, name, total);
        for (int e = 0; e < d; e++) {
            CHECK(memcmp(uuid[d].bytes, uuid[e].bytes, 16) != 0, "devices %d and %d: one UUID", e,
                  d);
            CHECK(strcmp(bus[d], bus[e]) != 0, "devices %d and %d: one PCI bus id %s", e, d,
                  bus[d]);
        }
        MUST(cuDevicePrimaryCtxRetain(&ctx[d], dev[d]));
        for (int e = 0; e < d; e++)
            CHECK(ctx[d] != ctx[e], "devices %d and %d share a primary context", e, d);
    }

    /* A buffer and a scratch buffer on every device, each filled with its own pattern. */
    CUdeviceptr buf[MAX_DEV], scratch[MAX_DEV];
    unsigned char *host = malloc(n);
    if (!host) {
        printf("FAIL multi_gpu: out of host memory\n");
        return 1;
    }
    for (int d = 0; d < count; d++) {
        MUST(cuCtxSetCurrent(ctx[d]));
        CUdevice cur = -1;
        MUST(cuCtxGetDevice(&cur));
        CHECK(cur == dev[d], "cuCtxGetDevice %d in device %d's primary context", (int)cur, d);
        MUST(cuMemAlloc_v2(&buf[d], n));
        MUST(cuMemAlloc_v2(&scratch[d], n));
        for (size_t i = 0; i < n; i++)
            host[i] = pattern(i, (unsigned)d);
        MUST(cuMemcpyHtoD_v2(buf[d], host, n));
        MUST(cuMemsetD8_v2(scratch[d], 0, n));
    }
    for (int d = 0; d < count; d++) {
        CUdeviceptr mine[2] = {buf[d], scratch[d]};
        for (int k = 0; k < 2; k++) {
            int ord = -1;
            CUcontext owner = NULL;
            MUST(cuPointerGetAttribute(&ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, mine[k]));
            MUST(cuPointerGetAttribute(&owner, CU_POINTER_ATTRIBUTE_CONTEXT, mine[k] + n - 1));
            CHECK(ord == d, "pointer 0x%llx of device %d: DEVICE_ORDINAL %d",
                  (unsigned long long)mine[k], d, ord);
            CHECK(owner == ctx[d], "pointer 0x%llx of device %d: another CONTEXT",
                  (unsigned long long)mine[k], d);
            for (int e = 0; e < count; e++) {
                CUdeviceptr other[2] = {buf[e], scratch[e]};
                for (int l = 0; l < 2; l++) {
                    if (e == d && l == k)
                        continue;
                    CHECK(mine[k] + n <= other[l] || other[l] + n <= mine[k],
                          "ranges of devices %d and %d overlap: 0x%llx and 0x%llx", d, e,
                          (unsigned long long)mine[k], (unsigned long long)other[l]);
                }
            }
        }
    }

    /* Peers: what the server's driver says (the simulated device: every other device). */
    for (int i = 0; i < count; i++)
        for (int j = 0; j < count; j++) {
            int can = -1, attr = -1;
            MUST(cuDeviceCanAccessPeer(&can, dev[i], dev[j]));
            CHECK(can == (i != j), "cuDeviceCanAccessPeer(%d, %d) = %d", i, j, can);
            CUresult r = cuDeviceGetP2PAttribute(&attr, P2P_ACCESS_SUPPORTED, dev[i], dev[j]);
            if (i == j)
                CHECK(r == CUDA_ERROR_INVALID_DEVICE, "P2P attribute of device %d with itself: %d",
                      i, (int)r);
            else
                CHECK(r == CUDA_SUCCESS && attr == can, "P2P access attribute (%d, %d): %d, %d", i,
                      j, (int)r, attr);
        }
    if (count > 1) {
        MUST(cuCtxSetCurrent(ctx[0]));
        CHECK(cuCtxEnablePeerAccess(ctx[1], 0) == CUDA_SUCCESS, "enabling peer access 0 -> 1");
        CHECK(cuCtxEnablePeerAccess(ctx[1], 0) == CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,
              "enabling peer access 0 -> 1 twice");
        CHECK(cuCtxEnablePeerAccess(ctx[0], 0) == CUDA_ERROR_INVALID_DEVICE,
              "enabling peer access to the context's own device");
        CHECK(cuCtxDisablePeerAccess(ctx[1]) == CUDA_SUCCESS, "disabling peer access 0 -> 1");
        CHECK(cuCtxDisablePeerAccess(ctx[1]) == CUDA_ERROR_PEER_ACCESS_NOT_ENABLED,
              "disabling peer access 0 -> 1 twice");
    }
    for (int i = 0; i < count; i++) {
        MUST(cuCtxSetCurrent(ctx[i]));
        for (int j = 0; j < count; j++)
            if (j != i) {
                CUresult r = cuCtxEnablePeerAccess(ctx[j], 0);
                CHECK(r == CUDA_SUCCESS || r == CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,
                      "enabling peer access %d -> %d: %d", i, j, (int)r);
            }
    }

    /* Copies between every ordered pair: cuMemcpyPeer, cuMemcpyPeerAsync, cuMemcpyDtoD. */
    CUstream s;
    MUST(cuCtxSetCurrent(ctx[0]));
    MUST(cuStreamCreate(&s, 0));
    for (int i = 0; i < count; i++)
        for (int j = 0; j < count; j++) {
            if (i == j)
                continue;
            MUST(cuCtxSetCurrent(ctx[j]));
            MUST(cuMemsetD8_v2(scratch[j], 0, n));
            MUST(cuMemcpyPeer(scratch[j], ctx[j], buf[i], ctx[i], n));
            expect_copy("cuMemcpyPeer", scratch[j], host, n, i, j);

            MUST(cuMemsetD8_v2(scratch[j], 0, n));
            MUST(cuCtxSetCurrent(ctx[0]));
            MUST(cuMemcpyPeerAsync(scratch[j], ctx[j], buf[i], ctx[i], n, s));
            MUST(cuStreamSynchronize(s));
            expect_copy("cuMemcpyPeerAsync", scratch[j], host, n, i, j);

            MUST(cuCtxSetCurrent(ctx[i]));
            MUST(cuMemsetD8_v2(scratch[j], 0, n));
            MUST(cuMemcpyDtoD_v2(scratch[j], buf[i], n));
            MUST(cuCtxSynchronize());
            expect_copy("cuMemcpyDtoD", scratch[j], host, n, i, j);
        }
    MUST(cuCtxSetCurrent(ctx[0]));
    MUST(cuStreamDestroy_v2(s));

    /* A context of its own on the last device: its memory is that device's. */
    CUcontext own;
    int last = count - 1;
    MUST(cuCtxCreate_v2(&own, 0, dev[last]));
    CUdevice cur = -1;
    MUST(cuCtxGetDevice(&cur));
    CHECK(cur == dev[last], "cuCtxCreate on device %d: cuCtxGetDevice %d", last, (int)cur);
    CUdeviceptr p;
    MUST(cuMemAlloc_v2(&p, n));
    int ord = -1;
    MUST(cuPointerGetAttribute(&ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p));
    CHECK(ord == last, "memory of a context on device %d: DEVICE_ORDINAL %d", last, ord);
    MUST(cuMemcpyDtoD_v2(p, buf[0], n));
    expect_copy("cuMemcpyDtoD (own context)", p, host, n, 0, last);
    MUST(cuMemFree_v2(p));
    MUST(cuCtxDestroy_v2(own));

    for (int d = 0; d < count; d++) {
        MUST(cuCtxSetCurrent(ctx[d]));
        MUST(cuMemFree_v2(buf[d]));
        MUST(cuMemFree_v2(scratch[d]));
    }
    MUST(cuCtxSetCurrent(NULL));
    for (int d = 0; d < count; d++)
        MUST(cuDevicePrimaryCtxRelease_v2(dev[d]));
    free(host);
    if (failed) {
        printf("FAIL multi_gpu: %d of %d checks failed\n", failed, checks);
        return 1;
    }
    printf("PASS multi_gpu: %d checks\n", checks);
    return 0;
}
