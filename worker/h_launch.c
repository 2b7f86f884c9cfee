/*
 * h_launch.c: kernel launches (function attributes: h_func.c; occupancy queries: h_occupancy.c).
 *
 * A function id is either a CUfunction (module) or a CUkernel (library). The driver accepts a
 * CUkernel cast to CUfunction in launches and occupancy queries, so only the attribute calls,
 * which have kernel variants taking a device, need to tell them apart.
 */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "pacing.h"
#include "worker.h"

/* The raw CUlaunchAttribute array from the wire, copied to aligned memory (*out may be NULL when
 * there are none; free it). */
CUresult wk_launch_attrs_copy(const uint8_t *blob, uint32_t len, CUlaunchAttribute **out,
                              unsigned *count)
{
    *out = NULL;
    *count = 0;
    if (len % sizeof(CUlaunchAttribute) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (len == 0)
        return CUDA_SUCCESS;
    *out = malloc(len);
    if (!*out)
        return CUDA_ERROR_OUT_OF_MEMORY;
    memcpy(*out, blob, len);
    *count = len / (unsigned)sizeof(CUlaunchAttribute);
    return CUDA_SUCCESS;
}

WK_HANDLER(launch)
{
    struct wk_obj *f = wk_func_get(w, m->func);
    if (!f) {
        wk_defer_error(w, GP_OP_LAUNCH, CUDA_ERROR_INVALID_HANDLE, "launch of function 0x%llx",
                       (unsigned long long)m->func);
        return;
    }
    CUstream s;
    CUresult rc = wk_stream_get(w, m->stream, &s);
    CUlaunchAttribute *attrs = NULL;
    unsigned nattrs = 0;
    if (rc == CUDA_SUCCESS)
        rc = wk_launch_attrs_copy(m->attrs, m->attrs_len, &attrs, &nattrs);
    /* The argument bytes sit at arbitrary alignment in the input buffer; the driver reads them
     * as the kernel's parameter block, so copy them to (malloc-)aligned memory. */
    if (rc == CUDA_SUCCESS && m->params_len > w->params_cap) {
        void *b = realloc(w->params_buf, m->params_len);
        if (b) {
            w->params_buf = b;
            w->params_cap = m->params_len;
        } else {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    if (rc == CUDA_SUCCESS) {
        size_t psize = m->params_len;
        if (psize)
            memcpy(w->params_buf, m->params, psize);
        void *extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, w->params_buf, CU_LAUNCH_PARAM_BUFFER_SIZE,
                         &psize, CU_LAUNCH_PARAM_END};
        void **ex = psize ? extra : NULL;
        wk_pace_launch_begin(w->drv.lib); /* a shared GPU: a share over its part waits here */
        if (nattrs > 0) {
            CUlaunchConfig cfg = {0};
            cfg.gridDimX = m->grid_x;
            cfg.gridDimY = m->grid_y;
            cfg.gridDimZ = m->grid_z;
            cfg.blockDimX = m->block_x;
            cfg.blockDimY = m->block_y;
            cfg.blockDimZ = m->block_z;
            cfg.sharedMemBytes = m->shared_mem;
            cfg.hStream = s;
            cfg.attrs = attrs;
            cfg.numAttrs = nattrs;
            rc = WK_LONG(w, DRV_BUSY(w, cuLaunchKernelEx, &cfg, f->h, NULL, ex));
        } else {
            rc = WK_LONG(w,
                         DRV_BUSY(w, cuLaunchKernel, f->h, m->grid_x, m->grid_y, m->grid_z,
                                  m->block_x, m->block_y, m->block_z, m->shared_mem, s, NULL, ex));
        }
        /* busy_ns is the kernel's time: not the wait for its turn on a shared simulated GPU. */
        uint64_t waited = wk_pace_launch_end();
        w->stats.busy_ns -= waited < w->stats.busy_ns ? waited : w->stats.busy_ns;
    }
    free(attrs);
    w->stats.launches++;
    if (rc != CUDA_SUCCESS)
        wk_defer_error(w, GP_OP_LAUNCH, rc, "launch of kernel '%s'", f->name);
}
