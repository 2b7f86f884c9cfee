/*
 * api_tensormap.c: tensor maps (TMA descriptors): cuTensorMapEncodeTiled, cuTensorMapEncodeIm2col,
 * cuTensorMapEncodeIm2colWide and cuTensorMapReplaceAddress.
 *
 * A CUtensorMap is 128 opaque bytes that only the driver can encode, so each call goes to the
 * worker (worker/h_tensormap.c), which calls the driver and returns the bytes. The global
 * address is sent as is: device addresses are the same on both sides (the VA window,
 * docs/architecture.md). Autotuners (Triton, JAX/XLA, CUTLASS) encode the same descriptor again
 * and again, so a successful encoding is cached by all its arguments: an identical call is
 * answered here without a round trip. The arrays are read only up to the rank (at most 5, what
 * the wire carries); the driver, on the server, checks everything else.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gp_cuda_launch.h"
#include "shim.h"

#define TM_MAX_RANK 5
#define TM_MAX_CORNERS 3
#define TM_BUCKETS 256
#define TM_MAX_ENTRIES 4096 /* beyond this the cache starts over */

enum {
    TM_TILED = 0,
    TM_IM2COL = 1,
    TM_IM2COL_WIDE = 2
};

/* Every argument of an encoding, fixed-size and zero-filled so that two keys compare bytewise. */
typedef struct tm_key {
    uint32_t kind, data_type, rank, n, n_corners;
    uint32_t channels_per_pixel, pixels_per_column, interleave, swizzle, l2, oob, wide_mode;
    uint64_t global_address;
    uint64_t dims[TM_MAX_RANK], strides[TM_MAX_RANK];
    uint32_t box[TM_MAX_RANK], estrides[TM_MAX_RANK];
    int32_t lower[TM_MAX_CORNERS], upper[TM_MAX_CORNERS];
} tm_key;

typedef struct tm_entry {
    struct tm_entry *next;
    uint64_t hash;
    tm_key key;
    uint8_t map[128];
} tm_entry;

static pthread_mutex_t tm_lock = PTHREAD_MUTEX_INITIALIZER;
static tm_entry *tm_table[TM_BUCKETS];
static size_t tm_count;

static uint64_t key_hash(const tm_key *k)
{
    const uint8_t *b = (const uint8_t *)k;
    uint64_t h = 14695981039346656037ull; /* FNV-1a */
    for (size_t i = 0; i < sizeof *k; i++)
        h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

static int cache_get(const tm_key *k, uint64_t h, void *map)
{
    int found = 0;
    pthread_mutex_lock(&tm_lock);
    for (tm_entry *e = tm_table[h % TM_BUCKETS]; e; e = e->next) {
        if (e->hash == h && memcmp(&e->key, k, sizeof *k) == 0) {
            memcpy(map, e->map, sizeof e->map);
            found = 1;
            break;
        }
    }
    pthread_mutex_unlock(&tm_lock);
    return found;
}

static void cache_put(const tm_key *k, uint64_t h, const uint8_t map[128])
{
    tm_entry *e = malloc(sizeof *e);
    if (!e)
        return; /* the answer stands; it just is not remembered */
    e->hash = h;
    e->key = *k;
    memcpy(e->map, map, sizeof e->map);
    pthread_mutex_lock(&tm_lock);
    if (tm_count >= TM_MAX_ENTRIES) {
        for (int b = 0; b < TM_BUCKETS; b++) {
            for (tm_entry *x = tm_table[b], *next; x; x = next) {
                next = x->next;
                free(x);
            }
            tm_table[b] = NULL;
        }
        tm_count = 0;
    }
    e->next = tm_table[h % TM_BUCKETS];
    tm_table[h % TM_BUCKETS] = e;
    tm_count++;
    pthread_mutex_unlock(&tm_lock);
}

/* The driver requires the caller's map to be 64-byte aligned. */
static int map_ok(const CUtensorMap *map)
{
    return map && ((uintptr_t)map & 63u) == 0;
}

/* Sends k, writes the driver's 128 bytes into map and caches them. */
static CUresult encode(const tm_key *k, CUtensorMap *map)
{
    CUresult r = gp_ctx_enter();
    if (r != CUDA_SUCCESS)
        return r;
    uint64_t h = key_hash(k);
    if (cache_get(k, h, map->opaque))
        return CUDA_SUCCESS;

    /* The wire's arrays: little-endian, as many entries as the rank asks for. */
    uint8_t dims[8 * TM_MAX_RANK], strides[8 * TM_MAX_RANK], box[4 * TM_MAX_RANK],
        estrides[4 * TM_MAX_RANK], lower[4 * TM_MAX_CORNERS], upper[4 * TM_MAX_CORNERS];
    for (uint32_t i = 0; i < TM_MAX_RANK; i++) {
        gp_wr_u64(dims + 8 * i, k->dims[i]);
        gp_wr_u64(strides + 8 * i, k->strides[i]);
        gp_wr_u32(box + 4 * i, k->box[i]);
        gp_wr_u32(estrides + 4 * i, k->estrides[i]);
    }
    for (uint32_t i = 0; i < TM_MAX_CORNERS; i++) {
        gp_wr_u32(lower + 4 * i, (uint32_t)k->lower[i]);
        gp_wr_u32(upper + 4 * i, (uint32_t)k->upper[i]);
    }
    gp_tensor_map_encode m = {
        .kind = k->kind,
        .data_type = k->data_type,
        .rank = k->rank,
        .global_address = k->global_address,
        .global_dim = dims,
        .global_dim_count = k->n,
        .global_strides = strides,
        .global_strides_count = k->n ? k->n - 1 : 0,
        .box_dim = box,
        .box_dim_count = k->kind == TM_TILED ? k->n : 0,
        .element_strides = estrides,
        .element_strides_count = k->n,
        .lower_corner = lower,
        .lower_corner_count = k->n_corners,
        .upper_corner = upper,
        .upper_corner_count = k->n_corners,
        .channels_per_pixel = k->channels_per_pixel,
        .pixels_per_column = k->pixels_per_column,
        .interleave = k->interleave,
        .swizzle = k->swizzle,
        .l2_promotion = k->l2,
        .oob_fill = k->oob,
        .wide_mode = k->wide_mode,
    };
    GP_FRAME(frame, flen, gp_tensor_map_encode, &m);
    if (!frame)
        return CUDA_ERROR_OUT_OF_MEMORY;
    gp_reply reply;
    r = gp_request(frame, flen, NULL, 0, NULL, 0, &reply);
    GP_FRAME_FREE(frame);
    if (r != CUDA_SUCCESS)
        return gp_server_result(r, "tensor map encoding");
    gp_tensor_map_encode_reply rep;
    if (gp_tensor_map_encode_reply_decode(reply.body, reply.len, &rep)) {
        gp_log_error("tensor map encoding: malformed reply");
        gp_reply_free(&reply);
        return CUDA_ERROR_UNKNOWN;
    }
    gp_reply_free(&reply);
    memcpy(map->opaque, rep.map, sizeof rep.map);
    cache_put(k, h, rep.map);
    return CUDA_SUCCESS;
}

/* The arguments every encoding shares, read up to the rank. NULL arrays the rank needs are
 * refused as the driver refuses them. */
static CUresult key_common(tm_key *k, uint32_t kind, CUtensorMapDataType dt, cuuint32_t rank,
                           void *addr, const cuuint64_t *dims, const cuuint64_t *strides,
                           const cuuint32_t *estrides, CUtensorMapInterleave il,
                           CUtensorMapSwizzle sw, CUtensorMapL2promotion l2,
                           CUtensorMapFloatOOBfill oob)
{
    memset(k, 0, sizeof *k);
    k->kind = kind;
    k->data_type = (uint32_t)dt;
    k->rank = rank;
    k->n = rank > TM_MAX_RANK ? TM_MAX_RANK : rank;
    k->global_address = (uint64_t)(uintptr_t)addr;
    k->interleave = (uint32_t)il;
    k->swizzle = (uint32_t)sw;
    k->l2 = (uint32_t)l2;
    k->oob = (uint32_t)oob;
    if (k->n && (!dims || !estrides || (k->n > 1 && !strides)))
        return CUDA_ERROR_INVALID_VALUE;
    for (uint32_t i = 0; i < k->n; i++) {
        k->dims[i] = dims[i];
        k->estrides[i] = estrides[i];
        if (i + 1 < k->n)
            k->strides[i] = strides[i];
    }
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuTensorMapEncodeTiled(
    CUtensorMap *tensorMap, CUtensorMapDataType tensorDataType, cuuint32_t tensorRank,
    void *globalAddress, const cuuint64_t *globalDim, const cuuint64_t *globalStrides,
    const cuuint32_t *boxDim, const cuuint32_t *elementStrides, CUtensorMapInterleave interleave,
    CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2Promotion, CUtensorMapFloatOOBfill oobFill)
{
    if (!map_ok(tensorMap))
        return CUDA_ERROR_INVALID_VALUE;
    tm_key k;
    CUresult r =
        key_common(&k, TM_TILED, tensorDataType, tensorRank, globalAddress, globalDim,
                   globalStrides, elementStrides, interleave, swizzle, l2Promotion, oobFill);
    if (r != CUDA_SUCCESS)
        return r;
    if (k.n && !boxDim)
        return CUDA_ERROR_INVALID_VALUE;
    for (uint32_t i = 0; i < k.n; i++)
        k.box[i] = boxDim[i];
    return encode(&k, tensorMap);
}

/* Im2col's corners: rank - 2 offsets (D, H, W) for a rank of 3 to 5, none otherwise (the driver
 * refuses such a rank anyway). */
static uint32_t corner_count(cuuint32_t rank)
{
    return rank >= 3 && rank <= TM_MAX_RANK ? rank - 2 : 0;
}

GP_EXPORT CUresult cuTensorMapEncodeIm2col(
    CUtensorMap *tensorMap, CUtensorMapDataType tensorDataType, cuuint32_t tensorRank,
    void *globalAddress, const cuuint64_t *globalDim, const cuuint64_t *globalStrides,
    const int *pixelBoxLowerCorner, const int *pixelBoxUpperCorner, cuuint32_t channelsPerPixel,
    cuuint32_t pixelsPerColumn, const cuuint32_t *elementStrides, CUtensorMapInterleave interleave,
    CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2Promotion, CUtensorMapFloatOOBfill oobFill)
{
    if (!map_ok(tensorMap))
        return CUDA_ERROR_INVALID_VALUE;
    tm_key k;
    CUresult r =
        key_common(&k, TM_IM2COL, tensorDataType, tensorRank, globalAddress, globalDim,
                   globalStrides, elementStrides, interleave, swizzle, l2Promotion, oobFill);
    if (r != CUDA_SUCCESS)
        return r;
    k.n_corners = corner_count(tensorRank);
    if (k.n_corners && (!pixelBoxLowerCorner || !pixelBoxUpperCorner))
        return CUDA_ERROR_INVALID_VALUE;
    for (uint32_t i = 0; i < k.n_corners; i++) {
        k.lower[i] = pixelBoxLowerCorner[i];
        k.upper[i] = pixelBoxUpperCorner[i];
    }
    k.channels_per_pixel = channelsPerPixel;
    k.pixels_per_column = pixelsPerColumn;
    return encode(&k, tensorMap);
}

GP_EXPORT CUresult cuTensorMapEncodeIm2colWide(
    CUtensorMap *tensorMap, CUtensorMapDataType tensorDataType, cuuint32_t tensorRank,
    void *globalAddress, const cuuint64_t *globalDim, const cuuint64_t *globalStrides,
    int pixelBoxLowerCornerWidth, int pixelBoxUpperCornerWidth, cuuint32_t channelsPerPixel,
    cuuint32_t pixelsPerColumn, const cuuint32_t *elementStrides, CUtensorMapInterleave interleave,
    CUtensorMapIm2ColWideMode mode, CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2Promotion,
    CUtensorMapFloatOOBfill oobFill)
{
    if (!map_ok(tensorMap))
        return CUDA_ERROR_INVALID_VALUE;
    tm_key k;
    CUresult r =
        key_common(&k, TM_IM2COL_WIDE, tensorDataType, tensorRank, globalAddress, globalDim,
                   globalStrides, elementStrides, interleave, swizzle, l2Promotion, oobFill);
    if (r != CUDA_SUCCESS)
        return r;
    k.n_corners = 1; /* the W offsets */
    k.lower[0] = pixelBoxLowerCornerWidth;
    k.upper[0] = pixelBoxUpperCornerWidth;
    k.channels_per_pixel = channelsPerPixel;
    k.pixels_per_column = pixelsPerColumn;
    k.wide_mode = (uint32_t)mode;
    return encode(&k, tensorMap);
}

/* Not cached: the map itself is the argument, and programs replace addresses far less often
 * than autotuners encode. */
GP_EXPORT CUresult cuTensorMapReplaceAddress(CUtensorMap *tensorMap, void *globalAddress)
{
    if (!map_ok(tensorMap))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_ctx_enter();
    if (r != CUDA_SUCCESS)
        return r;
    gp_tensor_map_replace_address m = {.global_address = (uint64_t)(uintptr_t)globalAddress};
    memcpy(m.map, tensorMap->opaque, sizeof m.map);
    GP_FRAME(frame, flen, gp_tensor_map_replace_address, &m);
    if (!frame)
        return CUDA_ERROR_OUT_OF_MEMORY;
    gp_reply reply;
    r = gp_request(frame, flen, NULL, 0, NULL, 0, &reply);
    GP_FRAME_FREE(frame);
    if (r != CUDA_SUCCESS)
        return gp_server_result(r, "tensor map address replacement");
    gp_tensor_map_replace_address_reply rep;
    if (gp_tensor_map_replace_address_reply_decode(reply.body, reply.len, &rep)) {
        gp_log_error("tensor map address replacement: malformed reply");
        gp_reply_free(&reply);
        return CUDA_ERROR_UNKNOWN;
    }
    gp_reply_free(&reply);
    memcpy(tensorMap->opaque, rep.map, sizeof rep.map);
    return CUDA_SUCCESS;
}
