/*
 * api_graph.c: stream capture and CUDA graphs (docs/architecture.md, "Stream capture and CUDA
 * graphs"; docs/protocol.md, ids 80-85).
 *
 * Capture works by forwarding: the worker begins and ends the capture on its real stream, and
 * every call the program makes on that stream in between reaches the worker in order, so the
 * driver records the worker's own copies, memsets, launches and event records. Graphs and graph
 * execs are handles chosen here. The capture status of each stream, the capture ids and the
 * thread's capture mode are kept here and answered locally: PyTorch's allocator and cuBLAS ask
 * cuStreamIsCapturing / cuStreamGetCaptureInfo around nearly every call.
 *
 * Round trips: only cuStreamEndCapture waits for the worker (the driver may refuse to end an
 * invalidated capture), and the launch of a graph that records an interprocess event (as that
 * event's cuEventRecord: a peer may wait for it at once). Begin capture, instantiate, launch,
 * upload and destroy are posted; a failure on the worker is the next synchronising call's
 * (deferred) error.
 *
 * Not remoted: copies between device memory and this process's host memory inside a capture
 * (a graph replays on the server, where that memory does not exist): refused with
 * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and one line. Graph construction and inspection calls
 * (cuGraphCreate, cuGraphAdd*Node, cuGraphGetNodes...) stay unimplemented.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "gp_graph.h"
#include "shim.h"
#include "shim_core.h"

#define MAX_CAPTURES 256 /* streams capturing at the same time */

typedef struct capture {
    uint64_t stream; /* wire id; 0: free slot */
    uint64_t id;     /* the capture's unique id (cuStreamGetCaptureInfo) */
    uint64_t graph;  /* handle the resulting graph will have */
    int mode;
    CUstreamCaptureStatus status; /* ACTIVE or INVALIDATED */
    pthread_t thread;             /* the thread that began it */
} capture;

typedef struct gp_graph_obj {
    uint64_t id, ctx;
    /* It records an interprocess event: a launch waits until the worker has launched it, as
     * cuEventRecord of such an event does, since a peer may wait for the event at once.
     * Written under cap_lock while capturing; read after end_capture took that lock. */
    int records_ipc_event;
} gp_graph_obj;

static pthread_mutex_t cap_lock = PTHREAD_MUTEX_INITIALIZER;
static capture caps[MAX_CAPTURES]; /* guarded by cap_lock */
static atomic_int cap_count;       /* live entries: 0 lets the queries skip the lock */
static atomic_uint_fast64_t next_capture_id = 1;
static __thread int tl_mode = GP_CAPTURE_MODE_GLOBAL;

/* The capture of stream `wire`, or NULL. The legacy stream (wire 0) is never captured (a
 * driver rule), and 0 also marks a free slot: it matches nothing here. Caller holds cap_lock. */
static capture *find(uint64_t wire)
{
    if (wire == 0)
        return NULL;
    for (int i = 0; i < MAX_CAPTURES; i++)
        if (caps[i].stream == wire)
            return &caps[i];
    return NULL;
}

/* A free slot, or NULL when MAX_CAPTURES streams capture. Caller holds cap_lock. */
static capture *free_slot(void)
{
    for (int i = 0; i < MAX_CAPTURES; i++)
        if (caps[i].stream == 0)
            return &caps[i];
    return NULL;
}

static void lock(void)
{
    if (pthread_mutex_lock(&cap_lock) != 0)
        abort(); /* a default mutex we own cannot fail */
}
static void unlock(void)
{
    if (pthread_mutex_unlock(&cap_lock) != 0)
        abort();
}

CUstreamCaptureStatus gp_capture_status(uint64_t wire)
{
    if (atomic_load(&cap_count) == 0)
        return CU_STREAM_CAPTURE_STATUS_NONE;
    lock();
    capture *c = find(wire);
    CUstreamCaptureStatus s = c ? c->status : CU_STREAM_CAPTURE_STATUS_NONE;
    unlock();
    return s;
}

int gp_capture_sync_call(uint64_t wire)
{
    if (atomic_load(&cap_count) == 0)
        return 0;
    lock();
    capture *c = find(wire);
    if (c)
        c->status = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
    unlock();
    return c != NULL;
}

CUresult gp_capture_host_copy(uint64_t wire, const char *call)
{
    if (!gp_capture_sync_call(wire))
        return CUDA_SUCCESS;
    static atomic_int said;
    if (!atomic_exchange(&said, 1))
        gp_log_error("%s between host and device memory on a capturing stream is not supported "
                     "(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED; the capture is invalidated): a "
                     "graph replays on the GPU server, where this process's host memory does "
                     "not exist. Copy to device memory before the capture and capture a "
                     "device-to-device copy instead",
                     call);
    return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
}

void gp_capture_note_ipc_event(uint64_t wire)
{
    /* The legacy stream is never in a capture (find() knows no wire 0; it is not "unknown"). */
    if (wire == 0 || atomic_load(&cap_count) == 0)
        return;
    lock();
    capture *c = find(wire);
    /* A stream the driver joined to a capture (it waited for an event recorded in one) is not
     * known here as capturing: every graph being captured is marked then, which costs at most a
     * round trip per launch of those graphs. */
    for (int i = 0; i < MAX_CAPTURES; i++) {
        if (caps[i].stream == 0 || (c && c != &caps[i]))
            continue;
        gp_graph_obj *g = gp_handle_get(caps[i].graph, GP_H_GRAPH);
        if (g)
            g->records_ipc_event = 1;
    }
    unlock();
}

void gp_capture_forget(uint64_t wire)
{
    if (atomic_load(&cap_count) == 0)
        return;
    lock();
    capture *c = find(wire);
    uint64_t graph = 0;
    if (c) {
        graph = c->graph;
        c->stream = 0;
        atomic_fetch_sub(&cap_count, 1);
    }
    unlock();
    if (graph)
        free(gp_handle_remove(graph, GP_H_GRAPH));
}

/* ================================================================ capture == */

static CUresult begin_capture(CUstream s, int mode)
{
    if (mode < GP_CAPTURE_MODE_GLOBAL || mode > GP_CAPTURE_MODE_RELAXED)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t wire;
    CUresult r = gp_stream_enter(s, &wire);
    if (r != CUDA_SUCCESS)
        return r;
    /* The legacy default stream cannot be captured (driver rule). */
    if (wire <= 1)
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    gp_graph_obj *g = calloc(1, sizeof *g);
    if (!g)
        return CUDA_ERROR_OUT_OF_MEMORY;
    g->ctx = gp_ctx_current();
    g->id = gp_handle_new(GP_H_GRAPH, g);
    if (!g->id) {
        free(g);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    lock();
    capture *c = find(wire);
    capture *slot = c ? NULL : free_slot();
    if (slot) {
        slot->stream = wire;
        slot->id = atomic_fetch_add(&next_capture_id, 1);
        slot->graph = g->id;
        slot->mode = mode;
        slot->status = CU_STREAM_CAPTURE_STATUS_ACTIVE;
        slot->thread = pthread_self();
        atomic_fetch_add(&cap_count, 1);
    }
    unlock();
    if (!slot) {
        free(gp_handle_remove(g->id, GP_H_GRAPH));
        /* Already capturing: the driver's answer. No free slot: too many captures at once. */
        return c ? GP_ERR_ILLEGAL_STATE : CUDA_ERROR_OUT_OF_MEMORY;
    }
    gp_stream_begin_capture m = {.stream = wire, .mode = (uint32_t)mode};
    GP_FRAME(buf, len, gp_stream_begin_capture, &m);
    if (!buf) {
        gp_capture_forget(wire);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    r = gp_post(buf, len, NULL, 0);
    GP_FRAME_FREE(buf);
    if (r != CUDA_SUCCESS)
        gp_capture_forget(wire);
    return r;
}

GP_EXPORT CUresult cuStreamBeginCapture_v2(CUstream hStream, GPstreamCaptureMode mode)
{
    return begin_capture(hStream, (int)mode);
}
GP_EXPORT CUresult cuStreamBeginCapture_v2_ptsz(CUstream hStream, GPstreamCaptureMode mode)
{
    return begin_capture(gp_ptsz(hStream), (int)mode);
}
/* The CUDA 10.0 entry point had no mode: it captured in global mode. */
GP_EXPORT CUresult cuStreamBeginCapture(CUstream hStream)
{
    return begin_capture(hStream, GP_CAPTURE_MODE_GLOBAL);
}
GP_EXPORT CUresult cuStreamBeginCapture_ptsz(CUstream hStream)
{
    return begin_capture(gp_ptsz(hStream), GP_CAPTURE_MODE_GLOBAL);
}

static CUresult end_capture(CUstream s, CUgraph *out)
{
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t wire;
    CUresult r = gp_stream_enter(s, &wire);
    if (r != CUDA_SUCCESS)
        return r;
    capture c = {0};
    lock();
    capture *p = atomic_load(&cap_count) ? find(wire) : NULL;
    if (p && p->mode != GP_CAPTURE_MODE_RELAXED && !pthread_equal(p->thread, pthread_self())) {
        unlock();
        return GP_ERR_CAPTURE_WRONG_THREAD;
    }
    if (p) {
        c = *p;
        p->stream = 0;
        atomic_fetch_sub(&cap_count, 1);
    }
    unlock();
    if (!p)
        return GP_ERR_ILLEGAL_STATE; /* not capturing */
    *out = NULL;
    gp_stream_end_capture m = {
        .stream = wire,
        .graph = c.graph,
        .invalidated = c.status == CU_STREAM_CAPTURE_STATUS_INVALIDATED,
    };
    GP_FRAME(buf, len, gp_stream_end_capture, &m);
    if (!buf) {
        free(gp_handle_remove(c.graph, GP_H_GRAPH));
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    gp_reply rep;
    r = gp_request(buf, len, NULL, 0, NULL, 0, &rep);
    GP_FRAME_FREE(buf);
    gp_reply_free(&rep);
    if (r != CUDA_SUCCESS) {
        free(gp_handle_remove(c.graph, GP_H_GRAPH));
        return gp_cu_result(r);
    }
    *out = (CUgraph)(uintptr_t)c.graph;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph)
{
    return end_capture(hStream, phGraph);
}
GP_EXPORT CUresult cuStreamEndCapture_ptsz(CUstream hStream, CUgraph *phGraph)
{
    return end_capture(gp_ptsz(hStream), phGraph);
}

/* cuStreamGetCaptureInfo, all versions: the v2/v3 outputs past id are written only while a
 * capture is active; the dependency list is always empty (nodes are not tracked here). */
static CUresult capture_info(CUstream s, CUstreamCaptureStatus *status, cuuint64_t *id,
                             CUgraph *graph, const void **deps, const void **edges, size_t *ndeps)
{
    if (!status)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t wire;
    CUresult r = gp_stream_enter(s, &wire);
    if (r != CUDA_SUCCESS)
        return r;
    capture c = {0};
    if (atomic_load(&cap_count) != 0) {
        lock();
        capture *p = find(wire);
        if (p)
            c = *p;
        unlock();
    }
    *status = c.stream ? c.status : CU_STREAM_CAPTURE_STATUS_NONE;
    if (c.stream && id)
        *id = c.id;
    if (*status == CU_STREAM_CAPTURE_STATUS_ACTIVE) {
        if (graph)
            *graph = (CUgraph)(uintptr_t)c.graph;
        if (deps)
            *deps = NULL;
        if (edges)
            *edges = NULL;
        if (ndeps)
            *ndeps = 0;
    }
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuStreamGetCaptureInfo(CUstream hStream, CUstreamCaptureStatus *status,
                                          cuuint64_t *id)
{
    return capture_info(hStream, status, id, NULL, NULL, NULL, NULL);
}
GP_EXPORT CUresult cuStreamGetCaptureInfo_ptsz(CUstream hStream, CUstreamCaptureStatus *status,
                                               cuuint64_t *id)
{
    return capture_info(gp_ptsz(hStream), status, id, NULL, NULL, NULL, NULL);
}
GP_EXPORT CUresult cuStreamGetCaptureInfo_v2(CUstream hStream, CUstreamCaptureStatus *status,
                                             cuuint64_t *id, CUgraph *graph, const void **deps,
                                             size_t *ndeps)
{
    return capture_info(hStream, status, id, graph, deps, NULL, ndeps);
}
GP_EXPORT CUresult cuStreamGetCaptureInfo_v2_ptsz(CUstream hStream, CUstreamCaptureStatus *status,
                                                  cuuint64_t *id, CUgraph *graph, const void **deps,
                                                  size_t *ndeps)
{
    return capture_info(gp_ptsz(hStream), status, id, graph, deps, NULL, ndeps);
}
GP_EXPORT CUresult cuStreamGetCaptureInfo_v3(CUstream hStream, CUstreamCaptureStatus *status,
                                             cuuint64_t *id, CUgraph *graph, const void **deps,
                                             const void **edges, size_t *ndeps)
{
    return capture_info(hStream, status, id, graph, deps, edges, ndeps);
}
GP_EXPORT CUresult cuStreamGetCaptureInfo_v3_ptsz(CUstream hStream, CUstreamCaptureStatus *status,
                                                  cuuint64_t *id, CUgraph *graph, const void **deps,
                                                  const void **edges, size_t *ndeps)
{
    return capture_info(gp_ptsz(hStream), status, id, graph, deps, edges, ndeps);
}

/* The mode is the calling thread's; the worker captures in relaxed mode and never needs it. */
GP_EXPORT CUresult cuThreadExchangeStreamCaptureMode(GPstreamCaptureMode *mode)
{
    if (!mode)
        return CUDA_ERROR_INVALID_VALUE;
    int m = (int)*mode;
    if (m < GP_CAPTURE_MODE_GLOBAL || m > GP_CAPTURE_MODE_RELAXED)
        return CUDA_ERROR_INVALID_VALUE;
    *mode = (GPstreamCaptureMode)tl_mode;
    tl_mode = m;
    return CUDA_SUCCESS;
}

/* ================================================================ graphs == */

static CUresult post_simple(uint8_t *buf, size_t len)
{
    if (!buf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    return gp_post(buf, len, NULL, 0);
}

/* Flags the driver knows: auto free on launch, upload, device launch, node priorities. */
#define INSTANTIATE_FLAGS 0xfull

static CUresult instantiate(CUgraphExec *out, CUgraph graph, unsigned long long flags)
{
    if (!out || (flags & ~INSTANTIATE_FLAGS))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    uint64_t gh = (uint64_t)(uintptr_t)graph;
    gp_graph_obj *g = gp_handle_get(gh, GP_H_GRAPH);
    if (!g)
        return CUDA_ERROR_INVALID_VALUE; /* the driver's answer for a bad graph */
    gp_graph_obj *x = calloc(1, sizeof *x);
    if (!x)
        return CUDA_ERROR_OUT_OF_MEMORY;
    x->ctx = g->ctx;
    x->records_ipc_event = g->records_ipc_event;
    x->id = gp_handle_new(GP_H_GRAPH_EXEC, x);
    if (!x->id) {
        free(x);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    gp_conn_use_ctx(g->ctx);
    gp_graph_instantiate m = {.graph = gh, .exec = x->id, .flags = flags};
    GP_FRAME(buf, len, gp_graph_instantiate, &m);
    r = post_simple(buf, len);
    if (buf)
        GP_FRAME_FREE(buf);
    if (r != CUDA_SUCCESS) {
        free(gp_handle_remove(x->id, GP_H_GRAPH_EXEC));
        return r;
    }
    *out = (CUgraphExec)(uintptr_t)x->id;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
                                               unsigned long long flags)
{
    return instantiate(phGraphExec, hGraph, flags);
}
/* The 10.0 / 11.0 signature: error node and log buffer. Errors are deferred here, so there is
 * never an error node, and the log stays empty. */
GP_EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph,
                                         void **phErrorNode, char *logBuffer, size_t bufferSize)
{
    if (phErrorNode)
        *phErrorNode = NULL;
    if (logBuffer && bufferSize > 0)
        logBuffer[0] = '\0';
    return instantiate(phGraphExec, hGraph, 0);
}
GP_EXPORT CUresult cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph, void **phErrorNode,
                                      char *logBuffer, size_t bufferSize)
{
    return cuGraphInstantiate_v2(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize);
}

static CUresult graph_launch(CUgraphExec exec, CUstream s, int upload)
{
    uint64_t wire;
    CUresult r = gp_stream_enter(s, &wire);
    if (r != CUDA_SUCCESS)
        return r;
    uint64_t xh = (uint64_t)(uintptr_t)exec;
    const gp_graph_obj *x = gp_handle_get(xh, GP_H_GRAPH_EXEC);
    if (!x)
        return CUDA_ERROR_INVALID_VALUE;
    int waits = x->records_ipc_event && !upload;
    if (gp_capture_status(wire) == CU_STREAM_CAPTURE_STATUS_INVALIDATED)
        return GP_ERR_CAPTURE_INVALIDATED;
    gp_graph_launch m = {.exec = xh, .stream = wire, .upload = (uint32_t)upload};
    GP_FRAME(buf, len, gp_graph_launch, &m);
    r = post_simple(buf, len);
    if (buf)
        GP_FRAME_FREE(buf);
    /* Its event record node is in the stream once the worker has launched it (api_event.c). */
    if (r == CUDA_SUCCESS && waits)
        r = gp_round_trip();
    return r;
}

GP_EXPORT CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)
{
    return graph_launch(hGraphExec, hStream, 0);
}
GP_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream)
{
    return graph_launch(hGraphExec, gp_ptsz(hStream), 0);
}
GP_EXPORT CUresult cuGraphUpload(CUgraphExec hGraphExec, CUstream hStream)
{
    return graph_launch(hGraphExec, hStream, 1);
}
GP_EXPORT CUresult cuGraphUpload_ptsz(CUgraphExec hGraphExec, CUstream hStream)
{
    return graph_launch(hGraphExec, gp_ptsz(hStream), 1);
}

GP_EXPORT CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    uint64_t xh = (uint64_t)(uintptr_t)hGraphExec;
    gp_graph_obj *x = gp_handle_remove(xh, GP_H_GRAPH_EXEC);
    if (!x)
        return CUDA_ERROR_INVALID_VALUE;
    gp_conn_use_ctx(x->ctx);
    free(x);
    gp_graph_exec_destroy m = {.exec = xh};
    GP_FRAME(buf, len, gp_graph_exec_destroy, &m);
    r = post_simple(buf, len);
    if (buf)
        GP_FRAME_FREE(buf);
    return r;
}

GP_EXPORT CUresult cuGraphDestroy(CUgraph hGraph)
{
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    uint64_t gh = (uint64_t)(uintptr_t)hGraph;
    /* A graph still being captured is not the program's to destroy. */
    lock();
    int capturing = 0;
    for (int i = 0; i < MAX_CAPTURES; i++)
        if (caps[i].stream && caps[i].graph == gh)
            capturing = 1;
    unlock();
    if (capturing)
        return CUDA_ERROR_INVALID_VALUE;
    gp_graph_obj *g = gp_handle_remove(gh, GP_H_GRAPH);
    if (!g)
        return CUDA_ERROR_INVALID_VALUE;
    gp_conn_use_ctx(g->ctx);
    free(g);
    gp_graph_destroy m = {.graph = gh};
    GP_FRAME(buf, len, gp_graph_destroy, &m);
    r = post_simple(buf, len);
    if (buf)
        GP_FRAME_FREE(buf);
    return r;
}

/* cuGraphGetNodes: the count (one round trip; PyTorch asks once per capture to warn about an
 * empty graph). Node handles are not remoted. */
GP_EXPORT CUresult cuGraphGetNodes(CUgraph hGraph, void **nodes, size_t *numNodes)
{
    if (!numNodes)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    uint64_t gh = (uint64_t)(uintptr_t)hGraph;
    gp_graph_obj *g = gp_handle_get(gh, GP_H_GRAPH);
    if (!g)
        return CUDA_ERROR_INVALID_VALUE;
    if (nodes) {
        static atomic_int said;
        if (!atomic_exchange(&said, 1))
            gp_log_error("cuGraphGetNodes with a node array is not supported: graph nodes stay "
                         "on the GPU server (CUDA_ERROR_NOT_SUPPORTED); pass NULL to get the "
                         "number of nodes");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    gp_conn_use_ctx(g->ctx);
    gp_graph_get_node_count m = {.graph = gh};
    GP_FRAME(buf, len, gp_graph_get_node_count, &m);
    if (!buf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    gp_reply rep;
    r = gp_request(buf, len, NULL, 0, NULL, 0, &rep);
    GP_FRAME_FREE(buf);
    if (r != CUDA_SUCCESS)
        return gp_cu_result(r);
    gp_graph_get_node_count_reply a;
    int ok = gp_graph_get_node_count_reply_decode(rep.body, rep.len, &a) == 0;
    gp_reply_free(&rep);
    if (!ok)
        return CUDA_ERROR_UNKNOWN;
    *numNodes = (size_t)a.count;
    return CUDA_SUCCESS;
}
