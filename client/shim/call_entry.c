/*
 * call_entry.c: what an API call does before its frame goes out, and with a sync call's result:
 * the connection is checked (cuInit done, not lost), the calling thread's context or the
 * stream's is resolved from the local state (state.c) and handed to the transport (conn.c),
 * which switches the worker's context with the next frame if it differs.
 */
#include <stdint.h>

#include "shim.h"
#include "shim_core.h"

CUresult gp_ctx_enter(void)
{
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    uint64_t c = gp_ctx_current();
    if (c == 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (c != GP_PRIMARY_CTX_ID && !gp_handle_get(c, GP_H_CTX))
        return CUDA_ERROR_CONTEXT_IS_DESTROYED;
    gp_conn_use_ctx(c);
    return CUDA_SUCCESS;
}

CUresult gp_stream_enter(CUstream s, uint64_t *wire)
{
    uint64_t h = (uint64_t)(uintptr_t)s;
    if (h <= 2) {
        CUresult r = gp_ctx_enter();
        if (r != CUDA_SUCCESS)
            return r;
        *wire = h;
        return CUDA_SUCCESS;
    }
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    gp_stream_obj *st = gp_handle_get(h, GP_H_STREAM);
    if (!st)
        return CUDA_ERROR_INVALID_HANDLE;
    gp_conn_use_ctx(st->ctx);
    *wire = h;
    return CUDA_SUCCESS;
}

CUresult gp_sync_result(CUresult r)
{
    if (r == CUDA_SUCCESS)
        return gp_take_pending_error();
    if (r != GP_LOST_CONNECTION_ERROR)
        gp_take_pending_error(); /* the server reported the error itself: one report is enough */
    return gp_cu_result(r);
}
