/*
 * sim_graph.c: CUDA graphs on the simulated device.
 *
 * A graph is the list of operations a capturing stream recorded (sim_stream.c begins and ends
 * captures; the copy, memset, launch and event calls record into the graph instead of running):
 * device-to-device copies, memsets, launches of the simulated kernels with their packed
 * arguments, event records and waits. Instantiating copies the list; launching replays it in
 * order on the launch stream, which in the synchronous sim means before cuGraphLaunch returns.
 * Replays read device memory when they run, so a replay sees the inputs as they are then.
 */
#include <stdlib.h>
#include <string.h>

#include "sim_api.h"
#include "sim_internal.h"
#include "sim_shared.h"

struct sim_graph {
    uint64_t handle, ctx; /* handle: 0 while being captured */
    struct sim_op *ops;
    size_t n, cap;
    bool exec; /* an instantiated copy (SIM_K_GRAPH_EXEC) */
};

struct sim_graph *sim_graph_new(uint64_t ctx)
{
    struct sim_graph *g = calloc(1, sizeof(*g));
    if (g)
        g->ctx = ctx;
    return g;
}

void sim_graph_free(struct sim_graph *g)
{
    if (!g)
        return;
    for (size_t i = 0; i < g->n; i++)
        free(g->ops[i].params);
    free(g->ops);
    free(g);
}

uint64_t sim_graph_publish(struct sim_graph *g)
{
    g->handle = sim_handle_new(g->exec ? SIM_K_GRAPH_EXEC : SIM_K_GRAPH, g);
    return g->handle;
}

CUresult sim_graph_add(struct sim_graph *g, const struct sim_op *op)
{
    if (g->n == g->cap) {
        size_t ncap = g->cap ? g->cap * 2 : 16;
        struct sim_op *n = realloc(g->ops, ncap * sizeof(*n));
        if (!n)
            return CUDA_ERROR_OUT_OF_MEMORY;
        g->ops = n;
        g->cap = ncap;
    }
    struct sim_op o = *op;
    o.params = NULL;
    if (op->params_len > 0) {
        o.params = malloc(op->params_len);
        if (!o.params)
            return CUDA_ERROR_OUT_OF_MEMORY;
        memcpy(o.params, op->params, op->params_len);
    }
    g->ops[g->n++] = o;
    return CUDA_SUCCESS;
}

CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
                                     unsigned long long flags)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    struct sim_graph *g = sim_handle_get((uint64_t)(uintptr_t)hGraph, SIM_K_GRAPH);
    if (!phGraphExec || !g || (flags & ~0xfull) != 0)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    struct sim_graph *x = sim_graph_new(c->handle);
    if (!x)
        return sim_leave(CUDA_ERROR_OUT_OF_MEMORY);
    x->exec = true;
    for (size_t i = 0; i < g->n && rc == CUDA_SUCCESS; i++)
        rc = sim_graph_add(x, &g->ops[i]);
    if (rc == CUDA_SUCCESS && sim_graph_publish(x) == 0)
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    if (rc != CUDA_SUCCESS) {
        sim_graph_free(x);
        return sim_leave(rc);
    }
    *phGraphExec = (CUgraphExec)(uintptr_t)x->handle;
    return sim_leave(CUDA_SUCCESS);
}

/* Runs one recorded operation. */
static CUresult replay_op(struct sim_ctx *c, const struct sim_op *op)
{
    switch (op->kind) {
    case SIM_OP_MEMSET:
        return sim_memset_run(op->dst, op->value, op->n, op->elem);
    case SIM_OP_DTOD: {
        void *d = sim_dev_range(op->dst, op->n);
        const void *s = d ? sim_dev_range(op->src, op->n) : NULL;
        if (!d || !s) {
            sim_detail("graph replay: copy [0x%llx -> 0x%llx, %llu bytes) is not in device memory "
                       "any more",
                       (unsigned long long)op->src, (unsigned long long)op->dst,
                       (unsigned long long)op->n);
            return CUDA_ERROR_INVALID_VALUE;
        }
        memmove(d, s, op->n);
        return CUDA_SUCCESS;
    }
    case SIM_OP_KERNEL: {
        struct sim_func *f = sim_func_get(op->func);
        if (f && !f->def && sim_cfg.count_only)
            return CUDA_SUCCESS; /* count mode: captured, not run (sim_launch.c) */
        if (!f || !f->def) {
            sim_detail("graph replay: the kernel of a kernel node was unloaded");
            return CUDA_ERROR_INVALID_HANDLE;
        }
        sim_shared_turn_begin(sim_phys_dev(c->dev)); /* a shared GPU: one process's kernel */
        CUresult rc = f->def->fn(op->params, &op->dims);
        sim_shared_turn_end(sim_phys_dev(c->dev));
        if (rc == CUDA_ERROR_ILLEGAL_ADDRESS)
            c->sticky = rc;
        return rc;
    }
    case SIM_OP_EVENT_RECORD:
        sim_event_replay_record(op->event);
        return CUDA_SUCCESS;
    case SIM_OP_EVENT_WAIT:
        return CUDA_SUCCESS; /* the recorded work is complete: the sim is synchronous */
    }
    return CUDA_ERROR_UNKNOWN;
}

static CUresult graph_launch(CUgraphExec hGraphExec, CUstream hStream, bool upload)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    struct sim_graph *x = sim_handle_get((uint64_t)(uintptr_t)hGraphExec, SIM_K_GRAPH_EXEC);
    if (!x)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    if ((rc = sim_stream_check(hStream)) != CUDA_SUCCESS)
        return sim_leave(rc);
    struct sim_graph *g = NULL;
    if ((rc = sim_capture_target(hStream, &g)) != CUDA_SUCCESS)
        return sim_leave(rc);
    if (upload)
        return sim_leave(CUDA_SUCCESS); /* nothing to upload: device memory is host memory */
    if (g) {
        /* Launching a graph into a capture adds its operations (a child graph node). */
        for (size_t i = 0; i < x->n && rc == CUDA_SUCCESS; i++)
            rc = sim_graph_add(g, &x->ops[i]);
        return sim_leave(rc);
    }
    for (size_t i = 0; i < x->n && rc == CUDA_SUCCESS; i++)
        rc = replay_op(c, &x->ops[i]);
    return sim_leave(rc);
}

CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)
{
    return graph_launch(hGraphExec, hStream, false);
}

CUresult cuGraphUpload(CUgraphExec hGraphExec, CUstream hStream)
{
    return graph_launch(hGraphExec, hStream, true);
}

static CUresult destroy(uint64_t h, enum sim_kind kind)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    struct sim_graph *g = sim_handle_get(h, kind);
    if (!g)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    sim_handle_del(h);
    sim_graph_free(g);
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    return destroy((uint64_t)(uintptr_t)hGraphExec, SIM_K_GRAPH_EXEC);
}

CUresult cuGraphDestroy(CUgraph hGraph)
{
    return destroy((uint64_t)(uintptr_t)hGraph, SIM_K_GRAPH);
}

static void drop_graph(uint64_t h, void *obj, void *arg)
{
    struct sim_graph *g = obj;
    if (g->ctx == *(uint64_t *)arg) {
        sim_handle_del(h);
        sim_graph_free(g);
    }
}

void sim_graph_release_ctx(uint64_t ctx)
{
    sim_handle_foreach(SIM_K_GRAPH, drop_graph, &ctx);
    sim_handle_foreach(SIM_K_GRAPH_EXEC, drop_graph, &ctx);
}

/* The count only: a graph's nodes have no handles in the sim. */
CUresult cuGraphGetNodes(CUgraph hGraph, void **nodes, size_t *numNodes)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    struct sim_graph *g = sim_handle_get((uint64_t)(uintptr_t)hGraph, SIM_K_GRAPH);
    if (!g || !numNodes)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    if (nodes) {
        sim_detail("cuGraphGetNodes: node handles are not simulated (only their count)");
        return sim_leave(CUDA_ERROR_NOT_SUPPORTED);
    }
    *numNodes = g->n;
    return sim_leave(CUDA_SUCCESS);
}
