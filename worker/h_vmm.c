/*
 * h_vmm.c: the program's own virtual memory management calls (docs/protocol.md, ids 70-76).
 *
 * The worker's driver reservation already covers the client's whole VA window (h_mem.c), so a
 * reservation of the program is only a range carved from the window's allocator (vm.c): no
 * driver call. Physical memory (cuMemCreate) is bound to the client's handle id; maps, unmaps and
 * access changes go to the driver at the program's addresses. The client validated every call
 * against its own records; what still fails here (the driver's own refusals) is a deferred error.
 */
#include <stdlib.h>

#include "worker.h"

/* The reservation wholly containing [ptr, ptr+size), or 0. A few reservations per session
 * (PyTorch makes one per segment stream), so a scan is fine. */
static uint64_t resv_containing(const struct worker *w, uint64_t ptr, uint64_t size)
{
    size_t pos = 0;
    uint64_t base;
    void *val;
    while (wk_idmap_next(&w->vmm_resvs, &pos, &base, &val)) {
        const struct wk_obj *r = val;
        if (ptr >= base && size <= r->size && ptr - base <= r->size - size)
            return base;
    }
    return 0;
}

WK_HANDLER(vmm_reserve)
{
    gp_vmm_reserve_reply r = {.result = CUDA_SUCCESS};
    uint64_t g = w->gran, align = m->alignment > g ? m->alignment : g, addr = 0;
    if (m->size == 0 || g == 0 || m->size % g != 0 || (m->alignment & (m->alignment - 1)) != 0)
        r.result = CUDA_ERROR_INVALID_VALUE;
    else if (!w->va_reserved)
        r.result = CUDA_ERROR_OUT_OF_MEMORY;
    if (r.result == CUDA_SUCCESS) {
        /* The hint is honoured when that range is free, as the driver does; else anywhere. */
        if (m->addr != 0 && m->addr % align == 0 && wk_vm_alloc_at(&w->vm, m->addr, m->size) == 0)
            addr = m->addr;
        else if (wk_vm_alloc_aligned(&w->vm, m->size, align, &addr) != 0)
            r.result = CUDA_ERROR_OUT_OF_MEMORY; /* the window is full */
    }
    if (r.result == CUDA_SUCCESS) {
        struct wk_obj *o = wk_obj_new(0, NULL, NULL, 0);
        if (o)
            o->size = m->size;
        r.result = wk_obj_bind(&w->vmm_resvs, addr, o);
        if (r.result != CUDA_SUCCESS && wk_vm_free(&w->vm, addr, m->size) != 0)
            wk_error("out of memory: %llu bytes of the VA window are lost",
                     (unsigned long long)m->size);
        r.ptr = r.result == CUDA_SUCCESS ? addr : 0;
    }
    WK_REPLY(w, req, gp_vmm_reserve_reply, &r);
}

/* Unmaps one mapping (its record o is removed from vmm_maps by the caller and freed here). */
static void unmap_one(struct worker *w, uint64_t ptr, struct wk_obj *o)
{
    CUresult rc = DRV(w, cuMemUnmap, ptr, o->size);
    if (rc != CUDA_SUCCESS)
        wk_defer_error(w, GP_OP_VMM_UNMAP, rc, "cuMemUnmap of 0x%llx (%llu bytes)",
                       (unsigned long long)ptr, (unsigned long long)o->size);
    free(o);
}

/* Work on the device may still use the memory: wait for it, as mem_free does. */
static int quiesce(struct worker *w)
{
    if (wk_io_flush(w) != 0)
        return -1;
    CUresult rc = DRV(w, cuCtxSynchronize);
    if (rc != CUDA_SUCCESS)
        wk_warn("synchronising before an unmap: %s", wk_err_name(w, rc));
    return 0;
}

/* Unmaps every mapping inside [base, base+size). */
static void unmap_inside(struct worker *w, uint64_t base, uint64_t size)
{
    size_t n = 0, pos = 0;
    uint64_t key;
    void *val;
    while (wk_idmap_next(&w->vmm_maps, &pos, &key, &val))
        n += key >= base && key - base < size;
    if (n == 0)
        return;
    uint64_t *keys = malloc(n * sizeof *keys);
    if (!keys) {
        wk_error("out of memory: mappings inside 0x%llx stay until the session ends",
                 (unsigned long long)base);
        return;
    }
    size_t k = 0;
    pos = 0;
    while (wk_idmap_next(&w->vmm_maps, &pos, &key, &val) && k < n)
        if (key >= base && key - base < size)
            keys[k++] = key;
    for (size_t i = 0; i < k; i++)
        unmap_one(w, keys[i], wk_idmap_del(&w->vmm_maps, keys[i]));
    free(keys);
}

WK_HANDLER(vmm_address_free)
{
    (void)req;
    struct wk_obj *r = wk_idmap_get(&w->vmm_resvs, m->ptr);
    if (!r || r->size != m->size) {
        wk_defer_error(w, GP_OP_VMM_ADDRESS_FREE, CUDA_ERROR_INVALID_VALUE,
                       "cuMemAddressFree of 0x%llx (%llu bytes): not a reservation",
                       (unsigned long long)m->ptr, (unsigned long long)m->size);
        return;
    }
    if (quiesce(w) != 0)
        return;
    unmap_inside(w, m->ptr, m->size);
    r = wk_idmap_del(&w->vmm_resvs, m->ptr);
    if (wk_vm_free(&w->vm, m->ptr, r->size) != 0)
        wk_error("out of memory: %llu bytes of the VA window are lost",
                 (unsigned long long)r->size);
    free(r);
}

/* cuMemCreate on lease device `d` (issue 37); the handle remembers its device (kind). */
static CUresult vmm_create_on(struct worker *w, const gp_vmm_create *m, int32_t d)
{
    gp_vmm_create_reply r = {.result = CUDA_SUCCESS};
    if (d < 0 || d >= w->ndev)
        return CUDA_ERROR_INVALID_DEVICE;
    if (m->handle == 0 || wk_idmap_get(&w->vmm_handles, m->handle))
        r.result = CUDA_ERROR_INVALID_VALUE;
    CUmemAllocationProp prop = {0};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = (int)m->handle_types;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = d == 0 ? w->dev : w->devs[d];
    prop.allocFlags.compressionType = (unsigned char)(m->alloc_flags & 0xff);
    prop.allocFlags.gpuDirectRDMACapable = (unsigned char)((m->alloc_flags >> 8) & 0xff);
    prop.allocFlags.usage = (unsigned short)(m->alloc_flags >> 16);
    CUmemGenericAllocationHandle h = 0;
    if (r.result == CUDA_SUCCESS)
        r.result = wk_quota_admit(w, m->size); /* past the quota: as on a full GPU */
    if (r.result == CUDA_SUCCESS)
        r.result = DRV(w, cuMemCreate, &h, m->size, &prop, 0);
    if (r.result == CUDA_SUCCESS) {
        struct wk_obj *o = wk_obj_new(0, NULL, NULL, 0);
        if (o) {
            o->size = m->size;
            o->mem = h;
            o->kind = (uint32_t)d;
        }
        r.result = wk_obj_bind(&w->vmm_handles, m->handle, o);
        if (r.result != CUDA_SUCCESS) {
            CUresult rc = DRV(w, cuMemRelease, h);
            if (rc != CUDA_SUCCESS)
                wk_warn("releasing an unbound allocation: %s", wk_err_name(w, rc));
        } else {
            w->stats.mem_used += m->size;
        }
    }
    return r.result;
}

WK_HANDLER(vmm_create)
{
    gp_vmm_create_reply r = {.result = vmm_create_on(w, m, 0)};
    WK_REPLY(w, req, gp_vmm_create_reply, &r);
}

WK_HANDLER(vmm_create_on)
{
    const gp_vmm_create c = {.handle = m->handle,
                             .size = m->size,
                             .handle_types = m->handle_types,
                             .alloc_flags = m->alloc_flags};
    gp_vmm_create_on_reply r = {.result = vmm_create_on(w, &c, m->device)};
    WK_REPLY(w, req, gp_vmm_create_on_reply, &r);
}

static void release_handle(struct worker *w, struct wk_obj *o)
{
    /* As in the driver, memory still mapped stays until its last mapping goes. The client
     * sends the release at the last unmap, so a share's memory is zeroed here (quota.c). */
    wk_quota_zero_handle(w, o->mem, o->size);
    CUresult rc = DRV(w, cuMemRelease, o->mem);
    if (rc != CUDA_SUCCESS)
        wk_defer_error(w, GP_OP_VMM_RELEASE, rc, "cuMemRelease of %llu bytes",
                       (unsigned long long)o->size);
    w->stats.mem_used -= o->size < w->stats.mem_used ? o->size : w->stats.mem_used;
    free(o);
}

WK_HANDLER(vmm_release)
{
    (void)req;
    struct wk_obj *o = wk_idmap_del(&w->vmm_handles, m->handle);
    if (!o) {
        wk_defer_error(w, GP_OP_VMM_RELEASE, CUDA_ERROR_INVALID_VALUE,
                       "cuMemRelease of unknown handle 0x%llx", (unsigned long long)m->handle);
        return;
    }
    release_handle(w, o);
}

WK_HANDLER(vmm_map)
{
    (void)req;
    struct wk_obj *h = wk_idmap_get(&w->vmm_handles, m->handle);
    CUresult rc = CUDA_SUCCESS;
    if (!h || m->size == 0 || m->offset > h->size || m->size > h->size - m->offset)
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (!resv_containing(w, m->ptr, m->size) || wk_idmap_get(&w->vmm_maps, m->ptr))
        rc = CUDA_ERROR_INVALID_VALUE; /* only inside the program's own reservations */
    if (rc == CUDA_SUCCESS)
        rc = DRV(w, cuMemMap, m->ptr, m->size, m->offset, h->mem, 0);
    if (rc == CUDA_SUCCESS) {
        struct wk_obj *o = wk_obj_new(0, NULL, NULL, 0);
        if (o) {
            o->size = m->size;
            o->mem = m->handle;
        }
        rc = wk_obj_bind(&w->vmm_maps, m->ptr, o);
        if (rc != CUDA_SUCCESS && DRV(w, cuMemUnmap, m->ptr, m->size) != CUDA_SUCCESS)
            wk_warn("unmapping an unrecorded mapping at 0x%llx failed", (unsigned long long)m->ptr);
    }
    if (rc != CUDA_SUCCESS)
        wk_defer_error(w, GP_OP_VMM_MAP, rc, "cuMemMap of %llu bytes at 0x%llx (offset %llu)",
                       (unsigned long long)m->size, (unsigned long long)m->ptr,
                       (unsigned long long)m->offset);
}

WK_HANDLER(vmm_unmap)
{
    (void)req;
    struct wk_obj *o = wk_idmap_get(&w->vmm_maps, m->ptr);
    if (!o || o->size != m->size) {
        wk_defer_error(w, GP_OP_VMM_UNMAP, CUDA_ERROR_INVALID_VALUE,
                       "cuMemUnmap of 0x%llx (%llu bytes): not a mapping",
                       (unsigned long long)m->ptr, (unsigned long long)m->size);
        return;
    }
    if (quiesce(w) != 0)
        return;
    unmap_one(w, m->ptr, wk_idmap_del(&w->vmm_maps, m->ptr));
}

WK_HANDLER(vmm_set_access)
{
    (void)req;
    /* The memory's own device and the lease's devices that can access it as peers (issue 37):
     * the device of the allocation mapped first in the range (the client checked the rest). */
    const struct wk_obj *map = wk_idmap_get(&w->vmm_maps, m->ptr);
    const struct wk_obj *h = map ? wk_idmap_get(&w->vmm_handles, map->mem) : NULL;
    CUmemAccessDesc d[WK_MAX_DEVICES];
    size_t n = wk_access_descs(w, h && h->kind < (uint32_t)w->ndev ? (int)h->kind : 0, d);
    for (size_t i = 0; i < n; i++)
        d[i].flags = (int)m->flags;
    CUresult rc = resv_containing(w, m->ptr, m->size)
                      ? DRV(w, cuMemSetAccess, m->ptr, m->size, d, n)
                      : CUDA_ERROR_INVALID_VALUE;
    if (rc != CUDA_SUCCESS)
        wk_defer_error(w, GP_OP_VMM_SET_ACCESS, rc, "cuMemSetAccess of %llu bytes at 0x%llx",
                       (unsigned long long)m->size, (unsigned long long)m->ptr);
}

static void destroy_map(struct worker *w, uint64_t ptr, struct wk_obj *o)
{
    CUresult rc = DRV(w, cuMemUnmap, ptr, o->size);
    if (rc != CUDA_SUCCESS)
        wk_warn("unmapping 0x%llx: %s", (unsigned long long)ptr, wk_err_name(w, rc));
}

static void destroy_handle(struct worker *w, uint64_t id, struct wk_obj *o)
{
    (void)id;
    wk_quota_zero_handle(w, o->mem, o->size); /* the session's mappings are gone by now */
    CUresult rc = DRV(w, cuMemRelease, o->mem);
    if (rc != CUDA_SUCCESS)
        wk_warn("releasing VMM memory: %s", wk_err_name(w, rc));
    w->stats.mem_used -= o->size < w->stats.mem_used ? o->size : w->stats.mem_used;
}

static void destroy_resv(struct worker *w, uint64_t base, struct wk_obj *o)
{
    if (w->va_reserved && wk_vm_free(&w->vm, base, o->size) != 0)
        wk_error("out of memory: %llu bytes of the VA window are lost",
                 (unsigned long long)o->size);
}

void wk_vmm_release_all(struct worker *w)
{
    if (w->vmm_maps.count > 0) {
        CUresult rc = DRV(w, cuCtxSynchronize);
        if (rc != CUDA_SUCCESS)
            wk_warn("synchronising before unmapping the session's memory: %s", wk_err_name(w, rc));
    }
    wk_obj_purge(w, &w->vmm_maps, 0, 0, destroy_map);
    wk_obj_purge(w, &w->vmm_handles, 0, 0, destroy_handle);
    wk_obj_purge(w, &w->vmm_resvs, 0, 0, destroy_resv);
}
