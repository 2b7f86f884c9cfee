/*
 * sim_memory.c: simulated device memory.
 *
 * Device memory is host memory at the same address, so a "device pointer" can be used directly
 * by copies and by the host versions of kernels. What makes it device memory is that the sim
 * knows it: every range a caller or a kernel touches is looked up in a registry of segments
 * (cuMemAlloc allocations, VMM mappings, cuMemHostAlloc memory) before it is used, so a bad
 * pointer yields an error instead of a crash of the worker.
 *
 * cuMemAlloc memory comes from a heap region per device, reserved (PROT_NONE, no swap) at
 * heap_base by cuInit, so that these pointers never land at addresses a client uses for its own
 * host memory. An allocation occupies whole pages: mapping fresh pages read-write allocates it,
 * mapping PROT_NONE over them frees it and gives the memory back to the system. With a memory
 * file (sim_memfile.c) the pages mapped are the file's instead, and what was written stays there
 * after the free, as in a GPU's DRAM.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "sim_api.h"
#include "sim_internal.h"
#include "sim_shared.h"

#define PAGE 4096ull
#define HEAP_STRIDE_ALIGN (2ull * 1024 * 1024)
/* Zeroing gives whole pages back (sim_zero_range) only for ranges at least this long: for a few
 * pages a memset is cheaper than the system call and the page faults that follow it. */
#define ZERO_GIVE_BACK_MIN (64ull * 1024)

static struct sim_seg *segs; /* sorted by start, never overlapping */
static size_t nsegs, capsegs;
static uint64_t used_bytes[SIM_MAX_DEVICES];
static uint64_t heap_stride;

/* ---- segment registry -------------------------------------------------------------------- */

/* Index of the first segment whose start is > addr. */
static size_t upper(uint64_t addr)
{
    size_t lo = 0, hi = nsegs;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (segs[mid].start <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

CUresult sim_seg_add(const struct sim_seg *s)
{
    if (nsegs == capsegs) {
        size_t ncap = capsegs ? capsegs * 2 : 64;
        struct sim_seg *n = realloc(segs, ncap * sizeof(*n));
        if (!n)
            return CUDA_ERROR_OUT_OF_MEMORY;
        segs = n;
        capsegs = ncap;
    }
    size_t i = upper(s->start);
    memmove(&segs[i + 1], &segs[i], (nsegs - i) * sizeof(*segs));
    segs[i] = *s;
    nsegs++;
    return CUDA_SUCCESS;
}

/* The segment whose footprint contains addr. */
const struct sim_seg *sim_seg_find(uint64_t addr)
{
    size_t i = upper(addr);
    if (i == 0)
        return NULL;
    const struct sim_seg *s = &segs[i - 1];
    return addr - s->start < s->foot ? s : NULL;
}

/* The first segment that starts at or after addr (for walking a range in address order). */
const struct sim_seg *sim_seg_from(uint64_t addr)
{
    size_t i = addr == 0 ? 0 : upper(addr - 1);
    return i < nsegs ? &segs[i] : NULL;
}

void sim_seg_remove(uint64_t start)
{
    size_t i = upper(start);
    if (i == 0 || segs[i - 1].start != start)
        return;
    i--;
    memmove(&segs[i], &segs[i + 1], (nsegs - i - 1) * sizeof(*segs));
    nsegs--;
}

void *sim_dev_range(uint64_t addr, uint64_t len)
{
    if (len == 0 || addr + len < addr)
        return NULL;
    uint64_t end = addr + len, cur = addr;
    /* Adjacent segments (VMM mappings side by side) form one valid range, as on the device. */
    for (;;) {
        size_t i = upper(cur);
        if (i == 0)
            return NULL;
        const struct sim_seg *s = &segs[i - 1];
        if (cur - s->start >= s->len)
            return NULL;
        uint64_t s_end = s->start + s->len;
        if (s_end >= end)
            return (void *)(uintptr_t)addr;
        cur = s_end;
    }
}

int sim_remap(uint64_t addr, uint64_t len, int prot)
{
    void *p = mmap((void *)(uintptr_t)addr, len, prot,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    return p == (void *)(uintptr_t)addr ? 0 : -1;
}

/* Zeroes [a, a+n), which lies within the touchable part of segment s. */
static void zero_piece(const struct sim_seg *s, uint64_t a, uint64_t n)
{
    unsigned char *p = (unsigned char *)(uintptr_t)a;
    uint64_t lo = (a + PAGE - 1) / PAGE * PAGE, hi = (a + n) / PAGE * PAGE;
    if (n < ZERO_GIVE_BACK_MIN || hi <= lo) {
        memset(p, 0, n);
        return;
    }
    memset(p, 0, lo - a); /* partial pages at either end are written */
    memset((unsigned char *)(uintptr_t)hi, 0, a + n - hi);
    int given_back;
    if (s->in_file) {
        given_back = sim_memfile_punch(s->file_off + (lo - s->start), hi - lo);
    } else {
        /* Private anonymous pages (heap, VMM mappings, cuMemHostAlloc memory): dropping them
         * makes them read as zeros and returns the memory to the system, where writing zeros
         * would have to allocate every page first. */
        given_back = madvise((void *)(uintptr_t)lo, hi - lo, MADV_DONTNEED);
    }
    if (given_back != 0)
        memset((unsigned char *)(uintptr_t)lo, 0, hi - lo);
}

void sim_zero_range(uint64_t addr, uint64_t len)
{
    /* The range may span adjacent segments (VMM mappings side by side), as in sim_dev_range. */
    uint64_t end = addr + len, cur = addr;
    while (cur < end) {
        const struct sim_seg *s = sim_seg_find(cur);
        if (!s) /* cannot happen after sim_dev_range accepted the range */
            return;
        uint64_t s_end = s->start + s->len < end ? s->start + s->len : end;
        zero_piece(s, cur, s_end - cur);
        cur = s_end;
    }
}

/* ---- accounting -------------------------------------------------------------------------- */

uint64_t sim_mem_used(int dev)
{
    return used_bytes[dev];
}

void sim_mem_account(int dev, int64_t delta)
{
    used_bytes[dev] += (uint64_t)delta;
}

/* ---- the cuMemAlloc heap ----------------------------------------------------------------- */

CUresult sim_memory_init(void)
{
    heap_stride =
        (sim_cfg.total_memory + HEAP_STRIDE_ALIGN - 1) / HEAP_STRIDE_ALIGN * HEAP_STRIDE_ALIGN;
    uint64_t span = heap_stride * (uint64_t)sim_cfg.device_count;
    void *want = (void *)(uintptr_t)sim_cfg.heap_base;
    void *p = mmap(want, span, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
    if (p == MAP_FAILED || p != want) {
        int err = errno;
        if (p != MAP_FAILED && munmap(p, span) != 0)
            fprintf(stderr, "gpupool-sim: munmap of a misplaced reservation failed\n");
        sim_init_fail("cannot reserve the device heap at 0x%llx (%llu bytes; key heap_base): %s",
                      (unsigned long long)sim_cfg.heap_base, (unsigned long long)span,
                      p == MAP_FAILED ? strerror(err) : "address taken");
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    CUresult rc = sim_shared_init(); /* first: it may choose the memory file */
    return rc == CUDA_SUCCESS ? sim_memfile_init() : rc;
}

CUresult sim_heap_alloc(int dev, uint64_t owner, uint64_t size, unsigned flags, uint64_t *out)
{
    if (size == 0 || size > sim_cfg.total_memory)
        return CUDA_ERROR_OUT_OF_MEMORY;
    uint64_t foot = (size + PAGE - 1) / PAGE * PAGE;
    if (used_bytes[dev] + foot > sim_cfg.total_memory)
        return CUDA_ERROR_OUT_OF_MEMORY;
    /* First fit over the device's region, walking its segments in address order. */
    uint64_t base = sim_cfg.heap_base + heap_stride * (uint64_t)dev, top = base + heap_stride;
    uint64_t cand = base;
    for (size_t i = upper(base - 1); i < nsegs && segs[i].start < top; i++) {
        if (segs[i].start - cand >= foot)
            break;
        cand = segs[i].start + segs[i].foot;
    }
    if (top - cand < foot)
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct sim_seg s = {.start = cand,
                        .len = size,
                        .foot = foot,
                        .kind = SIM_SEG_HEAP,
                        .flags = flags,
                        .dev = dev,
                        .owner = owner,
                        .in_file = sim_memfile_enabled()};
    if (s.in_file && sim_memfile_alloc(dev, foot, &s.file_off) != CUDA_SUCCESS)
        return CUDA_ERROR_OUT_OF_MEMORY; /* the file's part is too fragmented */
    int mapped = s.in_file ? sim_memfile_map(cand, foot, s.file_off)
                           : sim_remap(cand, foot, PROT_READ | PROT_WRITE);
    if (mapped != 0 || sim_seg_add(&s) != CUDA_SUCCESS) {
        if (sim_remap(cand, foot, PROT_NONE) != 0)
            fprintf(stderr, "gpupool-sim: cannot return heap pages at 0x%llx\n",
                    (unsigned long long)cand);
        if (s.in_file)
            sim_memfile_free(dev, s.file_off);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    used_bytes[dev] += foot;
    *out = cand;
    return CUDA_SUCCESS;
}

static void heap_release(size_t i)
{
    struct sim_seg s = segs[i];
    /* PROT_NONE pages in place of the old ones: the contents are gone and later accesses through
     * a stale pointer are refused by the registry (and would fault, not corrupt, in host code). */
    if (sim_remap(s.start, s.foot, PROT_NONE) != 0)
        fprintf(stderr, "gpupool-sim: cannot return heap pages at 0x%llx\n",
                (unsigned long long)s.start);
    if (s.in_file) /* the bytes stay in the file, as in DRAM, until someone overwrites them */
        sim_memfile_free(s.dev, s.file_off);
    used_bytes[s.dev] -= s.foot;
    sim_seg_remove(s.start);
}

CUresult sim_heap_free(uint64_t addr, bool allow_global)
{
    size_t i = upper(addr);
    if (i == 0 || segs[i - 1].start != addr || segs[i - 1].kind != SIM_SEG_HEAP)
        return CUDA_ERROR_INVALID_VALUE;
    if ((segs[i - 1].flags & SIM_SEG_GLOBAL) && !allow_global)
        return CUDA_ERROR_INVALID_VALUE;
    heap_release(i - 1);
    return CUDA_SUCCESS;
}

static void host_release(size_t i)
{
    struct sim_seg s = segs[i];
    if (munmap((void *)(uintptr_t)s.start, s.foot) != 0)
        fprintf(stderr, "gpupool-sim: munmap of host memory at 0x%llx failed\n",
                (unsigned long long)s.start);
    sim_seg_remove(s.start);
}

void sim_heap_free_owner(uint64_t owner)
{
    for (size_t i = nsegs; i-- > 0;) {
        if (segs[i].owner != owner)
            continue;
        if (segs[i].kind == SIM_SEG_HEAP)
            heap_release(i);
        else if (segs[i].kind == SIM_SEG_HOST)
            host_release(i);
    }
}

/* ---- API --------------------------------------------------------------------------------- */

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!dptr || bytesize == 0)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    uint64_t p = 0;
    rc = sim_heap_alloc(c->dev, c->handle, bytesize, 0, &p);
    if (rc == CUDA_SUCCESS)
        *dptr = p;
    return sim_leave(rc);
}

CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    return sim_leave(sim_heap_free(dptr, false));
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!free_bytes && !total)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    /* A shared GPU's free memory is what all its processes together leave (sim_shared.c). */
    uint64_t used =
        sim_shared_enabled() ? sim_shared_used(sim_phys_dev(c->dev)) : used_bytes[c->dev];
    if (free_bytes)
        *free_bytes = (size_t)(used < sim_cfg.total_memory ? sim_cfg.total_memory - used : 0);
    if (total)
        *total = (size_t)sim_cfg.total_memory;
    return sim_leave(CUDA_SUCCESS);
}

/* Page-locked host memory: ordinary host pages that the sim also treats as device-accessible, as
 * unified addressing makes mapped pinned memory on a real device. Not counted against the
 * device's memory. */
CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!pp || bytesize == 0 ||
        (Flags & ~(unsigned)(CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP |
                             CU_MEMHOSTALLOC_WRITECOMBINED)) != 0)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    if (bytesize > SIZE_MAX - PAGE)
        return sim_leave(CUDA_ERROR_OUT_OF_MEMORY);
    uint64_t foot = (bytesize + PAGE - 1) / PAGE * PAGE;
    void *p = mmap(NULL, foot, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return sim_leave(CUDA_ERROR_OUT_OF_MEMORY);
    struct sim_seg s = {.start = (uint64_t)(uintptr_t)p,
                        .len = bytesize,
                        .foot = foot,
                        .kind = SIM_SEG_HOST,
                        .dev = c->dev,
                        .owner = c->handle};
    if (sim_seg_add(&s) != CUDA_SUCCESS) {
        if (munmap(p, foot) != 0)
            fprintf(stderr, "gpupool-sim: munmap of host memory failed\n");
        return sim_leave(CUDA_ERROR_OUT_OF_MEMORY);
    }
    *pp = p;
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuMemFreeHost(void *p)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    uint64_t a = (uint64_t)(uintptr_t)p;
    size_t i = upper(a);
    if (!p || i == 0 || segs[i - 1].start != a || segs[i - 1].kind != SIM_SEG_HOST)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    host_release(i - 1);
    return sim_leave(CUDA_SUCCESS);
}

/* ---- process checkpoints (sim_checkpoint.c) ---------------------------------------------- */
/* Per segment, while a checkpoint holds the process: the bytes of heap segments and of VMM
 * mappings without a memory file (with one, a mapping's bytes are its allocation's, saved by
 * sim_vmm.c). Indexes are the registry's, which cannot change while the process is locked. */
static void **saved;
static size_t nsaved;

static bool saves_bytes(const struct sim_seg *s)
{
    return s->kind == SIM_SEG_HEAP || (s->kind == SIM_SEG_VMM && !s->in_file);
}

void sim_memory_discard(void)
{
    for (size_t i = 0; i < nsaved; i++)
        free(saved[i]);
    free(saved);
    saved = NULL;
    nsaved = 0;
}

CUresult sim_memory_save(void)
{
    sim_memory_discard();
    saved = calloc(nsegs ? nsegs : 1, sizeof(*saved));
    if (!saved)
        return CUDA_ERROR_OUT_OF_MEMORY;
    nsaved = nsegs;
    for (size_t i = 0; i < nsegs; i++) {
        if (!saves_bytes(&segs[i]))
            continue;
        saved[i] = malloc(segs[i].foot);
        if (!saved[i]) {
            sim_memory_discard();
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        /* From the memory file with pread where there is one: several times faster than copying
         * from the mapping, whose pages this process may never have touched (each would fault). */
        if (segs[i].in_file) {
            if (sim_memfile_read(segs[i].file_off, saved[i], segs[i].foot) != 0) {
                sim_memory_discard();
                return CUDA_ERROR_OPERATING_SYSTEM;
            }
        } else {
            memcpy(saved[i], (const void *)(uintptr_t)segs[i].start, segs[i].foot);
        }
    }
    return CUDA_SUCCESS;
}

void sim_memory_release(void)
{
    for (size_t i = 0; i < nsegs; i++) {
        struct sim_seg *s = &segs[i];
        if (s->kind == SIM_SEG_HOST)
            continue;
        /* A tenant of a shared GPU leaves nothing behind for the next one to read, as gpupool
         * requires of every byte a share frees (its worker zeroes what the program frees; the
         * checkpoint's release is the driver's, so zeroed here). */
        if (s->kind == SIM_SEG_HEAP && sim_shared_enabled())
            zero_piece(s, s->start, s->foot);
        /* The addresses stay reserved (PROT_NONE) and in the registry: the process keeps its
         * pointers; only the memory behind them goes. */
        if (sim_remap(s->start, s->foot, PROT_NONE) != 0)
            fprintf(stderr, "gpupool-sim: checkpoint: cannot release 0x%llx\n",
                    (unsigned long long)s->start);
        if (s->kind == SIM_SEG_HEAP) {
            if (s->in_file)
                sim_memfile_free(s->dev, s->file_off);
            used_bytes[s->dev] -= s->foot;
        }
    }
}

CUresult sim_memory_restore(void)
{
    CUresult rc = CUDA_SUCCESS;
    for (size_t i = 0; i < nsegs && rc == CUDA_SUCCESS; i++) {
        struct sim_seg *s = &segs[i];
        if (s->kind == SIM_SEG_HOST)
            continue;
        int mapped;
        if (s->in_file) {
            uint64_t off = 0;
            if (s->kind == SIM_SEG_HEAP) {
                if (sim_memfile_alloc(s->dev, s->foot, &off) != CUDA_SUCCESS) {
                    rc = CUDA_ERROR_OUT_OF_MEMORY;
                    break;
                }
            } else {
                off = sim_vmm_restored_offset(s->obj, s->file_off);
            }
            s->file_off = off;
            /* The bytes go into the file first (pwrite allocates its pages in bulk, about twice
             * as fast as faulting them in through the mapping), then the mapping. */
            if (i < nsaved && saved[i] && sim_memfile_write(off, saved[i], s->foot) != 0) {
                rc = CUDA_ERROR_OPERATING_SYSTEM;
                break;
            }
            if (i < nsaved && saved[i]) {
                free(saved[i]);
                saved[i] = NULL;
            }
            mapped = sim_memfile_map(s->start, s->foot, off);
        } else {
            mapped = sim_remap(s->start, s->foot, PROT_READ | PROT_WRITE);
        }
        if (mapped != 0) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
            break;
        }
        if (i < nsaved && saved[i])
            memcpy((void *)(uintptr_t)s->start, saved[i], s->foot);
        if (s->kind == SIM_SEG_HEAP)
            used_bytes[s->dev] += s->foot;
    }
    if (rc == CUDA_SUCCESS)
        sim_memory_discard();
    return rc;
}
