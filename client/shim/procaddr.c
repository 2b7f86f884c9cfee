/*
 * procaddr.c: cuGetProcAddress, through which cudart resolves almost every driver function
 * (about 440 lookups per cudart instance at start-up, each with a CUDA version and flags).
 *
 * The table (generated/gp_procaddr_table.c, from cudaTypedefs.h) lists every revision of every
 * function: (base name, CUDA version that introduced the revision, per-thread flag, function).
 * A query asks for a base name at a CUDA version: it gets the newest revision not newer than
 * that version, because that is the signature the caller was compiled against.
 *
 * Lookups are two binary searches over constant arrays: no locks, no allocation, safe to call
 * before cuInit (cudart asks for cuInit itself through here).
 */
#include <stddef.h>
#include <string.h>

#include "generated/gp_cuda_tables.h"
#include "procaddr.h"

/* Index of `name` in the sorted base table, or -1. */
static long find_base(const char *name)
{
    size_t lo = 0, hi = gp_procaddr_bases_len;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(name, gp_procaddr_bases[mid].name);
        if (c == 0)
            return (long)mid;
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return -1;
}

gp_cu_fn gp_symbol_lookup(const char *name)
{
    if (name == NULL)
        return NULL;
    size_t lo = 0, hi = gp_symbol_table_len;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(name, gp_symbol_table[mid].name);
        if (c == 0)
            return gp_symbol_table[mid].fn;
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return NULL;
}

CUresult gp_procaddr_lookup(const char *symbol, int cuda_version, cuuint64_t flags, gp_cu_fn *fn,
                            CUdriverProcAddressQueryResult *status)
{
    *fn = NULL;
    long b = find_base(symbol);
    if (b >= 0) {
        const gp_procaddr_base *base = &gp_procaddr_bases[b];
        const gp_procaddr_entry *plain = NULL, *per_thread = NULL;
        /* Entries are sorted by version, so the last match below the limit is the newest. */
        for (uint16_t i = 0; i < base->count; i++) {
            const gp_procaddr_entry *e = &gp_procaddr_entries[base->first + i];
            if (e->version > cuda_version)
                break;
            if (e->ptds)
                per_thread = e;
            else
                plain = e;
        }
        /* The generator guarantees a per-thread revision is the same API revision as the
         * default one in force at its version, so preferring it never changes the signature. */
        const gp_procaddr_entry *pick =
            (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) && per_thread ? per_thread
                                                                                  : plain;
        if (pick == NULL) {
            *status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
            return CUDA_ERROR_NOT_FOUND;
        }
        *fn = pick->fn;
        *status = CU_GET_PROC_ADDRESS_SUCCESS;
        return CUDA_SUCCESS;
    }
    /* Not a base name: a caller may pass an exact exported name ("cuMemAlloc_v2"); answering it
     * costs nothing and matches what dlsym() would give. */
    gp_cu_fn exact = gp_symbol_lookup(symbol);
    if (exact != NULL) {
        *fn = exact;
        *status = CU_GET_PROC_ADDRESS_SUCCESS;
        return CUDA_SUCCESS;
    }
    *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return CUDA_ERROR_NOT_FOUND;
}

static CUresult get_proc_address(const char *symbol, void **pfn, int cuda_version, cuuint64_t flags,
                                 CUdriverProcAddressQueryResult *symbol_status)
{
    CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    if (symbol == NULL || pfn == NULL) {
        if (pfn != NULL)
            *pfn = NULL;
        if (symbol_status != NULL)
            *symbol_status = status;
        return CUDA_ERROR_INVALID_VALUE;
    }
    gp_cu_fn fn = NULL;
    CUresult rc = gp_procaddr_lookup(symbol, cuda_version, flags, &fn, &status);
    /* The driver API hands functions out as void *; POSIX guarantees the round trip. memcpy
     * says so without a cast ISO C frowns upon. */
    _Static_assert(sizeof fn == sizeof *pfn, "function and object pointers differ in size");
    memcpy(pfn, &fn, sizeof fn);
    if (symbol_status != NULL)
        *symbol_status = status;
    return rc;
}

/* The CUDA 11.3 form (cudart still asks for it by name at 11030). */
__attribute__((visibility("default"))) CUresult cuGetProcAddress(const char *symbol, void **pfn,
                                                                 int cudaVersion, cuuint64_t flags)
{
    return get_proc_address(symbol, pfn, cudaVersion, flags, NULL);
}

/* The CUDA 12.0 form; symbolStatus is optional. */
__attribute__((visibility("default"))) CUresult
cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                    CUdriverProcAddressQueryResult *symbolStatus)
{
    return get_proc_address(symbol, pfn, cudaVersion, flags, symbolStatus);
}
