/*
 * h_graph.c: stream capture and CUDA graphs (docs/protocol.md, ids 80-85).
 *
 * Capture works by forwarding: the client's calls on a capturing stream arrive here in the order
 * the program made them and go to the driver on the worker's real stream, so the driver records
 * the worker's own copies, memsets, launches and event records. The worker always captures in
 * relaxed mode: the client applies the program's capture mode itself, and the worker's own calls
 * made during a capture (allocations through the VMM calls, staging) must never be refused.
 *
 * Only the end of a capture is answered (the driver refuses to end an invalidated capture);
 * everything else is fire-and-forget with deferred errors.
 */
#include <stdlib.h>

#include "pacing.h"
#include "worker.h"

enum {
    CAPTURE_MODE_RELAXED = 2,
    ERR_CAPTURE_FIRST = 900, /* CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED .. _WRONG_THREAD (908) */
    ERR_CAPTURE_INVALIDATED = 901,
    ERR_CAPTURE_LAST = 908,
};

static int is_capture_error(CUresult rc)
{
    return rc >= ERR_CAPTURE_FIRST && rc <= ERR_CAPTURE_LAST;
}

WK_HANDLER(stream_begin_capture)
{
    CUstream s;
    CUresult rc = wk_stream_get(w, m->stream, &s);
    if (rc == CUDA_SUCCESS)
        rc = DRV(w, cuStreamBeginCapture, s, CAPTURE_MODE_RELAXED);
    if (rc != CUDA_SUCCESS)
        wk_defer_error(w, GP_OP_STREAM_BEGIN_CAPTURE, rc, "beginning a capture on stream 0x%llx",
                       (unsigned long long)m->stream);
}

static void graph_destroy_handle(struct worker *w, CUgraph g, uint64_t id)
{
    CUresult rc = DRV(w, cuGraphDestroy, g);
    if (rc != CUDA_SUCCESS)
        wk_warn("destroying graph 0x%llx: %s", (unsigned long long)id, wk_err_name(w, rc));
}

WK_HANDLER(stream_end_capture)
{
    gp_stream_end_capture_reply r = {0};
    CUstream s;
    CUgraph g = NULL;
    r.result = wk_stream_get(w, m->stream, &s);
    if (r.result == CUDA_SUCCESS && wk_idmap_get(&w->graphs, m->graph))
        r.result = CUDA_ERROR_INVALID_VALUE;
    if (r.result == CUDA_SUCCESS)
        r.result = DRV(w, cuStreamEndCapture, s, &g);
    if (r.result == CUDA_SUCCESS && m->invalidated) {
        /* The client saw an illegal call during the capture (and refused it itself). */
        graph_destroy_handle(w, g, m->graph);
        g = NULL;
        r.result = ERR_CAPTURE_INVALIDATED;
    }
    if (r.result == CUDA_SUCCESS) {
        r.result = wk_obj_bind(&w->graphs, m->graph, wk_obj_new(w->cur_ctx, g, NULL, 0));
        if (r.result != CUDA_SUCCESS)
            graph_destroy_handle(w, g, m->graph);
    }
    /* Calls refused because the capture was invalidated are this answer's business: their
     * deferred errors must not surface again at the next synchronisation. */
    if (r.result == ERR_CAPTURE_INVALIDATED && is_capture_error(w->pending))
        w->pending = CUDA_SUCCESS;
    WK_REPLY(w, req, gp_stream_end_capture_reply, &r);
}

WK_HANDLER(graph_instantiate)
{
    CUgraphExec x = NULL;
    struct wk_obj *g = wk_idmap_get(&w->graphs, m->graph);
    CUresult rc = g ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (rc == CUDA_SUCCESS && wk_idmap_get(&w->graph_execs, m->exec))
        rc = CUDA_ERROR_INVALID_VALUE;
    if (rc == CUDA_SUCCESS)
        rc = DRV(w, cuGraphInstantiateWithFlags, &x, g->h, (unsigned long long)m->flags);
    if (rc == CUDA_SUCCESS) {
        rc = wk_obj_bind(&w->graph_execs, m->exec, wk_obj_new(w->cur_ctx, x, NULL, 0));
        if (rc != CUDA_SUCCESS && DRV(w, cuGraphExecDestroy, x) != CUDA_SUCCESS)
            wk_warn("destroying an unbound graph exec failed");
    }
    if (rc != CUDA_SUCCESS)
        wk_defer_error(w, GP_OP_GRAPH_INSTANTIATE, rc, "instantiation of graph 0x%llx",
                       (unsigned long long)m->graph);
}

WK_HANDLER(graph_launch)
{
    CUstream s;
    struct wk_obj *x = wk_idmap_get(&w->graph_execs, m->exec);
    CUresult rc = x ? wk_stream_get(w, m->stream, &s) : CUDA_ERROR_INVALID_VALUE;
    if (rc == CUDA_SUCCESS) {
        if (m->upload) {
            rc = DRV(w, cuGraphUpload, x->h, s);
        } else {
            wk_pace_launch_begin(w->drv.lib); /* a graph's kernels are paced as launches */
            rc = WK_LONG(w, DRV_BUSY(w, cuGraphLaunch, x->h, s));
            uint64_t waited = wk_pace_launch_end(); /* busy_ns: the kernels' time, not turns */
            w->stats.busy_ns -= waited < w->stats.busy_ns ? waited : w->stats.busy_ns;
            w->stats.launches++;
        }
    }
    if (rc != CUDA_SUCCESS)
        wk_defer_error(w, GP_OP_GRAPH_LAUNCH, rc, "%s of graph exec 0x%llx on stream 0x%llx",
                       m->upload ? "upload" : "launch", (unsigned long long)m->exec,
                       (unsigned long long)m->stream);
}

static void destroy_exec(struct worker *w, uint64_t id, struct wk_obj *o)
{
    CUresult rc = DRV(w, cuGraphExecDestroy, o->h);
    if (rc != CUDA_SUCCESS)
        wk_warn("destroying graph exec 0x%llx: %s", (unsigned long long)id, wk_err_name(w, rc));
}

static void destroy_graph(struct worker *w, uint64_t id, struct wk_obj *o)
{
    graph_destroy_handle(w, o->h, id);
}

WK_HANDLER(graph_exec_destroy)
{
    struct wk_obj *o = wk_idmap_del(&w->graph_execs, m->exec);
    CUresult rc = o ? DRV(w, cuGraphExecDestroy, o->h) : CUDA_ERROR_INVALID_VALUE;
    free(o);
    if (rc != CUDA_SUCCESS)
        wk_defer_error(w, GP_OP_GRAPH_EXEC_DESTROY, rc, "destruction of graph exec 0x%llx",
                       (unsigned long long)m->exec);
}

WK_HANDLER(graph_destroy)
{
    struct wk_obj *o = wk_idmap_del(&w->graphs, m->graph);
    CUresult rc = o ? DRV(w, cuGraphDestroy, o->h) : CUDA_ERROR_INVALID_VALUE;
    free(o);
    if (rc != CUDA_SUCCESS)
        wk_defer_error(w, GP_OP_GRAPH_DESTROY, rc, "destruction of graph 0x%llx",
                       (unsigned long long)m->graph);
}

void wk_graph_release_all(struct worker *w)
{
    wk_obj_purge(w, &w->graph_execs, 0, 0, destroy_exec);
    wk_obj_purge(w, &w->graphs, 0, 0, destroy_graph);
}

WK_HANDLER(graph_get_node_count)
{
    gp_graph_get_node_count_reply r = {0};
    struct wk_obj *g = wk_idmap_get(&w->graphs, m->graph);
    size_t n = 0;
    r.result = g ? DRV(w, cuGraphGetNodes, g->h, NULL, &n) : CUDA_ERROR_INVALID_VALUE;
    r.count = r.result == CUDA_SUCCESS ? n : 0;
    WK_REPLY(w, req, gp_graph_get_node_count_reply, &r);
}
