/*
 * detach_client: the tenant of bench/detach_bench.py, on the driver API through the shim.
 *
 *   detach_client BYTES reattach          set up, print "ready", then per stdin line:
 *                                           "call"   one cuCtxSynchronize, timed: "call_ms=X"
 *                                           "verify" read BYTES back: "verify=ok" or "verify=bad"
 *   detach_client BYTES notebook CYCLES BUSY_MS IDLE_MS
 *                                         CYCLES times: copy 16 MiB up and down for BUSY_MS (the
 *                                         first call of a cycle timed: it may have to take a GPU
 *                                         back), then idle IDLE_MS; one line per cycle
 *                                         "cycle=N first_ms=X busy_s=Y", then "verify=ok|bad"
 *
 * BYTES of device memory hold a pattern the whole time (0: no allocation at all).
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define CHECK(call)                                                                                \
    do {                                                                                           \
        CUresult rc_ = (call);                                                                     \
        if (rc_ != CUDA_SUCCESS) {                                                                 \
            const char *name_ = NULL;                                                              \
            cuGetErrorName(rc_, &name_);                                                           \
            fprintf(stderr, "detach_client: %s failed: %s\n", #call, name_ ? name_ : "?");         \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#define CHUNK (16u << 20)

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static uint8_t pattern(size_t i)
{
    uint64_t x = (uint64_t)i * 0x9E3779B97F4A7C15ull;
    x ^= x >> 31;
    return (uint8_t)(x | 1);
}

static CUdeviceptr mem;
static size_t bytes;
static uint8_t *host;

static void fill(void)
{
    for (size_t off = 0; off < bytes; off += CHUNK) {
        size_t n = bytes - off < CHUNK ? bytes - off : CHUNK;
        for (size_t i = 0; i < n; i++)
            host[i] = pattern(off + i);
        CHECK(cuMemcpyHtoD(mem + off, host, n));
    }
}

static int verify(void)
{
    for (size_t off = 0; off < bytes; off += CHUNK) {
        size_t n = bytes - off < CHUNK ? bytes - off : CHUNK;
        CHECK(cuMemcpyDtoH(host, mem + off, n));
        for (size_t i = 0; i < n; i++)
            if (host[i] != pattern(off + i))
                return 0;
    }
    return 1;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: detach_client BYTES reattach | BYTES notebook CYCLES BUSY_MS "
                        "IDLE_MS\n");
        return 2;
    }
    bytes = strtoull(argv[1], NULL, 0);
    CUdevice dev;
    CUcontext ctx;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));
    host = malloc(CHUNK);
    if (!host)
        return 1;
    if (bytes) {
        CHECK(cuMemAlloc(&mem, bytes));
        fill();
    }
    if (strcmp(argv[2], "reattach") == 0) {
        printf("ready\n");
        fflush(stdout);
        char line[64];
        while (fgets(line, sizeof line, stdin)) {
            if (strncmp(line, "call", 4) == 0) {
                double t0 = now_s();
                CHECK(cuCtxSynchronize());
                printf("call_ms=%.3f\n", (now_s() - t0) * 1000);
            } else if (strncmp(line, "verify", 6) == 0) {
                printf("verify=%s\n", bytes == 0 || verify() ? "ok" : "bad");
            }
            fflush(stdout);
        }
        return 0;
    }
    if (strcmp(argv[2], "notebook") != 0 || argc < 6) {
        fprintf(stderr, "detach_client: unknown mode %s\n", argv[2]);
        return 2;
    }
    int cycles = atoi(argv[3]);
    double busy = atof(argv[4]) / 1000, idle = atof(argv[5]) / 1000;
    CUdeviceptr work;
    CHECK(cuMemAlloc(&work, CHUNK));
    for (int c = 0; c < cycles; c++) {
        double t0 = now_s();
        CHECK(cuCtxSynchronize());
        double first = now_s() - t0, b0 = now_s();
        while (now_s() - b0 < busy) {
            CHECK(cuMemcpyHtoD(work, host, CHUNK));
            CHECK(cuMemcpyDtoH(host, work, CHUNK));
        }
        printf("cycle=%d first_ms=%.3f busy_s=%.3f\n", c, first * 1000, now_s() - b0);
        fflush(stdout);
        usleep((useconds_t)(idle * 1e6));
    }
    printf("verify=%s\n", bytes == 0 || verify() ? "ok" : "bad");
    return 0;
}
