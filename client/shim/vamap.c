/*
 * vamap.c: the client's map of addresses.
 *
 * Two jobs (docs/architecture.md, "the VA window"):
 *  - reserve the window of address space where the server places every device allocation, so
 *    that no device pointer can ever alias memory of this process;
 *  - record every range the program got from us (device allocations, module globals, pinned
 *    host memory, registered host memory), so that copies are checked locally, cuMemcpy without
 *    a direction is classified and pointer attributes are answered without a round trip.
 * The ranges never overlap; they live in an array sorted by base under a read-write lock.
 * Programs hold at most a few thousand live allocations (caching allocators hold few, large
 * ones), so insertion by memmove is cheaper than a tree and lookups are a binary search.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "gp_vmm.h"
#include "shim.h"
#include "shim_core.h"

#ifndef MAP_FIXED_NOREPLACE
#define MAP_FIXED_NOREPLACE 0x100000
#endif

static pthread_rwlock_t map_lock = PTHREAD_RWLOCK_INITIALIZER;
static gp_range *ranges; /* guarded by map_lock, sorted by base */
static size_t nranges, rcap;
static atomic_uint_fast64_t next_buffer_id = 1;

static uint64_t win_base, win_size; /* set once before any device range exists */

/* Globals of a lease spread over servers (docs/multi-gpu.md, "Across servers"): each part's
 * worker has its own copy of a library's globals, placed where its own driver chose, so two
 * parts' copies of one global may have the same address (the simulated device always does).
 * The first is in `ranges`; the others, "twins" (the same base and size, another context),
 * are kept here, under map_lock, and gp_vamap_global_of finds the one the caller wants. */
#define MAX_TWINS 1024
static gp_range twins[MAX_TWINS];
static size_t ntwins;

/* Index of the first range whose base is > addr. Caller holds the lock. */
static size_t upper(uint64_t addr)
{
    size_t lo = 0, hi = nranges;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (ranges[mid].base <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Index of the range containing addr, or -1. Caller holds the lock. */
static long containing(uint64_t addr)
{
    size_t i = upper(addr);
    if (i == 0)
        return -1;
    const gp_range *r = &ranges[i - 1];
    return addr - r->base < r->size ? (long)(i - 1) : -1;
}

int gp_vamap_add(const gp_range *r)
{
    if (!r || r->size == 0 || r->base + r->size < r->base)
        return -1;
    int rc = -1;
    pthread_rwlock_wrlock(&map_lock);
    size_t i = upper(r->base);
    int overlaps = (i > 0 && ranges[i - 1].base + ranges[i - 1].size > r->base) ||
                   (i < nranges && ranges[i].base < r->base + r->size);
    if (!overlaps) {
        if (nranges == rcap) {
            size_t ncap = rcap ? rcap * 2 : 64;
            gp_range *n = realloc(ranges, ncap * sizeof *n);
            if (!n)
                goto out;
            ranges = n;
            rcap = ncap;
        }
        memmove(&ranges[i + 1], &ranges[i], (nranges - i) * sizeof *ranges);
        ranges[i] = *r;
        if (ranges[i].buffer_id == 0)
            ranges[i].buffer_id = atomic_fetch_add(&next_buffer_id, 1);
        nranges++;
        rc = 0;
    }
out:
    pthread_rwlock_unlock(&map_lock);
    return rc;
}

int gp_vamap_remove(uint64_t base, gp_range *out)
{
    int rc = -1;
    pthread_rwlock_wrlock(&map_lock);
    size_t i = upper(base);
    if (i > 0 && ranges[i - 1].base == base) {
        if (out)
            *out = ranges[i - 1];
        memmove(&ranges[i - 1], &ranges[i], (nranges - i) * sizeof *ranges);
        nranges--;
        rc = 0;
    }
    pthread_rwlock_unlock(&map_lock);
    return rc;
}

int gp_vamap_find(uint64_t addr, gp_range *out)
{
    pthread_rwlock_rdlock(&map_lock);
    long i = containing(addr);
    if (i >= 0 && out)
        *out = ranges[i];
    pthread_rwlock_unlock(&map_lock);
    return i >= 0 ? 0 : -1;
}

static int accessible(const gp_range *r)
{
    return (r->kind == GP_RANGE_DEVICE || r->kind == GP_RANGE_GLOBAL) &&
           !(r->flags & GP_RANGE_F_NOACCESS);
}

int gp_vamap_device_span(uint64_t addr, uint64_t len)
{
    int ok = 0;
    pthread_rwlock_rdlock(&map_lock);
    long i = containing(addr);
    if (i >= 0 && accessible(&ranges[i])) {
        const gp_range *r = &ranges[i];
        uint64_t end = r->base + r->size; /* covered so far */
        ok = len <= end - addr;
        /* cuMemMap mappings placed side by side are one span of virtual addresses. */
        for (size_t k = (size_t)i + 1; !ok && (r->flags & GP_RANGE_F_VMM) && k < nranges; k++) {
            const gp_range *n = &ranges[k];
            if (n->base != end || !(n->flags & GP_RANGE_F_VMM) || !accessible(n))
                break;
            end += n->size;
            ok = len <= end - addr;
        }
    }
    pthread_rwlock_unlock(&map_lock);
    return ok;
}

/* Host ranges are never side by side in one span: each is its own allocation or registration. */
int gp_vamap_host_span(uint64_t addr, uint64_t len)
{
    int ok = 0;
    pthread_rwlock_rdlock(&map_lock);
    long i = containing(addr);
    if (i >= 0 && (ranges[i].kind == GP_RANGE_HOST_ALLOC || ranges[i].kind == GP_RANGE_HOST_REG))
        ok = len <= ranges[i].base + ranges[i].size - addr;
    pthread_rwlock_unlock(&map_lock);
    return ok;
}

int gp_vamap_vmm_flags(uint64_t addr, uint64_t len, unsigned set, unsigned clear)
{
    if (len == 0 || addr + len < addr)
        return -1;
    int rc = -1;
    pthread_rwlock_wrlock(&map_lock);
    long i = containing(addr);
    if (i >= 0 && ranges[i].base == addr) {
        size_t k = (size_t)i;
        uint64_t cur = addr;
        while (k < nranges && ranges[k].base == cur && (ranges[k].flags & GP_RANGE_F_VMM) &&
               cur - addr < len)
            cur += ranges[k++].size;
        if (cur - addr == len) {
            for (size_t j = (size_t)i; j < k; j++)
                ranges[j].flags = (ranges[j].flags | set) & ~clear;
            rc = 0;
        }
    }
    pthread_rwlock_unlock(&map_lock);
    return rc;
}

void gp_vamap_async_bytes(uint64_t *used, uint64_t *mapped)
{
    uint64_t u = 0, m = 0;
    pthread_rwlock_rdlock(&map_lock);
    for (size_t i = 0; i < nranges; i++) {
        if (ranges[i].kind != GP_RANGE_DEVICE || !(ranges[i].flags & GP_RANGE_F_ASYNC))
            continue;
        u += ranges[i].size;
        m += ranges[i].mapped_size ? ranges[i].mapped_size : ranges[i].size;
    }
    pthread_rwlock_unlock(&map_lock);
    *used = u;
    *mapped = m;
}

/* The twin at base (of context ctx, or of any context when ctx is 0), or -1. Caller holds
 * the lock. */
static long twin_at(uint64_t base, uint64_t ctx)
{
    for (size_t i = 0; i < ntwins; i++)
        if (twins[i].base == base && (ctx == 0 || twins[i].ctx == ctx))
            return (long)i;
    return -1;
}

static void twin_drop(long i)
{
    twins[i] = twins[--ntwins];
}

/* ranges[i] goes: a twin of it takes its place, if there is one. Caller holds the lock. */
static void main_drop(size_t i, size_t *nkeep)
{
    long t = ranges[i].kind == GP_RANGE_GLOBAL ? twin_at(ranges[i].base, 0) : -1;
    if (t >= 0) {
        ranges[(*nkeep)++] = twins[t];
        twin_drop(t);
    }
}

int gp_vamap_remove_ctx(uint64_t ctx)
{
    int n = 0;
    pthread_rwlock_wrlock(&map_lock);
    for (long t = (long)ntwins - 1; t >= 0; t--)
        if (twins[t].ctx == ctx) {
            twin_drop(t);
            n++;
        }
    size_t k = 0;
    for (size_t i = 0; i < nranges; i++) {
        int dev = ranges[i].kind == GP_RANGE_DEVICE || ranges[i].kind == GP_RANGE_GLOBAL;
        if (dev && ranges[i].ctx == ctx) {
            n++;
            main_drop(i, &k); /* same base: the order stays sorted */
            continue;
        }
        ranges[k++] = ranges[i];
    }
    nranges = k;
    pthread_rwlock_unlock(&map_lock);
    return n;
}

/* ---- the window ---------------------------------------------------------------------------- */

uint64_t gp_vamap_window_base(void)
{
    return win_base;
}
uint64_t gp_vamap_window_size(void)
{
    return win_size;
}

int gp_vamap_in_window(uint64_t addr)
{
    return win_size && addr - win_base < win_size;
}

int gp_vamap_reserve_window(uint64_t base, uint64_t size)
{
    if (win_size)
        return -1;
    void *p = mmap((void *)(uintptr_t)base, size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
    if (p == MAP_FAILED)
        return -1;
    if ((uint64_t)(uintptr_t)p != base) {
        /* A kernel older than 4.17 ignores MAP_FIXED_NOREPLACE and treats base as a hint. */
        munmap(p, size);
        errno = EEXIST;
        return -1;
    }
    win_base = base;
    win_size = size;
    return 0;
}

void gp_vamap_release_window(void)
{
    if (!win_size)
        return;
    munmap((void *)(uintptr_t)win_base, win_size);
    win_base = win_size = 0;
}

/* ---- module globals ------------------------------------------------------------------------ */

/* Reserve [base, base+size) PROT_NONE where nothing is mapped yet (best effort). */
static void reserve_pages(uint64_t base, uint64_t size)
{
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t lo = base & ~(page - 1), hi = (base + size + page - 1) & ~(page - 1);
    int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE;
    void *p = mmap((void *)(uintptr_t)lo, hi - lo, PROT_NONE, flags, -1, 0);
    if (p != MAP_FAILED && (uint64_t)(uintptr_t)p == lo)
        return;
    if (p != MAP_FAILED)
        munmap(p, hi - lo);
    /* Part of it is mapped already (often our own reservation of a neighbouring global): do the
     * rest page by page, for ranges of sane size. */
    int clash = 0;
    for (uint64_t a = lo; a < hi && (hi - lo) / page <= 16384; a += page) {
        p = mmap((void *)(uintptr_t)a, page, PROT_NONE, flags, -1, 0);
        if (p == MAP_FAILED || (uint64_t)(uintptr_t)p != a) {
            if (p != MAP_FAILED)
                munmap(p, page);
            clash = 1;
        }
    }
    if (clash)
        gp_log_debug("module global at 0x%llx (%llu bytes) overlaps pages already mapped in "
                     "this process",
                     (unsigned long long)base, (unsigned long long)size);
}

int gp_vamap_add_global(uint64_t base, uint64_t size, uint64_t ctx)
{
    if (size == 0)
        size = 1;
    gp_range have;
    if (gp_vamap_find(base, &have) == 0) {
        if (have.kind != GP_RANGE_GLOBAL || have.base != base || have.size != size)
            return -1;
        if (have.ctx == ctx)
            return 0;
        int rc = 0; /* another part's copy at the same address: a twin */
        pthread_rwlock_wrlock(&map_lock);
        if (twin_at(base, ctx) < 0) {
            if (ntwins == MAX_TWINS) {
                rc = -1;
            } else {
                twins[ntwins] = have;
                twins[ntwins].ctx = ctx;
                twins[ntwins++].buffer_id = atomic_fetch_add(&next_buffer_id, 1);
            }
        }
        pthread_rwlock_unlock(&map_lock);
        return rc;
    }
    if (!gp_vamap_in_window(base))
        reserve_pages(base, size);
    gp_range r = {.base = base, .size = size, .kind = GP_RANGE_GLOBAL, .ctx = ctx};
    int rc = gp_vamap_add(&r);
    if (rc != 0 && gp_vamap_find(base, &have) == 0 && have.kind == GP_RANGE_GLOBAL &&
        have.base == base && have.size == size)
        rc = 0; /* another thread added the same global meanwhile */
    return rc;
}

int gp_vamap_remove_global(uint64_t base, uint64_t ctx)
{
    int rc = -1;
    pthread_rwlock_wrlock(&map_lock);
    long t = twin_at(base, ctx);
    size_t i = upper(base);
    if (t >= 0) {
        twin_drop(t);
        rc = 0;
    } else if (i > 0 && ranges[i - 1].base == base && ranges[i - 1].kind == GP_RANGE_GLOBAL &&
               ranges[i - 1].ctx == ctx) {
        size_t k = i - 1;
        main_drop(i - 1, &k);
        if (k == i - 1) { /* no twin took its place */
            memmove(&ranges[i - 1], &ranges[i], (nranges - i) * sizeof *ranges);
            nranges--;
        }
        rc = 0;
    }
    pthread_rwlock_unlock(&map_lock);
    return rc;
}

int gp_vamap_global_of(uint64_t addr, int (*wanted)(uint64_t ctx), gp_range *out)
{
    int rc = -1;
    pthread_rwlock_rdlock(&map_lock);
    long i = containing(addr);
    if (i >= 0 && ranges[i].kind == GP_RANGE_GLOBAL) {
        if (wanted(ranges[i].ctx)) {
            *out = ranges[i];
            rc = 0;
        }
        for (size_t t = 0; rc != 0 && t < ntwins; t++)
            if (twins[t].base == ranges[i].base && wanted(twins[t].ctx)) {
                *out = twins[t];
                rc = 0;
            }
    }
    pthread_rwlock_unlock(&map_lock);
    return rc;
}
