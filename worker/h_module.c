/*
 * h_module.c: module and library loading (through the image cache), functions and globals.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sha256.h"
#include "worker.h"

/* A client string as a C string for the driver (names are at most 4095 bytes by the spec). */
static void cstr(char out[4096], const char *s, uint32_t len)
{
    size_t n = len < 4095 ? len : 4095;
    memcpy(out, s, n);
    out[n] = '\0';
}

/* The image of a module_load: from the caches when the frame carries none, else received,
 * verified and cached. Sets *result to the reply's error when there is no image. */
static const struct mc_entry *get_image(struct worker *w, const gp_module_load *m, int32_t *result)
{
    uint64_t n = m->data_len;
    if (n == 0) {
        const struct mc_entry *e = wk_modcache_get(&w->mc, m->sha256, m->image_size);
        if (e)
            w->stats.module_cache_hits++;
        else
            *result = GP_ENEEDIMAGE; /* the client sends it again, with the image */
        return e;
    }
    if (n > WK_MAX_IMAGE || n != m->image_size) {
        char text[200];
        snprintf(text, sizeof text,
                 n > WK_MAX_IMAGE ? "module image of %llu bytes exceeds the server's limit"
                                  : "module image of %llu bytes does not match its image_size",
                 (unsigned long long)n);
        if (wk_io_read_bulk(w, NULL, n) != 0) /* keep the stream in sync */
            return NULL;
        w->stats.module_bytes_received += n; /* only what arrived */
        wk_send_notice(w, CUDA_ERROR_INVALID_VALUE, GP_OP_MODULE_LOAD, text);
        *result = n > WK_MAX_IMAGE ? CUDA_ERROR_INVALID_VALUE : GP_EPROTO;
        return NULL;
    }
    uint8_t *data = malloc((size_t)n + 1);
    if (!data) {
        *result = CUDA_ERROR_OUT_OF_MEMORY;
        (void)wk_io_read_bulk(w, NULL, n); /* a failure sets w->closing, which the caller checks */
        return NULL;
    }
    if (wk_io_read_bulk(w, data, n) != 0) {
        free(data);
        return NULL;
    }
    w->stats.module_bytes_received += n;
    data[n] = '\0';
    uint8_t sha[32];
    gp_sha256(data, (size_t)n, sha);
    if (memcmp(sha, m->sha256, 32) != 0) {
        free(data);
        wk_send_notice(w, GP_EPROTO, GP_OP_MODULE_LOAD,
                       "module image does not match its SHA-256 (corrupted in transit?)");
        *result = GP_EPROTO;
        return NULL;
    }
    const struct mc_entry *e = wk_modcache_put(&w->mc, m->sha256, data, (size_t)n);
    if (!e)
        *result = CUDA_ERROR_OUT_OF_MEMORY;
    return e;
}

/* A module just loaded goes again: it took the tenant past its quota (quota.c). */
static void wk_module_drop(struct worker *w, uint64_t id)
{
    struct wk_obj *o = wk_idmap_del(&w->modules, id);
    if (!o)
        return;
    wk_quota_destroy_module(w, id, o);
    free(o);
}

WK_HANDLER(module_load)
{
    gp_module_load_reply r = {0};
    if (m->kind > 1 || m->module == 0 || wk_idmap_get(&w->modules, m->module)) {
        r.result = CUDA_ERROR_INVALID_VALUE;
        if (wk_io_read_bulk(w, NULL, m->data_len) == 0)
            WK_REPLY(w, req, gp_module_load_reply, &r);
        return;
    }
    const struct mc_entry *img = get_image(w, m, &r.result);
    if (w->closing)
        return;
    if (img) {
        CUmodule mh = NULL;
        CUlibrary lh = NULL;
        uint64_t free_before = wk_quota_probe(w); /* what the load takes counts (quota.c) */
        if (m->kind == 0)
            r.result = WK_LONG(w, DRV(w, cuModuleLoadData, &mh, img->data));
        else
            r.result =
                WK_LONG(w, DRV(w, cuLibraryLoadData, &lh, img->data, NULL, NULL, 0, NULL, NULL, 0));
        void *h = m->kind == 0 ? (void *)mh : (void *)lh;
        if (r.result == CUDA_SUCCESS) {
            struct wk_obj *o = wk_obj_new(w->cur_ctx, h, NULL, 0);
            if (o)
                o->kind = m->kind;
            r.result = wk_obj_bind(&w->modules, m->module, o);
            if (r.result != CUDA_SUCCESS) {
                CUresult rc = m->kind == 0 ? DRV(w, cuModuleUnload, h) : DRV(w, cuLibraryUnload, h);
                if (rc != CUDA_SUCCESS)
                    wk_warn("unloading an unbound module: %s", wk_err_name(w, rc));
            } else {
                w->stats.modules_loaded++;
                r.result = wk_quota_charge_module(w, o, free_before);
                if (r.result != CUDA_SUCCESS)
                    wk_module_drop(w, m->module); /* past the quota: as on a full GPU */
            }
        }
    }
    WK_REPLY(w, req, gp_module_load_reply, &r);
}

WK_HANDLER(module_unload)
{
    struct wk_obj *o = wk_idmap_get(&w->modules, m->module);
    if (!o || o->kind != m->kind) {
        wk_defer_error(w, GP_OP_MODULE_UNLOAD, CUDA_ERROR_INVALID_HANDLE, "unload of module 0x%llx",
                       (unsigned long long)m->module);
        return;
    }
    wk_idmap_del(&w->modules, m->module);
    wk_obj_purge(w, &w->funcs, m->module, 0, NULL); /* its functions die with it */
    wk_quota_module_gone(w, m->module, o);
    CUresult rc = o->kind == 1 ? DRV(w, cuLibraryUnload, o->h) : DRV(w, cuModuleUnload, o->h);
    free(o);
    if (rc != CUDA_SUCCESS)
        wk_defer_error(w, GP_OP_MODULE_UNLOAD, rc, "unload of module 0x%llx",
                       (unsigned long long)m->module);
}

/* Parameter layout of a function: count, or -1 when the driver cannot tell (it lacks
 * cuFuncGetParamInfo, or fails for another reason than "no such parameter"). */
static int32_t param_layout(struct worker *w, const struct wk_obj *f, uint8_t *offs, uint8_t *sizes,
                            uint32_t max)
{
    for (uint32_t i = 0; i < max; i++) {
        size_t off = 0, size = 0;
        CUresult rc = f->kind == 1 ? DRV(w, cuKernelGetParamInfo, f->h, i, &off, &size)
                                   : DRV(w, cuFuncGetParamInfo, f->h, i, &off, &size);
        if (rc == CUDA_ERROR_INVALID_VALUE)
            return (int32_t)i; /* one past the last parameter */
        if (rc != CUDA_SUCCESS || off > UINT32_MAX || size > UINT32_MAX)
            return -1;
        gp_wr_u32(offs + 4 * (size_t)i, (uint32_t)off);
        gp_wr_u32(sizes + 4 * (size_t)i, (uint32_t)size);
    }
    return -1;
}

WK_HANDLER(get_function)
{
    enum {
        MAXP = 8192
    }; /* the reply's array limit */
    gp_get_function_reply r = {0};
    char name[4096];
    cstr(name, m->name, m->name_len);
    struct wk_obj *mod = wk_idmap_get(&w->modules, m->module);
    CUfunction fh = NULL;
    CUkernel kh = NULL;
    if (!mod || mod->kind != m->kind)
        r.result = CUDA_ERROR_INVALID_HANDLE;
    else if (m->func == 0 || wk_idmap_get(&w->funcs, m->func))
        r.result = CUDA_ERROR_INVALID_VALUE;
    else if (m->kind == 0)
        r.result = DRV(w, cuModuleGetFunction, &fh, mod->h, name);
    else
        r.result = DRV(w, cuLibraryGetKernel, &kh, mod->h, name);
    void *h = m->kind == 0 ? (void *)fh : (void *)kh;
    uint8_t *offs = NULL, *sizes = NULL;
    if (r.result == CUDA_SUCCESS) {
        struct wk_obj *f = wk_obj_new(m->module, h, name, strlen(name));
        if (f)
            f->kind = m->kind;
        r.result = wk_obj_bind(&w->funcs, m->func, f);
        if (r.result == CUDA_SUCCESS) {
            offs = malloc(4 * MAXP);
            sizes = malloc(4 * MAXP);
            r.param_count = offs && sizes ? param_layout(w, f, offs, sizes, MAXP) : -1;
            if (r.param_count > 0) {
                r.param_offsets = offs;
                r.param_offsets_count = (uint32_t)r.param_count;
                r.param_sizes = sizes;
                r.param_sizes_count = (uint32_t)r.param_count;
            }
        }
    }
    WK_REPLY(w, req, gp_get_function_reply, &r);
    free(offs);
    free(sizes);
}

WK_HANDLER(get_global)
{
    gp_get_global_reply r = {0};
    char name[4096];
    cstr(name, m->name, m->name_len);
    struct wk_obj *mod = wk_idmap_get(&w->modules, m->module);
    CUdeviceptr dptr = 0;
    size_t size = 0;
    /* The simulated device places a global at its first request: measured as a load is. */
    uint64_t free_before = wk_quota_probe(w);
    if (!mod || mod->kind != m->kind)
        r.result = CUDA_ERROR_INVALID_HANDLE;
    else if (m->kind == 0)
        r.result = DRV(w, cuModuleGetGlobal, &dptr, &size, mod->h, name);
    else
        r.result = DRV(w, cuLibraryGetGlobal, &dptr, &size, mod->h, name);
    if (r.result == CUDA_SUCCESS) {
        wk_quota_note_global(w, m->module, dptr, size);
        r.result = wk_quota_charge_module(w, mod, free_before);
    }
    if (r.result == CUDA_SUCCESS) {
        r.dptr = dptr;
        r.size = size;
    }
    WK_REPLY(w, req, gp_get_global_reply, &r);
}
