/*
 * tensormap.c: TMA descriptors through the driver API (tests/test_e2e_tensormap.py).
 *
 * A plain C program against the toolkit's cuda.h, linked with the libcuda.so it is given (ours,
 * for gpupool). On a cuMemAlloc'd buffer: a tiled map (success, non-zero 128 bytes), the same
 * call again (same bytes, and through gpupool no second request: the shim's cache, counted with
 * GPUPOOL_CALL_COUNTS=1), another box size (other bytes), the documented refusals (rank 0, a
 * misaligned address, a stride that is not a multiple of 16, boxes of 0 and 257), an im2col and
 * an im2col-wide map, and cuTensorMapReplaceAddress. Prints one line per failed check and ends
 * with "PASS tensormap: N checks" or "FAIL tensormap: K of N checks failed".
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
            printf("%s failed: %d\nFAIL tensormap: setup failed\n", #call, (int)r_);               \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* Requests sent for tensor map encodings so far: from the shim's call counts (-1 when the
 * library is not gpupool's or counting is off). */
static long encode_requests(void)
{
    size_t (*counts)(char *, size_t) =
        (size_t(*)(char *, size_t))dlsym(RTLD_DEFAULT, "gpupool_call_counts");
    if (!counts)
        return -1;
    static char buf[65536];
    counts(buf, sizeof buf);
    if (!strstr(buf, "\"enabled\": true"))
        return -1;
    const char *op = strstr(buf, "\"tensor_map_encode\": {\"frames\": ");
    return op ? strtol(op + strlen("\"tensor_map_encode\": {\"frames\": "), NULL, 10) : 0;
}

static int nonzero(const CUtensorMap *m)
{
    for (int i = 0; i < CU_TENSOR_MAP_NUM_QWORDS; i++)
        if (m->opaque[i])
            return 1;
    return 0;
}

static CUresult tiled(CUtensorMap *m, cuuint32_t rank, CUdeviceptr addr, cuuint64_t stride,
                      cuuint32_t box0)
{
    /* float32, 32 rows of 64 elements. */
    cuuint64_t dims[2] = {64, 32}, strides[1] = {stride};
    cuuint32_t box[2] = {box0, 8}, es[2] = {1, 1};
    return cuTensorMapEncodeTiled(m, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, rank, (void *)addr, dims,
                                  strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                  CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

int main(void)
{
    CUdevice dev;
    CUcontext ctx;
    CUdeviceptr buf;
    MUST(cuInit(0));
    MUST(cuDeviceGet(&dev, 0));
    MUST(cuDevicePrimaryCtxRetain(&ctx, dev));
    MUST(cuCtxSetCurrent(ctx));
    MUST(cuMemAlloc(&buf, 1 << 20));

    CUtensorMap a, b, c, m; /* aligned by the type (128 bytes), as the driver needs (64) */
    memset(&a, 0, sizeof a);
    long before = encode_requests();
    CUresult r = tiled(&a, 2, buf, 256, 32);
    CHECK(r == CUDA_SUCCESS, "tiled encode returned %d", (int)r);
    CHECK(nonzero(&a), "the tiled map is all zero");
    long after_first = encode_requests();

    r = tiled(&b, 2, buf, 256, 32);
    CHECK(r == CUDA_SUCCESS && memcmp(&a, &b, sizeof a) == 0, "the same call gave other bytes (%d)",
          (int)r);
    long after_second = encode_requests();
    if (before >= 0) {
        printf("encode_requests=%ld,%ld,%ld\n", before, after_first, after_second);
        CHECK(after_first == before + 1, "the first encoding sent %ld requests",
              after_first - before);
        CHECK(after_second == after_first, "the repeated encoding sent %ld requests (cache)",
              after_second - after_first);
    }

    r = tiled(&c, 2, buf, 256, 16);
    CHECK(r == CUDA_SUCCESS && nonzero(&c) && memcmp(&a, &c, sizeof a) != 0,
          "another box size gave the same map (%d)", (int)r);

    /* The documented refusals. */
    r = tiled(&m, 0, buf, 256, 32);
    CHECK(r == CUDA_ERROR_INVALID_VALUE, "rank 0: %d", (int)r);
    r = tiled(&m, 2, buf + 8, 256, 32);
    CHECK(r == CUDA_ERROR_INVALID_VALUE, "address aligned to 8 only: %d", (int)r);
    r = tiled(&m, 2, buf, 264, 32);
    CHECK(r == CUDA_ERROR_INVALID_VALUE, "stride 264 (not a multiple of 16): %d", (int)r);
    r = tiled(&m, 2, buf, 256, 0);
    CHECK(r == CUDA_ERROR_INVALID_VALUE, "box 0: %d", (int)r);
    r = tiled(&m, 2, buf, 256, 257);
    CHECK(r == CUDA_ERROR_INVALID_VALUE, "box 257: %d", (int)r);

    /* im2col: NHWC fp16, 64 channels, 16 x 16 pixels, 2 images. */
    cuuint64_t idims[4] = {64, 16, 16, 2}, istrides[3] = {128, 2048, 32768};
    cuuint32_t ies[4] = {1, 1, 1, 1};
    int lower[2] = {-1, -1}, upper[2] = {1, 1};
    r = cuTensorMapEncodeIm2col(&m, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4, (void *)buf, idims,
                                istrides, lower, upper, 64, 128, ies, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    CHECK(r == CUDA_SUCCESS && nonzero(&m), "im2col encode returned %d", (int)r);
    r = cuTensorMapEncodeIm2col(&m, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, (void *)buf, idims,
                                istrides, lower, upper, 64, 128, ies, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    CHECK(r == CUDA_ERROR_INVALID_VALUE, "im2col of rank 2: %d", (int)r);
    cuuint64_t wdims[3] = {64, 256, 2}, wstrides[2] = {128, 32768};
    r = cuTensorMapEncodeIm2colWide(
        &m, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3, (void *)buf, wdims, wstrides, -1, 1, 64, 256, ies,
        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_IM2COL_WIDE_MODE_W, CU_TENSOR_MAP_SWIZZLE_128B,
        CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    CHECK(r == CUDA_SUCCESS && nonzero(&m), "im2col wide encode returned %d", (int)r);

    /* Replacing the address gives the map of an encoding at the new address. */
    m = a;
    r = cuTensorMapReplaceAddress(&m, (void *)(buf + 4096));
    CHECK(r == CUDA_SUCCESS && memcmp(&m, &a, sizeof m) != 0, "replace address: %d", (int)r);
    r = tiled(&b, 2, buf + 4096, 256, 32);
    CHECK(r == CUDA_SUCCESS && memcmp(&m, &b, sizeof m) == 0,
          "the replaced map differs from one encoded at the new address (%d)", (int)r);
    r = cuTensorMapReplaceAddress(&m, (void *)(buf + 8));
    CHECK(r == CUDA_ERROR_INVALID_VALUE, "replace with an 8-aligned address: %d", (int)r);

    MUST(cuMemFree(buf));
    if (failed) {
        printf("FAIL tensormap: %d of %d checks failed\n", failed, checks);
        return 1;
    }
    printf("PASS tensormap: %d checks\n", checks);
    return 0;
}
