/*
 * sim_stream.c: streams and events.
 *
 * The simulated device does all work inside the call that submits it, so a stream never has
 * anything outstanding: synchronising and querying succeed at once (or return the context's
 * sticky error). Events take a host CLOCK_MONOTONIC timestamp when recorded, which is exactly
 * when the work before them finished; elapsed times are therefore real host durations.
 *
 * Stream capture: between cuStreamBeginCapture_v2 and cuStreamEndCapture a stream records its
 * work into a graph (sim_graph.c) instead of running it. Synchronizing or querying a capturing
 * stream is illegal: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, and the capture is invalidated; work
 * submitted to an invalidated capture fails with CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, and so
 * does cuStreamEndCapture, which ends it. The legacy default stream cannot capture. Not
 * simulated: other streams joining a capture through events (cross-stream capture), and the
 * restrictions of the global / thread-local modes on other calls.
 */
#include <stdlib.h>

#include "sim_api.h"
#include "sim_internal.h"

enum {
    EVENT_RECORD_EXTERNAL = 0x1,
    EVENT_WAIT_EXTERNAL = 0x1
};

struct sim_stream {
    uint64_t handle, ctx;
    unsigned flags;
    int priority;
    struct sim_graph *cap; /* the graph being captured, or NULL */
    bool cap_invalid;      /* the capture was invalidated */
};

struct sim_event {
    uint64_t handle, ctx;
    unsigned flags;
    bool recorded;
    bool captured; /* last recorded in a capture (not as an external record node) */
    uint64_t t_ns;
    struct sim_ipc_event *ipc; /* shared with another process (sim_ipc.c), or NULL */
};

CUresult sim_stream_check(CUstream s)
{
    if (s == NULL || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD)
        return CUDA_SUCCESS;
    return sim_handle_get((uint64_t)(uintptr_t)s, SIM_K_STREAM) ? CUDA_SUCCESS
                                                                : CUDA_ERROR_INVALID_HANDLE;
}

static void drop_stream(uint64_t h, void *obj, void *arg)
{
    struct sim_stream *s = obj;
    if (s->ctx == *(uint64_t *)arg) {
        sim_handle_del(h);
        sim_graph_free(s->cap);
        free(s);
    }
}

static void drop_event(uint64_t h, void *obj, void *arg)
{
    struct sim_event *e = obj;
    if (e->ctx == *(uint64_t *)arg) {
        sim_handle_del(h);
        if (e->ipc)
            sim_ipc_event_close(e->ipc);
        free(e);
    }
}

void sim_stream_release_ctx(uint64_t ctx)
{
    sim_handle_foreach(SIM_K_STREAM, drop_stream, &ctx);
    sim_handle_foreach(SIM_K_EVENT, drop_event, &ctx);
    sim_graph_release_ctx(ctx);
}

CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!phStream || (flags & ~(unsigned)CU_STREAM_NON_BLOCKING) != 0)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    struct sim_stream *s = calloc(1, sizeof(*s));
    if (!s)
        return sim_leave(CUDA_ERROR_OUT_OF_MEMORY);
    /* Out-of-range priorities are clamped to [greatest, least] = [-5, 0], as documented. */
    s->priority = priority < -5 ? -5 : priority > 0 ? 0 : priority;
    s->flags = flags;
    s->ctx = c->handle;
    s->handle = sim_handle_new(SIM_K_STREAM, s);
    if (s->handle == 0) {
        free(s);
        return sim_leave(CUDA_ERROR_OUT_OF_MEMORY);
    }
    *phStream = (CUstream)(uintptr_t)s->handle;
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuStreamDestroy_v2(CUstream hStream)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    struct sim_stream *s = sim_handle_get((uint64_t)(uintptr_t)hStream, SIM_K_STREAM);
    if (!s) /* includes the NULL / legacy / per-thread streams, which cannot be destroyed */
        return sim_leave(CUDA_ERROR_INVALID_HANDLE);
    sim_handle_del(s->handle);
    sim_graph_free(s->cap);
    free(s);
    return sim_leave(CUDA_SUCCESS);
}

static struct sim_stream *stream_get(CUstream s)
{
    return sim_handle_get((uint64_t)(uintptr_t)s, SIM_K_STREAM);
}

CUresult sim_capture_target(CUstream s, struct sim_graph **g)
{
    *g = NULL;
    struct sim_stream *st = stream_get(s);
    if (!st || !st->cap)
        return CUDA_SUCCESS;
    if (st->cap_invalid) {
        sim_detail("stream capture was invalidated by an earlier illegal call");
        return SIM_ERR_CAPTURE_INVALIDATED;
    }
    *g = st->cap;
    return CUDA_SUCCESS;
}

bool sim_capture_invalidate(CUstream s)
{
    struct sim_stream *st = stream_get(s);
    if (!st || !st->cap)
        return false;
    st->cap_invalid = true;
    return true;
}

/* Synchronize / query: illegal on a capturing stream. */
static CUresult stream_wait(CUstream hStream)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if ((rc = sim_stream_check(hStream)) != CUDA_SUCCESS)
        return sim_leave(rc);
    if (sim_capture_invalidate(hStream)) {
        sim_detail("synchronizing or querying a capturing stream (the capture is invalidated)");
        return sim_leave(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuStreamSynchronize(CUstream hStream)
{
    return stream_wait(hStream);
}

/* Never CUDA_ERROR_NOT_READY: all work is done. */
CUresult cuStreamQuery(CUstream hStream)
{
    return stream_wait(hStream);
}

CUresult cuStreamBeginCapture_v2(CUstream hStream, int mode)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (mode < 0 || mode > 2)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    if ((rc = sim_stream_check(hStream)) != CUDA_SUCCESS)
        return sim_leave(rc);
    struct sim_stream *st = stream_get(hStream);
    if (!st) {
        sim_detail("the default streams cannot be captured in the simulated device");
        return sim_leave(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    if (st->cap)
        return sim_leave(SIM_ERR_ILLEGAL_STATE);
    st->cap = sim_graph_new(c->handle);
    if (!st->cap)
        return sim_leave(CUDA_ERROR_OUT_OF_MEMORY);
    st->cap_invalid = false;
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!phGraph)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    if ((rc = sim_stream_check(hStream)) != CUDA_SUCCESS)
        return sim_leave(rc);
    struct sim_stream *st = stream_get(hStream);
    if (!st || !st->cap)
        return sim_leave(SIM_ERR_ILLEGAL_STATE);
    struct sim_graph *g = st->cap;
    bool invalid = st->cap_invalid;
    st->cap = NULL;
    st->cap_invalid = false;
    *phGraph = NULL;
    if (invalid) {
        sim_graph_free(g);
        sim_detail("the capture was invalidated by an illegal call during it");
        return sim_leave(SIM_ERR_CAPTURE_INVALIDATED);
    }
    uint64_t h = sim_graph_publish(g);
    if (h == 0) {
        sim_graph_free(g);
        return sim_leave(CUDA_ERROR_OUT_OF_MEMORY);
    }
    *phGraph = (CUgraph)(uintptr_t)h;
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuStreamIsCapturing(CUstream hStream, int *captureStatus)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!captureStatus)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    if ((rc = sim_stream_check(hStream)) != CUDA_SUCCESS)
        return sim_leave(rc);
    struct sim_stream *st = stream_get(hStream);
    *captureStatus = !st || !st->cap ? 0 : st->cap_invalid ? 2 : 1;
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if ((Flags & ~(unsigned)EVENT_WAIT_EXTERNAL) != 0)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    if ((rc = sim_stream_check(hStream)) != CUDA_SUCCESS)
        return sim_leave(rc);
    if (!sim_handle_get((uint64_t)(uintptr_t)hEvent, SIM_K_EVENT))
        return sim_leave(CUDA_ERROR_INVALID_HANDLE);
    struct sim_graph *g = NULL;
    if ((rc = sim_capture_target(hStream, &g)) != CUDA_SUCCESS)
        return sim_leave(rc);
    struct sim_event *e = sim_handle_get((uint64_t)(uintptr_t)hEvent, SIM_K_EVENT);
    if (g && (Flags & EVENT_WAIT_EXTERNAL)) {
        struct sim_op op = {.kind = SIM_OP_EVENT_WAIT, .event = e->handle};
        return sim_leave(sim_graph_add(g, &op));
    }
    if (!g && e->captured) {
        /* The driver would make this stream join the capture (cross-stream capture). */
        sim_detail("a stream waiting for an event recorded in a capture (joining the capture) "
                   "is not simulated");
        return sim_leave(CUDA_ERROR_NOT_SUPPORTED);
    }
    /* In a capture: an ordering inside the captured sequence, which is in order anyway.
     * Outside: the event's work is already complete. */
    return sim_leave(CUDA_SUCCESS);
}

static CUresult event_new(uint64_t ctx, unsigned flags, CUevent *out)
{
    struct sim_event *e = calloc(1, sizeof(*e));
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    e->flags = flags;
    e->ctx = ctx;
    e->handle = sim_handle_new(SIM_K_EVENT, e);
    if (e->handle == 0) {
        free(e);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *out = (CUevent)(uintptr_t)e->handle;
    return CUDA_SUCCESS;
}

CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    unsigned known = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
    if (!phEvent || (Flags & ~known) != 0)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    /* An interprocess event must also disable timing (driver rule); it is shared with another
     * process once cuIpcGetEventHandle exports it (sim_ipc.c). */
    if ((Flags & CU_EVENT_INTERPROCESS) && !(Flags & CU_EVENT_DISABLE_TIMING))
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    return sim_leave(event_new(c->handle, Flags, phEvent));
}

static struct sim_event *event_get(CUevent h)
{
    return sim_handle_get((uint64_t)(uintptr_t)h, SIM_K_EVENT);
}

/* The interprocess side (the shared record, the handle's bytes) is sim_ipc.c's. */
CUresult cuIpcGetEventHandle(CUipcEventHandle *pHandle, CUevent event)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    struct sim_event *e = event_get(event);
    if (!e)
        return sim_leave(CUDA_ERROR_INVALID_HANDLE);
    unsigned need = CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING;
    if (!pHandle || (e->flags & need) != need)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    return sim_leave(sim_ipc_event_export(&e->ipc, pHandle));
}

CUresult cuIpcOpenEventHandle(CUevent *phEvent, CUipcEventHandle handle)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!phEvent)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    struct sim_ipc_event *ipc = NULL;
    rc = sim_ipc_event_import(&handle, &ipc);
    if (rc != CUDA_SUCCESS)
        return sim_leave(rc);
    /* The driver: the opened event behaves like one created with CU_EVENT_DISABLE_TIMING. */
    CUevent h = NULL;
    rc = event_new(c->handle, CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS, &h);
    if (rc != CUDA_SUCCESS) {
        sim_ipc_event_close(ipc);
        return sim_leave(rc);
    }
    event_get(h)->ipc = ipc;
    *phEvent = h;
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuEventDestroy_v2(CUevent hEvent)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    struct sim_event *e = event_get(hEvent);
    if (!e)
        return sim_leave(CUDA_ERROR_INVALID_HANDLE);
    sim_handle_del(e->handle);
    if (e->ipc)
        sim_ipc_event_close(e->ipc);
    free(e);
    return sim_leave(CUDA_SUCCESS);
}

static CUresult record(CUevent hEvent, CUstream hStream, unsigned flags)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if ((flags & ~(unsigned)EVENT_RECORD_EXTERNAL) != 0)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    struct sim_event *e = event_get(hEvent);
    if (!e)
        return sim_leave(CUDA_ERROR_INVALID_HANDLE);
    if ((rc = sim_stream_check(hStream)) != CUDA_SUCCESS)
        return sim_leave(rc);
    struct sim_graph *g = NULL;
    if ((rc = sim_capture_target(hStream, &g)) != CUDA_SUCCESS)
        return sim_leave(rc);
    if (g && (flags & EVENT_RECORD_EXTERNAL)) {
        struct sim_op op = {.kind = SIM_OP_EVENT_RECORD, .event = e->handle};
        return sim_leave(sim_graph_add(g, &op));
    }
    if (g) {
        /* A plain record in a capture is no node: it marks a point of the capture for other
         * streams to wait for. Query and synchronize then refuse the event. */
        e->captured = true;
        return sim_leave(CUDA_SUCCESS);
    }
    e->captured = false;
    e->recorded = true;
    e->t_ns = sim_now_ns();
    if (e->ipc)
        sim_ipc_event_recorded(e->ipc, e->t_ns);
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuEventRecord(CUevent hEvent, CUstream hStream)
{
    return record(hEvent, hStream, 0);
}

CUresult cuEventRecordWithFlags(CUevent hEvent, CUstream hStream, unsigned int flags)
{
    return record(hEvent, hStream, flags);
}

/* Recorded work is complete at once; an event never recorded also counts as complete (driver
 * semantics: cuEventQuery / cuEventSynchronize succeed on it). */
static CUresult event_done(CUevent hEvent)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    struct sim_event *e = event_get(hEvent);
    if (!e)
        return sim_leave(CUDA_ERROR_INVALID_HANDLE);
    if (e->captured) {
        /* What the real driver answers (580.x on an H200, docs/validation.md 2026-11-27), not
         * the CUDA_ERROR_CAPTURED_EVENT its documentation suggests. */
        sim_detail("the event was last recorded in a stream capture");
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    }
    return sim_leave(e->ipc ? sim_ipc_event_done(e->ipc) : CUDA_SUCCESS);
}

CUresult cuEventQuery(CUevent hEvent)
{
    return event_done(hEvent);
}
CUresult cuEventSynchronize(CUevent hEvent)
{
    return event_done(hEvent);
}

CUresult cuEventElapsedTime_v2(float *pMilliseconds, CUevent hStart, CUevent hEnd)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!pMilliseconds)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    struct sim_event *a = event_get(hStart), *b = event_get(hEnd);
    if (!a || !b)
        return sim_leave(CUDA_ERROR_INVALID_HANDLE);
    /* The driver's documented answers, in its order: timing disabled on either -> invalid
     * handle; either never recorded -> invalid handle (what the 13.0 header documents and what
     * NVIDIA's cuda-python tests observe on Linux). Recorded events are always complete here, so
     * CUDA_ERROR_NOT_READY cannot happen. */
    if ((a->flags | b->flags) & CU_EVENT_DISABLE_TIMING)
        return sim_leave(CUDA_ERROR_INVALID_HANDLE);
    if (!a->recorded || !b->recorded)
        return sim_leave(CUDA_ERROR_INVALID_HANDLE);
    *pMilliseconds = (float)((double)((int64_t)(b->t_ns - a->t_ns)) / 1e6);
    return sim_leave(CUDA_SUCCESS);
}

void sim_event_replay_record(uint64_t event)
{
    struct sim_event *e = sim_handle_get(event, SIM_K_EVENT);
    if (!e)
        return; /* destroyed since the capture: the driver's event node would dangle too */
    e->captured = false;
    e->recorded = true;
    e->t_ns = sim_now_ns();
}
