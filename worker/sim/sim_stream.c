/*
 * sim_stream.c: streams and events.
 *
 * The simulated device does all work inside the call that submits it, so a stream never has
 * anything outstanding: synchronising and querying succeed at once (or return the context's
 * sticky error). Events take a host CLOCK_MONOTONIC timestamp when recorded, which is exactly
 * when the work before them finished; elapsed times are therefore real host durations.
 */
#include <stdlib.h>

#include "sim_api.h"
#include "sim_internal.h"

enum { EVENT_RECORD_EXTERNAL = 0x1, EVENT_WAIT_EXTERNAL = 0x1 };

struct sim_stream {
    uint64_t handle, ctx;
    unsigned flags;
    int priority;
};

struct sim_event {
    uint64_t handle, ctx;
    unsigned flags;
    bool recorded;
    uint64_t t_ns;
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
        free(s);
    }
}

static void drop_event(uint64_t h, void *obj, void *arg)
{
    struct sim_event *e = obj;
    if (e->ctx == *(uint64_t *)arg) {
        sim_handle_del(h);
        free(e);
    }
}

void sim_stream_release_ctx(uint64_t ctx)
{
    sim_handle_foreach(SIM_K_STREAM, drop_stream, &ctx);
    sim_handle_foreach(SIM_K_EVENT, drop_event, &ctx);
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
    free(s);
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuStreamSynchronize(CUstream hStream)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    return sim_leave(sim_stream_check(hStream));
}

CUresult cuStreamQuery(CUstream hStream)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    return sim_leave(sim_stream_check(hStream)); /* never CUDA_ERROR_NOT_READY: all work is done */
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
    return sim_leave(CUDA_SUCCESS); /* the event's work is already complete */
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
    /* An interprocess event must also disable timing (driver rule). The sim has no IPC, so it
     * refuses them altogether, as its IPC_EVENT_SUPPORTED attribute (0) announces. */
    if (Flags & CU_EVENT_INTERPROCESS)
        return sim_leave((Flags & CU_EVENT_DISABLE_TIMING) ? CUDA_ERROR_NOT_SUPPORTED
                                                           : CUDA_ERROR_INVALID_VALUE);
    struct sim_event *e = calloc(1, sizeof(*e));
    if (!e)
        return sim_leave(CUDA_ERROR_OUT_OF_MEMORY);
    e->flags = Flags;
    e->ctx = c->handle;
    e->handle = sim_handle_new(SIM_K_EVENT, e);
    if (e->handle == 0) {
        free(e);
        return sim_leave(CUDA_ERROR_OUT_OF_MEMORY);
    }
    *phEvent = (CUevent)(uintptr_t)e->handle;
    return sim_leave(CUDA_SUCCESS);
}

static struct sim_event *event_get(CUevent h)
{
    return sim_handle_get((uint64_t)(uintptr_t)h, SIM_K_EVENT);
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
    e->recorded = true;
    e->t_ns = sim_now_ns();
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuEventRecord(CUevent hEvent, CUstream hStream) { return record(hEvent, hStream, 0); }

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
    return sim_leave(event_get(hEvent) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE);
}

CUresult cuEventQuery(CUevent hEvent) { return event_done(hEvent); }
CUresult cuEventSynchronize(CUevent hEvent) { return event_done(hEvent); }

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
