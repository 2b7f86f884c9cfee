/*
 * test_sim_tensormap.c: tensor maps on the simulated device (worker/sim/sim_tensormap.c): the
 * documented packing of a tiled, an im2col and an im2col-wide map, the argument checks of the
 * driver API documentation (each refused with CUDA_ERROR_INVALID_VALUE), the compute capability
 * check, and cuTensorMapReplaceAddress.
 */
#include <stdint.h>

#include "sim_test.h"

#define F32 CU_TENSOR_MAP_DATA_TYPE_FLOAT32
#define IL_NONE CU_TENSOR_MAP_INTERLEAVE_NONE
#define SW_NONE CU_TENSOR_MAP_SWIZZLE_NONE
#define L2_NONE CU_TENSOR_MAP_L2_PROMOTION_NONE
#define OOB_NONE CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE

/* A 2-D float tensor of 32 rows of 64 elements (rows 256 bytes apart) in fresh device memory. */
struct tiled {
    CUdeviceptr base;
    cuuint64_t dims[2];
    cuuint64_t strides[1];
    cuuint32_t box[2];
    cuuint32_t estrides[2];
};

static struct tiled tiled_setup(void)
{
    sim_test_init();
    struct tiled t = {.dims = {64, 32}, .strides = {256}, .box = {32, 8}, .estrides = {1, 1}};
    OK(cuMemAlloc_v2(&t.base, 1 << 20));
    return t;
}

static CUresult tiled_encode(CUtensorMap *map, const struct tiled *t, cuuint32_t rank,
                             uint64_t addr)
{
    return cuTensorMapEncodeTiled(map, F32, rank, (void *)(uintptr_t)addr, t->dims, t->strides,
                                  t->box, t->estrides, IL_NONE, SW_NONE, L2_NONE, OOB_NONE);
}

static int is_zero(const CUtensorMap *m)
{
    for (int i = 0; i < CU_TENSOR_MAP_NUM_QWORDS; i++)
        if (m->opaque[i])
            return 0;
    return 1;
}

static void test_tiled_packing(void)
{
    struct tiled t = tiled_setup();
    CUtensorMap a, b, c;
    memset(&a, 0, sizeof a);
    OK(tiled_encode(&a, &t, 2, t.base));
    CHECK(!is_zero(&a));
    CHECK_EQ(a.opaque[0], t.base);
    CHECK_EQ(a.opaque[1] & 0xff, 1);          /* kind + 1: tiled */
    CHECK_EQ((a.opaque[1] >> 8) & 0xff, F32); /* data type */
    CHECK_EQ((a.opaque[1] >> 16) & 0xff, 2);  /* rank */
    CHECK_EQ(a.opaque[2], 64);
    CHECK_EQ(a.opaque[3], 32);
    CHECK_EQ(a.opaque[7], 256);
    CHECK_EQ(a.opaque[11] & 0xffff, (31 | 7 << 8)); /* box dims - 1 */
    /* Deterministic: the same arguments give the same bytes; another box other bytes. */
    OK(tiled_encode(&b, &t, 2, t.base));
    CHECK(memcmp(&a, &b, sizeof a) == 0);
    t.box[0] = 16;
    OK(tiled_encode(&c, &t, 2, t.base));
    CHECK(memcmp(&a, &c, sizeof a) != 0);
}

static void test_tiled_refusals(void)
{
    struct tiled t = tiled_setup();
    CUtensorMap m;
    CHECK_RC(tiled_encode(&m, &t, 0, t.base), CUDA_ERROR_INVALID_VALUE); /* rank 0 */
    CHECK(strstr(gpupoolSimLastErrorDetail(), "rank") != NULL);
    CHECK_RC(tiled_encode(&m, &t, 6, t.base), CUDA_ERROR_INVALID_VALUE);     /* rank 6 */
    CHECK_RC(tiled_encode(&m, &t, 2, t.base + 8), CUDA_ERROR_INVALID_VALUE); /* 8-aligned */
    CHECK(strstr(gpupoolSimLastErrorDetail(), "misaligned") != NULL);
    struct tiled bad = t;
    bad.strides[0] = 264; /* not a multiple of 16 */
    CHECK_RC(tiled_encode(&m, &bad, 2, t.base), CUDA_ERROR_INVALID_VALUE);
    bad = t;
    bad.strides[0] = 1ull << 40;
    CHECK_RC(tiled_encode(&m, &bad, 2, t.base), CUDA_ERROR_INVALID_VALUE);
    bad = t;
    bad.box[1] = 0;
    CHECK_RC(tiled_encode(&m, &bad, 2, t.base), CUDA_ERROR_INVALID_VALUE);
    bad.box[1] = 257;
    CHECK_RC(tiled_encode(&m, &bad, 2, t.base), CUDA_ERROR_INVALID_VALUE);
    bad.box[1] = 256;
    OK(tiled_encode(&m, &bad, 2, t.base));
    bad = t;
    bad.box[0] = 2; /* 8 bytes: not a multiple of 16 */
    CHECK_RC(tiled_encode(&m, &bad, 2, t.base), CUDA_ERROR_INVALID_VALUE);
    bad = t;
    bad.dims[1] = 0;
    CHECK_RC(tiled_encode(&m, &bad, 2, t.base), CUDA_ERROR_INVALID_VALUE);
    bad.dims[1] = (1ull << 32) + 1;
    CHECK_RC(tiled_encode(&m, &bad, 2, t.base), CUDA_ERROR_INVALID_VALUE);
    bad = t;
    bad.estrides[1] = 9;
    CHECK_RC(tiled_encode(&m, &bad, 2, t.base), CUDA_ERROR_INVALID_VALUE);
    void *a = (void *)(uintptr_t)t.base;
    /* Enums out of range, and the combinations the documentation rules out. */
    CHECK_RC(cuTensorMapEncodeTiled(&m, (CUtensorMapDataType)16, 2, a, t.dims, t.strides, t.box,
                                    t.estrides, IL_NONE, SW_NONE, L2_NONE, OOB_NONE),
             CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuTensorMapEncodeTiled(&m, F32, 2, a, t.dims, t.strides, t.box, t.estrides, IL_NONE,
                                    (CUtensorMapSwizzle)7, L2_NONE, OOB_NONE),
             CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuTensorMapEncodeTiled(&m, F32, 2, a, t.dims, t.strides, t.box, t.estrides, IL_NONE,
                                    SW_NONE, (CUtensorMapL2promotion)4, OOB_NONE),
             CUDA_ERROR_INVALID_VALUE);
    /* 32 floats are 128 bytes: too wide for a 64-byte swizzle, fine for 128. */
    CHECK_RC(cuTensorMapEncodeTiled(&m, F32, 2, a, t.dims, t.strides, t.box, t.estrides, IL_NONE,
                                    CU_TENSOR_MAP_SWIZZLE_64B, L2_NONE, OOB_NONE),
             CUDA_ERROR_INVALID_VALUE);
    OK(cuTensorMapEncodeTiled(&m, F32, 2, a, t.dims, t.strides, t.box, t.estrides, IL_NONE,
                              CU_TENSOR_MAP_SWIZZLE_128B, L2_NONE, OOB_NONE));
    /* Interleave needs rank 3 or more. */
    CHECK_RC(cuTensorMapEncodeTiled(&m, F32, 2, a, t.dims, t.strides, t.box, t.estrides,
                                    CU_TENSOR_MAP_INTERLEAVE_16B, SW_NONE, L2_NONE, OOB_NONE),
             CUDA_ERROR_INVALID_VALUE);
    /* NaN fill is for floating-point types only. */
    CHECK_RC(cuTensorMapEncodeTiled(&m, CU_TENSOR_MAP_DATA_TYPE_INT32, 2, a, t.dims, t.strides,
                                    t.box, t.estrides, IL_NONE, SW_NONE, L2_NONE,
                                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA),
             CUDA_ERROR_INVALID_VALUE);
    OK(cuTensorMapEncodeTiled(&m, F32, 2, a, t.dims, t.strides, t.box, t.estrides, IL_NONE, SW_NONE,
                              L2_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA));
    /* The map itself must be 64-byte aligned. */
    static CUtensorMap two[2];
    CHECK_RC(tiled_encode((CUtensorMap *)((char *)two + 32), &t, 2, t.base),
             CUDA_ERROR_INVALID_VALUE);
}

static void test_interleave_32b(void)
{
    sim_test_init();
    CUdeviceptr base;
    OK(cuMemAlloc_v2(&base, 1 << 20));
    cuuint64_t dims[3] = {16, 8, 4}, strides[2] = {64, 512};
    cuuint32_t box[3] = {16, 8, 4}, es[3] = {1, 1, 1};
    CUtensorMap m;
    /* 32B interleave: 32-byte alignment, 32B swizzle. */
    CHECK_RC(cuTensorMapEncodeTiled(&m, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3,
                                    (void *)(uintptr_t)(base + 16), dims, strides, box, es,
                                    CU_TENSOR_MAP_INTERLEAVE_32B, CU_TENSOR_MAP_SWIZZLE_32B,
                                    L2_NONE, OOB_NONE),
             CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuTensorMapEncodeTiled(&m, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3, (void *)(uintptr_t)base,
                                    dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_32B, SW_NONE,
                                    L2_NONE, OOB_NONE),
             CUDA_ERROR_INVALID_VALUE);
    OK(cuTensorMapEncodeTiled(&m, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3, (void *)(uintptr_t)base, dims,
                              strides, box, es, CU_TENSOR_MAP_INTERLEAVE_32B,
                              CU_TENSOR_MAP_SWIZZLE_32B, L2_NONE, OOB_NONE));
}

static void test_before_hopper_refused(void)
{
    setenv("GPUPOOL_SIM_CC_MAJOR", "8", 1);
    struct tiled t = tiled_setup();
    CUtensorMap m;
    CHECK_RC(tiled_encode(&m, &t, 2, t.base), CUDA_ERROR_INVALID_VALUE);
    CHECK(strstr(gpupoolSimLastErrorDetail(), "compute capability") != NULL);
}

static void test_no_context(void)
{
    struct tiled t = tiled_setup();
    OK(cuCtxSetCurrent(NULL));
    CUtensorMap m;
    CHECK_RC(tiled_encode(&m, &t, 2, t.base), CUDA_ERROR_INVALID_CONTEXT);
}

static void test_im2col(void)
{
    sim_test_init();
    CUdeviceptr base;
    OK(cuMemAlloc_v2(&base, 1 << 20));
    void *a = (void *)(uintptr_t)base;
    /* NHWC: 64 channels of fp16, 16 x 16 pixels, 2 images. */
    cuuint64_t dims[4] = {64, 16, 16, 2}, strides[3] = {128, 2048, 32768};
    cuuint32_t es[4] = {1, 1, 1, 1};
    int lower[2] = {-1, -1}, upper[2] = {1, 1};
    CUtensorMap m, m2;
    OK(cuTensorMapEncodeIm2col(&m, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4, a, dims, strides, lower,
                               upper, 64, 128, es, IL_NONE, CU_TENSOR_MAP_SWIZZLE_128B, L2_NONE,
                               OOB_NONE));
    CHECK_EQ(m.opaque[1] & 0xff, 2);                 /* kind + 1: im2col */
    CHECK_EQ(m.opaque[12] & 0xffffffff, 0xffffffff); /* two offsets of -1 */
    CHECK_EQ(m.opaque[14], 64 | 128ull << 32);
    int wider[2] = {-2, -1};
    OK(cuTensorMapEncodeIm2col(&m2, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4, a, dims, strides, wider,
                               upper, 64, 128, es, IL_NONE, CU_TENSOR_MAP_SWIZZLE_128B, L2_NONE,
                               OOB_NONE));
    CHECK(memcmp(&m, &m2, sizeof m) != 0);
    /* Rank 4 allows offsets of [-128, 127]. */
    int far[2] = {-129, 0};
    CHECK_RC(cuTensorMapEncodeIm2col(&m, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4, a, dims, strides, far,
                                     upper, 64, 128, es, IL_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                     L2_NONE, OOB_NONE),
             CUDA_ERROR_INVALID_VALUE);
    /* Rank 3 to 5 only; channels 1 to 256; pixels 1 to 1024. */
    CHECK_RC(cuTensorMapEncodeIm2col(&m, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, a, dims, strides,
                                     lower, upper, 64, 128, es, IL_NONE, SW_NONE, L2_NONE,
                                     OOB_NONE),
             CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuTensorMapEncodeIm2col(&m, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4, a, dims, strides,
                                     lower, upper, 257, 128, es, IL_NONE, SW_NONE, L2_NONE,
                                     OOB_NONE),
             CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuTensorMapEncodeIm2col(&m, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4, a, dims, strides,
                                     lower, upper, 64, 1025, es, IL_NONE, SW_NONE, L2_NONE,
                                     OOB_NONE),
             CUDA_ERROR_INVALID_VALUE);
    /* 64 fp16 channels are 128 bytes: wider than a 64-byte swizzle. */
    CHECK_RC(cuTensorMapEncodeIm2col(&m, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4, a, dims, strides,
                                     lower, upper, 64, 128, es, IL_NONE, CU_TENSOR_MAP_SWIZZLE_64B,
                                     L2_NONE, OOB_NONE),
             CUDA_ERROR_INVALID_VALUE);
}

static void test_im2col_wide(void)
{
    sim_test_init();
    CUdeviceptr base;
    OK(cuMemAlloc_v2(&base, 1 << 20));
    void *a = (void *)(uintptr_t)base;
    cuuint64_t dims[3] = {64, 256, 2}, strides[2] = {128, 32768};
    cuuint32_t es[3] = {1, 1, 1};
    CUtensorMap m;
    OK(cuTensorMapEncodeIm2colWide(&m, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3, a, dims, strides, -1, 1,
                                   64, 256, es, IL_NONE, CU_TENSOR_MAP_IM2COL_WIDE_MODE_W,
                                   CU_TENSOR_MAP_SWIZZLE_128B, L2_NONE, OOB_NONE));
    CHECK_EQ(m.opaque[1] & 0xff, 3); /* kind + 1: im2col wide */
    /* Only the 64B and 128B swizzles; a known mode. */
    CHECK_RC(cuTensorMapEncodeIm2colWide(
                 &m, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3, a, dims, strides, -1, 1, 64, 256, es,
                 IL_NONE, CU_TENSOR_MAP_IM2COL_WIDE_MODE_W, SW_NONE, L2_NONE, OOB_NONE),
             CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuTensorMapEncodeIm2colWide(&m, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3, a, dims, strides,
                                         -1, 1, 64, 256, es, IL_NONE, (CUtensorMapIm2ColWideMode)2,
                                         CU_TENSOR_MAP_SWIZZLE_128B, L2_NONE, OOB_NONE),
             CUDA_ERROR_INVALID_VALUE);
}

static void test_replace_address(void)
{
    struct tiled t = tiled_setup();
    CUtensorMap m, orig;
    OK(tiled_encode(&m, &t, 2, t.base));
    orig = m;
    OK(cuTensorMapReplaceAddress(&m, (void *)(uintptr_t)(t.base + 4096)));
    CHECK_EQ(m.opaque[0], t.base + 4096);
    for (int i = 1; i < 15; i++)
        CHECK_EQ(m.opaque[i], orig.opaque[i]);
    /* The same as encoding at the new address. */
    CUtensorMap direct;
    OK(tiled_encode(&direct, &t, 2, t.base + 4096));
    CHECK(memcmp(&m, &direct, sizeof m) == 0);
    CHECK_RC(cuTensorMapReplaceAddress(&m, (void *)(uintptr_t)(t.base + 8)),
             CUDA_ERROR_INVALID_VALUE);
    CUtensorMap junk;
    memset(&junk, 0x5a, sizeof junk);
    CHECK_RC(cuTensorMapReplaceAddress(&junk, (void *)(uintptr_t)t.base), CUDA_ERROR_INVALID_VALUE);
}

SIM_TEST_MAIN(SIM_T(tiled_packing), SIM_T(tiled_refusals), SIM_T(interleave_32b),
              SIM_T(before_hopper_refused), SIM_T(no_context), SIM_T(im2col), SIM_T(im2col_wide),
              SIM_T(replace_address))
