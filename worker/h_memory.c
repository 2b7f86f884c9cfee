/*
 * h_memory.c: device memory inside the client's VA window and memory info (device-side copies
 * and memsets are in h_copy.c, with the other copies).
 *
 * Every allocation is placed by vm.c at an address of the window the client reserved too, then
 * backed with the virtual memory management calls (cuMemCreate + cuMemMap + cuMemSetAccess):
 * cuMemAlloc would let the driver pick an address that may be valid host memory on the client.
 */
#include <stdlib.h>

#include "worker.h"

CUresult wk_va_reserve(struct worker *w)
{
    CUdeviceptr p = 0;
    CUresult rc = w->drv.cuMemAddressReserve(&p, w->va_size, w->gran, w->va_base, 0);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (p != w->va_base) {
        /* The hint is only a hint: the driver gave us other addresses, useless to this client. */
        rc = w->drv.cuMemAddressFree(p, w->va_size);
        if (rc != CUDA_SUCCESS)
            wk_warn("freeing a misplaced VA reservation: %s", wk_err_name(w, rc));
        return (CUresult)-1;
    }
    w->va_reserved = 1;
    return CUDA_SUCCESS;
}

void wk_va_release(struct worker *w)
{
    if (!w->va_reserved)
        return;
    CUresult rc = w->drv.cuMemAddressFree(w->va_base, w->va_size);
    if (rc != CUDA_SUCCESS)
        wk_warn("releasing the VA window: %s", wk_err_name(w, rc));
    w->va_reserved = 0;
}

void wk_obj_destroy_alloc(struct worker *w, uint64_t id, struct wk_obj *o)
{
    /* Another worker's memory (cuIpcOpenMemHandle) is only unmapped: neither zeroed nor ours to
     * count. */
    int imported = o->kind == WK_ALLOC_IMPORTED;
    if (!imported)
        wk_quota_zero_range(w, id, o->size); /* a share's memory goes back as zeros (quota.c) */
    CUresult rc = w->drv.cuMemUnmap(id, o->size);
    if (rc != CUDA_SUCCESS)
        wk_warn("unmapping 0x%llx: %s", (unsigned long long)id, wk_err_name(w, rc));
    rc = w->drv.cuMemRelease(o->mem);
    if (rc != CUDA_SUCCESS)
        wk_warn("releasing the memory at 0x%llx: %s", (unsigned long long)id, wk_err_name(w, rc));
    if (!imported)
        w->stats.mem_used -= o->size < w->stats.mem_used ? o->size : w->stats.mem_used;
    /* Only a range that is really unmapped may be handed out again. */
    if (w->va_reserved && wk_vm_free(&w->vm, id, o->size) != 0)
        wk_error("out of memory: %llu bytes of the VA window are lost",
                 (unsigned long long)o->size);
}

static CUresult alloc_mapped(struct worker *w, uint64_t size, uint64_t *dptr, uint64_t *mapped)
{
    if (w->cur_ctx == 0)
        return CUDA_ERROR_INVALID_CONTEXT; /* as cuMemAlloc without a current context */
    if (size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!w->va_reserved || size > UINT64_MAX - (w->gran - 1))
        return CUDA_ERROR_OUT_OF_MEMORY;
    uint64_t len = (size + w->gran - 1) / w->gran * w->gran;
    if (wk_quota_admit(w, len) != CUDA_SUCCESS)
        return CUDA_ERROR_OUT_OF_MEMORY; /* past the tenant's quota, as on a full GPU */
    uint64_t addr;
    if (wk_vm_alloc(&w->vm, len, &addr) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY; /* the window is full: the client sees an OOM */

    /* On the device of the current context (issue 37), reachable from the lease's devices that
     * the driver says can access it, as cuMemAlloc memory is once peer access is on. */
    int d = wk_cur_device(w);
    CUmemAllocationProp prop = {0};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = d == 0 ? w->dev : w->devs[d];
    /* Exportable (cuIpcGetMemHandle, h_ipc.c) where the device can: an allocation that asks for
     * a handle type the device lacks would fail. */
    int posix_fd = 0;
    if (DRV(w, cuDeviceGetAttribute, &posix_fd,
            (CUdevice_attribute)103 /* HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED */,
            prop.location.id) == CUDA_SUCCESS &&
        posix_fd)
        prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    CUmemGenericAllocationHandle h = 0;
    CUresult rc = w->drv.cuMemCreate(&h, len, &prop, 0);
    if (rc != CUDA_SUCCESS)
        goto free_range;
    rc = w->drv.cuMemMap(addr, len, 0, h, 0);
    if (rc != CUDA_SUCCESS)
        goto release;
    CUmemAccessDesc access[WK_MAX_DEVICES];
    rc = w->drv.cuMemSetAccess(addr, len, access, wk_access_descs(w, d, access));
    if (rc != CUDA_SUCCESS)
        goto unmap;
    struct wk_obj *o = wk_obj_new(w->cur_ctx, NULL, NULL, 0);
    if (o) {
        o->size = len;
        o->mem = h;
    }
    rc = wk_obj_bind(&w->allocs, addr, o);
    if (rc != CUDA_SUCCESS)
        goto unmap;
    *dptr = addr;
    *mapped = len;
    w->stats.mem_used += len;
    return CUDA_SUCCESS;

unmap:
    if (w->drv.cuMemUnmap(addr, len) != CUDA_SUCCESS)
        wk_warn("unmapping a failed allocation at 0x%llx failed", (unsigned long long)addr);
release:
    if (w->drv.cuMemRelease(h) != CUDA_SUCCESS)
        wk_warn("releasing a failed allocation failed");
free_range:
    if (wk_vm_free(&w->vm, addr, len) != 0)
        wk_error("out of memory: %llu bytes of the VA window are lost", (unsigned long long)len);
    return rc;
}

WK_HANDLER(mem_get_info)
{
    gp_mem_get_info_reply r = {0};
    r.result = wk_quota_mem_info(w, &r.free, &r.total); /* a quota is the tenant's total */
    WK_REPLY(w, req, gp_mem_get_info_reply, &r);
}

WK_HANDLER(mem_alloc)
{
    gp_mem_alloc_reply r = {0};
    CUstream s;
    /* flags (cuMemAllocAsync pools, managed memory...) do not change where memory goes. A
     * stream-ordered allocation is made at once; it is usable in stream order all the same. */
    r.result = wk_stream_get(w, m->stream, &s);
    if (r.result == CUDA_SUCCESS)
        r.result = alloc_mapped(w, m->size, &r.dptr, &r.mapped_size);
    WK_REPLY(w, req, gp_mem_alloc_reply, &r);
}

WK_HANDLER(mem_free)
{
    struct wk_obj *o = wk_idmap_get(&w->allocs, m->dptr);
    if (!o) {
        wk_defer_error(w, GP_OP_MEM_FREE, CUDA_ERROR_INVALID_VALUE, "free of device pointer 0x%llx",
                       (unsigned long long)m->dptr);
        return;
    }
    CUstream s;
    CUresult rc = wk_stream_get(w, m->stream, &s);
    if (rc != CUDA_SUCCESS) {
        wk_defer_error(w, GP_OP_MEM_FREE, rc, "free of 0x%llx on stream 0x%llx",
                       (unsigned long long)m->dptr, (unsigned long long)m->stream);
        return;
    }
    /* Unmapping under running work would fault it. cuMemFree waits for the device, and a
     * stream-ordered free for its stream; so do we. Their errors are not this call's: they stay
     * with the driver and come back at the next synchronisation. */
    if (wk_io_flush(w) != 0)
        return;
    rc = WK_LONG(w, m->stream ? DRV(w, cuStreamSynchronize, s) : DRV(w, cuCtxSynchronize));
    if (rc != CUDA_SUCCESS)
        wk_warn("synchronising before a free: %s", wk_err_name(w, rc));
    o = wk_idmap_del(&w->allocs, m->dptr);
    wk_obj_destroy_alloc(w, m->dptr, o);
    free(o);
}
