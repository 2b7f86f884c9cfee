/*
 * h_occupancy.c: the occupancy queries the client's calculator (client/shim/api_occupancy.c)
 * does not answer from its cache. A CUkernel id is accepted as a CUfunction, as the driver does.
 */
#include <limits.h>
#include <stdlib.h>

#include "worker.h"

WK_HANDLER(occupancy)
{
    gp_occupancy_reply r = {0};
    struct wk_obj *f = wk_func_get(w, m->func);
    if (!f) {
        r.result = CUDA_ERROR_INVALID_HANDLE;
        WK_REPLY(w, req, gp_occupancy_reply, &r);
        return;
    }
    CUfunction fn = f->h;
    CUlaunchAttribute *attrs = NULL;
    int n = 0;
    size_t smem = 0;
    switch (m->kind) {
    case 0:
        r.result = DRV(w, cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags, &n, fn,
                       m->block_size, (size_t)m->dyn_smem, m->flags);
        r.value = n;
        break;
    case 1: /* the block count travels in dyn_smem */
        if (m->dyn_smem > INT_MAX) {
            r.result = CUDA_ERROR_INVALID_VALUE;
            break;
        }
        r.result = DRV(w, cuOccupancyAvailableDynamicSMemPerBlock, &smem, fn, (int)m->dyn_smem,
                       m->block_size);
        r.value = (int64_t)smem;
        break;
    case 2:
    case 3: {
        CUlaunchConfig cfg = {0};
        cfg.gridDimX = m->grid_x;
        cfg.gridDimY = m->grid_y;
        cfg.gridDimZ = m->grid_z;
        cfg.blockDimX = m->block_x;
        cfg.blockDimY = m->block_y;
        cfg.blockDimZ = m->block_z;
        cfg.sharedMemBytes = m->dyn_smem > UINT_MAX ? UINT_MAX : (unsigned)m->dyn_smem;
        r.result = wk_launch_attrs_copy(m->attrs, m->attrs_len, &attrs, &cfg.numAttrs);
        cfg.attrs = attrs;
        if (r.result == CUDA_SUCCESS && m->kind == 2)
            r.result = DRV(w, cuOccupancyMaxPotentialClusterSize, &n, fn, &cfg);
        else if (r.result == CUDA_SUCCESS)
            r.result = DRV(w, cuOccupancyMaxActiveClusters, &n, fn, &cfg);
        r.value = n;
        break;
    }
    default:
        r.result = CUDA_ERROR_INVALID_VALUE;
    }
    if (r.result != CUDA_SUCCESS)
        r.value = 0;
    free(attrs);
    WK_REPLY(w, req, gp_occupancy_reply, &r);
}
