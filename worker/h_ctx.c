/*
 * h_ctx.c: contexts, limits, primary context reset.
 *
 * The worker's current context changes only through ctx_set_current (and falls back to the
 * primary when the current one is destroyed): ctx_create leaves it as it was, because the client
 * tracks which context it last made current on the connection, not the driver's push semantics.
 */
#include <stdio.h>
#include <stdlib.h>

#include "worker.h"

/* A module the driver has already unloaded (with its context): drop its functions' ids. */
static void forget_module(struct worker *w, uint64_t id, struct wk_obj *o)
{
    (void)o;
    wk_obj_purge(w, &w->funcs, id, 0, NULL);
}

static int is_primary(uint64_t id)
{
    return wk_ctx_canon(id) == WK_PRIMARY_CTX_ID;
}

/* cuCtxCreate on lease device `d` for the client's id; the context remembers its device (kind). */
static CUresult create_ctx(struct worker *w, uint64_t id, uint32_t flags, int32_t d)
{
    gp_ctx_create_reply r = {0};
    CUcontext c = NULL;
    if (d < 0 || d >= w->ndev) {
        return CUDA_ERROR_INVALID_DEVICE;
    } else if (id == 0 || is_primary(id) || wk_primary_index(w, id) || wk_idmap_get(&w->ctxs, id)) {
        r.result = CUDA_ERROR_INVALID_VALUE;
    } else if (w->drv.cuCtxCreate) {
        r.result = w->drv.cuCtxCreate(&c, flags, w->devs[d]);
    } else if (w->drv.cuCtxCreate_v4) {
        r.result = w->drv.cuCtxCreate_v4(&c, NULL, flags, w->devs[d]);
    } else {
        r.result = CUDA_ERROR_NOT_SUPPORTED;
    }
    if (r.result == CUDA_SUCCESS) {
        /* cuCtxCreate made the new context current: restore what the client last chose. */
        CUresult rc = w->drv.cuCtxSetCurrent(w->cur_ctx ? wk_ctx_handle(w, w->cur_ctx) : NULL);
        if (rc != CUDA_SUCCESS)
            wk_warn("restoring the current context after cuCtxCreate: %s", wk_err_name(w, rc));
        struct wk_obj *o = wk_obj_new(0, c, NULL, 0);
        if (o)
            o->kind = (uint32_t)d;
        r.result = wk_obj_bind(&w->ctxs, id, o);
        if (r.result != CUDA_SUCCESS && DRV(w, cuCtxDestroy, c) != CUDA_SUCCESS)
            wk_warn("destroying an unbound context failed");
    }
    return r.result;
}

WK_HANDLER(ctx_create)
{
    gp_ctx_create_reply r = {.result = create_ctx(w, m->ctx, m->flags, 0)};
    WK_REPLY(w, req, gp_ctx_create_reply, &r);
}

WK_HANDLER(ctx_create_on)
{
    gp_ctx_create_on_reply r = {.result = create_ctx(w, m->ctx, m->flags, m->device)};
    WK_REPLY(w, req, gp_ctx_create_on_reply, &r);
}

CUresult wk_ctx_teardown(struct worker *w, uint64_t id, struct wk_obj *o)
{
    wk_staging_drop_events(w, id);
    wk_peer_ctx_gone(w, id, 0); /* the context's stream for peer copies goes with it */
    /* The driver frees the context's streams, events and modules (libraries are
     * context-independent and stay): forget their ids. */
    wk_obj_purge(w, &w->streams, id, 0, NULL);
    wk_obj_purge(w, &w->events, id, 0, NULL);
    wk_quota_ctx_gone(w, id, o->h); /* a share's globals go back as zeros (quota.c) */
    wk_obj_purge(w, &w->modules, id, 1u << 0, forget_module);
    CUresult rc = DRV(w, cuCtxDestroy, o->h); /* waits for the context's work */
    if (w->cur_ctx == id) {
        CUresult r2 = w->drv.cuCtxSetCurrent(w->primary);
        if (r2 != CUDA_SUCCESS)
            wk_warn("making the primary context current: %s", wk_err_name(w, r2));
        w->cur_ctx = WK_PRIMARY_CTX_ID;
    }
    /* Our VMM allocations are not tied to a context: free those made in it ourselves, once its
     * work is done, as cuCtxDestroy frees cuMemAlloc memory. */
    wk_obj_purge(w, &w->allocs, id, 0, wk_obj_destroy_alloc);
    return rc;
}

WK_HANDLER(ctx_destroy)
{
    gp_ctx_destroy_reply r = {0};
    struct wk_obj *o = is_primary(m->ctx) ? NULL : wk_idmap_del(&w->ctxs, m->ctx);
    if (!o) {
        /* The driver refuses to destroy a primary context or a handle it does not know. */
        r.result = CUDA_ERROR_INVALID_CONTEXT;
    } else {
        /* Destroying waits for the context's work: earlier replies go out first. (A failed flush
         * marks the connection dead; the context is destroyed all the same.) */
        (void)wk_io_flush(w);
        r.result = wk_ctx_teardown(w, m->ctx, o);
        free(o);
    }
    WK_REPLY(w, req, gp_ctx_destroy_reply, &r);
}

WK_HANDLER(ctx_set_current)
{
    if (m->ctx == 0) {
        CUresult rc = w->drv.cuCtxSetCurrent(NULL);
        if (rc != CUDA_SUCCESS)
            wk_defer_error(w, GP_OP_CTX_SET_CURRENT, rc, "making no context current");
        else
            w->cur_ctx = 0;
        return;
    }
    CUcontext c = wk_ctx_handle(w, m->ctx);
    if (!c) {
        wk_defer_error(w, GP_OP_CTX_SET_CURRENT, CUDA_ERROR_INVALID_CONTEXT,
                       "making context 0x%llx current", (unsigned long long)m->ctx);
        return;
    }
    CUresult rc = w->drv.cuCtxSetCurrent(c);
    if (rc != CUDA_SUCCESS) {
        wk_defer_error(w, GP_OP_CTX_SET_CURRENT, rc, "making context 0x%llx current",
                       (unsigned long long)m->ctx);
        return;
    }
    w->cur_ctx = wk_ctx_canon(m->ctx);
}

WK_HANDLER(ctx_synchronize)
{
    gp_ctx_synchronize_reply r = {0};
    if (wk_io_flush(w) != 0) /* may take long: earlier replies must not wait behind it */
        return;
    r.result = wk_sync_result(w, WK_LONG(w, DRV(w, cuCtxSynchronize)));
    WK_REPLY(w, req, gp_ctx_synchronize_reply, &r);
}

WK_HANDLER(ctx_set_limit)
{
    gp_ctx_set_limit_reply r = {0};
    r.result = DRV(w, cuCtxSetLimit, (CUlimit)m->limit, (size_t)m->value);
    WK_REPLY(w, req, gp_ctx_set_limit_reply, &r);
}

WK_HANDLER(ctx_get_limit)
{
    gp_ctx_get_limit_reply r = {0};
    size_t v = 0;
    r.result = DRV(w, cuCtxGetLimit, &v, (CUlimit)m->limit);
    r.value = r.result == CUDA_SUCCESS ? v : 0;
    WK_REPLY(w, req, gp_ctx_get_limit_reply, &r);
}

WK_HANDLER(primary_ctx_reset)
{
    gp_primary_ctx_reset_reply r = {0};
    if (wk_io_flush(w) != 0)
        return;
    /* Release what the client created in the primary context, before the driver destroys it
     * under us: the staging buffers and events (allocated there), streams, events, modules,
     * and the allocations made while the primary was current. */
    wk_staging_release(w);
    wk_peer_ctx_gone(w, 0, 1); /* the streams of peer copies (h_peer.c) */
    wk_obj_purge(w, &w->streams, WK_PRIMARY_CTX_ID, 0, wk_obj_destroy_stream);
    wk_obj_purge(w, &w->events, WK_PRIMARY_CTX_ID, 0, wk_obj_destroy_event);
    wk_obj_purge(w, &w->modules, WK_PRIMARY_CTX_ID, 1u << 0, wk_quota_destroy_module);
    wk_obj_purge(w, &w->allocs, WK_PRIMARY_CTX_ID, 0, wk_obj_destroy_alloc);
    /* Whether a reset also drops VA reservations is not documented; when nothing is mapped in
     * the window any more, give it back and take it again afterwards, which is right either way. */
    int rereserve = w->va_reserved && w->allocs.count == 0;
    if (rereserve)
        wk_va_release(w);

    r.result = DRV(w, cuDevicePrimaryCtxReset, w->dev);
    CUcontext c = NULL;
    CUresult rc = w->drv.cuDevicePrimaryCtxRetain(&c, w->dev);
    if (rc == CUDA_SUCCESS) {
        w->primary = c;
        w->primary_retains++;
    } else {
        wk_warn("retaining the primary context after a reset: %s", wk_err_name(w, rc));
        if (r.result == CUDA_SUCCESS)
            r.result = rc;
    }
    if (w->cur_ctx == WK_PRIMARY_CTX_ID) {
        rc = w->drv.cuCtxSetCurrent(w->primary);
        if (rc != CUDA_SUCCESS)
            wk_warn("making the primary context current after a reset: %s", wk_err_name(w, rc));
    }
    if (rereserve) {
        rc = wk_va_reserve(w);
        if (rc != CUDA_SUCCESS) {
            /* The session goes on, but every allocation now fails with out-of-memory. */
            char text[256];
            snprintf(text, sizeof text,
                     "the VA window could not be reserved again after a primary context reset "
                     "(%s); device allocations will fail",
                     rc == (CUresult)-1 ? "another address was returned" : wk_err_name(w, rc));
            wk_log("%s", text);
            wk_send_notice(w, CUDA_ERROR_OUT_OF_MEMORY, GP_OP_PRIMARY_CTX_RESET, text);
        }
    }
    WK_REPLY(w, req, gp_primary_ctx_reset_reply, &r);
}
