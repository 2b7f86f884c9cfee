/*
 * objects.c: client-chosen ids -> driver handles, and the cleanup of groups of them.
 *
 * A bad id from the client must give the error the driver gives for a bad handle, never a crash:
 * every lookup goes through here and turns "unknown" into that error.
 */
#include <stdlib.h>
#include <string.h>

#include "worker.h"

struct wk_obj *wk_obj_new(uint64_t owner, void *h, const char *name, size_t name_len)
{
    struct wk_obj *o = calloc(1, sizeof *o + name_len + 1);
    if (!o)
        return NULL;
    o->owner = owner;
    o->h = h;
    if (name_len)
        memcpy(o->name, name, name_len);
    o->name[name_len] = '\0';
    return o;
}

CUresult wk_obj_bind(struct idmap *m, uint64_t id, struct wk_obj *obj)
{
    if (!obj)
        return CUDA_ERROR_OUT_OF_MEMORY;
    int r = wk_idmap_put(m, id, obj);
    if (r == 0)
        return CUDA_SUCCESS;
    free(obj);
    return r == -1 ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult wk_stream_get(struct worker *w, uint64_t id, CUstream *out)
{
    /* The default stream, CU_STREAM_LEGACY and CU_STREAM_PER_THREAD are the same values on the
     * wire and in the driver. */
    if (id <= 2) {
        *out = (CUstream)(uintptr_t)id;
        return CUDA_SUCCESS;
    }
    struct wk_obj *o = wk_idmap_get(&w->streams, id);
    if (!o)
        return CUDA_ERROR_INVALID_HANDLE;
    *out = o->h;
    return CUDA_SUCCESS;
}

CUresult wk_event_get(struct worker *w, uint64_t id, CUevent *out)
{
    struct wk_obj *o = wk_idmap_get(&w->events, id);
    if (!o)
        return CUDA_ERROR_INVALID_HANDLE;
    *out = o->h;
    return CUDA_SUCCESS;
}

uint64_t wk_ctx_canon(uint64_t id)
{
    return id == 1 ? WK_PRIMARY_CTX_ID : id;
}

/* A context id's device when it is a primary's (issue 37): k for WK_PRIMARY_CTX_OF(k), k < ndev. */
int wk_primary_index(const struct worker *w, uint64_t id)
{
    uint64_t k = (id >> 32) & 0xff;
    if (k == 0 || k >= (uint64_t)w->ndev || (id & ~(0xffull << 32)) != WK_PRIMARY_CTX_ID)
        return 0;
    return (int)k;
}

CUcontext wk_ctx_handle(struct worker *w, uint64_t id)
{
    id = wk_ctx_canon(id);
    if (id == WK_PRIMARY_CTX_ID)
        return w->primary;
    int k = wk_primary_index(w, id);
    if (k > 0)
        return w->prims[k];
    struct wk_obj *o = wk_idmap_get(&w->ctxs, id);
    return o ? o->h : NULL;
}

void wk_obj_purge(struct worker *w, struct idmap *m, uint64_t owner, unsigned kind_mask,
                  void (*destroy)(struct worker *, uint64_t id, struct wk_obj *))
{
    if (m->count == 0)
        return;
    /* Collect first: the map must not change while we iterate it. */
    uint64_t *ids = malloc(m->count * sizeof *ids);
    if (!ids) {
        wk_error("out of memory while releasing objects; some are left to process exit");
        return;
    }
    size_t n = 0, pos = 0;
    uint64_t id;
    void *val;
    while (wk_idmap_next(m, &pos, &id, &val)) {
        struct wk_obj *o = val;
        if (owner != 0 && o->owner != owner)
            continue;
        if (kind_mask != 0 && !(kind_mask & (1u << o->kind)))
            continue;
        ids[n++] = id;
    }
    for (size_t i = 0; i < n; i++) {
        struct wk_obj *o = wk_idmap_del(m, ids[i]);
        if (o && destroy)
            destroy(w, ids[i], o);
        free(o);
    }
    free(ids);
}

void wk_obj_destroy_stream(struct worker *w, uint64_t id, struct wk_obj *o)
{
    CUresult rc = DRV(w, cuStreamDestroy, o->h);
    if (rc != CUDA_SUCCESS)
        wk_warn("destroying stream 0x%llx: %s", (unsigned long long)id, wk_err_name(w, rc));
}

void wk_obj_destroy_event(struct worker *w, uint64_t id, struct wk_obj *o)
{
    CUresult rc = DRV(w, cuEventDestroy, o->h);
    if (rc != CUDA_SUCCESS)
        wk_warn("destroying event 0x%llx: %s", (unsigned long long)id, wk_err_name(w, rc));
}

void wk_obj_destroy_module(struct worker *w, uint64_t id, struct wk_obj *o)
{
    /* Functions of the module die with it, as in the driver. */
    wk_obj_purge(w, &w->funcs, id, 0, NULL);
    CUresult rc = o->kind == 1 ? DRV(w, cuLibraryUnload, o->h) : DRV(w, cuModuleUnload, o->h);
    if (rc != CUDA_SUCCESS)
        wk_warn("unloading module 0x%llx: %s", (unsigned long long)id, wk_err_name(w, rc));
}
