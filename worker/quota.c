/*
 * quota.c: see quota.h. What is counted where:
 *   allocations (cuMemAlloc*, cuMemAllocAsync, cuMemCreate): stats.mem_used, kept by h_memory.c
 *     and h_vmm.c, which ask wk_quota_admit first;
 *   module images and globals: the drop of the driver's free memory across the load (a real
 *     driver places code and globals at the load; the simulated device allocates a global when
 *     it is first asked for, so get_global is measured too);
 *   the context: total - free when the device was opened (real driver only: the simulated
 *     device reserves nothing for a context).
 * Without a quota nothing here calls the driver: a whole GPU's session runs as before.
 */
#include <stdlib.h>

#include "worker.h"

void wk_quota_measure_context(struct worker *w)
{
    w->quota.context = 0;
    if (w->simulated)
        return; /* no reservation; its free memory may be other processes' (a shared sim GPU) */
    size_t fr = 0, total = 0;
    CUresult rc = DRV(w, cuMemGetInfo, &fr, &total);
    if (rc != CUDA_SUCCESS) {
        wk_warn("reading the context's memory reservation: %s", wk_err_name(w, rc));
        return;
    }
    /* Taken while this worker is the GPU's only process (shares are not placed yet: a quota
     * caps a tenant of a whole GPU), so what is in use is our context's. */
    w->quota.context = total > fr ? total - fr : 0;
}

void wk_quota_start(struct worker *w, uint64_t limit)
{
    w->quota.limit = limit;
    w->quota.modules = 0;
    if (limit != 0)
        wk_log("memory quota %llu MiB (context %llu MiB); every allocation is zeroed before "
               "it is freed",
               (unsigned long long)(limit >> 20), (unsigned long long)(w->quota.context >> 20));
}

uint64_t wk_quota_used(const struct worker *w)
{
    return w->quota.context + w->quota.modules + w->stats.mem_used;
}

CUresult wk_quota_admit(const struct worker *w, uint64_t bytes)
{
    if (w->quota.limit == 0)
        return CUDA_SUCCESS;
    uint64_t used = wk_quota_used(w);
    return used <= w->quota.limit && bytes <= w->quota.limit - used ? CUDA_SUCCESS
                                                                    : CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult wk_quota_mem_info(struct worker *w, uint64_t *free_bytes, uint64_t *total)
{
    size_t fr = 0, tot = 0;
    CUresult rc = DRV(w, cuMemGetInfo, &fr, &tot);
    if (rc != CUDA_SUCCESS)
        return rc;
    *free_bytes = fr;
    *total = tot;
    if (w->quota.limit == 0)
        return CUDA_SUCCESS;
    uint64_t used = wk_quota_used(w), room = used < w->quota.limit ? w->quota.limit - used : 0;
    *total = w->quota.limit;
    /* Never more than the GPU has free: its other tenants' memory is not ours to promise. */
    *free_bytes = room < fr ? room : fr;
    return CUDA_SUCCESS;
}

uint64_t wk_quota_probe(struct worker *w)
{
    if (w->quota.limit == 0)
        return 0;
    size_t fr = 0, total = 0;
    return DRV(w, cuMemGetInfo, &fr, &total) == CUDA_SUCCESS ? fr : 0;
}

CUresult wk_quota_charge_module(struct worker *w, struct wk_obj *mod, uint64_t free_before)
{
    if (w->quota.limit == 0 || free_before == 0)
        return CUDA_SUCCESS;
    uint64_t after = wk_quota_probe(w);
    /* A drop only: memory another process freed meanwhile is not ours (a share's neighbours
     * can move the figure either way: docs/architecture.md says what that costs). */
    uint64_t took = after != 0 && after < free_before ? free_before - after : 0;
    mod->size += took;
    w->quota.modules += took;
    return w->quota.modules + w->quota.context + w->stats.mem_used > w->quota.limit
               ? CUDA_ERROR_OUT_OF_MEMORY
               : CUDA_SUCCESS;
}

void wk_quota_note_global(struct worker *w, uint64_t module_id, uint64_t dptr, uint64_t size)
{
    if (w->quota.limit == 0 || dptr == 0 || size == 0 || wk_idmap_get(&w->quota.globals, dptr))
        return;
    struct wk_obj *o = wk_obj_new(module_id, NULL, NULL, 0);
    if (o)
        o->size = size;
    if (wk_obj_bind(&w->quota.globals, dptr, o) != CUDA_SUCCESS)
        wk_warn("out of memory: the global at 0x%llx will not be zeroed before its module goes",
                (unsigned long long)dptr);
}

static void zero_global(struct worker *w, uint64_t dptr, struct wk_obj *o)
{
    wk_quota_zero_range(w, dptr, o->size);
}

void wk_quota_module_gone(struct worker *w, uint64_t id, struct wk_obj *mod)
{
    if (w->quota.limit == 0)
        return;
    wk_obj_purge(w, &w->quota.globals, id, 0, zero_global);
    w->quota.modules -= mod->size < w->quota.modules ? mod->size : w->quota.modules;
    mod->size = 0;
}

void wk_quota_destroy_module(struct worker *w, uint64_t id, struct wk_obj *mod)
{
    wk_quota_module_gone(w, id, mod); /* its globals first: the unload frees them */
    wk_obj_destroy_module(w, id, mod);
}

void wk_quota_ctx_gone(struct worker *w, uint64_t ctx_id, CUcontext h)
{
    if (w->quota.limit == 0 || w->modules.count == 0)
        return;
    CUresult rc = DRV(w, cuCtxSetCurrent, h);
    if (rc != CUDA_SUCCESS)
        wk_warn("making a context current to zero its modules' globals: %s", wk_err_name(w, rc));
    size_t pos = 0;
    uint64_t id;
    void *val;
    /* wk_quota_module_gone changes quota.globals only, not the map being walked. */
    while (wk_idmap_next(&w->modules, &pos, &id, &val)) {
        struct wk_obj *mod = val;
        if (mod->owner == ctx_id && mod->kind == 0) /* libraries are not a context's */
            wk_quota_module_gone(w, id, mod);
    }
    CUcontext back = wk_ctx_handle(w, w->cur_ctx);
    if (rc == CUDA_SUCCESS && back && (rc = DRV(w, cuCtxSetCurrent, back)) != CUDA_SUCCESS)
        wk_warn("making the current context current again: %s", wk_err_name(w, rc));
}

void wk_quota_zero_range(struct worker *w, uint64_t ptr, uint64_t size)
{
    if (w->quota.limit == 0 || size == 0)
        return;
    /* The legacy stream orders the memset after the tenant's work; the synchronise makes the
     * zeros land before the memory goes back (a real GPU's memset is asynchronous). */
    CUresult rc = DRV(w, cuMemsetD8Async, ptr, 0, size, NULL);
    if (rc == CUDA_SUCCESS)
        rc = DRV(w, cuCtxSynchronize);
    if (rc != CUDA_SUCCESS)
        wk_error("zeroing %llu bytes at 0x%llx before freeing them failed: %s; the GPU must be "
                 "scrubbed whole before its next tenant",
                 (unsigned long long)size, (unsigned long long)ptr, wk_err_name(w, rc));
}

void wk_quota_zero_handle(struct worker *w, CUmemGenericAllocationHandle h, uint64_t size)
{
    if (w->quota.limit == 0 || size == 0)
        return;
    /* The tenant may have unmapped it already (the client releases a handle at its last unmap):
     * map all of it once more, at addresses the driver picks outside the client's window. */
    CUdeviceptr p = 0;
    CUresult rc = DRV(w, cuMemAddressReserve, &p, size, w->gran, 0, 0);
    if (rc == CUDA_SUCCESS) {
        rc = DRV(w, cuMemMap, p, size, 0, h, 0);
        if (rc == CUDA_SUCCESS) {
            CUmemAccessDesc access = {0};
            access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            access.location.id = w->dev;
            access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
            rc = DRV(w, cuMemSetAccess, p, size, &access, 1);
            if (rc == CUDA_SUCCESS)
                wk_quota_zero_range(w, p, size);
            CUresult urc = DRV(w, cuMemUnmap, p, size);
            if (urc != CUDA_SUCCESS)
                wk_warn("unmapping zeroed memory: %s", wk_err_name(w, urc));
        }
        CUresult frc = DRV(w, cuMemAddressFree, p, size);
        if (frc != CUDA_SUCCESS)
            wk_warn("freeing the addresses used for zeroing: %s", wk_err_name(w, frc));
    }
    if (rc != CUDA_SUCCESS)
        wk_error("zeroing %llu bytes of physical memory before releasing them failed: %s; the "
                 "GPU must be scrubbed whole before its next tenant",
                 (unsigned long long)size, wk_err_name(w, rc));
}

void wk_quota_end(struct worker *w)
{
    /* Every module went before this (its globals with it); what is left are records only. */
    wk_obj_purge(w, &w->quota.globals, 0, 0, NULL);
    wk_idmap_clear(&w->quota.globals);
}
