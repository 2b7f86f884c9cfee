/*
 * copy_check: a driver-API client of the shim that copies zeros, random bytes and a mix both
 * ways and checks every byte (tests/test_e2e_compression.py runs it with and without
 * GPUPOOL_COMPRESSION=lz4). Sizes: the argument in MiB (default 64), plus the block edges
 * (65535, 65536, 1 MiB + 1) and an odd tail. Sync copies, and async ones on a stream.
 *
 *   copy_check [MiB] [zeros|random|mixed|all]
 *   copy_check dtoh MiB           (one device-to-host copy; prints "dtoh: N", N the CUresult)
 *   copy_check bench MiB REPS     (bench/remoting_bench.py --compression, bench/link_bench.py:
 *                                  the best of REPS sync copies each way of zeros, of random
 *                                  bytes and of "half" (4 KiB random, 4 KiB zeros: LZ4 halves
 *                                  it), as lines
 *                                  RESULT {"pattern": ..., "dir": "htod"|"dtoh", "bytes_per_s": ...,
 *                                          "cpu_s": ..., "bytes": ...}: cpu_s the CPU time of
 *                                  this process, its shim threads included, over every rep of
 *                                  that direction, which moved `bytes`)
 *   copy_check rtt COUNT          (bench/link_bench.py: COUNT synchronous 4-byte device-to-host
 *                                  copies, each a round trip; RESULT {"rtt_us": median, "p90_us": ...})
 *
 * Ends with "PASS copy_check: n checks" or "FAIL copy_check: k of n checks failed".
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "gp_cuda_more.h"

CUresult cuInit(unsigned int);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuCtxCreate_v2(CUcontext *, unsigned int, CUdevice);
CUresult cuCtxDestroy_v2(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemcpyHtoD_v2(CUdeviceptr, const void *, size_t);
CUresult cuMemcpyDtoH_v2(void *, CUdeviceptr, size_t);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr, const void *, size_t, CUstream);
CUresult cuMemcpyDtoHAsync_v2(void *, CUdeviceptr, size_t, CUstream);
CUresult cuStreamCreate(CUstream *, unsigned int);
CUresult cuStreamDestroy_v2(CUstream);
CUresult cuStreamSynchronize(CUstream);
CUresult cuCtxSynchronize(void);

static int checks, failed;

#define CK(call)                                                                                   \
    do {                                                                                           \
        checks++;                                                                                  \
        CUresult rc_ = (call);                                                                     \
        if (rc_ != CUDA_SUCCESS) {                                                                 \
            failed++;                                                                              \
            printf("line %d: %s returned %d\n", __LINE__, #call, (int)rc_);                        \
        }                                                                                          \
    } while (0)

static void same(const uint8_t *a, const uint8_t *b, size_t n, const char *what, size_t size)
{
    checks++;
    if (memcmp(a, b, n) != 0) {
        failed++;
        size_t i = 0;
        while (a[i] == b[i])
            i++;
        printf("%s of %zu bytes: byte %zu differs (%u != %u)\n", what, size, i, a[i], b[i]);
    }
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* CPU seconds this process has used, every thread (the shim's sender and reader) included. */
static double cpu_s(void)
{
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0)
        return 0;
    return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec / 1e6 +
           (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec / 1e6;
}

/* Context and one device buffer of n bytes on device 0; 0, or -1 (counted as failed). */
static int open_device(size_t n, CUcontext *ctx, CUdeviceptr *d)
{
    CUdevice dev;
    int before = failed;
    CK(cuInit(0));
    CK(cuDeviceGet(&dev, 0));
    CK(cuCtxCreate_v2(ctx, 0, dev));
    CK(cuMemAlloc_v2(d, n));
    return failed == before ? 0 : -1;
}

static int bench(size_t mib, int reps)
{
    size_t n = mib << 20;
    uint8_t *buf = malloc(n);
    CUcontext ctx;
    CUdeviceptr d = 0;
    if (!buf || open_device(n, &ctx, &d) != 0) {
        free(buf);
        return 1;
    }
    uint64_t x = 0x243f6a8885a308d3ull;
    /* One untimed upload first: the first write of device memory may allocate it (the
     * simulated device's memory file gets its pages then), which no pattern should pay for. */
    memset(buf, 1, n);
    CK(cuMemcpyHtoD_v2(d, buf, n));
    CK(cuCtxSynchronize());
    static const char *const names[] = {"zeros", "random", "half"};
    for (int pattern = 0; pattern < 3 && !failed; pattern++) {
        for (size_t i = 0; i < n; i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            buf[i] = pattern == 0 || (pattern == 2 && (i & 4096)) ? 0 : (uint8_t)x;
        }
        double best_h = 1e30, best_d = 1e30, cpu_h = 0, cpu_d = 0;
        for (int r = 0; r < reps; r++) {
            double c0 = cpu_s(), t0 = now_s();
            CK(cuMemcpyHtoD_v2(d, buf, n));
            CK(cuCtxSynchronize()); /* answered once the worker has the whole upload */
            double c1 = cpu_s(), t1 = now_s();
            CK(cuMemcpyDtoH_v2(buf, d, n));
            double c2 = cpu_s(), t2 = now_s();
            cpu_h += c1 - c0;
            cpu_d += c2 - c1;
            if (t1 - t0 < best_h)
                best_h = t1 - t0;
            if (t2 - t1 < best_d)
                best_d = t2 - t1;
        }
        const char *name = names[pattern];
        double moved = (double)n * reps;
        printf("RESULT {\"pattern\": \"%s\", \"dir\": \"htod\", \"bytes_per_s\": %.0f, "
               "\"cpu_s\": %.6f, \"bytes\": %.0f}\n",
               name, (double)n / best_h, cpu_h, moved);
        printf("RESULT {\"pattern\": \"%s\", \"dir\": \"dtoh\", \"bytes_per_s\": %.0f, "
               "\"cpu_s\": %.6f, \"bytes\": %.0f}\n",
               name, (double)n / best_d, cpu_d, moved);
    }
    CK(cuMemFree_v2(d));
    CK(cuCtxDestroy_v2(ctx));
    free(buf);
    return failed ? 1 : 0;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* count synchronous 4-byte copies to the host: each is one round trip to the worker. */
static int rtt(int count)
{
    CUcontext ctx;
    CUdeviceptr d = 0;
    double *t = count > 0 ? malloc(sizeof *t * (size_t)count) : NULL;
    if (!t || open_device(4096, &ctx, &d) != 0) {
        free(t);
        return 1;
    }
    uint32_t word = 0;
    for (int i = 0; i < 20 && !failed; i++) /* warm up: the first calls set things up */
        CK(cuMemcpyDtoH_v2(&word, d, sizeof word));
    for (int i = 0; i < count && !failed; i++) {
        double t0 = now_s();
        CK(cuMemcpyDtoH_v2(&word, d, sizeof word));
        t[i] = now_s() - t0;
    }
    if (!failed) {
        qsort(t, (size_t)count, sizeof *t, cmp_double);
        printf("RESULT {\"rtt_us\": %.2f, \"p90_us\": %.2f}\n", t[count / 2] * 1e6,
               t[count * 9 / 10] * 1e6);
    }
    CK(cuMemFree_v2(d));
    CK(cuCtxDestroy_v2(ctx));
    free(t);
    return failed ? 1 : 0;
}

static int dtoh_once(size_t mib)
{
    size_t n = mib << 20;
    uint8_t *buf = malloc(n);
    CUcontext ctx;
    CUdeviceptr d = 0;
    if (!buf || open_device(n, &ctx, &d) != 0) {
        free(buf);
        return 1;
    }
    CUresult rc = cuMemcpyDtoH_v2(buf, d, n);
    printf("dtoh: %d\n", (int)rc);
    free(buf);
    return failed ? 1 : 0;
}

int main(int argc, char **argv)
{
    if (argc > 2 && !strcmp(argv[1], "dtoh"))
        return dtoh_once(strtoul(argv[2], NULL, 10));
    if (argc > 2 && !strcmp(argv[1], "rtt"))
        return rtt(atoi(argv[2]));
    if (argc > 3 && !strcmp(argv[1], "bench"))
        return bench(strtoul(argv[2], NULL, 10), atoi(argv[3]));
    size_t mib = argc > 1 ? strtoul(argv[1], NULL, 10) : 64;
    size_t big = mib << 20;
    const char *only = argc > 2 ? argv[2] : "all";
    uint8_t *src = malloc(big), *back = malloc(big);
    if (!src || !back) {
        printf("FAIL copy_check: out of host memory\n");
        return 1;
    }
    CUcontext ctx;
    CUdeviceptr d = 0;
    CUstream s = NULL;
    if (open_device(big, &ctx, &d) == 0)
        CK(cuStreamCreate(&s, 0));
    if (failed) {
        printf("FAIL copy_check: setup failed\n");
        return 1;
    }
    const size_t sizes[] = {65535, 65536, (1u << 20) + 1, big - 12345, big};
    uint64_t x = 0x243f6a8885a308d3ull;
    for (int pattern = 0; pattern < 3; pattern++) {
        const char *name = pattern == 0 ? "zeros" : pattern == 1 ? "random" : "mixed";
        if (strcmp(only, "all") != 0 && strcmp(only, name) != 0)
            continue;
        for (size_t i = 0; i < big; i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            /* mixed: random in the first half of every MiB, zeros in the second */
            src[i] = pattern == 0 ? 0 : pattern == 1 || (i & (1u << 19)) == 0 ? (uint8_t)x : 0;
        }
        for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
            size_t n = sizes[k];
            memset(back, 0x5a, n);
            CK(cuMemcpyHtoD_v2(d, src, n));
            CK(cuMemcpyDtoH_v2(back, d, n));
            char what[64];
            snprintf(what, sizeof what, "%s sync", name);
            same(src, back, n, what, n);
            memset(back, 0x5a, n);
            CK(cuMemcpyHtoDAsync_v2(d, src, n, s));
            CK(cuMemcpyDtoHAsync_v2(back, d, n, s));
            CK(cuStreamSynchronize(s));
            snprintf(what, sizeof what, "%s async", name);
            same(src, back, n, what, n);
        }
    }
    CK(cuStreamDestroy_v2(s));
    CK(cuMemFree_v2(d));
    CK(cuCtxDestroy_v2(ctx));
    free(src);
    free(back);
    if (failed) {
        printf("FAIL copy_check: %d of %d checks failed\n", failed, checks);
        return 1;
    }
    printf("PASS copy_check: %d checks\n", checks);
    return 0;
}
