/*
 * wipe.c: the stages of a scrub: take all free memory, zero it, wait for the zeros to land, check
 * samples of it, give it back.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "scrub.h"

#define MIB (1024ull * 1024)
#define START_ALIGN (2 * MIB) /* the first chunk: all free memory rounded down to this */
#define PAGE 4096ull
#define SAMPLE 4096ull /* bytes per verified sample */

static const char advice_hw[] =
    "the GPU may be faulty: keep it out of service (quarantined) and reset it";

static int push_alloc(struct scrub_run *r, CUdeviceptr p, size_t size)
{
    if (r->nallocs == r->cap) {
        size_t ncap = r->cap ? r->cap * 2 : 64;
        struct scrub_alloc *n = realloc(r->allocs, ncap * sizeof(*n));
        if (!n)
            return -1;
        r->allocs = n;
        r->cap = ncap;
    }
    r->allocs[r->nallocs++] = (struct scrub_alloc){.ptr = p, .size = size};
    return 0;
}

/* Shrinking chunks: as large as possible first (few allocations, few calls), halving whenever the
 * driver says the memory is not there in one piece, until below --min-chunk. What is left is
 * smaller than min_chunk in every free block: on a GPU that is less than one allocation unit. */
int scrub_alloc_all(struct scrub_run *r)
{
    uint64_t chunk = r->free_before / START_ALIGN * START_ALIGN;
    if (chunk < r->min_chunk)
        chunk = r->free_before / PAGE * PAGE;
    while (chunk >= r->min_chunk && chunk > 0) {
        CUdeviceptr p = 0;
        /* Never ask for more than the device has in all: a driver that never says "out of
         * memory" must not make us loop for ever. */
        CUresult rc = r->bytes + chunk > r->total ? CUDA_ERROR_OUT_OF_MEMORY
                                                  : r->drv.cuMemAlloc(&p, (size_t)chunk);
        if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
            chunk = chunk / 2 / PAGE * PAGE;
            continue;
        }
        if (rc != CUDA_SUCCESS) {
            char what[96];
            snprintf(what, sizeof(what), "cuMemAlloc_v2(%llu bytes)", (unsigned long long)chunk);
            return scrub_fail_cu(r, "alloc", rc, what, advice_hw);
        }
        if (push_alloc(r, p, (size_t)chunk) != 0) {
            /* The allocation is released with the process. */
            return scrub_fail(r, "alloc",
                              "out of host memory for the allocation list (%zu "
                              "entries); run the scrub with a larger --min-chunk",
                              r->nallocs);
        }
        r->bytes += chunk;
        scrub_log("allocation %zu: %llu bytes at 0x%llx (%llu of %zu free bytes taken)", r->nallocs,
                  (unsigned long long)chunk, (unsigned long long)p, (unsigned long long)r->bytes,
                  r->free_before);
    }
    if (r->nallocs == 0 && r->free_before >= r->min_chunk)
        return scrub_fail(r, "alloc",
                          "no allocation of %llu bytes or more succeeded although cuMemGetInfo "
                          "reported %zu bytes free: another process may be holding the GPU's "
                          "memory (check nvidia-smi); the memory cannot be wiped",
                          (unsigned long long)r->min_chunk, r->free_before);
    return 0;
}

int scrub_zero_all(struct scrub_run *r)
{
    for (size_t i = 0; i < r->nallocs; i++) {
        CUresult rc = r->drv.cuMemsetD8(r->allocs[i].ptr, 0, r->allocs[i].size);
        if (rc != CUDA_SUCCESS) {
            char what[128];
            snprintf(what, sizeof(what), "cuMemsetD8_v2(0x%llx, 0, %zu bytes)",
                     (unsigned long long)r->allocs[i].ptr, r->allocs[i].size);
            return scrub_fail_cu(r, "memset", rc, what, advice_hw);
        }
    }
    scrub_log("zeroing of %llu bytes in %zu allocations submitted", (unsigned long long)r->bytes,
              r->nallocs);
    return 0;
}

int scrub_sync(struct scrub_run *r)
{
    /* Memsets of device memory are asynchronous: this is where they complete, or report that
     * they could not. */
    CUresult rc = r->drv.cuCtxSynchronize();
    if (rc != CUDA_SUCCESS)
        return scrub_fail_cu(r, "sync", rc, "cuCtxSynchronize after zeroing", advice_hw);
    scrub_log("zeroing complete");
    return 0;
}

static uint64_t next_rand(struct scrub_run *r)
{
    /* xorshift64: the sample offsets only need to be spread out and unpredictable to a tenant
     * who might try to hide data where the scrub does not look. */
    uint64_t x = r->rng;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    r->rng = x;
    return x;
}

static int check_piece(struct scrub_run *r, size_t k, uint64_t off, uint64_t len)
{
    unsigned char buf[SAMPLE];
    const struct scrub_alloc *a = &r->allocs[k];
    CUresult rc = r->drv.cuMemcpyDtoH(buf, a->ptr + off, (size_t)len);
    if (rc != CUDA_SUCCESS) {
        char what[128];
        snprintf(what, sizeof(what), "cuMemcpyDtoH_v2 of %llu bytes at 0x%llx",
                 (unsigned long long)len, (unsigned long long)(a->ptr + off));
        return scrub_fail_cu(r, "verify", rc, what, advice_hw);
    }
    r->samples_done++;
    for (uint64_t i = 0; i < len; i++) {
        if (buf[i] == 0)
            continue;
        uint64_t bad = 0;
        for (uint64_t j = i; j < len; j++)
            bad += buf[j] != 0;
        return scrub_fail(r, "verify",
                          "%llu of %llu bytes read back at 0x%llx (allocation %zu, offset %llu) "
                          "are not zero after zeroing (first: 0x%02x at +%llu); %s",
                          (unsigned long long)bad, (unsigned long long)len,
                          (unsigned long long)(a->ptr + off), k + 1, (unsigned long long)off,
                          buf[i], (unsigned long long)i, advice_hw);
    }
    return 0;
}

/* Every allocation's first and last 4 KiB, then r->samples pieces at random offsets, spread in
 * proportion to the allocations' sizes. */
int scrub_verify(struct scrub_run *r)
{
    uint64_t extra_left = r->samples;
    for (size_t k = 0; k < r->nallocs; k++) {
        uint64_t size = r->allocs[k].size;
        uint64_t piece = size < SAMPLE ? size : SAMPLE;
        if (check_piece(r, k, 0, piece) != 0)
            return -1;
        if (size > SAMPLE && check_piece(r, k, size - SAMPLE, SAMPLE) != 0)
            return -1;
        /* Share of the random samples; the last allocation takes what rounding left over. */
        uint64_t share = k + 1 == r->nallocs
                             ? extra_left
                             : (uint64_t)((double)r->samples * (double)size / (double)r->bytes);
        if (share > extra_left)
            share = extra_left;
        extra_left -= share;
        for (uint64_t s = 0; s < share && size > SAMPLE; s++) {
            uint64_t off = next_rand(r) % (size - SAMPLE + 1);
            if (check_piece(r, k, off, SAMPLE) != 0)
                return -1;
        }
    }
    scrub_log("verified %llu samples: all zero", (unsigned long long)r->samples_done);
    return 0;
}

int scrub_free_all(struct scrub_run *r)
{
    for (size_t i = 0; i < r->nallocs; i++) {
        CUresult rc = r->drv.cuMemFree(r->allocs[i].ptr);
        if (rc != CUDA_SUCCESS) {
            char what[96];
            snprintf(what, sizeof(what), "cuMemFree_v2(0x%llx)",
                     (unsigned long long)r->allocs[i].ptr);
            return scrub_fail_cu(r, "free", rc, what, advice_hw);
        }
    }
    scrub_log("freed %zu allocations", r->nallocs);
    return 0;
}
