/*
 * sim_vmm.c: the virtual memory management calls (cuMemAddressReserve, cuMemCreate, cuMemMap,
 * ...), emulated with mmap.
 *
 * A reservation is address space mapped PROT_NONE (MAP_NORESERVE: it costs no memory). cuMemCreate
 * only accounts the physical memory against the device's total; cuMemMap maps fresh read-write
 * pages over the reserved range, cuMemUnmap maps PROT_NONE pages back (the data is gone).
 * Limitation: the contents live in the mapping, not in the allocation handle, so mapping one
 * handle at two addresses does not alias them and a handle mapped again starts zeroed.
 *
 * With a memory file (sim_memfile.c) the contents live in the allocation as on a GPU: cuMemCreate
 * takes a range of the file, cuMemMap maps that range (shared) at the address, so mappings of one
 * handle alias each other and keep the data across unmap and map; cuMemRelease gives the range
 * back without clearing it.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "sim_api.h"
#include "sim_internal.h"
#include "sim_shared.h"

#define MAX_HINT_TRIES 64

struct phys {
    uint64_t handle;
    uint64_t size;
    int dev;
    bool released; /* cuMemRelease called; freed when the last mapping goes */
    unsigned maps;
    bool in_file;      /* backed by the memory file */
    uint64_t file_off; /* in_file: where it lies in the file */
    /* While a checkpoint holds the process (sim_checkpoint.c): */
    void *saved;      /* in_file: the allocation's bytes */
    uint64_t old_off; /* in_file: file_off when it was checkpointed */
    /* CUDA IPC (sim_ipc.c): */
    bool exportable; /* created with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR */
    bool exported;   /* its file range stays reserved until the process ends */
    bool imported;   /* another process's memory: not ours to free or count */
};

struct resv {
    uint64_t base, size;
};

static struct resv *resvs;
static size_t nresv, capresv;
static uint64_t va_cursor; /* where the next addr == 0 reservation is tried */

static bool is_pow2(uint64_t v)
{
    return v != 0 && (v & (v - 1)) == 0;
}

static bool try_reserve(uint64_t addr, uint64_t size)
{
    void *want = (void *)(uintptr_t)addr;
    void *p = mmap(want, size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
    if (p == MAP_FAILED)
        return false;
    if (p != want) { /* a kernel without MAP_FIXED_NOREPLACE treats it as a hint */
        if (munmap(p, size) != 0)
            fprintf(stderr, "gpupool-sim: munmap of a misplaced reservation failed\n");
        return false;
    }
    return true;
}

/* Any free, aligned range: first in the sim's own part of the address space (so that device
 * addresses stay clear of where hosts put their memory), else wherever the kernel likes. */
static bool reserve_anywhere(uint64_t size, uint64_t align, uint64_t *out)
{
    if (va_cursor == 0)
        va_cursor = sim_cfg.va_base;
    uint64_t a = va_cursor;
    for (int i = 0; i < MAX_HINT_TRIES; i++) {
        a = (a + align - 1) & ~(align - 1);
        if (a + size < a || a + size > 0x7f0000000000ull)
            break;
        if (try_reserve(a, size)) {
            va_cursor = a + size;
            *out = a;
            return true;
        }
        a += size;
    }
    /* Over-reserve by the alignment and trim both ends. */
    if (size + align < size)
        return false;
    void *p =
        mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
        return false;
    uint64_t start = (uint64_t)(uintptr_t)p, aligned = (start + align - 1) & ~(align - 1);
    if (aligned > start && munmap(p, aligned - start) != 0)
        fprintf(stderr, "gpupool-sim: munmap while trimming a reservation failed\n");
    uint64_t tail = start + size + align - (aligned + size);
    if (tail > 0 && munmap((void *)(uintptr_t)(aligned + size), tail) != 0)
        fprintf(stderr, "gpupool-sim: munmap while trimming a reservation failed\n");
    *out = aligned;
    return true;
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    uint64_t g = sim_cfg.granularity;
    if (!ptr || size == 0 || flags != 0 || size % g != 0 || (alignment != 0 && !is_pow2(alignment)))
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    uint64_t align = alignment > g ? alignment : g;
    if (nresv == capresv) {
        size_t ncap = capresv ? capresv * 2 : 16;
        struct resv *n = realloc(resvs, ncap * sizeof(*n));
        if (!n)
            return sim_leave(CUDA_ERROR_OUT_OF_MEMORY);
        resvs = n;
        capresv = ncap;
    }
    /* The hint is honoured when that exact range is free; otherwise, as the driver may, we
     * return another address and the caller decides whether that will do. */
    uint64_t got = 0;
    bool ok = false;
    if (addr != 0 && addr % align == 0 && addr + size > addr && try_reserve(addr, size)) {
        got = addr;
        ok = true;
    }
    if (!ok)
        ok = reserve_anywhere(size, align, &got);
    if (!ok)
        return sim_leave(CUDA_ERROR_OUT_OF_MEMORY);
    resvs[nresv++] = (struct resv){.base = got, .size = size};
    *ptr = got;
    return sim_leave(CUDA_SUCCESS);
}

static void phys_free(struct phys *p)
{
    /* An exported range may still be mapped by an importer: it stays reserved and counted (as
     * the driver keeps an allocation until its last mapping goes), until the process ends. */
    if (!p->exported && !p->imported) {
        if (p->in_file)
            sim_memfile_free(p->dev, p->file_off);
        sim_mem_account(p->dev, -(int64_t)p->size);
    }
    sim_handle_del(p->handle);
    free(p);
}

/* Removes the VMM mapping that starts at `start` (its pages become PROT_NONE again). */
static void unmap_one(uint64_t start)
{
    const struct sim_seg *s = sim_seg_find(start);
    struct sim_seg copy = *s;
    if (sim_remap(copy.start, copy.foot, PROT_NONE) != 0)
        fprintf(stderr, "gpupool-sim: cannot unmap 0x%llx\n", (unsigned long long)copy.start);
    sim_seg_remove(copy.start);
    struct phys *p = copy.obj;
    p->maps--;
    if (p->released && p->maps == 0)
        phys_free(p);
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    size_t i = 0;
    while (i < nresv && !(resvs[i].base == ptr && resvs[i].size == size))
        i++;
    if (i == nresv)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    /* Mappings still inside are dropped with the range rather than left dangling. */
    uint64_t cur = ptr;
    for (const struct sim_seg *s = sim_seg_from(cur); s && s->start < ptr + size;
         s = sim_seg_from(cur)) {
        cur = s->start + s->foot;
        if (s->kind == SIM_SEG_VMM) /* nothing else can live in a reservation */
            unmap_one(s->start);
    }
    if (munmap((void *)(uintptr_t)ptr, size) != 0)
        fprintf(stderr, "gpupool-sim: munmap of a reservation failed: errno %d\n", errno);
    resvs[i] = resvs[--nresv];
    return sim_leave(CUDA_SUCCESS);
}

/* Checks an allocation property the way cuMemCreate and cuMemGetAllocationGranularity need it. */
static CUresult check_prop(const CUmemAllocationProp *prop)
{
    if (prop->type != CU_MEM_ALLOCATION_TYPE_PINNED)
        return CUDA_ERROR_INVALID_VALUE;
    if (prop->location.type >= 2 && prop->location.type <= 4)
        return CUDA_ERROR_NOT_SUPPORTED; /* host memory locations: the sim has device memory only */
    if (prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    if (!sim_dev_valid(prop->location.id))
        return CUDA_ERROR_INVALID_DEVICE;
    return CUDA_SUCCESS;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                     const CUmemAllocationProp *prop, unsigned long long flags)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!handle || !prop || flags != 0)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    rc = check_prop(prop);
    if (rc != CUDA_SUCCESS)
        return sim_leave(rc);
    if (size == 0 || size % sim_cfg.granularity != 0)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    int dev = prop->location.id;
    if (sim_mem_used(dev) + size > sim_cfg.total_memory)
        return sim_leave(CUDA_ERROR_OUT_OF_MEMORY);
    struct phys *p = calloc(1, sizeof(*p));
    if (!p)
        return sim_leave(CUDA_ERROR_OUT_OF_MEMORY);
    p->size = size;
    p->dev = dev;
    p->exportable = (prop->requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) != 0;
    p->in_file = sim_memfile_enabled();
    if (p->in_file && sim_memfile_alloc(dev, size, &p->file_off) != CUDA_SUCCESS) {
        free(p); /* the file's part is too fragmented for this size */
        return sim_leave(CUDA_ERROR_OUT_OF_MEMORY);
    }
    p->handle = sim_handle_new(SIM_K_MEMHANDLE, p);
    if (p->handle == 0) {
        if (p->in_file)
            sim_memfile_free(dev, p->file_off);
        free(p);
        return sim_leave(CUDA_ERROR_OUT_OF_MEMORY);
    }
    sim_mem_account(dev, (int64_t)size);
    *handle = p->handle;
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    struct phys *p = sim_handle_get(handle, SIM_K_MEMHANDLE);
    if (!p || p->released)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    /* As with the driver, the memory stays until its last mapping is unmapped. */
    p->released = true;
    if (p->maps == 0)
        phys_free(p);
    return sim_leave(CUDA_SUCCESS);
}

static const struct resv *resv_containing(uint64_t ptr, uint64_t size)
{
    for (size_t i = 0; i < nresv; i++)
        if (ptr >= resvs[i].base && size <= resvs[i].size &&
            ptr - resvs[i].base <= resvs[i].size - size)
            return &resvs[i];
    return NULL;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    uint64_t g = sim_cfg.granularity;
    struct phys *p = sim_handle_get(handle, SIM_K_MEMHANDLE);
    if (flags != 0 || !p || p->released || size == 0 || ptr % g || size % g || offset % g ||
        offset > p->size || size > p->size - offset)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    if (!resv_containing(ptr, size))
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    const struct sim_seg *next = sim_seg_from(ptr);
    if (sim_seg_find(ptr) || (next && next->start < ptr + size))
        return sim_leave(CUDA_ERROR_INVALID_VALUE); /* overlaps a mapping */
    int mapped = p->in_file ? sim_memfile_map(ptr, size, p->file_off + offset)
                            : sim_remap(ptr, size, PROT_READ | PROT_WRITE);
    if (mapped != 0) {
        if (sim_remap(ptr, size, PROT_NONE) != 0) /* a failed MAP_FIXED may have unmapped it */
            fprintf(stderr, "gpupool-sim: cannot unmap 0x%llx\n", (unsigned long long)ptr);
        return sim_leave(CUDA_ERROR_OUT_OF_MEMORY);
    }
    struct sim_seg s = {.start = ptr,
                        .len = size,
                        .foot = size,
                        .kind = SIM_SEG_VMM,
                        .dev = p->dev,
                        .obj = p,
                        .in_file = p->in_file,
                        .file_off = p->file_off + offset};
    if (sim_seg_add(&s) != CUDA_SUCCESS) {
        if (sim_remap(ptr, size, PROT_NONE) != 0)
            fprintf(stderr, "gpupool-sim: cannot unmap 0x%llx\n", (unsigned long long)ptr);
        return sim_leave(CUDA_ERROR_OUT_OF_MEMORY);
    }
    p->maps++;
    return sim_leave(CUDA_SUCCESS);
}

/* True when [ptr, ptr+size) is exactly a run of whole, adjacent VMM mappings. */
static bool whole_mappings(uint64_t ptr, uint64_t size)
{
    if (size == 0 || ptr + size < ptr)
        return false;
    uint64_t cur = ptr, end = ptr + size;
    while (cur < end) {
        const struct sim_seg *s = sim_seg_find(cur);
        if (!s || s->kind != SIM_SEG_VMM || s->start != cur || s->foot > end - cur)
            return false;
        cur += s->foot;
    }
    return true;
}

/* True when every byte of [ptr, ptr+size) is VMM-mapped (by one or several mappings). */
static bool vmm_covered(uint64_t ptr, uint64_t size)
{
    if (size == 0 || ptr + size < ptr)
        return false;
    for (uint64_t cur = ptr; cur < ptr + size;) {
        const struct sim_seg *s = sim_seg_find(cur);
        if (!s || s->kind != SIM_SEG_VMM)
            return false;
        cur = s->start + s->foot;
    }
    return true;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    /* The driver unmaps whole mappings only; check all of them before touching any. */
    if (!whole_mappings(ptr, size))
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    for (uint64_t cur = ptr; cur < ptr + size;) {
        uint64_t next = cur + sim_seg_find(cur)->foot;
        unmap_one(cur);
        cur = next;
    }
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!desc || count == 0)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE)
            return sim_leave(CUDA_ERROR_INVALID_VALUE);
        if (!sim_dev_valid(desc[i].location.id))
            return sim_leave(CUDA_ERROR_INVALID_DEVICE);
        if (desc[i].flags != 0 && desc[i].flags != 1 &&
            desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            return sim_leave(CUDA_ERROR_INVALID_VALUE);
    }
    uint64_t g = sim_cfg.granularity;
    if (ptr % g != 0 || size % g != 0 || !vmm_covered(ptr, size))
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    /* Mappings are always read-write in the sim; the access flags are checked, not applied. */
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                       int option)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!granularity || !prop ||
        (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM &&
         option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    rc = check_prop(prop);
    if (rc != CUDA_SUCCESS)
        return sim_leave(rc);
    *granularity = (size_t)sim_cfg.granularity;
    return sim_leave(CUDA_SUCCESS);
}

/* ---- process checkpoints (sim_checkpoint.c) ---------------------------------------------- */
/* Every physical allocation is accounted against its device; with a memory file its bytes live
 * in the file (mapped or not), so they are saved here, per allocation; without one they live in
 * the mappings, which sim_memory.c saves. */

static void discard_one(uint64_t h, void *obj, void *arg)
{
    (void)h;
    (void)arg;
    struct phys *p = obj;
    free(p->saved);
    p->saved = NULL;
}

void sim_vmm_discard(void)
{
    sim_handle_foreach(SIM_K_MEMHANDLE, discard_one, NULL);
}

static void save_one(uint64_t h, void *obj, void *arg)
{
    (void)h;
    struct phys *p = obj;
    CUresult *rc = arg;
    if (!p->in_file || *rc != CUDA_SUCCESS)
        return;
    p->saved = malloc(p->size);
    if (!p->saved || sim_memfile_read(p->file_off, p->saved, p->size) != 0)
        *rc = CUDA_ERROR_OUT_OF_MEMORY;
    p->old_off = p->file_off;
}

CUresult sim_vmm_save(void)
{
    CUresult rc = CUDA_SUCCESS;
    sim_handle_foreach(SIM_K_MEMHANDLE, save_one, &rc);
    if (rc != CUDA_SUCCESS)
        sim_vmm_discard();
    return rc;
}

/* [off, off+len) of the memory file zeroed (a hole punched, else zeros written). 0, or -1 when
 * neither worked (the bytes may still be there). */
static int zero_file(uint64_t off, uint64_t len)
{
    if (sim_memfile_punch(off, len) == 0)
        return 0;
    static const unsigned char zeros[1 << 16];
    for (uint64_t done = 0; done < len;) {
        uint64_t n = len - done < sizeof(zeros) ? len - done : sizeof(zeros);
        if (sim_memfile_write(off + done, zeros, n) != 0)
            return -1;
        done += n;
    }
    return 0;
}

static void release_one(uint64_t h, void *obj, void *arg)
{
    (void)h;
    (void)arg;
    struct phys *p = obj;
    if (p->imported)
        return; /* the exporter's memory */
    /* On a shared GPU zeroed first, as a share's every freed byte (sim_memory_release). A range
     * that could not be zeroed stays out of the allocator: the next share would read its
     * bytes. Lost until the GPU's memory file is made anew (the whole-GPU scrub). */
    if (p->in_file && sim_shared_enabled() && zero_file(p->file_off, p->size) != 0)
        fprintf(stderr,
                "gpupool-sim: checkpoint: cannot zero the %llu bytes a share gives back (%s); "
                "they stay out of use until the GPU is scrubbed whole\n",
                (unsigned long long)p->size, strerror(errno));
    else if (p->in_file)
        sim_memfile_free(p->dev, p->file_off);
    sim_mem_account(p->dev, -(int64_t)p->size);
}

void sim_vmm_release(void)
{
    sim_handle_foreach(SIM_K_MEMHANDLE, release_one, NULL);
}

static void restore_one(uint64_t h, void *obj, void *arg)
{
    (void)h;
    struct phys *p = obj;
    CUresult *rc = arg;
    if (*rc != CUDA_SUCCESS || p->imported)
        return;
    if (p->in_file) {
        uint64_t off;
        if (sim_memfile_alloc(p->dev, p->size, &off) != CUDA_SUCCESS ||
            sim_memfile_write(off, p->saved, p->size) != 0) {
            *rc = CUDA_ERROR_OUT_OF_MEMORY;
            return;
        }
        p->file_off = off;
    }
    sim_mem_account(p->dev, (int64_t)p->size);
}

CUresult sim_vmm_restore(void)
{
    CUresult rc = CUDA_SUCCESS;
    sim_handle_foreach(SIM_K_MEMHANDLE, restore_one, &rc);
    return rc;
}

uint64_t sim_vmm_restored_offset(void *obj, uint64_t old_file_off)
{
    const struct phys *p = obj;
    return p->file_off + (old_file_off - p->old_off);
}

/* ---- CUDA IPC (sim_ipc.c) ---------------------------------------------------------------- */

CUresult sim_vmm_share(uint64_t handle, struct sim_vmm_share *out)
{
    struct phys *p = sim_handle_get(handle, SIM_K_MEMHANDLE);
    if (!p || p->released || p->imported)
        return CUDA_ERROR_INVALID_VALUE;
    if (!p->exportable) {
        sim_detail("the allocation was created without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR "
                   "in prop.requestedHandleTypes");
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (!p->in_file) {
        sim_detail("sharing device memory between processes needs a memory file (key "
                   "memory_file)");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    p->exported = true;
    *out = (struct sim_vmm_share){.dev = p->dev, .size = p->size, .file_off = p->file_off};
    return CUDA_SUCCESS;
}

CUresult sim_vmm_import(int dev, uint64_t file_off, uint64_t size,
                        CUmemGenericAllocationHandle *handle)
{
    struct phys *p = calloc(1, sizeof(*p));
    if (!p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *p = (struct phys){
        .size = size, .dev = dev, .in_file = true, .file_off = file_off, .imported = true};
    p->handle = sim_handle_new(SIM_K_MEMHANDLE, p);
    if (p->handle == 0) {
        free(p);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *handle = p->handle;
    return CUDA_SUCCESS;
}
