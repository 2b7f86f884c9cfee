/*
 * api_memory.c: device memory, pinned/registered host memory and pointer attributes (copies and
 * memsets: api_copy.c).
 *
 * - Allocation waits for the server (it returns the address); freeing is validated here and
 *   then stream-ordered without a reply.
 * - Pinned host memory is ordinary local memory (page-aligned, recorded in the VA map): the
 *   remote GPU cannot map it, so "mapped" host memory cannot be read by kernels (one warning);
 *   memsets and copies on its device alias (its host address) are done here (api_copy.c).
 * - Pointer attributes are answered from the VA map.
 * The _ptds / _ptsz variants run the same code with the per-thread default stream.
 */
#include <stdatomic.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "compress.h"
#include "gp_graph.h"
#include "gp_vmm.h"
#include "shim.h"
#include "shim_core.h"

static uint64_t page_size(void)
{
    return (uint64_t)sysconf(_SC_PAGESIZE);
}

static void warn_mapped_once(void)
{
    static atomic_int said;
    if (!atomic_exchange(&said, 1))
        gp_log_info("mapped (zero-copy) host memory was requested, but this memory stays on this "
                    "machine: kernels on the remote GPU cannot read or write it (memsets and "
                    "copies naming it are done here, in stream order). Copy it to device memory "
                    "for kernels to use it.");
}

/* ================================================================ allocation == */

static CUresult mem_alloc(CUdeviceptr *dptr, size_t bytesize, CUstream stream, int is_async)
{
    if (!dptr || bytesize == 0)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t wire = 0;
    CUresult r = is_async ? gp_stream_enter(stream, &wire) : gp_ctx_enter();
    if (r != CUDA_SUCCESS)
        return r;
    uint64_t ctx = gp_ctx_current();
    if (is_async && wire > 2) {
        gp_stream_obj *st = gp_handle_get(wire, GP_H_STREAM);
        if (!st)
            return CUDA_ERROR_INVALID_HANDLE; /* destroyed meanwhile */
        ctx = st->ctx;
    }
    gp_mem_alloc m = {.size = bytesize, .stream = wire, .flags = 0};
    GP_FRAME(buf, len, gp_mem_alloc, &m);
    if (!buf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    gp_reply rep;
    r = gp_request(buf, len, NULL, 0, NULL, 0, &rep);
    GP_FRAME_FREE(buf);
    if (r != CUDA_SUCCESS)
        return gp_cu_result(r);
    gp_mem_alloc_reply a;
    int ok = gp_mem_alloc_reply_decode(rep.body, rep.len, &a) == 0 && a.dptr != 0;
    gp_reply_free(&rep);
    if (!ok)
        return CUDA_ERROR_UNKNOWN;
    if (!gp_vamap_in_window(a.dptr)) {
        static atomic_int said;
        if (!atomic_exchange(&said, 1))
            gp_log_error("the server allocated device memory at 0x%llx, outside this process's "
                         "reserved window; such pointers may alias host memory",
                         (unsigned long long)a.dptr);
    }
    gp_range rg = {.base = a.dptr,
                   .size = bytesize,
                   .kind = GP_RANGE_DEVICE,
                   .ctx = ctx,
                   .flags = is_async ? GP_RANGE_F_ASYNC : 0,
                   .mapped_size = a.mapped_size};
    if (gp_vamap_add(&rg) != 0)
        gp_log_error("device allocation 0x%llx+%llu overlaps a range this process already "
                     "has; copies to it may be refused",
                     (unsigned long long)a.dptr, (unsigned long long)bytesize);
    *dptr = a.dptr;
    if (is_async)
        gp_pool_note_alloc();
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    return mem_alloc(dptr, bytesize, NULL, 0);
}

GP_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    return mem_alloc(dptr, bytesize, hStream, 1);
}

GP_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    return mem_alloc(dptr, bytesize, gp_ptsz(hStream), 1);
}

/* Only the dummy default pool exists (cuDeviceGetDefaultMemPool). */
GP_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                           CUstream hStream)
{
    if ((uint64_t)(uintptr_t)pool != gp_default_mempool())
        return CUDA_ERROR_INVALID_VALUE;
    return mem_alloc(dptr, bytesize, hStream, 1);
}

GP_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize,
                                                CUmemoryPool pool, CUstream hStream)
{
    return cuMemAllocFromPoolAsync(dptr, bytesize, pool, gp_ptsz(hStream));
}

/* Rows padded to a multiple of the texture pitch alignment (512 bytes on current GPUs). */
GP_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes,
                                      size_t Height, unsigned int ElementSizeBytes)
{
    if (!dptr || !pPitch || WidthInBytes == 0 || Height == 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (ElementSizeBytes != 4 && ElementSizeBytes != 8 && ElementSizeBytes != 16)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_ctx_enter();
    if (r != CUDA_SUCCESS)
        return r;
    const gp_device_snapshot *d = gp_device_current();
    size_t align = 512;
    if (d && CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT < d->attribute_count &&
        d->attributes[CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT] > 0)
        align = (size_t)d->attributes[CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT];
    size_t pitch = (WidthInBytes + align - 1) / align * align;
    if (Height > SIZE_MAX / pitch)
        return CUDA_ERROR_INVALID_VALUE;
    r = mem_alloc(dptr, pitch * Height, NULL, 0);
    if (r == CUDA_SUCCESS)
        *pPitch = pitch;
    return r;
}

static CUresult mem_free(CUdeviceptr dptr, CUstream stream, int is_async)
{
    uint64_t wire = 0;
    CUresult r = is_async ? gp_stream_enter(stream, &wire) : gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    if (dptr == 0)
        return is_async ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
    gp_range rg;
    if (gp_vamap_find(dptr, &rg) != 0 || rg.kind != GP_RANGE_DEVICE || rg.base != dptr ||
        (rg.flags & (GP_RANGE_F_VMM | GP_RANGE_F_IPC))) /* returned with cuMemUnmap or
                                                          * cuIpcCloseMemHandle */
        return CUDA_ERROR_INVALID_VALUE;
    if (is_async && gp_conn_parts() > 1 && gp_conn_part_of_addr(dptr) != gp_conn_next_part()) {
        /* A spread lease: the stream's worker (its part) does not hold the memory. Refused
         * before the range goes, so the memory stays usable and freeable. */
        gp_log_error("cuMemFreeAsync: the memory is on another server than the stream; free it "
                     "with a stream of its own device (or cuMemFree)");
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (gp_vamap_remove(dptr, &rg) != 0)
        return CUDA_ERROR_INVALID_VALUE; /* freed meanwhile */
    if (!is_async)
        gp_conn_use_ctx(rg.ctx);
    gp_mem_free m = {.dptr = dptr, .stream = wire};
    GP_FRAME(buf, len, gp_mem_free, &m);
    if (!buf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    r = gp_post(buf, len, NULL, 0);
    GP_FRAME_FREE(buf);
    return r;
}

GP_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    return mem_free(dptr, NULL, 0);
}

GP_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    return mem_free(dptr, hStream, 1);
}

GP_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    return mem_free(dptr, gp_ptsz(hStream), 1);
}

GP_EXPORT CUresult cuMemGetInfo_v2(size_t *free_out, size_t *total_out)
{
    CUresult r = gp_ctx_enter();
    if (r != CUDA_SUCCESS)
        return r;
    gp_mem_get_info m = {0};
    GP_FRAME(buf, len, gp_mem_get_info, &m);
    if (!buf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    gp_reply rep;
    r = gp_request(buf, len, NULL, 0, NULL, 0, &rep);
    GP_FRAME_FREE(buf);
    if (r != CUDA_SUCCESS)
        return gp_cu_result(r);
    gp_mem_get_info_reply a;
    int ok = gp_mem_get_info_reply_decode(rep.body, rep.len, &a) == 0;
    gp_reply_free(&rep);
    if (!ok)
        return CUDA_ERROR_UNKNOWN;
    if (free_out)
        *free_out = (size_t)a.free;
    if (total_out)
        *total_out = (size_t)a.total;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuMemGetInfo(unsigned int *free_out, unsigned int *total_out)
{
    size_t f, t;
    CUresult r = cuMemGetInfo_v2(&f, &t);
    if (r != CUDA_SUCCESS)
        return r;
    if (free_out)
        *free_out = f > 0xffffffffu ? 0xffffffffu : (unsigned int)f;
    if (total_out)
        *total_out = t > 0xffffffffu ? 0xffffffffu : (unsigned int)t;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)
{
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    gp_range rg;
    if (gp_vamap_find(dptr, &rg) != 0 || rg.kind == GP_RANGE_HOST_REG)
        return CUDA_ERROR_NOT_FOUND;
    if (pbase)
        *pbase = rg.base;
    if (psize)
        *psize = (size_t)rg.size;
    return CUDA_SUCCESS;
}

/* ================================================================ host memory == */

static CUresult host_alloc(void **pp, size_t bytesize, unsigned int flags)
{
    if (!pp || bytesize == 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (flags & ~(unsigned)(CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP |
                            CU_MEMHOSTALLOC_WRITECOMBINED))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_ctx_enter();
    if (r != CUDA_SUCCESS)
        return r;
    uint64_t pg = page_size();
    if (bytesize > SIZE_MAX - pg)
        return CUDA_ERROR_OUT_OF_MEMORY;
    size_t mapped = (bytesize + pg - 1) & ~(pg - 1);
    void *p = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    gp_range rg = {.base = (uint64_t)(uintptr_t)p,
                   .size = bytesize,
                   .kind = GP_RANGE_HOST_ALLOC,
                   .ctx = gp_ctx_current(),
                   .flags = flags};
    if (gp_vamap_add(&rg) != 0) {
        munmap(p, mapped);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (flags & CU_MEMHOSTALLOC_DEVICEMAP)
        warn_mapped_once();
    *pp = p;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags)
{
    return host_alloc(pp, bytesize, Flags);
}

GP_EXPORT CUresult cuMemAllocHost_v2(void **pp, size_t bytesize)
{
    return host_alloc(pp, bytesize, 0);
}

GP_EXPORT CUresult cuMemAllocHost(void **pp, unsigned int bytesize)
{
    return host_alloc(pp, bytesize, 0);
}

GP_EXPORT CUresult cuMemFreeHost(void *p)
{
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    uint64_t a = (uint64_t)(uintptr_t)p;
    gp_range rg;
    if (!p || gp_vamap_find(a, &rg) != 0 || rg.kind != GP_RANGE_HOST_ALLOC || rg.base != a)
        return CUDA_ERROR_INVALID_VALUE;
    if (gp_vamap_remove(a, &rg) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t pg = page_size();
    munmap(p, (rg.size + pg - 1) & ~(pg - 1));
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags)
{
    if (!p || bytesize == 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (Flags & ~(unsigned)(CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP |
                            CU_MEMHOSTREGISTER_IOMEMORY | CU_MEMHOSTREGISTER_READ_ONLY))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_ctx_enter();
    if (r != CUDA_SUCCESS)
        return r;
    gp_range rg = {.base = (uint64_t)(uintptr_t)p,
                   .size = bytesize,
                   .kind = GP_RANGE_HOST_REG,
                   .ctx = gp_ctx_current(),
                   .flags = Flags};
    if (gp_vamap_add(&rg) != 0)
        return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    if (Flags & CU_MEMHOSTREGISTER_DEVICEMAP)
        warn_mapped_once();
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuMemHostRegister(void *p, size_t bytesize, unsigned int Flags)
{
    return cuMemHostRegister_v2(p, bytesize, Flags);
}

GP_EXPORT CUresult cuMemHostUnregister(void *p)
{
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    uint64_t a = (uint64_t)(uintptr_t)p;
    gp_range rg;
    if (!p || gp_vamap_find(a, &rg) != 0 || rg.kind != GP_RANGE_HOST_REG || rg.base != a)
        return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
    gp_vamap_remove(a, NULL);
    return CUDA_SUCCESS;
}

/* Unified addressing: the device pointer of pinned memory is its host address. */
GP_EXPORT CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *pdptr, void *p, unsigned int Flags)
{
    if (!pdptr || Flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    gp_range rg;
    if (!p || gp_vamap_find((uint64_t)(uintptr_t)p, &rg) != 0 ||
        (rg.kind != GP_RANGE_HOST_ALLOC && rg.kind != GP_RANGE_HOST_REG))
        return CUDA_ERROR_INVALID_VALUE;
    warn_mapped_once();
    *pdptr = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuMemHostGetFlags(unsigned int *pFlags, void *p)
{
    if (!pFlags)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    gp_range rg;
    if (!p || gp_vamap_find((uint64_t)(uintptr_t)p, &rg) != 0 || rg.kind != GP_RANGE_HOST_ALLOC)
        return CUDA_ERROR_INVALID_VALUE;
    *pFlags = rg.flags;
    return CUDA_SUCCESS;
}

/* ======================================================== pointer attributes == */

/* Bytes the driver writes for each attribute (0: not an attribute we know). */
static size_t attr_size(int a)
{
    switch (a) {
    case CU_POINTER_ATTRIBUTE_CONTEXT:
        return sizeof(CUcontext);
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
        return sizeof(unsigned int);
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
        return sizeof(CUdeviceptr);
    case CU_POINTER_ATTRIBUTE_HOST_POINTER:
        return sizeof(void *);
    case CU_POINTER_ATTRIBUTE_SYNC_MEMOPS:
    case CU_POINTER_ATTRIBUTE_IS_MANAGED:
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
    case CU_POINTER_ATTRIBUTE_MAPPED:
    case CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE:
    case CU_POINTER_ATTRIBUTE_ACCESS_FLAGS:
    case CU_POINTER_ATTRIBUTE_IS_HW_DECOMPRESS_CAPABLE:
        return sizeof(int);
    case CU_POINTER_ATTRIBUTE_BUFFER_ID:
    case CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID:
        return sizeof(unsigned long long);
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
    case CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR:
        return sizeof(CUdeviceptr);
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
    case CU_POINTER_ATTRIBUTE_MAPPING_SIZE:
        return sizeof(size_t);
    case CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES:
        return sizeof(unsigned int);
    case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE:
        return sizeof(CUmemoryPool);
    default:
        return 0;
    }
}

/* One attribute of a known range. `strict`: cuPointerGetAttribute, where "no such value" is an
 * error; cuPointerGetAttributes writes NULL instead. */
static CUresult ptr_attr(const gp_range *rg, uint64_t ptr, int a, void *data, int strict)
{
    int dev = rg->kind == GP_RANGE_DEVICE || rg->kind == GP_RANGE_GLOBAL;
    int iv;
    uint64_t u;
    switch (a) {
    case CU_POINTER_ATTRIBUTE_CONTEXT:
        *(CUcontext *)data = (CUcontext)(uintptr_t)rg->ctx;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
        *(unsigned int *)data = dev ? CU_MEMORYTYPE_DEVICE : CU_MEMORYTYPE_HOST;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
        *(CUdeviceptr *)data = ptr;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_HOST_POINTER:
        if (dev && strict)
            return CUDA_ERROR_INVALID_VALUE;
        *(void **)data = dev ? NULL : (void *)(uintptr_t)ptr;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_BUFFER_ID:
    case CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID:
        *(unsigned long long *)data = rg->buffer_id;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
    case CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR:
        *(CUdeviceptr *)data = rg->base;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
        *(size_t *)data = (size_t)rg->size;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MAPPING_SIZE:
        u = rg->mapped_size ? rg->mapped_size : rg->size;
        *(size_t *)data = (size_t)u;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE:
        *(CUmemoryPool *)data = (rg->flags & GP_RANGE_F_ASYNC) && rg->kind == GP_RANGE_DEVICE
                                    ? (CUmemoryPool)(uintptr_t)gp_default_mempool()
                                    : NULL;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES:
        *(unsigned int *)data = 0;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_SYNC_MEMOPS:
        iv = 0;
        break;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED:
        iv = 0;
        break;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: {
        /* The device of the context it was allocated in (issue 37). */
        const gp_ctx_obj *c = gp_ctx_obj_get(rg->ctx);
        iv = c ? c->device : 0;
        break;
    }
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
        iv = rg->kind == GP_RANGE_DEVICE && !(rg->flags & (GP_RANGE_F_ASYNC | GP_RANGE_F_VMM));
        break;
    case CU_POINTER_ATTRIBUTE_MAPPED:
        iv = 1;
        break;
    case CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE:
        iv = 0;
        break;
    case CU_POINTER_ATTRIBUTE_ACCESS_FLAGS: /* READWRITE, or none before cuMemSetAccess */
        iv = (rg->flags & GP_RANGE_F_NOACCESS) ? 0 : 3;
        break;
    case CU_POINTER_ATTRIBUTE_IS_HW_DECOMPRESS_CAPABLE:
        iv = 0;
        break;
    case CU_POINTER_ATTRIBUTE_P2P_TOKENS:
        return strict ? CUDA_ERROR_NOT_SUPPORTED : CUDA_ERROR_INVALID_VALUE;
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
    *(int *)data = iv;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr)
{
    if (!data)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    gp_range rg;
    if (gp_conn_find_range(ptr, &rg) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    return ptr_attr(&rg, ptr, attribute, data, 1);
}

/* Unknown pointers are not an error here: every attribute gets its "nothing" value (zero; the
 * device ordinal -2, as cudart reports for unregistered memory). */
GP_EXPORT CUresult cuPointerGetAttributes(unsigned int numAttributes,
                                          CUpointer_attribute *attributes, void **data,
                                          CUdeviceptr ptr)
{
    if (numAttributes == 0 || !attributes || !data)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    for (unsigned i = 0; i < numAttributes; i++) {
        if (!data[i] || !attr_size(attributes[i]) ||
            attributes[i] == CU_POINTER_ATTRIBUTE_P2P_TOKENS)
            return CUDA_ERROR_INVALID_VALUE;
    }
    gp_range rg;
    int known = gp_conn_find_range(ptr, &rg) == 0;
    for (unsigned i = 0; i < numAttributes; i++) {
        if (!known) {
            memset(data[i], 0, attr_size(attributes[i]));
            if (attributes[i] == CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)
                *(int *)data[i] = -2;
            continue;
        }
        r = ptr_attr(&rg, ptr, attributes[i], data[i], 0);
        if (r != CUDA_SUCCESS)
            return r;
    }
    return CUDA_SUCCESS;
}
