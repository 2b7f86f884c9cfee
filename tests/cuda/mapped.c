/*
 * mapped.c: mapped (zero-copy) host memory through the driver API, as JAX/XLA uses it
 * (tests/test_e2e_mapped.py).
 *
 * A plain C program against the toolkit's cuda.h, linked with the libcuda.so it is given (ours,
 * for gpupool; the refusals past the end are what gpupool answers). Memory from cuMemHostAlloc(DEVICEMAP) and from
 * cuMemHostRegister(DEVICEMAP), named by its device alias (cuMemHostGetDevicePointer):
 *   - memsets D8/D16/D32, sync and async, and a 2D one, land in the host bytes;
 *   - in stream order: an async memset queued after an async device-to-host copy into the same
 *     memory overwrites the copy's bytes (done the other way round, the copy's bytes would win);
 *     a device-to-device copy from it queued after such a copy reads the copy's bytes;
 *   - copies to and from it (HtoD/DtoH/DtoD, sync and async, cuMemcpy without a kind, and 2D
 *     copies declaring it device memory) are bit-exact;
 *   - a memset running past its end is refused.
 * Prints one line per failed check and ends with "PASS mapped: N checks" or
 * "FAIL mapped: K of N checks failed".
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N (1u << 20) /* bytes of each buffer */

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
            printf("%s failed: %d\nFAIL mapped: setup failed\n", #call, (int)r_);                  \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static unsigned char pattern(size_t i, unsigned seed)
{
    return (unsigned char)((i * 131u + seed * 7u + (i >> 9)) & 0xffu);
}

static void fill_pattern(unsigned char *p, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++)
        p[i] = pattern(i, seed);
}

/* First index in [from, to) where p differs from the pattern, or `to`. */
static size_t pattern_mismatch(const unsigned char *p, size_t from, size_t to, unsigned seed)
{
    for (size_t i = from; i < to; i++)
        if (p[i] != pattern(i, seed))
            return i;
    return to;
}

/* 1 if every `elem`-byte element of [p, p+bytes) holds the low bytes of value. */
static int all_equal(const unsigned char *p, size_t bytes, uint32_t value, size_t elem)
{
    for (size_t i = 0; i < bytes; i += elem)
        if (memcmp(p + i, &value, elem) != 0)
            return 0;
    return 1;
}

/* Memsets on a mapped alias, sync and async, checked on the host. */
static void memsets(unsigned char *h, CUdeviceptr dh, CUstream s)
{
    memset(h, 0, N);
    CHECK(cuMemsetD8(dh + 3, 0x5a, 1000) == CUDA_SUCCESS, "cuMemsetD8");
    CHECK(h[2] == 0 && all_equal(h + 3, 1000, 0x5a, 1) && h[1003] == 0, "D8 bytes");
    CHECK(cuMemsetD16(dh + 2048, 0xbeef, 300) == CUDA_SUCCESS, "cuMemsetD16");
    CHECK(all_equal(h + 2048, 600, 0xbeef, 2) && h[2648] == 0, "D16 bytes");
    CHECK(cuMemsetD32(dh + 4096, 0xa5b6c7d8u, 256) == CUDA_SUCCESS, "cuMemsetD32");
    CHECK(all_equal(h + 4096, 1024, 0xa5b6c7d8u, 4) && h[5120] == 0, "D32 bytes");
    CHECK(cuMemsetD8Async(dh + 8192, 0x11, 10, s) == CUDA_SUCCESS, "cuMemsetD8Async");
    CHECK(cuMemsetD16Async(dh + 8202, 0x2233, 5, s) == CUDA_SUCCESS, "cuMemsetD16Async");
    CHECK(cuMemsetD32Async(dh + 8212, 0x44556677u, 3, s) == CUDA_SUCCESS, "cuMemsetD32Async");
    CHECK(cuStreamSynchronize(s) == CUDA_SUCCESS, "sync");
    CHECK(all_equal(h + 8192, 10, 0x11, 1) && all_equal(h + 8202, 10, 0x2233, 2) &&
              all_equal(h + 8212, 12, 0x44556677u, 4) && h[8224] == 0,
          "async memset bytes");
    /* 2D: 4 rows of 6 shorts, 64 bytes apart; the gaps untouched. */
    CHECK(cuMemsetD2D16Async(dh + 16384, 64, 0x7e7f, 6, 4, s) == CUDA_SUCCESS, "2D memset");
    CHECK(cuStreamSynchronize(s) == CUDA_SUCCESS, "sync");
    int rows_ok = 1;
    for (int r = 0; r < 4; r++)
        rows_ok &= all_equal(h + 16384 + r * 64, 12, 0x7e7f, 2) && h[16384 + r * 64 + 12] == 0;
    CHECK(rows_ok, "2D memset rows");
    /* Past the end of the allocation: refused, nothing written. */
    CHECK(cuMemsetD8(dh + N - 10, 1, 11) == CUDA_ERROR_INVALID_VALUE, "memset past the end");
    CHECK(h[N - 10] == 0, "the refused memset wrote");
}

/* An async memset after an async device-to-host copy into the same bytes, on one stream: the
 * memset must win. A device-to-device copy from the alias after such a copy must see it. */
static void stream_order(unsigned char *h, CUdeviceptr dh, CUdeviceptr d, CUdeviceptr d2,
                         CUstream s)
{
    unsigned char *check = malloc(N);
    if (!check) {
        printf("FAIL mapped: out of host memory\n");
        exit(1);
    }
    fill_pattern(check, N, 1);
    MUST(cuMemcpyHtoD(d, check, N));
    memset(h, 0, N);
    CHECK(cuMemcpyDtoHAsync(h, d, N, s) == CUDA_SUCCESS, "DtoH async");
    CHECK(cuMemsetD32Async(dh + 65536, 0xcafef00du, 4096, s) == CUDA_SUCCESS, "memset async");
    CHECK(cuMemsetD8Async(dh, 0x99, 100, s) == CUDA_SUCCESS, "memset async");
    CHECK(cuStreamSynchronize(s) == CUDA_SUCCESS, "sync");
    CHECK(all_equal(h, 100, 0x99, 1), "the D8 memset did not follow the copy: h[0]=%d", h[0]);
    CHECK(all_equal(h + 65536, 16384, 0xcafef00du, 4),
          "the D32 memset did not follow the copy: h[65536]=%d", h[65536]);
    size_t at = pattern_mismatch(h, 100, 65536, 1);
    CHECK(at == 65536, "copied bytes wrong at %zu", at);
    at = pattern_mismatch(h, 65536 + 16384, N, 1);
    CHECK(at == N, "copied bytes wrong at %zu", at);

    /* DtoD from the alias reads what the earlier async copy put there. */
    memset(h, 0, N);
    MUST(cuMemsetD8(d2, 0, N));
    CHECK(cuMemcpyDtoHAsync(h, d, N, s) == CUDA_SUCCESS, "DtoH async");
    CHECK(cuMemcpyDtoDAsync(d2, dh, N, s) == CUDA_SUCCESS, "DtoD async from the alias");
    CHECK(cuStreamSynchronize(s) == CUDA_SUCCESS, "sync");
    memset(check, 0, N);
    MUST(cuMemcpyDtoH(check, d2, N));
    at = pattern_mismatch(check, 0, N, 1);
    CHECK(at == N, "DtoD from the alias read other bytes at %zu", at);
    free(check);
}

/* Copies with one side (or both) a mapped alias: bit-exact. */
static void copies(unsigned char *h, CUdeviceptr dh, CUdeviceptr d, CUstream s)
{
    unsigned char *src = malloc(N), *dst = malloc(N);
    if (!src || !dst) {
        printf("FAIL mapped: out of host memory\n");
        exit(1);
    }
    size_t at;
    fill_pattern(src, N, 2);
    memset(h, 0, N);
    CHECK(cuMemcpyHtoD(dh, src, N) == CUDA_SUCCESS, "HtoD into the alias");
    at = pattern_mismatch(h, 0, N, 2);
    CHECK(at == N, "HtoD into the alias: wrong at %zu", at);
    memset(dst, 0, N);
    CHECK(cuMemcpyDtoH(dst, dh, N) == CUDA_SUCCESS, "DtoH from the alias");
    at = pattern_mismatch(dst, 0, N, 2);
    CHECK(at == N, "DtoH from the alias: wrong at %zu", at);

    /* Device to the alias and back to device, sync. */
    fill_pattern(src, N, 3);
    MUST(cuMemcpyHtoD(d, src, N));
    memset(h, 0, N);
    CHECK(cuMemcpyDtoD(dh, d, N) == CUDA_SUCCESS, "DtoD into the alias");
    at = pattern_mismatch(h, 0, N, 3);
    CHECK(at == N, "DtoD into the alias: wrong at %zu", at);
    MUST(cuMemsetD8(d, 0, N));
    CHECK(cuMemcpyDtoD(d, dh, N) == CUDA_SUCCESS, "DtoD from the alias");
    memset(dst, 0, N);
    MUST(cuMemcpyDtoH(dst, d, N));
    at = pattern_mismatch(dst, 0, N, 3);
    CHECK(at == N, "DtoD from the alias: wrong at %zu", at);

    /* Async, and without a kind. */
    fill_pattern(src, N, 4);
    CHECK(cuMemcpyHtoDAsync(dh, src, N, s) == CUDA_SUCCESS, "HtoD async into the alias");
    memset(dst, 0, N);
    CHECK(cuMemcpyDtoHAsync(dst, dh, N, s) == CUDA_SUCCESS, "DtoH async from the alias");
    CHECK(cuMemcpyAsync(d, dh, N, s) == CUDA_SUCCESS, "cuMemcpyAsync from the alias");
    CHECK(cuStreamSynchronize(s) == CUDA_SUCCESS, "sync");
    at = pattern_mismatch(dst, 0, N, 4);
    CHECK(at == N, "async copies through the alias: wrong at %zu", at);
    memset(h, 0, N);
    CHECK(cuMemcpy(dh, d, N) == CUDA_SUCCESS, "cuMemcpy into the alias");
    at = pattern_mismatch(h, 0, N, 4);
    CHECK(at == N, "cuMemcpy into the alias: wrong at %zu", at);
    fill_pattern(src, N, 5);
    CHECK(cuMemcpyHtoD(dh, src, N) == CUDA_SUCCESS, "HtoD into the alias");
    CHECK(cuMemcpyDtoDAsync(dh + 4096, dh, 8192, s) == CUDA_SUCCESS, "DtoD alias to alias");
    CHECK(cuStreamSynchronize(s) == CUDA_SUCCESS, "sync");
    CHECK(memcmp(h + 4096, src, 8192) == 0, "DtoD alias to alias: wrong bytes");
    /* 2D, the alias declared as device memory: 8 rows of 100 bytes, pitch 256 on the device,
     * packed on the alias; device rows to the alias, then the alias to other device rows. */
    fill_pattern(src, N, 6);
    MUST(cuMemcpyHtoD(d, src, N));
    memset(h, 0, N);
    CUDA_MEMCPY2D c2 = {.srcMemoryType = CU_MEMORYTYPE_DEVICE,
                        .srcDevice = d,
                        .srcPitch = 256,
                        .dstMemoryType = CU_MEMORYTYPE_DEVICE,
                        .dstDevice = dh,
                        .dstPitch = 100,
                        .WidthInBytes = 100,
                        .Height = 8};
    CHECK(cuMemcpy2DAsync(&c2, s) == CUDA_SUCCESS, "2D device to the alias");
    CHECK(cuStreamSynchronize(s) == CUDA_SUCCESS, "sync");
    int rows_ok = h[800] == 0;
    for (int r = 0; r < 8; r++)
        rows_ok &= memcmp(h + r * 100, src + r * 256, 100) == 0;
    CHECK(rows_ok, "2D device to the alias: wrong rows");
    c2.srcDevice = dh;
    c2.srcPitch = 100;
    c2.dstDevice = d + 65536;
    c2.dstPitch = 128;
    CHECK(cuMemcpy2D(&c2) == CUDA_SUCCESS, "2D alias to device");
    memset(dst, 0, N);
    MUST(cuMemcpyDtoH(dst, d + 65536, 8 * 128));
    rows_ok = 1;
    for (int r = 0; r < 8; r++)
        rows_ok &= memcmp(dst + r * 128, src + r * 256, 100) == 0;
    CHECK(rows_ok, "2D alias to device: wrong rows");
    /* A copy running past the end of the mapped memory is refused. */
    CHECK(cuMemcpyDtoH(dst, dh + N - 8, 16) != CUDA_SUCCESS, "DtoH past the end accepted");
    free(src);
    free(dst);
}

int main(void)
{
    CUdevice dev;
    CUcontext ctx;
    CUstream s;
    CUdeviceptr d, d2, dh, dr;
    void *hp;
    MUST(cuInit(0));
    MUST(cuDeviceGet(&dev, 0));
    MUST(cuDevicePrimaryCtxRetain(&ctx, dev));
    MUST(cuCtxSetCurrent(ctx));
    MUST(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    MUST(cuMemAlloc(&d, N));
    MUST(cuMemAlloc(&d2, N));
    MUST(cuMemHostAlloc(&hp, N, CU_MEMHOSTALLOC_DEVICEMAP));
    MUST(cuMemHostGetDevicePointer(&dh, hp, 0));
    CHECK(dh != 0, "no device pointer");
    unsigned char *h = hp;

    memsets(h, dh, s);
    stream_order(h, dh, d, d2, s);
    copies(h, dh, d, s);

    /* Registered memory mapped the same way. */
    void *reg = NULL;
    if (posix_memalign(&reg, 4096, 8192) != 0) {
        printf("FAIL mapped: out of host memory\n");
        return 1;
    }
    memset(reg, 0, 8192);
    MUST(cuMemHostRegister(reg, 8192, CU_MEMHOSTREGISTER_DEVICEMAP));
    MUST(cuMemHostGetDevicePointer(&dr, reg, 0));
    CHECK(cuMemsetD32Async(dr + 4096, 0x01020304u, 1024, s) == CUDA_SUCCESS, "registered memset");
    CHECK(cuStreamSynchronize(s) == CUDA_SUCCESS, "sync");
    CHECK(all_equal((unsigned char *)reg + 4096, 4096, 0x01020304u, 4) &&
              ((unsigned char *)reg)[4095] == 0,
          "registered memset bytes");
    MUST(cuMemHostUnregister(reg));
    free(reg);

    MUST(cuMemFreeHost(hp));
    MUST(cuMemFree(d));
    MUST(cuMemFree(d2));
    MUST(cuStreamDestroy(s));
    if (failed) {
        printf("FAIL mapped: %d of %d checks failed\n", failed, checks);
        return 1;
    }
    printf("PASS mapped: %d checks\n", checks);
    return 0;
}
