/*
 * h_event.c: events.
 *
 * As for streams (h_stream.c): creation and destruction are fire-and-forget (the client names the
 * event itself), so their failures become pending errors; queries and synchronisations are the
 * synchronising calls that report pending errors.
 */
#include <stdlib.h>

#include "worker.h"

WK_HANDLER(event_create)
{
    CUresult rc;
    CUevent e = NULL;
    if (wk_idmap_get(&w->events, m->event)) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        rc = DRV(w, cuEventCreate, &e, m->flags);
        if (rc == CUDA_SUCCESS) {
            rc = wk_obj_bind(&w->events, m->event, wk_obj_new(w->cur_ctx, e, NULL, 0));
            if (rc != CUDA_SUCCESS && DRV(w, cuEventDestroy, e) != CUDA_SUCCESS)
                wk_warn("destroying an unbound event failed");
        }
    }
    if (rc != CUDA_SUCCESS)
        wk_defer_error(w, GP_OP_EVENT_CREATE, rc, "creation of event 0x%llx",
                       (unsigned long long)m->event);
}

WK_HANDLER(event_destroy)
{
    struct wk_obj *o = wk_idmap_del(&w->events, m->event);
    CUresult rc = o ? DRV(w, cuEventDestroy, o->h) : CUDA_ERROR_INVALID_HANDLE;
    free(o);
    if (rc != CUDA_SUCCESS)
        wk_defer_error(w, GP_OP_EVENT_DESTROY, rc, "destruction of event 0x%llx",
                       (unsigned long long)m->event);
}

WK_HANDLER(event_record)
{
    CUstream s;
    CUevent e = NULL;
    CUresult rc = wk_event_get(w, m->event, &e);
    if (rc == CUDA_SUCCESS)
        rc = wk_stream_get(w, m->stream, &s);
    if (rc == CUDA_SUCCESS) {
        /* cuEventRecordWithFlags is newer; plain cuEventRecord is the same call with flags 0. */
        if (w->drv.cuEventRecordWithFlags)
            rc = w->drv.cuEventRecordWithFlags(e, s, m->flags);
        else if (m->flags == 0)
            rc = DRV(w, cuEventRecord, e, s);
        else
            rc = CUDA_ERROR_NOT_SUPPORTED;
    }
    if (rc != CUDA_SUCCESS)
        wk_defer_error(w, GP_OP_EVENT_RECORD, rc, "record of event 0x%llx on stream 0x%llx",
                       (unsigned long long)m->event, (unsigned long long)m->stream);
}

WK_HANDLER(event_query)
{
    gp_event_query_reply r = {0};
    CUevent e;
    r.result = wk_event_get(w, m->event, &e);
    if (r.result == CUDA_SUCCESS)
        r.result = DRV(w, cuEventQuery, e);
    r.result = wk_sync_result(w, r.result);
    WK_REPLY(w, req, gp_event_query_reply, &r);
}

WK_HANDLER(event_synchronize)
{
    gp_event_synchronize_reply r = {0};
    CUevent e;
    r.result = wk_event_get(w, m->event, &e);
    if (r.result == CUDA_SUCCESS) {
        if (wk_io_flush(w) != 0)
            return;
        r.result = WK_LONG(w, DRV(w, cuEventSynchronize, e));
    }
    r.result = wk_sync_result(w, r.result);
    WK_REPLY(w, req, gp_event_synchronize_reply, &r);
}

WK_HANDLER(event_elapsed_time)
{
    gp_event_elapsed_time_reply r = {0};
    CUevent a, b;
    float ms = 0.0f;
    r.result = wk_event_get(w, m->start, &a);
    if (r.result == CUDA_SUCCESS)
        r.result = wk_event_get(w, m->end, &b);
    if (r.result == CUDA_SUCCESS)
        r.result = DRV(w, cuEventElapsedTime, &ms, a, b);
    r.ms = r.result == CUDA_SUCCESS ? ms : 0.0f;
    WK_REPLY(w, req, gp_event_elapsed_time_reply, &r);
}
