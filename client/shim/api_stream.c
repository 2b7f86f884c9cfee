/*
 * api_stream.c: streams. The handle is chosen here and stream_create is posted without a reply
 * (docs/architecture.md); the queries (priority, flags, context, capture status, id) are local;
 * synchronize and query wait for the server. The capture status comes from api_graph.c, which
 * knows every capture this process began; synchronising or querying a capturing stream
 * invalidates its capture, as with the driver (the worker's driver sees the call too). The _ptsz
 * variants treat a NULL stream as the per-thread default stream.
 */
#include <stdatomic.h>
#include <stdlib.h>

#include "gp_graph.h"
#include "shim.h"
#include "shim_core.h"

/* NOT_READY is an answer, not an error: it must not consume the pending error. */
static CUresult query_result(CUresult r)
{
    return r == CUDA_ERROR_NOT_READY ? r : gp_sync_result(r);
}

static CUresult stream_create(CUstream *ph, unsigned int flags, int priority)
{
    if (!ph)
        return CUDA_ERROR_INVALID_VALUE;
    if (flags & ~(unsigned)CU_STREAM_NON_BLOCKING)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_ctx_enter();
    if (r != CUDA_SUCCESS)
        return r;
    gp_ctx_obj *c = gp_ctx_current_obj();
    const gp_device_snapshot *d = gp_device(c ? c->device : 0);
    /* The driver clamps the priority into [greatest, least] (greatest is the smaller number). */
    if (d) {
        int lo = d->stream_priority_greatest, hi = d->stream_priority_least;
        if (lo > hi) {
            int t = lo;
            lo = hi;
            hi = t;
        }
        if (priority < lo)
            priority = lo;
        if (priority > hi)
            priority = hi;
    }
    gp_stream_obj *st = calloc(1, sizeof *st);
    if (!st)
        return CUDA_ERROR_OUT_OF_MEMORY;
    st->ctx = gp_ctx_current();
    st->flags = flags;
    st->priority = priority;
    st->id = gp_handle_new(GP_H_STREAM, st);
    if (!st->id) {
        free(st);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    gp_stream_create m = {.stream = st->id, .flags = flags, .priority = priority};
    GP_FRAME(buf, len, gp_stream_create, &m);
    if (!buf) {
        free(gp_handle_remove(st->id, GP_H_STREAM));
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    r = gp_post(buf, len, NULL, 0);
    GP_FRAME_FREE(buf);
    if (r != CUDA_SUCCESS) {
        free(gp_handle_remove(st->id, GP_H_STREAM));
        return r;
    }
    *ph = (CUstream)(uintptr_t)st->id;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags)
{
    return stream_create(phStream, Flags, 0);
}

GP_EXPORT CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority)
{
    return stream_create(phStream, flags, priority);
}

GP_EXPORT CUresult cuStreamDestroy_v2(CUstream hStream)
{
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    uint64_t h = (uint64_t)(uintptr_t)hStream;
    gp_stream_obj *st = gp_handle_remove(h, GP_H_STREAM);
    if (!st)
        return CUDA_ERROR_INVALID_HANDLE;
    gp_conn_use_ctx(st->ctx);
    free(st);
    gp_capture_forget(h);
    gp_stream_destroy m = {.stream = h};
    GP_FRAME(buf, len, gp_stream_destroy, &m);
    if (!buf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    r = gp_post(buf, len, NULL, 0);
    GP_FRAME_FREE(buf);
    return r;
}

GP_EXPORT CUresult cuStreamDestroy(CUstream hStream)
{
    return cuStreamDestroy_v2(hStream);
}

static CUresult stream_wait_op(CUstream s, int query)
{
    uint64_t wire;
    CUresult r = gp_stream_enter(s, &wire);
    if (r != CUDA_SUCCESS)
        return r;
    /* Illegal during a capture: the capture is invalidated here and by the worker's driver,
     * which also answers CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED. */
    int capturing = gp_capture_sync_call(wire);
    gp_reply rep;
    if (query) {
        gp_stream_query m = {.stream = wire};
        GP_FRAME(buf, len, gp_stream_query, &m);
        if (!buf)
            return CUDA_ERROR_OUT_OF_MEMORY;
        r = gp_request(buf, len, NULL, 0, NULL, 0, &rep);
        GP_FRAME_FREE(buf);
    } else {
        gp_stream_synchronize m = {.stream = wire};
        GP_FRAME(buf, len, gp_stream_synchronize, &m);
        if (!buf)
            return CUDA_ERROR_OUT_OF_MEMORY;
        r = gp_request(buf, len, NULL, 0, NULL, 0, &rep);
        GP_FRAME_FREE(buf);
    }
    gp_reply_free(&rep);
    if (capturing)
        return r == CUDA_SUCCESS || r == CUDA_ERROR_NOT_READY
                   ? CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
                   : gp_cu_result(r);
    return query_result(r);
}

GP_EXPORT CUresult cuStreamSynchronize(CUstream hStream)
{
    return stream_wait_op(hStream, 0);
}
GP_EXPORT CUresult cuStreamSynchronize_ptsz(CUstream hStream)
{
    return stream_wait_op(gp_ptsz(hStream), 0);
}
GP_EXPORT CUresult cuStreamQuery(CUstream hStream)
{
    return stream_wait_op(hStream, 1);
}
GP_EXPORT CUresult cuStreamQuery_ptsz(CUstream hStream)
{
    return stream_wait_op(gp_ptsz(hStream), 1);
}

static CUresult stream_wait_event(CUstream s, CUevent ev, unsigned int flags)
{
    if (flags & ~(unsigned)CU_EVENT_WAIT_EXTERNAL)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t wire;
    CUresult r = gp_stream_enter(s, &wire);
    if (r != CUDA_SUCCESS)
        return r;
    uint64_t e = (uint64_t)(uintptr_t)ev;
    const gp_event_obj *eo = gp_handle_get(e, GP_H_EVENT);
    if (!eo)
        return CUDA_ERROR_INVALID_HANDLE;
    if (gp_capture_status(wire) == CU_STREAM_CAPTURE_STATUS_INVALIDATED)
        return GP_ERR_CAPTURE_INVALIDATED;
    if (gp_conn_parts() > 1) {
        /* A spread lease: an event of another part cannot be waited for on this part's worker.
         * Wait for it here, on the host (its part says when it has happened), then return: the
         * stream's later work is sent after it, so the order holds; the call blocks the host. */
        const gp_ctx_obj *ec = gp_ctx_obj_get(eo->ctx);
        if (ec && gp_conn_part_of_device(ec->device) != gp_conn_next_part()) {
            if (gp_capture_sync_call(wire)) { /* the dependency cannot be in the graph */
                static atomic_int said;
                if (!atomic_exchange(&said, 1))
                    gp_log_error("cuStreamWaitEvent of an event on another server of the lease, "
                                 "on a capturing stream, is not supported "
                                 "(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED; the capture is "
                                 "invalidated): record the event on the stream's own server");
                return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
            }
            return gp_event_wait_host(e, eo->ctx);
        }
    }
    gp_stream_wait_event m = {.stream = wire, .event = e, .flags = flags};
    GP_FRAME(buf, len, gp_stream_wait_event, &m);
    if (!buf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    r = gp_post(buf, len, NULL, 0);
    GP_FRAME_FREE(buf);
    return r;
}

GP_EXPORT CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags)
{
    return stream_wait_event(hStream, hEvent, Flags);
}
GP_EXPORT CUresult cuStreamWaitEvent_ptsz(CUstream hStream, CUevent hEvent, unsigned int Flags)
{
    return stream_wait_event(gp_ptsz(hStream), hEvent, Flags);
}

/* The local facts of a stream; a default stream (0, legacy, per-thread) needs a current
 * context and has priority 0, flags 0. */
typedef struct stream_info {
    uint64_t h, ctx;
    unsigned flags;
    int priority;
} stream_info;

static CUresult stream_info_of(CUstream s, stream_info *out)
{
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    uint64_t h = (uint64_t)(uintptr_t)s;
    out->h = h;
    if (h <= 2) {
        out->ctx = gp_ctx_current();
        if (!out->ctx)
            return CUDA_ERROR_INVALID_CONTEXT;
        out->flags = 0;
        out->priority = 0;
        return CUDA_SUCCESS;
    }
    gp_stream_obj *st = gp_handle_get(h, GP_H_STREAM);
    if (!st)
        return CUDA_ERROR_INVALID_HANDLE;
    out->ctx = st->ctx;
    out->flags = st->flags;
    out->priority = st->priority;
    return CUDA_SUCCESS;
}

static CUresult stream_get_priority(CUstream s, int *priority)
{
    if (!priority)
        return CUDA_ERROR_INVALID_VALUE;
    stream_info si;
    CUresult r = stream_info_of(s, &si);
    if (r == CUDA_SUCCESS)
        *priority = si.priority;
    return r;
}
GP_EXPORT CUresult cuStreamGetPriority(CUstream hStream, int *priority)
{
    return stream_get_priority(hStream, priority);
}
GP_EXPORT CUresult cuStreamGetPriority_ptsz(CUstream hStream, int *priority)
{
    return stream_get_priority(gp_ptsz(hStream), priority);
}

static CUresult stream_get_flags(CUstream s, unsigned int *flags)
{
    if (!flags)
        return CUDA_ERROR_INVALID_VALUE;
    stream_info si;
    CUresult r = stream_info_of(s, &si);
    if (r == CUDA_SUCCESS)
        *flags = si.flags;
    return r;
}
GP_EXPORT CUresult cuStreamGetFlags(CUstream hStream, unsigned int *flags)
{
    return stream_get_flags(hStream, flags);
}
GP_EXPORT CUresult cuStreamGetFlags_ptsz(CUstream hStream, unsigned int *flags)
{
    return stream_get_flags(gp_ptsz(hStream), flags);
}

static CUresult stream_get_ctx(CUstream s, CUcontext *pctx, CUgreenCtx *pgreen)
{
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    stream_info si;
    CUresult r = stream_info_of(s, &si);
    if (r != CUDA_SUCCESS)
        return r;
    *pctx = (CUcontext)(uintptr_t)si.ctx;
    if (pgreen)
        *pgreen = NULL;
    return CUDA_SUCCESS;
}
GP_EXPORT CUresult cuStreamGetCtx(CUstream hStream, CUcontext *pctx)
{
    return stream_get_ctx(hStream, pctx, NULL);
}
GP_EXPORT CUresult cuStreamGetCtx_ptsz(CUstream hStream, CUcontext *pctx)
{
    return stream_get_ctx(gp_ptsz(hStream), pctx, NULL);
}
GP_EXPORT CUresult cuStreamGetCtx_v2(CUstream hStream, CUcontext *pCtx, CUgreenCtx *pGreenCtx)
{
    return stream_get_ctx(hStream, pCtx, pGreenCtx);
}
GP_EXPORT CUresult cuStreamGetCtx_v2_ptsz(CUstream hStream, CUcontext *pCtx, CUgreenCtx *pGreenCtx)
{
    return stream_get_ctx(gp_ptsz(hStream), pCtx, pGreenCtx);
}

static CUresult stream_get_device(CUstream s, CUdevice *device)
{
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    stream_info si;
    CUresult r = stream_info_of(s, &si);
    if (r != CUDA_SUCCESS)
        return r;
    gp_ctx_obj *c = gp_ctx_obj_get(si.ctx);
    if (!c)
        return CUDA_ERROR_CONTEXT_IS_DESTROYED;
    *device = c->device;
    return CUDA_SUCCESS;
}
GP_EXPORT CUresult cuStreamGetDevice(CUstream hStream, CUdevice *device)
{
    return stream_get_device(hStream, device);
}
GP_EXPORT CUresult cuStreamGetDevice_ptsz(CUstream hStream, CUdevice *device)
{
    return stream_get_device(gp_ptsz(hStream), device);
}

static CUresult stream_is_capturing(CUstream s, CUstreamCaptureStatus *status)
{
    if (!status)
        return CUDA_ERROR_INVALID_VALUE;
    stream_info si;
    CUresult r = stream_info_of(s, &si);
    if (r == CUDA_SUCCESS)
        *status = gp_capture_status(si.h);
    return r;
}
GP_EXPORT CUresult cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus *captureStatus)
{
    return stream_is_capturing(hStream, captureStatus);
}
GP_EXPORT CUresult cuStreamIsCapturing_ptsz(CUstream hStream, CUstreamCaptureStatus *captureStatus)
{
    return stream_is_capturing(gp_ptsz(hStream), captureStatus);
}

/* A host function runs on this machine, after the work queued before it on the stream: the
 * shim waits for the stream, then calls it on the caller's thread, so the launch returns once it
 * ran rather than at once (JAX/XLA launch these). Work queued later on the stream is sent after
 * it returns, so it waits for the function as with the driver. A capture cannot hold one: its
 * graph replays on the server, where this process's functions are not. */
typedef void (*gp_host_fn)(void *user_data); /* the driver's CUhostFn */
static CUresult launch_host_func(CUstream s, gp_host_fn fn, void *data)
{
    if (!fn)
        return CUDA_ERROR_INVALID_VALUE;
    CUstreamCaptureStatus status;
    CUresult r = stream_is_capturing(s, &status);
    if (r != CUDA_SUCCESS)
        return r;
    if (status != CU_STREAM_CAPTURE_STATUS_NONE) {
        gp_log_error("cuLaunchHostFunc on a capturing stream is not supported: a graph replays on "
                     "the GPU server, where this process's host functions do not exist");
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    r = stream_wait_op(s, 0);
    if (r != CUDA_SUCCESS)
        return r;
    fn(data);
    return CUDA_SUCCESS;
}
GP_EXPORT CUresult cuLaunchHostFunc(CUstream hStream, gp_host_fn fn, void *userData)
{
    return launch_host_func(hStream, fn, userData);
}
GP_EXPORT CUresult cuLaunchHostFunc_ptsz(CUstream hStream, gp_host_fn fn, void *userData)
{
    return launch_host_func(gp_ptsz(hStream), fn, userData);
}

/* Ids: the handle's counter for created streams; 1 and 2 for the legacy and per-thread default
 * streams (the NULL stream is the legacy one). */
static CUresult stream_get_id(CUstream s, unsigned long long *id)
{
    if (!id)
        return CUDA_ERROR_INVALID_VALUE;
    stream_info si;
    CUresult r = stream_info_of(s, &si);
    if (r != CUDA_SUCCESS)
        return r;
    *id = si.h <= 2 ? (si.h == 2 ? 2 : 1) : (si.h & ((1ull << 40) - 1));
    return CUDA_SUCCESS;
}
GP_EXPORT CUresult cuStreamGetId(CUstream hStream, unsigned long long *streamId)
{
    return stream_get_id(hStream, streamId);
}
GP_EXPORT CUresult cuStreamGetId_ptsz(CUstream hStream, unsigned long long *streamId)
{
    return stream_get_id(gp_ptsz(hStream), streamId);
}

/* Wait for the work queued on `wire` (and so for the detached replies before it: replies come in
 * order). */
CUresult gp_stream_wait_wire(uint64_t wire)
{
    gp_stream_synchronize m = {.stream = wire};
    GP_FRAME(buf, len, gp_stream_synchronize, &m);
    if (!buf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    gp_reply rep;
    CUresult r = gp_request(buf, len, NULL, 0, NULL, 0, &rep);
    GP_FRAME_FREE(buf);
    gp_reply_free(&rep);
    return gp_sync_result(r);
}
