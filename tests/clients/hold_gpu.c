/*
 * hold_gpu: a small tenant for the lease tests (tests/test_e2e_leases.py), on the driver API.
 *
 *   hold_gpu BYTES HOLD_MS SEED [LOOP_COPIES]
 *
 * Takes the GPU (cuInit), allocates BYTES of device memory, reads it back BEFORE writing and
 * counts the bytes that are not zero (a new tenant must only ever see zeros), writes a pattern
 * made from SEED, holds the GPU for HOLD_MS milliseconds (with LOOP_COPIES > 0 it copies the
 * buffer to the host that many times meanwhile: a client killed mid-transfer), reads it back and
 * checks every byte. Prints one line of key=value facts, then exits without freeing (the worker
 * releases everything). Exit status 0 only if the data came back bit-exact.
 *
 * LOOP_COPIES = -1: copy the buffer to the host again and again until HOLD_MS have passed, and
 * check every copy (a job streaming while its server restarts); `copies=N` says how many.
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

#define CHECK(call)                                                                                \
    do {                                                                                           \
        CUresult rc_ = (call);                                                                     \
        if (rc_ != CUDA_SUCCESS) {                                                                 \
            const char *name_ = NULL;                                                              \
            cuGetErrorName(rc_, &name_);                                                           \
            fprintf(stderr, "hold_gpu: %s failed: %s (%d)\n", #call, name_ ? name_ : "?",          \
                    (int)rc_);                                                                     \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

static uint8_t pattern_byte(uint64_t seed, size_t i)
{
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + i;
    x ^= x >> 29;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 32;
    return (uint8_t)(x | 1); /* never zero: a zero would hide a missed write */
}

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: hold_gpu BYTES HOLD_MS SEED [LOOP_COPIES]\n");
        return 2;
    }
    size_t bytes = strtoull(argv[1], NULL, 0);
    long hold_ms = strtol(argv[2], NULL, 0);
    uint64_t seed = strtoull(argv[3], NULL, 0);
    long loops = argc > 4 ? strtol(argv[4], NULL, 0) : 0;
    uint8_t *host = malloc(bytes), *back = malloc(bytes);
    if (!host || !back) {
        fprintf(stderr, "hold_gpu: out of host memory\n");
        return 1;
    }
    double t_start = now_s();
    CHECK(cuInit(0));
    double t_leased = now_s();
    CUdevice dev;
    CUcontext ctx;
    CUuuid uuid;
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDeviceGetUuid(&uuid, dev));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));
    CUdeviceptr d;
    CHECK(cuMemAlloc(&d, bytes));
    CHECK(cuMemcpyDtoH(back, d, bytes));
    size_t nonzero = 0;
    for (size_t i = 0; i < bytes; i++)
        nonzero += back[i] != 0;
    for (size_t i = 0; i < bytes; i++)
        host[i] = pattern_byte(seed, i);
    CHECK(cuMemcpyHtoD(d, host, bytes));
    printf("holding seed=%llu\n", (unsigned long long)seed);
    fflush(stdout);
    double until = now_s() + hold_ms / 1000.0;
    long copies = 0;
    while (loops < 0 && now_s() < until) {
        memset(back, 0, bytes);
        CHECK(cuMemcpyDtoH(back, d, bytes));
        if (memcmp(host, back, bytes) != 0) {
            fprintf(stderr, "hold_gpu: copy %ld came back different\n", copies);
            return 1;
        }
        copies++;
    }
    for (long k = 0; loops >= 0 && (k < loops || now_s() < until); k++) {
        if (k < loops) {
            CHECK(cuMemcpyDtoH(back, d, bytes));
        } else {
            struct timespec ts = {0, 10 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
    }
    memset(back, 0, bytes);
    CHECK(cuMemcpyDtoH(back, d, bytes));
    int exact = memcmp(host, back, bytes) == 0;
    printf("seed=%llu uuid=", (unsigned long long)seed);
    for (int i = 0; i < 16; i++)
        printf("%02x", (unsigned char)uuid.bytes[i]);
    printf(" nonzero_before=%zu exact=%d copies=%ld t_start=%.6f t_leased=%.6f t_end=%.6f\n",
           nonzero, exact, copies, t_start, t_leased, now_s());
    return exact ? 0 : 1;
}
