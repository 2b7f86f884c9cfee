/*
 * api_vmm.c: the virtual memory management calls (PyTorch's expandable segments) and the
 * default memory pool of the stream-ordered allocator (PyTorch's cudaMallocAsync backend).
 *
 * VMM (docs/architecture.md, "Virtual memory management and pools"):
 * - A reservation is carved by the worker from this process's VA window (one round trip: the
 *   worker's allocator of the window also places cuMemAlloc memory). cuMemAddressFree is posted.
 * - Physical memory (cuMemCreate) is named by a client-chosen handle; creation waits for the
 *   worker so that an out-of-memory is the call's own result (PyTorch frees its cache and retries).
 * - cuMemMap, cuMemUnmap, cuMemSetAccess and cuMemRelease are checked here against our records
 *   (reservations, handles, mappings) and posted without a reply; the mappings go into the VA
 *   map, so copies are validated and pointer attributes answered locally.
 * - The granularity, cuMemGetAccess, cuMemGetAllocationPropertiesFromHandle and
 *   cuMemRetainAllocationHandle are answered here.
 * - A handle's memory lives on the worker until it is released AND unmapped everywhere: the
 *   release is sent when both hold, so cuMemRetainAllocationHandle can revive a released handle
 *   that is still mapped, as in the driver.
 *
 * Pools: one pool per device, the default one (handle from api_init.c). Stream-ordered
 * allocations are made and freed on the worker at once (docs), so the pool keeps nothing cached:
 * its reserved and used memory are the live cuMemAllocAsync allocations, counted from the VA map;
 * trimming has nothing to do; the release threshold and reuse flags are kept and reported.
 * cuMemPoolCreate is refused (CUDA_ERROR_NOT_SUPPORTED and one line).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "gp_vmm.h"
#include "shim.h"
#include "shim_core.h"

/* Driver ABI values gp_cuda.h does not declare (prefixed so they never clash with it). */
enum {
    GP_LOC_DEVICE = 1,
    GP_LOC_HOST = 2,
    GP_LOC_HOST_NUMA_CURRENT = 4,
    GP_ACCESS_NONE = 0,
    GP_ACCESS_READ = 1,
    GP_ACCESS_RW = 3,
    GP_POOL_REUSE_FOLLOW_EVENT_DEPENDENCIES = 1,
    GP_POOL_REUSE_ALLOW_OPPORTUNISTIC = 2,
    GP_POOL_REUSE_ALLOW_INTERNAL_DEPENDENCIES = 3,
    GP_POOL_RELEASE_THRESHOLD = 4,
    GP_POOL_RESERVED_MEM_CURRENT = 5,
    GP_POOL_RESERVED_MEM_HIGH = 6,
    GP_POOL_USED_MEM_CURRENT = 7,
    GP_POOL_USED_MEM_HIGH = 8,
};

#define GP_DEFAULT_GRANULARITY (2ull << 20)

struct phys {
    CUmemAllocationProp prop;
    uint64_t size;
    unsigned refs; /* cuMemCreate + cuMemRetainAllocationHandle - cuMemRelease */
    unsigned maps; /* live mappings of it */
};

struct mapping {
    uint64_t base, size, offset, handle;
    int access; /* CUmemAccess_flags for the device */
};

struct resv {
    uint64_t base, size;
};

static pthread_mutex_t vmm_lock = PTHREAD_MUTEX_INITIALIZER;
/* guarded by vmm_lock: */
static struct resv *resvs;
static size_t nresv, capresv;
static struct mapping *maps; /* sorted by base, never overlapping */
static size_t nmaps, capmaps;

static uint64_t granularity(void)
{
    const gp_device_snapshot *d = gp_device(0);
    return d && d->granularity ? d->granularity : GP_DEFAULT_GRANULARITY;
}

/* Checks an allocation property as cuMemCreate and cuMemGetAllocationGranularity do. */
static CUresult check_prop(const CUmemAllocationProp *prop, const char *call)
{
    if (prop->type != CU_MEM_ALLOCATION_TYPE_PINNED)
        return CUDA_ERROR_INVALID_VALUE;
    if (prop->location.type >= GP_LOC_HOST && prop->location.type <= GP_LOC_HOST_NUMA_CURRENT) {
        static atomic_int said;
        if (!atomic_exchange(&said, 1))
            gp_log_error("%s: host memory locations are not supported over gpupool (the GPU is "
                         "on another machine); allocate device memory and copy instead "
                         "(returned CUDA_ERROR_NOT_SUPPORTED)",
                         call);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    if (prop->location.type != GP_LOC_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    if (!gp_device(prop->location.id))
        return CUDA_ERROR_INVALID_DEVICE;
    return CUDA_SUCCESS;
}

/* Index of the first mapping with base > addr. Caller holds vmm_lock. */
static size_t maps_upper(uint64_t addr)
{
    size_t lo = 0, hi = nmaps;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (maps[mid].base <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Index of the mapping containing addr, or -1. Caller holds vmm_lock. */
static long map_containing(uint64_t addr)
{
    size_t i = maps_upper(addr);
    if (i == 0)
        return -1;
    return addr - maps[i - 1].base < maps[i - 1].size ? (long)(i - 1) : -1;
}

/* The reservation wholly containing [ptr, ptr+size), or -1. Caller holds vmm_lock. */
static long resv_containing(uint64_t ptr, uint64_t size)
{
    for (size_t i = 0; i < nresv; i++)
        if (ptr >= resvs[i].base && size <= resvs[i].size &&
            ptr - resvs[i].base <= resvs[i].size - size)
            return (long)i;
    return -1;
}

/* A lease spread over servers (docs/multi-gpu.md, "Across servers"): these calls set no
 * context, so they name their part themselves (gp_conn_route; -1 after). A reservation is made on
 * the part of the thread's current context (part 0 without one) and lies in that part's slice of
 * the window; maps, unmaps, access and the address's free go to the part whose slice holds the
 * address; a handle lives on its device's part. One part: always part 0. */
static int part_of_ctx(void)
{
    if (gp_conn_parts() == 1) /* no lookup (nor the handle map's lock) for one part */
        return 0;
    const gp_ctx_obj *c = gp_ctx_current_obj();
    int k = c ? gp_conn_part_of_device(c->device) : 0;
    return k < 0 ? 0 : k;
}

static int part_of_va(uint64_t a)
{
    if (gp_conn_parts() == 1)
        return 0;
    int k = gp_conn_part_of_addr(a);
    return k < 0 ? 0 : k;
}

static int part_of_phys(const struct phys *p)
{
    if (gp_conn_parts() == 1)
        return 0;
    int k = gp_conn_part_of_device(p->prop.location.id);
    return k < 0 ? 0 : k;
}

/* Tells the handle's part that the handle is released; part: part_of_phys, found while the
 * handle still existed. */
static CUresult post_frame_release(uint64_t handle, int part)
{
    gp_vmm_release m = {.handle = handle};
    GP_FRAME(buf, len, gp_vmm_release, &m);
    if (!buf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    gp_conn_route(part);
    CUresult r = gp_post(buf, len, NULL, 0);
    gp_conn_route(-1);
    GP_FRAME_FREE(buf);
    return r;
}

/* Drops the handle when nothing refers to it any more; the caller holds vmm_lock. Returns 1 if
 * the worker must be told (after the lock is released: post_frame_release). */
static int phys_maybe_drop(uint64_t handle, struct phys *p)
{
    if (p->refs > 0 || p->maps > 0)
        return 0;
    free(gp_handle_remove(handle, GP_H_MEMHANDLE));
    return 1;
}

/* ======================================================================= reservations == */

GP_EXPORT CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
                                       CUdeviceptr addr, unsigned long long flags)
{
    if (!ptr || size == 0 || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    if (size % granularity() != 0 || (alignment & (alignment - 1)) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    gp_vmm_reserve m = {.size = size, .alignment = alignment, .addr = addr};
    GP_FRAME(buf, len, gp_vmm_reserve, &m);
    if (!buf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    gp_reply rep;
    int part = part_of_ctx();
    gp_conn_route(part);
    r = gp_request(buf, len, NULL, 0, NULL, 0, &rep);
    gp_conn_route(-1);
    GP_FRAME_FREE(buf);
    if (r != CUDA_SUCCESS)
        return gp_cu_result(r);
    gp_vmm_reserve_reply a;
    int ok = gp_vmm_reserve_reply_decode(rep.body, rep.len, &a) == 0 && a.ptr != 0 &&
             gp_vamap_in_window(a.ptr) && gp_vamap_in_window(a.ptr + size - 1);
    gp_reply_free(&rep);
    if (!ok)
        return CUDA_ERROR_UNKNOWN;
    int stored = 0;
    pthread_mutex_lock(&vmm_lock);
    if (nresv == capresv) {
        size_t ncap = capresv ? capresv * 2 : 16;
        struct resv *n = realloc(resvs, ncap * sizeof *n);
        if (n) {
            resvs = n;
            capresv = ncap;
        }
    }
    if (nresv < capresv) {
        resvs[nresv++] = (struct resv){.base = a.ptr, .size = size};
        stored = 1;
    }
    pthread_mutex_unlock(&vmm_lock);
    if (!stored) {
        gp_vmm_address_free f = {.ptr = a.ptr, .size = size};
        GP_FRAME(fb, fl, gp_vmm_address_free, &f);
        if (fb) {
            gp_conn_route(part);
            (void)gp_post(fb, fl, NULL, 0); /* best effort: we are out of memory anyway */
            gp_conn_route(-1);
            GP_FRAME_FREE(fb);
        }
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *ptr = a.ptr;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    uint64_t drop[64];
    int drop_part[64];
    size_t ndrop = 0, overflow = 0;
    pthread_mutex_lock(&vmm_lock);
    size_t i = 0;
    while (i < nresv && !(resvs[i].base == ptr && resvs[i].size == size))
        i++;
    if (i == nresv) {
        pthread_mutex_unlock(&vmm_lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    resvs[i] = resvs[--nresv];
    /* Mappings still inside go with the range (the worker unmaps them too). */
    size_t k = ptr ? maps_upper(ptr - 1) : 0; /* the first mapping at or above ptr */
    while (k < nmaps && maps[k].base < ptr + size) {
        struct mapping mp = maps[k];
        memmove(&maps[k], &maps[k + 1], (nmaps - k - 1) * sizeof *maps);
        nmaps--;
        (void)gp_vamap_remove(mp.base, NULL);
        struct phys *p = gp_handle_get(mp.handle, GP_H_MEMHANDLE);
        if (p) {
            p->maps--;
            int hp = part_of_phys(p);
            if (phys_maybe_drop(mp.handle, p)) {
                if (ndrop < sizeof drop / sizeof drop[0]) {
                    drop_part[ndrop] = hp;
                    drop[ndrop++] = mp.handle;
                } else
                    overflow++;
            }
        }
    }
    pthread_mutex_unlock(&vmm_lock);
    gp_vmm_address_free m = {.ptr = ptr, .size = size};
    GP_FRAME(buf, len, gp_vmm_address_free, &m);
    if (!buf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    gp_conn_route(part_of_va(ptr));
    r = gp_post(buf, len, NULL, 0);
    gp_conn_route(-1);
    GP_FRAME_FREE(buf);
    for (size_t j = 0; j < ndrop && r == CUDA_SUCCESS; j++)
        r = post_frame_release(drop[j], drop_part[j]);
    if (overflow)
        gp_log_error("cuMemAddressFree: %zu released handles stay allocated on the server until "
                     "the process ends (too many at once)",
                     overflow);
    return r;
}

/* ========================================================================== handles == */

GP_EXPORT CUresult cuMemGetAllocationGranularity(size_t *granularity_out,
                                                 const CUmemAllocationProp *prop, int option)
{
    if (!granularity_out || !prop ||
        (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM &&
         option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    r = check_prop(prop, "cuMemGetAllocationGranularity");
    if (r != CUDA_SUCCESS)
        return r;
    *granularity_out = (size_t)granularity();
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                               const CUmemAllocationProp *prop, unsigned long long flags)
{
    if (!handle || !prop || flags != 0 || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    r = check_prop(prop, "cuMemCreate");
    if (r != CUDA_SUCCESS)
        return r;
    if (size % granularity() != 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct phys *p = calloc(1, sizeof *p);
    if (!p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    p->prop = *prop;
    p->size = size;
    p->refs = 1;
    uint64_t h = gp_handle_new(GP_H_MEMHANDLE, p);
    if (!h) {
        free(p);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    gp_vmm_create m = {
        .handle = h,
        .size = size,
        .handle_types = (uint32_t)prop->requestedHandleTypes,
        .alloc_flags = (uint32_t)prop->allocFlags.compressionType |
                       (uint32_t)prop->allocFlags.gpuDirectRDMACapable << 8 |
                       (uint32_t)prop->allocFlags.usage << 16,
    };
    gp_reply rep = {0};
    /* A spread lease: on the device's part, as that worker numbers it (its maps follow the
     * context of that device, on the same part). */
    int local = gp_conn_local_device(prop->location.id);
    gp_conn_route(gp_conn_part_of_device(prop->location.id));
    if (local == 0) {
        GP_FRAME(buf, len, gp_vmm_create, &m);
        r = buf ? gp_request(buf, len, NULL, 0, NULL, 0, &rep) : CUDA_ERROR_OUT_OF_MEMORY;
        if (buf)
            GP_FRAME_FREE(buf);
    } else { /* another device of the lease (protocol 1.6, issue 37) */
        gp_vmm_create_on on = {.handle = m.handle,
                               .size = m.size,
                               .handle_types = m.handle_types,
                               .alloc_flags = m.alloc_flags,
                               .device = local};
        GP_FRAME(buf, len, gp_vmm_create_on, &on);
        r = buf ? gp_request(buf, len, NULL, 0, NULL, 0, &rep) : CUDA_ERROR_OUT_OF_MEMORY;
        if (buf)
            GP_FRAME_FREE(buf);
    }
    gp_conn_route(-1);
    if (r != CUDA_SUCCESS) {
        free(gp_handle_remove(h, GP_H_MEMHANDLE));
        return gp_cu_result(r);
    }
    gp_reply_free(&rep);
    *handle = (CUmemGenericAllocationHandle)h;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&vmm_lock);
    struct phys *p = gp_handle_get(handle, GP_H_MEMHANDLE);
    int tell = 0, part = 0;
    if (p && p->refs > 0) {
        p->refs--;
        part = part_of_phys(p);
        tell = phys_maybe_drop(handle, p);
    } else {
        r = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&vmm_lock);
    return tell ? post_frame_release(handle, part) : r;
}

GP_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    if (!handle)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&vmm_lock);
    long i = map_containing((uint64_t)(uintptr_t)addr);
    struct phys *p = i >= 0 ? gp_handle_get(maps[i].handle, GP_H_MEMHANDLE) : NULL;
    if (p) {
        p->refs++;
        *handle = (CUmemGenericAllocationHandle)maps[i].handle;
    } else {
        r = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&vmm_lock);
    return r;
}

GP_EXPORT CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
                                                          CUmemGenericAllocationHandle handle)
{
    if (!prop)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&vmm_lock);
    const struct phys *p = gp_handle_get(handle, GP_H_MEMHANDLE);
    if (p && p->refs > 0)
        *prop = p->prop;
    else
        r = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_unlock(&vmm_lock);
    return r;
}

/* ========================================================================= mappings == */

GP_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                            CUmemGenericAllocationHandle handle, unsigned long long flags)
{
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    uint64_t g = granularity();
    if (flags != 0 || size == 0 || ptr % g || size % g || offset % g || ptr + size < ptr)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&vmm_lock);
    struct phys *p = gp_handle_get(handle, GP_H_MEMHANDLE);
    size_t i = maps_upper(ptr);
    if (!p || p->refs == 0 || offset > p->size || size > p->size - offset ||
        resv_containing(ptr, size) < 0 || (i > 0 && maps[i - 1].base + maps[i - 1].size > ptr) ||
        (i < nmaps && maps[i].base < ptr + size)) {
        /* no such handle, outside its memory or outside every reservation, or over a mapping */
        pthread_mutex_unlock(&vmm_lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    int part = part_of_va(ptr);
    if (part != part_of_phys(p)) {
        /* A spread lease: the handle's memory is on another server than the reservation (as
         * PyTorch's expandable segments would map after set_device to a device of another
         * part): no worker holds both. */
        pthread_mutex_unlock(&vmm_lock);
        gp_log_error("cuMemMap: the allocation is on a device of another server than the "
                     "reserved address; reserve the address with a context of that device "
                     "current");
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (nmaps == capmaps) {
        size_t ncap = capmaps ? capmaps * 2 : 64;
        struct mapping *n = realloc(maps, ncap * sizeof *n);
        if (!n) {
            pthread_mutex_unlock(&vmm_lock);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        maps = n;
        capmaps = ncap;
    }
    gp_range rg = {.base = ptr,
                   .size = size,
                   .kind = GP_RANGE_DEVICE,
                   .ctx = 0,
                   .flags = GP_RANGE_F_VMM | GP_RANGE_F_NOACCESS,
                   .mapped_size = size};
    if (gp_vamap_add(&rg) != 0) {
        pthread_mutex_unlock(&vmm_lock);
        return CUDA_ERROR_INVALID_VALUE; /* overlaps another device range */
    }
    memmove(&maps[i + 1], &maps[i], (nmaps - i) * sizeof *maps);
    maps[i] = (struct mapping){
        .base = ptr, .size = size, .offset = offset, .handle = handle, .access = GP_ACCESS_NONE};
    nmaps++;
    p->maps++;
    gp_vmm_map m = {.ptr = ptr, .size = size, .offset = offset, .handle = handle};
    GP_FRAME(buf, len, gp_vmm_map, &m);
    /* Posted under the lock, so that the worker sees maps and unmaps in our order. */
    gp_conn_route(part);
    r = buf ? gp_post(buf, len, NULL, 0) : CUDA_ERROR_OUT_OF_MEMORY;
    gp_conn_route(-1);
    GP_FRAME_FREE(buf);
    pthread_mutex_unlock(&vmm_lock);
    return r;
}

GP_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    if (size == 0 || ptr + size < ptr)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&vmm_lock);
    /* Whole mappings only, side by side from ptr to ptr+size; checked before anything changes. */
    long first = map_containing(ptr);
    size_t end = first < 0 ? 0 : (size_t)first;
    uint64_t cur = ptr;
    if (first >= 0 && maps[first].base == ptr)
        while (end < nmaps && maps[end].base == cur && cur - ptr < size)
            cur += maps[end++].size;
    if (first < 0 || maps[first].base != ptr || cur - ptr != size) {
        pthread_mutex_unlock(&vmm_lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    /* Our records change whatever happens to the frames: a failed post means a lost
     * connection, after which nothing reaches the worker anyway. */
    for (size_t k = (size_t)first; k < end; k++) {
        const struct mapping *mp = &maps[k];
        (void)gp_vamap_remove(mp->base, NULL);
        if (r == CUDA_SUCCESS) {
            gp_vmm_unmap m = {.ptr = mp->base, .size = mp->size};
            GP_FRAME(buf, len, gp_vmm_unmap, &m);
            gp_conn_route(part_of_va(mp->base));
            r = buf ? gp_post(buf, len, NULL, 0) : CUDA_ERROR_OUT_OF_MEMORY;
            gp_conn_route(-1);
            GP_FRAME_FREE(buf);
        }
        struct phys *p = gp_handle_get(mp->handle, GP_H_MEMHANDLE);
        if (p) {
            p->maps--;
            int hp = part_of_phys(p);
            if (phys_maybe_drop(mp->handle, p) && r == CUDA_SUCCESS)
                r = post_frame_release(mp->handle, hp);
        }
    }
    memmove(&maps[first], &maps[end], (nmaps - end) * sizeof *maps);
    nmaps -= end - (size_t)first;
    pthread_mutex_unlock(&vmm_lock);
    return r;
}

GP_EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
                                  size_t count)
{
    if (!desc || count == 0 || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    int flags = -1;
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != GP_LOC_DEVICE)
            return CUDA_ERROR_INVALID_VALUE;
        if (!gp_device(desc[i].location.id))
            return CUDA_ERROR_INVALID_DEVICE;
        if (desc[i].flags != GP_ACCESS_NONE && desc[i].flags != GP_ACCESS_READ &&
            desc[i].flags != GP_ACCESS_RW)
            return CUDA_ERROR_INVALID_VALUE;
        flags = desc[i].flags; /* one device: the last description wins */
    }
    uint64_t g = granularity();
    if (ptr % g || size % g)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&vmm_lock);
    unsigned set = flags == GP_ACCESS_NONE ? GP_RANGE_F_NOACCESS : 0;
    unsigned clear = flags == GP_ACCESS_NONE ? 0 : GP_RANGE_F_NOACCESS;
    if (gp_vamap_vmm_flags(ptr, size, set, clear) != 0) {
        pthread_mutex_unlock(&vmm_lock);
        return CUDA_ERROR_INVALID_VALUE; /* not all of it is mapped */
    }
    for (long k = map_containing(ptr); k >= 0 && (size_t)k < nmaps && maps[k].base < ptr + size;
         k++)
        maps[k].access = flags;
    gp_vmm_set_access m = {.ptr = ptr, .size = size, .flags = (uint32_t)flags};
    GP_FRAME(buf, len, gp_vmm_set_access, &m);
    gp_conn_route(part_of_va(ptr));
    r = buf ? gp_post(buf, len, NULL, 0) : CUDA_ERROR_OUT_OF_MEMORY;
    gp_conn_route(-1);
    GP_FRAME_FREE(buf);
    pthread_mutex_unlock(&vmm_lock);
    return r;
}

GP_EXPORT CUresult cuMemGetAccess(unsigned long long *flags, const CUmemLocation *location,
                                  CUdeviceptr ptr)
{
    if (!flags || !location)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    if (location->type != GP_LOC_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    if (!gp_device(location->id))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&vmm_lock);
    long i = map_containing(ptr);
    if (i >= 0)
        *flags = (unsigned long long)maps[i].access;
    else
        r = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_unlock(&vmm_lock);
    return r;
}

/* ==================================================================== memory pools == */

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
/* guarded by pool_lock: */
static uint64_t pool_release_threshold;
static int pool_reuse[4] = {0, 1, 1, 1}; /* by attribute 1..3: the driver's defaults */
static uint64_t pool_used_high, pool_reserved_high;

void gp_pool_note_alloc(void)
{
    uint64_t used, mapped;
    gp_vamap_async_bytes(&used, &mapped);
    pthread_mutex_lock(&pool_lock);
    if (used > pool_used_high)
        pool_used_high = used;
    if (mapped > pool_reserved_high)
        pool_reserved_high = mapped;
    pthread_mutex_unlock(&pool_lock);
}

static CUresult check_pool(CUmemoryPool pool)
{
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    return (uint64_t)(uintptr_t)pool == gp_default_mempool() ? CUDA_SUCCESS
                                                             : CUDA_ERROR_INVALID_VALUE;
}

GP_EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value)
{
    if (!value)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = check_pool(pool);
    if (r != CUDA_SUCCESS)
        return r;
    uint64_t used, mapped;
    gp_vamap_async_bytes(&used, &mapped);
    pthread_mutex_lock(&pool_lock);
    switch (attr) {
    case GP_POOL_REUSE_FOLLOW_EVENT_DEPENDENCIES:
    case GP_POOL_REUSE_ALLOW_OPPORTUNISTIC:
    case GP_POOL_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
        *(int *)value = pool_reuse[attr];
        break;
    case GP_POOL_RELEASE_THRESHOLD:
        *(uint64_t *)value = pool_release_threshold;
        break;
    /* Nothing is cached: what the pool holds is what is in use. */
    case GP_POOL_RESERVED_MEM_CURRENT:
        *(uint64_t *)value = mapped;
        break;
    case GP_POOL_RESERVED_MEM_HIGH:
        *(uint64_t *)value = pool_reserved_high > mapped ? pool_reserved_high : mapped;
        break;
    case GP_POOL_USED_MEM_CURRENT:
        *(uint64_t *)value = used;
        break;
    case GP_POOL_USED_MEM_HIGH:
        *(uint64_t *)value = pool_used_high > used ? pool_used_high : used;
        break;
    default:
        r = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&pool_lock);
    return r;
}

GP_EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value)
{
    if (!value)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = check_pool(pool);
    if (r != CUDA_SUCCESS)
        return r;
    uint64_t used, mapped;
    gp_vamap_async_bytes(&used, &mapped);
    pthread_mutex_lock(&pool_lock);
    switch (attr) {
    case GP_POOL_REUSE_FOLLOW_EVENT_DEPENDENCIES:
    case GP_POOL_REUSE_ALLOW_OPPORTUNISTIC:
    case GP_POOL_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
        pool_reuse[attr] = *(int *)value != 0;
        break;
    case GP_POOL_RELEASE_THRESHOLD:
        pool_release_threshold = *(uint64_t *)value;
        break;
    /* The high-water marks can only be reset, to the current value (the driver requires 0). */
    case GP_POOL_RESERVED_MEM_HIGH:
        if (*(uint64_t *)value != 0)
            r = CUDA_ERROR_INVALID_VALUE;
        else
            pool_reserved_high = mapped;
        break;
    case GP_POOL_USED_MEM_HIGH:
        if (*(uint64_t *)value != 0)
            r = CUDA_ERROR_INVALID_VALUE;
        else
            pool_used_high = used;
        break;
    default:
        r = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&pool_lock);
    return r;
}

/* Freed memory goes back to the device at once (the worker frees it), so nothing is left to
 * trim. */
GP_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep)
{
    (void)minBytesToKeep;
    return check_pool(pool);
}

GP_EXPORT CUresult cuMemPoolSetAccess(CUmemoryPool pool, const CUmemAccessDesc *map, size_t count)
{
    if (!map && count)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = check_pool(pool);
    if (r != CUDA_SUCCESS)
        return r;
    for (size_t i = 0; i < count; i++) {
        if (map[i].location.type != GP_LOC_DEVICE)
            return CUDA_ERROR_INVALID_VALUE;
        if (!gp_device(map[i].location.id))
            return CUDA_ERROR_INVALID_DEVICE;
        /* The pool's own device always has read-write access, and cannot be given less. */
        if (map[i].flags != GP_ACCESS_RW)
            return CUDA_ERROR_INVALID_DEVICE;
    }
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuMemPoolGetAccess(int *flags, CUmemoryPool pool, CUmemLocation *location)
{
    if (!flags || !location)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = check_pool(pool);
    if (r != CUDA_SUCCESS)
        return r;
    if (location->type != GP_LOC_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    if (!gp_device(location->id))
        return CUDA_ERROR_INVALID_DEVICE;
    *flags = GP_ACCESS_RW;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool)
{
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    if (!gp_device(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    return (uint64_t)(uintptr_t)pool == gp_default_mempool() ? CUDA_SUCCESS
                                                             : CUDA_ERROR_INVALID_VALUE;
}

GP_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const void *poolProps)
{
    (void)poolProps;
    if (!pool)
        return CUDA_ERROR_INVALID_VALUE;
    static atomic_int said;
    if (!atomic_exchange(&said, 1))
        gp_log_error("cuMemPoolCreate: only the default memory pool is available over gpupool "
                     "(returned CUDA_ERROR_NOT_SUPPORTED); allocate from the default pool "
                     "(cudaMallocAsync / cuMemAllocAsync) instead");
    return CUDA_ERROR_NOT_SUPPORTED;
}

GP_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    CUresult r = check_pool(pool);
    /* The default pool cannot be destroyed; there is no other. */
    return r == CUDA_SUCCESS ? CUDA_ERROR_INVALID_VALUE : r;
}

/* ================================================================== graph memory == */

/* Memory of graph allocation nodes. A stream-ordered allocation captured into a graph is made at
 * once on the worker (docs/architecture.md), so graphs own no memory of their own: every value
 * is 0 (PyTorch's cudaMallocAsync backend reads them for its statistics). */
enum {
    GP_GRAPH_MEM_USED_CURRENT = 0,
    GP_GRAPH_MEM_USED_HIGH = 1,
    GP_GRAPH_MEM_RESERVED_CURRENT = 2,
    GP_GRAPH_MEM_RESERVED_HIGH = 3,
};

GP_EXPORT CUresult cuDeviceGetGraphMemAttribute(CUdevice device, int attr, void *value)
{
    if (!value)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    if (!gp_device(device))
        return CUDA_ERROR_INVALID_DEVICE;
    if (attr < GP_GRAPH_MEM_USED_CURRENT || attr > GP_GRAPH_MEM_RESERVED_HIGH)
        return CUDA_ERROR_INVALID_VALUE;
    *(uint64_t *)value = 0;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuDeviceSetGraphMemAttribute(CUdevice device, int attr, void *value)
{
    if (!value)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    if (!gp_device(device))
        return CUDA_ERROR_INVALID_DEVICE;
    /* Only the high-water marks can be set, and only reset to 0. */
    if ((attr != GP_GRAPH_MEM_USED_HIGH && attr != GP_GRAPH_MEM_RESERVED_HIGH) ||
        *(uint64_t *)value != 0)
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice device)
{
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    return gp_device(device) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}
