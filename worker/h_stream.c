/*
 * h_stream.c: streams (events: h_event.c).
 *
 * Creation and destruction are fire-and-forget (the client names the object itself), so their
 * failures become pending errors. Queries and synchronisations are the synchronising calls that
 * report pending errors.
 */
#include <stdlib.h>

#include "worker.h"

WK_HANDLER(stream_create)
{
    CUresult rc;
    CUstream s = NULL;
    if (m->stream <= 2 || wk_idmap_get(&w->streams, m->stream)) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        rc = DRV(w, cuStreamCreateWithPriority, &s, m->flags, m->priority);
        if (rc == CUDA_SUCCESS) {
            rc = wk_obj_bind(&w->streams, m->stream, wk_obj_new(w->cur_ctx, s, NULL, 0));
            if (rc != CUDA_SUCCESS && DRV(w, cuStreamDestroy, s) != CUDA_SUCCESS)
                wk_warn("destroying an unbound stream failed");
        }
    }
    if (rc != CUDA_SUCCESS)
        wk_defer_error(w, GP_OP_STREAM_CREATE, rc, "creation of stream 0x%llx",
                       (unsigned long long)m->stream);
}

WK_HANDLER(stream_destroy)
{
    struct wk_obj *o = wk_idmap_del(&w->streams, m->stream);
    CUresult rc = o ? DRV(w, cuStreamDestroy, o->h) : CUDA_ERROR_INVALID_HANDLE;
    free(o);
    if (rc != CUDA_SUCCESS)
        wk_defer_error(w, GP_OP_STREAM_DESTROY, rc, "destruction of stream 0x%llx",
                       (unsigned long long)m->stream);
}

WK_HANDLER(stream_synchronize)
{
    gp_stream_synchronize_reply r = {0};
    CUstream s;
    r.result = wk_stream_get(w, m->stream, &s);
    if (r.result == CUDA_SUCCESS) {
        if (wk_io_flush(w) != 0) /* may take long: earlier replies must not wait behind it */
            return;
        r.result = WK_LONG(w, DRV(w, cuStreamSynchronize, s));
    }
    r.result = wk_sync_result(w, r.result);
    WK_REPLY(w, req, gp_stream_synchronize_reply, &r);
}

WK_HANDLER(stream_query)
{
    gp_stream_query_reply r = {0};
    CUstream s;
    r.result = wk_stream_get(w, m->stream, &s);
    if (r.result == CUDA_SUCCESS)
        r.result = DRV(w, cuStreamQuery, s);
    r.result = wk_sync_result(w, r.result);
    WK_REPLY(w, req, gp_stream_query_reply, &r);
}

WK_HANDLER(stream_wait_event)
{
    CUstream s;
    CUevent e = NULL;
    CUresult rc = wk_stream_get(w, m->stream, &s);
    if (rc == CUDA_SUCCESS)
        rc = wk_event_get(w, m->event, &e);
    if (rc == CUDA_SUCCESS)
        rc = DRV(w, cuStreamWaitEvent, s, e, m->flags);
    if (rc != CUDA_SUCCESS)
        wk_defer_error(w, GP_OP_STREAM_WAIT_EVENT, rc, "stream 0x%llx waiting for event 0x%llx",
                       (unsigned long long)m->stream, (unsigned long long)m->event);
}
