/*
 * api_event.c: events. Creating, recording and destroying cost no round trip (the handle is
 * chosen here); query, synchronize and elapsed time wait for the server. An event call runs in
 * the event's own context on the worker, whatever context the calling thread has.
 * Recording an interprocess event waits for the worker (event_record): another process may wait
 * for it as soon as this one says so (api_ipc.c).
 */
#include <stdbool.h>
#include <stdlib.h>

#include "gp_graph.h"
#include "shim.h"
#include "shim_core.h"

gp_event_obj *gp_event_new(unsigned flags)
{
    gp_event_obj *ev = calloc(1, sizeof *ev);
    if (!ev)
        return NULL;
    ev->ctx = gp_ctx_current();
    ev->flags = flags;
    ev->id = gp_handle_new(GP_H_EVENT, ev);
    if (!ev->id) {
        free(ev);
        return NULL;
    }
    return ev;
}

GP_EXPORT CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags)
{
    if (!phEvent)
        return CUDA_ERROR_INVALID_VALUE;
    unsigned all = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
    if (Flags & ~all)
        return CUDA_ERROR_INVALID_VALUE;
    /* An interprocess event must not record timing. */
    if ((Flags & CU_EVENT_INTERPROCESS) && !(Flags & CU_EVENT_DISABLE_TIMING))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_ctx_enter();
    if (r != CUDA_SUCCESS)
        return r;
    gp_event_obj *ev = gp_event_new(Flags);
    if (!ev)
        return CUDA_ERROR_OUT_OF_MEMORY;
    gp_event_create m = {.event = ev->id, .flags = Flags};
    GP_FRAME(buf, len, gp_event_create, &m);
    if (!buf) {
        free(gp_handle_remove(ev->id, GP_H_EVENT));
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    r = gp_post(buf, len, NULL, 0);
    GP_FRAME_FREE(buf);
    if (r != CUDA_SUCCESS) {
        free(gp_handle_remove(ev->id, GP_H_EVENT));
        return r;
    }
    *phEvent = (CUevent)(uintptr_t)ev->id;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuEventDestroy_v2(CUevent hEvent)
{
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    uint64_t h = (uint64_t)(uintptr_t)hEvent;
    gp_event_obj *ev = gp_handle_remove(h, GP_H_EVENT);
    if (!ev)
        return CUDA_ERROR_INVALID_HANDLE;
    gp_conn_use_ctx(ev->ctx);
    free(ev);
    gp_event_destroy m = {.event = h};
    GP_FRAME(buf, len, gp_event_destroy, &m);
    if (!buf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    r = gp_post(buf, len, NULL, 0);
    GP_FRAME_FREE(buf);
    return r;
}

GP_EXPORT CUresult cuEventDestroy(CUevent hEvent)
{
    return cuEventDestroy_v2(hEvent);
}

static CUresult event_record(CUevent e, CUstream s, unsigned int flags)
{
    if (flags & ~(unsigned)CU_EVENT_RECORD_EXTERNAL)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t wire;
    CUresult r = gp_stream_enter(s, &wire);
    if (r != CUDA_SUCCESS)
        return r;
    uint64_t h = (uint64_t)(uintptr_t)e;
    const gp_event_obj *ev = gp_handle_get(h, GP_H_EVENT);
    if (!ev)
        return CUDA_ERROR_INVALID_HANDLE;
    bool shared = (ev->flags & CU_EVENT_INTERPROCESS) != 0;
    /* Work on a stream whose capture was invalidated fails at once, as with the driver. */
    if (gp_capture_status(wire) == CU_STREAM_CAPTURE_STATUS_INVALIDATED)
        return GP_ERR_CAPTURE_INVALIDATED;
    gp_event_record m = {.event = h, .stream = wire, .flags = flags};
    GP_FRAME(buf, len, gp_event_record, &m);
    if (!buf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    r = gp_post(buf, len, NULL, 0);
    GP_FRAME_FREE(buf);
    if (r == CUDA_SUCCESS && shared)
        gp_capture_note_ipc_event(wire); /* a graph's record node: its launch waits too */
    /* The driver's record is in the event when the call returns, and a program may tell another
     * process to wait for it at once: the worker must have recorded it before we return. */
    if (r == CUDA_SUCCESS && shared)
        r = gp_round_trip();
    return r;
}

GP_EXPORT CUresult cuEventRecord(CUevent hEvent, CUstream hStream)
{
    return event_record(hEvent, hStream, 0);
}
GP_EXPORT CUresult cuEventRecord_ptsz(CUevent hEvent, CUstream hStream)
{
    return event_record(hEvent, gp_ptsz(hStream), 0);
}
GP_EXPORT CUresult cuEventRecordWithFlags(CUevent hEvent, CUstream hStream, unsigned int flags)
{
    return event_record(hEvent, hStream, flags);
}
GP_EXPORT CUresult cuEventRecordWithFlags_ptsz(CUevent hEvent, CUstream hStream, unsigned int flags)
{
    return event_record(hEvent, gp_ptsz(hStream), flags);
}

/* A live event: makes the worker use its context. */
static CUresult event_enter(CUevent e, uint64_t *h)
{
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    *h = (uint64_t)(uintptr_t)e;
    gp_event_obj *ev = gp_handle_get(*h, GP_H_EVENT);
    if (!ev)
        return CUDA_ERROR_INVALID_HANDLE;
    gp_conn_use_ctx(ev->ctx);
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuEventQuery(CUevent hEvent)
{
    uint64_t h;
    CUresult r = event_enter(hEvent, &h);
    if (r != CUDA_SUCCESS)
        return r;
    gp_event_query m = {.event = h};
    GP_FRAME(buf, len, gp_event_query, &m);
    if (!buf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    gp_reply rep;
    r = gp_request(buf, len, NULL, 0, NULL, 0, &rep);
    GP_FRAME_FREE(buf);
    gp_reply_free(&rep);
    return r == CUDA_ERROR_NOT_READY ? r : gp_sync_result(r);
}

/* event_synchronize of event h on the wire, in the worker's context as the caller set it. */
static CUresult event_synchronize_wire(uint64_t h)
{
    gp_event_synchronize m = {.event = h};
    GP_FRAME(buf, len, gp_event_synchronize, &m);
    if (!buf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    gp_reply rep;
    CUresult r = gp_request(buf, len, NULL, 0, NULL, 0, &rep);
    GP_FRAME_FREE(buf);
    gp_reply_free(&rep);
    return gp_sync_result(r);
}

GP_EXPORT CUresult cuEventSynchronize(CUevent hEvent)
{
    uint64_t h;
    CUresult r = event_enter(hEvent, &h);
    if (r != CUDA_SUCCESS)
        return r;
    return event_synchronize_wire(h);
}

/* Waits on the host until event e (of context ctx, on another part of a spread lease) has
 * happened: an event_synchronize on the event's part, in its context; the thread's own context
 * comes back after. Not the exported cuEventSynchronize: this is no API call of the program's
 * (not counted, not interposable). api_stream.c's cuStreamWaitEvent across parts. */
CUresult gp_event_wait_host(uint64_t e, uint64_t ctx)
{
    uint64_t own = gp_conn_wire_ctx();
    gp_conn_use_ctx(ctx);
    CUresult r = event_synchronize_wire(e);
    gp_conn_use_ctx(own);
    return r;
}

GP_EXPORT CUresult cuEventElapsedTime_v2(float *pMilliseconds, CUevent hStart, CUevent hEnd)
{
    if (!pMilliseconds)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t hs, he;
    CUresult r = event_enter(hStart, &hs);
    if (r == CUDA_SUCCESS)
        r = event_enter(hEnd, &he);
    if (r != CUDA_SUCCESS)
        return r;
    gp_event_elapsed_time m = {.start = hs, .end = he};
    GP_FRAME(buf, len, gp_event_elapsed_time, &m);
    if (!buf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    gp_reply rep;
    r = gp_request(buf, len, NULL, 0, NULL, 0, &rep);
    GP_FRAME_FREE(buf);
    if (r != CUDA_SUCCESS)
        return gp_cu_result(r);
    gp_event_elapsed_time_reply a;
    int ok = gp_event_elapsed_time_reply_decode(rep.body, rep.len, &a) == 0;
    gp_reply_free(&rep);
    if (!ok)
        return CUDA_ERROR_UNKNOWN;
    *pMilliseconds = a.ms;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd)
{
    return cuEventElapsedTime_v2(pMilliseconds, hStart, hEnd);
}
