/*
 * sim_tensormap.c: tensor maps (TMA descriptors) on the simulated device.
 *
 * The arguments are checked as the driver API documentation of cuTensorMapEncodeTiled,
 * cuTensorMapEncodeIm2col and cuTensorMapEncodeIm2colWide states them (cuda.h, "Tensor Map
 * Object Management"); every refusal is CUDA_ERROR_INVALID_VALUE, with the reason in
 * gpupool_sim_last_error_detail. Not checked: the im2col bounding box's "non-zero area", whose
 * exact rule the documentation does not give.
 *
 * The real encoding is NVIDIA's secret; the simulated one is a documented packing of the
 * arguments (16 little-endian qwords), deterministic, never all zero, different whenever an
 * argument differs:
 *   q0       global address
 *   q1       bits 0-7 kind + 1 (1 tiled, 2 im2col, 3 im2col wide), 8-15 data type, 16-23 rank,
 *            24-31 interleave, 32-39 swizzle, 40-47 L2 promotion, 48-55 OOB fill, 56-63 wide mode
 *   q2-q6    global dims 0-4
 *   q7-q10   global strides 0-3
 *   q11      box dims - 1 (8 bits each, dims 0-4 from bit 0) | element strides - 1 (3 bits
 *            each, from bit 40)
 *   q12      im2col lower corner offsets (16 bits each, two's complement, from bit 0)
 *   q13      im2col upper corner offsets (the same)
 *   q14      channels per pixel | pixels per column << 32
 *   q15      FNV-1a of q0-q14: cuTensorMapReplaceAddress refuses a map that is not one of ours
 */
#include <stdint.h>
#include <string.h>

#include "sim_api.h"
#include "sim_internal.h"

#define TM_MAX_RANK 5
enum {
    TM_TILED = 0,
    TM_IM2COL = 1,
    TM_IM2COL_WIDE = 2
};

/* Bits one element takes in global memory (the packed types: 16 values in 8 or 16 bytes). */
static unsigned elem_bits(CUtensorMapDataType t)
{
    switch (t) {
    case CU_TENSOR_MAP_DATA_TYPE_UINT8:
        return 8;
    case CU_TENSOR_MAP_DATA_TYPE_UINT16:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT16:
    case CU_TENSOR_MAP_DATA_TYPE_BFLOAT16:
        return 16;
    case CU_TENSOR_MAP_DATA_TYPE_UINT64:
    case CU_TENSOR_MAP_DATA_TYPE_INT64:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT64:
        return 64;
    case CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN8B:
        return 4;
    case CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN16B:
    case CU_TENSOR_MAP_DATA_TYPE_16U6_ALIGN16B:
        return 8;
    default: /* the 32-bit integer and float types */
        return 32;
    }
}

static int packed16(CUtensorMapDataType t)
{
    return t == CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN16B || t == CU_TENSOR_MAP_DATA_TYPE_16U6_ALIGN16B;
}

static int is_float(CUtensorMapDataType t)
{
    return t == CU_TENSOR_MAP_DATA_TYPE_FLOAT16 || t == CU_TENSOR_MAP_DATA_TYPE_FLOAT32 ||
           t == CU_TENSOR_MAP_DATA_TYPE_FLOAT64 || t == CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 ||
           t == CU_TENSOR_MAP_DATA_TYPE_FLOAT32_FTZ || t == CU_TENSOR_MAP_DATA_TYPE_TFLOAT32 ||
           t == CU_TENSOR_MAP_DATA_TYPE_TFLOAT32_FTZ;
}

/* The address alignment a map of this type and interleave needs. */
static uint64_t addr_align(CUtensorMapDataType t, CUtensorMapInterleave il)
{
    return il == CU_TENSOR_MAP_INTERLEAVE_32B || packed16(t) ? 32 : 16;
}

/* Everything an encoding call passed, in one place for the checks and the packing. */
struct tm_args {
    int kind;
    CUtensorMapDataType dt;
    cuuint32_t rank;
    uint64_t addr;
    const cuuint64_t *dims, *strides;
    const cuuint32_t *box, *estrides;
    int lower[3], upper[3], ncorners;
    cuuint32_t channels, pixels;
    CUtensorMapInterleave il;
    CUtensorMapSwizzle sw;
    CUtensorMapL2promotion l2;
    CUtensorMapFloatOOBfill oob;
    CUtensorMapIm2ColWideMode mode;
};

static CUresult refuse(const char *why)
{
    sim_detail("tensor map: %s", why);
    return CUDA_ERROR_INVALID_VALUE;
}

/* The swizzle span in bytes (0: no swizzle). */
static unsigned swizzle_span(CUtensorMapSwizzle sw)
{
    switch (sw) {
    case CU_TENSOR_MAP_SWIZZLE_32B:
        return 32;
    case CU_TENSOR_MAP_SWIZZLE_64B:
        return 64;
    case CU_TENSOR_MAP_SWIZZLE_NONE:
        return 0;
    default:
        return 128;
    }
}

static CUresult check_common(const struct tm_args *a)
{
    if (sim_cfg.cc_major < 9)
        return refuse("tensor maps need compute capability 9.0 or higher");
    if ((unsigned)a->dt > CU_TENSOR_MAP_DATA_TYPE_16U6_ALIGN16B)
        return refuse("unknown data type");
    if ((unsigned)a->il > CU_TENSOR_MAP_INTERLEAVE_32B)
        return refuse("unknown interleave");
    if ((unsigned)a->sw > CU_TENSOR_MAP_SWIZZLE_128B_ATOM_64B)
        return refuse("unknown swizzle");
    if ((unsigned)a->l2 > CU_TENSOR_MAP_L2_PROMOTION_L2_256B)
        return refuse("unknown L2 promotion");
    if ((unsigned)a->oob > CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA)
        return refuse("unknown OOB fill");
    if (a->kind == TM_TILED) {
        if (a->rank < 1 || a->rank > TM_MAX_RANK)
            return refuse("rank must be 1 to 5");
        if (a->il != CU_TENSOR_MAP_INTERLEAVE_NONE && a->rank < 3)
            return refuse("an interleaved map needs rank 3 or more");
    } else if (a->rank < 3 || a->rank > TM_MAX_RANK) {
        return refuse("an im2col map's rank must be 3 to 5");
    }
    if (!a->dims || !a->estrides || (a->rank > 1 && !a->strides))
        return refuse("an array argument is NULL");
    if (a->addr % addr_align(a->dt, a->il))
        return refuse("global address misaligned (16 bytes; 32 with 32B interleave or a packed "
                      "16B type)");
    for (cuuint32_t i = 0; i < a->rank; i++) {
        if (a->dims[i] == 0 || a->dims[i] > (1ull << 32))
            return refuse("global dims must be 1 to 2^32");
        if (a->estrides[i] == 0 || a->estrides[i] > 8)
            return refuse("element strides must be 1 to 8");
    }
    if (packed16(a->dt) && a->dims[0] % 128)
        return refuse("a packed 16B type needs global dim 0 a multiple of 128");
    if (a->dt == CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN8B && a->dims[0] % 2)
        return refuse("16U4_ALIGN8B needs global dim 0 a multiple of 2");
    uint64_t smul = a->il == CU_TENSOR_MAP_INTERLEAVE_32B || packed16(a->dt) ? 32 : 16;
    for (cuuint32_t i = 0; i + 1 < a->rank; i++)
        if (a->strides[i] % smul || a->strides[i] >= (1ull << 40))
            return refuse("global strides must be multiples of 16 (32 with 32B interleave or a "
                          "packed 16B type) and below 2^40");
    if (a->il == CU_TENSOR_MAP_INTERLEAVE_32B && a->sw != CU_TENSOR_MAP_SWIZZLE_32B)
        return refuse("32B interleave needs 32B swizzle");
    if (a->dt == CU_TENSOR_MAP_DATA_TYPE_16U6_ALIGN16B) {
        if (a->il != CU_TENSOR_MAP_INTERLEAVE_NONE)
            return refuse("16U6_ALIGN16B needs no interleave");
        if (a->sw != CU_TENSOR_MAP_SWIZZLE_NONE && a->sw != CU_TENSOR_MAP_SWIZZLE_128B &&
            a->sw != CU_TENSOR_MAP_SWIZZLE_128B_ATOM_32B &&
            a->sw != CU_TENSOR_MAP_SWIZZLE_128B_ATOM_64B)
            return refuse("swizzle not supported with 16U6_ALIGN16B");
    }
    if (a->dt == CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN16B && a->sw != CU_TENSOR_MAP_SWIZZLE_NONE &&
        a->sw != CU_TENSOR_MAP_SWIZZLE_128B && a->sw != CU_TENSOR_MAP_SWIZZLE_128B_ATOM_32B)
        return refuse("swizzle not supported with 16U4_ALIGN16B");
    if (a->oob == CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA && !is_float(a->dt))
        return refuse("NaN OOB fill needs a floating-point type");
    return CUDA_SUCCESS;
}

/* The bounding box's inner dimension in bytes against the swizzle span (no interleave). */
static CUresult check_inner(const struct tm_args *a, uint64_t inner_elems)
{
    uint64_t inner = inner_elems * elem_bits(a->dt) / 8;
    unsigned span = swizzle_span(a->sw);
    if (a->il == CU_TENSOR_MAP_INTERLEAVE_NONE && span && inner > span)
        return refuse("the box's inner dimension is larger than the swizzle span");
    return CUDA_SUCCESS;
}

static CUresult check_tiled(const struct tm_args *a)
{
    if (!a->box)
        return refuse("boxDim is NULL");
    for (cuuint32_t i = 0; i < a->rank; i++)
        if (a->box[i] == 0 || a->box[i] > 256)
            return refuse("box dims must be 1 to 256");
    if (a->il == CU_TENSOR_MAP_INTERLEAVE_NONE && (a->box[0] * elem_bits(a->dt) / 8) % 16)
        return refuse("box dim 0 times the element size must be a multiple of 16 bytes");
    if (packed16(a->dt) && a->box[0] != 128)
        return refuse("a packed 16B type needs box dim 0 of 128");
    return check_inner(a, a->box[0]);
}

static CUresult check_im2col(const struct tm_args *a)
{
    if (a->channels == 0 || a->channels > 256)
        return refuse("channels per pixel must be 1 to 256");
    if (packed16(a->dt) && a->channels != 128)
        return refuse("a packed 16B type needs 128 channels per pixel");
    int wide = a->kind == TM_IM2COL_WIDE;
    if (!(wide && a->mode == CU_TENSOR_MAP_IM2COL_WIDE_MODE_W128) &&
        (a->pixels == 0 || a->pixels > 1024))
        return refuse("pixels per column must be 1 to 1024");
    /* Corner offsets: one per spatial dimension (rank - 2; the W offset alone when wide), in a
     * range that narrows as the rank grows. */
    int lim = wide || a->rank == 3 ? 32768 : a->rank == 4 ? 128 : 16;
    for (int i = 0; i < a->ncorners; i++)
        if (a->lower[i] < -lim || a->lower[i] >= lim || a->upper[i] < -lim || a->upper[i] >= lim)
            return refuse("an im2col corner offset is out of range for the rank");
    if (wide) {
        if ((unsigned)a->mode > CU_TENSOR_MAP_IM2COL_WIDE_MODE_W128)
            return refuse("unknown im2col wide mode");
        if (a->sw != CU_TENSOR_MAP_SWIZZLE_64B && a->sw != CU_TENSOR_MAP_SWIZZLE_128B &&
            a->sw != CU_TENSOR_MAP_SWIZZLE_128B_ATOM_32B)
            return refuse("im2col wide supports only 64B, 128B and 128B_ATOM_32B swizzles");
    }
    return check_inner(a, a->channels);
}

static uint64_t fnv(const uint64_t *q, size_t n)
{
    uint64_t h = 14695981039346656037ull;
    const uint8_t *b = (const uint8_t *)q;
    for (size_t i = 0; i < n * 8; i++)
        h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

static void pack(const struct tm_args *a, CUtensorMap *map)
{
    uint64_t q[CU_TENSOR_MAP_NUM_QWORDS] = {0};
    q[0] = a->addr;
    q[1] = (uint64_t)(a->kind + 1) | (uint64_t)(a->dt & 0xff) << 8 | (uint64_t)a->rank << 16 |
           (uint64_t)(a->il & 0xff) << 24 | (uint64_t)(a->sw & 0xff) << 32 |
           (uint64_t)(a->l2 & 0xff) << 40 | (uint64_t)(a->oob & 0xff) << 48 |
           (uint64_t)(a->mode & 0xff) << 56;
    for (cuuint32_t i = 0; i < a->rank; i++) {
        q[2 + i] = a->dims[i];
        if (i + 1 < a->rank)
            q[7 + i] = a->strides[i];
        if (a->kind == TM_TILED)
            q[11] |= (uint64_t)(a->box[i] - 1) << (8 * i);
        q[11] |= (uint64_t)(a->estrides[i] - 1) << (40 + 3 * i);
    }
    for (int i = 0; i < a->ncorners; i++) {
        q[12] |= (uint64_t)(uint16_t)a->lower[i] << (16 * i);
        q[13] |= (uint64_t)(uint16_t)a->upper[i] << (16 * i);
    }
    q[14] = (uint64_t)a->channels | (uint64_t)a->pixels << 32;
    q[15] = fnv(q, 15);
    memcpy(map->opaque, q, sizeof q);
}

static CUresult encode(struct tm_args *a, CUtensorMap *map)
{
    struct sim_ctx *ctx;
    CUresult rc = sim_enter_ctx(&ctx);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!map || (uintptr_t)map % 64)
        return sim_leave(refuse("the tensor map must be 64-byte aligned"));
    rc = check_common(a);
    if (rc == CUDA_SUCCESS)
        rc = a->kind == TM_TILED ? check_tiled(a) : check_im2col(a);
    if (rc == CUDA_SUCCESS)
        pack(a, map);
    return sim_leave(rc);
}

CUresult cuTensorMapEncodeTiled(CUtensorMap *tensorMap, CUtensorMapDataType tensorDataType,
                                cuuint32_t tensorRank, void *globalAddress,
                                const cuuint64_t *globalDim, const cuuint64_t *globalStrides,
                                const cuuint32_t *boxDim, const cuuint32_t *elementStrides,
                                CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
                                CUtensorMapL2promotion l2Promotion, CUtensorMapFloatOOBfill oobFill)
{
    struct tm_args a = {.kind = TM_TILED,
                        .dt = tensorDataType,
                        .rank = tensorRank,
                        .addr = (uint64_t)(uintptr_t)globalAddress,
                        .dims = globalDim,
                        .strides = globalStrides,
                        .box = boxDim,
                        .estrides = elementStrides,
                        .il = interleave,
                        .sw = swizzle,
                        .l2 = l2Promotion,
                        .oob = oobFill};
    return encode(&a, tensorMap);
}

CUresult cuTensorMapEncodeIm2col(CUtensorMap *tensorMap, CUtensorMapDataType tensorDataType,
                                 cuuint32_t tensorRank, void *globalAddress,
                                 const cuuint64_t *globalDim, const cuuint64_t *globalStrides,
                                 const int *pixelBoxLowerCorner, const int *pixelBoxUpperCorner,
                                 cuuint32_t channelsPerPixel, cuuint32_t pixelsPerColumn,
                                 const cuuint32_t *elementStrides, CUtensorMapInterleave interleave,
                                 CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2Promotion,
                                 CUtensorMapFloatOOBfill oobFill)
{
    struct tm_args a = {.kind = TM_IM2COL,
                        .dt = tensorDataType,
                        .rank = tensorRank,
                        .addr = (uint64_t)(uintptr_t)globalAddress,
                        .dims = globalDim,
                        .strides = globalStrides,
                        .estrides = elementStrides,
                        .channels = channelsPerPixel,
                        .pixels = pixelsPerColumn,
                        .il = interleave,
                        .sw = swizzle,
                        .l2 = l2Promotion,
                        .oob = oobFill};
    if (tensorRank >= 3 && tensorRank <= TM_MAX_RANK) {
        if (!pixelBoxLowerCorner || !pixelBoxUpperCorner) {
            CUresult rc = sim_enter();
            return rc != CUDA_SUCCESS ? rc : sim_leave(refuse("an im2col corner is NULL"));
        }
        a.ncorners = (int)tensorRank - 2;
        for (int i = 0; i < a.ncorners; i++) {
            a.lower[i] = pixelBoxLowerCorner[i];
            a.upper[i] = pixelBoxUpperCorner[i];
        }
    }
    return encode(&a, tensorMap);
}

CUresult cuTensorMapEncodeIm2colWide(
    CUtensorMap *tensorMap, CUtensorMapDataType tensorDataType, cuuint32_t tensorRank,
    void *globalAddress, const cuuint64_t *globalDim, const cuuint64_t *globalStrides,
    int pixelBoxLowerCornerWidth, int pixelBoxUpperCornerWidth, cuuint32_t channelsPerPixel,
    cuuint32_t pixelsPerColumn, const cuuint32_t *elementStrides, CUtensorMapInterleave interleave,
    CUtensorMapIm2ColWideMode mode, CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2Promotion,
    CUtensorMapFloatOOBfill oobFill)
{
    struct tm_args a = {.kind = TM_IM2COL_WIDE,
                        .dt = tensorDataType,
                        .rank = tensorRank,
                        .addr = (uint64_t)(uintptr_t)globalAddress,
                        .dims = globalDim,
                        .strides = globalStrides,
                        .estrides = elementStrides,
                        .lower = {pixelBoxLowerCornerWidth},
                        .upper = {pixelBoxUpperCornerWidth},
                        .ncorners = 1,
                        .channels = channelsPerPixel,
                        .pixels = pixelsPerColumn,
                        .il = interleave,
                        .sw = swizzle,
                        .l2 = l2Promotion,
                        .oob = oobFill,
                        .mode = mode};
    return encode(&a, tensorMap);
}

CUresult cuTensorMapReplaceAddress(CUtensorMap *tensorMap, void *globalAddress)
{
    struct sim_ctx *ctx;
    CUresult rc = sim_enter_ctx(&ctx);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!tensorMap || (uintptr_t)tensorMap % 64)
        return sim_leave(refuse("the tensor map must be 64-byte aligned"));
    uint64_t q[CU_TENSOR_MAP_NUM_QWORDS];
    memcpy(q, tensorMap->opaque, sizeof q);
    if (q[15] != fnv(q, 15) || (q[1] & 0xff) == 0)
        return sim_leave(refuse("not a tensor map this device encoded"));
    uint64_t addr = (uint64_t)(uintptr_t)globalAddress;
    CUtensorMapDataType dt = (CUtensorMapDataType)((q[1] >> 8) & 0xff);
    CUtensorMapInterleave il = (CUtensorMapInterleave)((q[1] >> 24) & 0xff);
    if (addr % addr_align(dt, il))
        return sim_leave(refuse("global address misaligned for this map"));
    q[0] = addr;
    q[15] = fnv(q, 15);
    memcpy(tensorMap->opaque, q, sizeof q);
    return sim_leave(CUDA_SUCCESS);
}
