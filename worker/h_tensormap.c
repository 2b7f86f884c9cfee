/*
 * h_tensormap.c: tensor maps (TMA descriptors) for the client's cuTensorMapEncode* and
 * cuTensorMapReplaceAddress (client/shim/api_tensormap.c). The driver does all the encoding and
 * checking; the worker only rebuilds the arrays from the wire and returns the 128 bytes. The
 * global address needs no translation: the client's device addresses are the worker's (the VA
 * window).
 */
#include <string.h>

#include "worker.h"

#define TM_MAX_RANK 5
#define TM_MAX_CORNERS 3

enum {
    TM_TILED = 0,
    TM_IM2COL = 1,
    TM_IM2COL_WIDE = 2
};

/* The driver's map must be 64-byte aligned; CUtensorMap is (128). */
static void map_out(uint8_t out[128], const CUtensorMap *map)
{
    memcpy(out, map->opaque, sizeof map->opaque);
}

WK_HANDLER(tensor_map_encode)
{
    gp_tensor_map_encode_reply r = {0};
    /* The arrays hold rank entries (global strides rank - 1); a rank the wire cannot carry is one
     * the driver refuses, so the worker refuses it without calling it. Entries beyond what the
     * client sent are 0, which the driver refuses too. */
    if (m->rank > TM_MAX_RANK || m->global_dim_count > TM_MAX_RANK ||
        m->global_strides_count > TM_MAX_RANK || m->box_dim_count > TM_MAX_RANK ||
        m->element_strides_count > TM_MAX_RANK || m->lower_corner_count > TM_MAX_CORNERS ||
        m->upper_corner_count > TM_MAX_CORNERS) {
        r.result = CUDA_ERROR_INVALID_VALUE;
        WK_REPLY(w, req, gp_tensor_map_encode_reply, &r);
        return;
    }
    cuuint64_t dims[TM_MAX_RANK] = {0}, strides[TM_MAX_RANK] = {0};
    cuuint32_t box[TM_MAX_RANK] = {0}, estrides[TM_MAX_RANK] = {0};
    int lower[TM_MAX_CORNERS] = {0}, upper[TM_MAX_CORNERS] = {0};
    for (uint32_t i = 0; i < m->global_dim_count; i++)
        dims[i] = gp_arr_u64(m->global_dim, i);
    for (uint32_t i = 0; i < m->global_strides_count; i++)
        strides[i] = gp_arr_u64(m->global_strides, i);
    for (uint32_t i = 0; i < m->box_dim_count; i++)
        box[i] = gp_arr_u32(m->box_dim, i);
    for (uint32_t i = 0; i < m->element_strides_count; i++)
        estrides[i] = gp_arr_u32(m->element_strides, i);
    for (uint32_t i = 0; i < m->lower_corner_count; i++)
        lower[i] = gp_arr_i32(m->lower_corner, i);
    for (uint32_t i = 0; i < m->upper_corner_count; i++)
        upper[i] = gp_arr_i32(m->upper_corner, i);

    CUtensorMap map;
    memset(&map, 0, sizeof map);
    void *addr = (void *)(uintptr_t)m->global_address;
    CUtensorMapDataType dt = (CUtensorMapDataType)m->data_type;
    CUtensorMapInterleave il = (CUtensorMapInterleave)m->interleave;
    CUtensorMapSwizzle sw = (CUtensorMapSwizzle)m->swizzle;
    CUtensorMapL2promotion l2 = (CUtensorMapL2promotion)m->l2_promotion;
    CUtensorMapFloatOOBfill oob = (CUtensorMapFloatOOBfill)m->oob_fill;
    switch (m->kind) {
    case TM_TILED:
        r.result = DRV(w, cuTensorMapEncodeTiled, &map, dt, m->rank, addr, dims, strides, box,
                       estrides, il, sw, l2, oob);
        break;
    case TM_IM2COL:
        r.result =
            DRV(w, cuTensorMapEncodeIm2col, &map, dt, m->rank, addr, dims, strides, lower, upper,
                m->channels_per_pixel, m->pixels_per_column, estrides, il, sw, l2, oob);
        break;
    case TM_IM2COL_WIDE:
        r.result = DRV(w, cuTensorMapEncodeIm2colWide, &map, dt, m->rank, addr, dims, strides,
                       lower[0], upper[0], m->channels_per_pixel, m->pixels_per_column, estrides,
                       il, (CUtensorMapIm2ColWideMode)m->wide_mode, sw, l2, oob);
        break;
    default:
        r.result = CUDA_ERROR_INVALID_VALUE;
    }
    if (r.result == CUDA_SUCCESS)
        map_out(r.map, &map);
    WK_REPLY(w, req, gp_tensor_map_encode_reply, &r);
}

WK_HANDLER(tensor_map_replace_address)
{
    gp_tensor_map_replace_address_reply r = {0};
    CUtensorMap map;
    memcpy(map.opaque, m->map, sizeof map.opaque);
    r.result = DRV(w, cuTensorMapReplaceAddress, &map, (void *)(uintptr_t)m->global_address);
    if (r.result == CUDA_SUCCESS)
        map_out(r.map, &map);
    WK_REPLY(w, req, gp_tensor_map_replace_address_reply, &r);
}
