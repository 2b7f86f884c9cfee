/*
 * quota.h: the tenant's memory quota on a shared GPU (issue 32; docs/architecture.md, "Memory
 * quotas and zeroing").
 *
 * worker_session's memory_quota (0: none, a whole GPU) bounds every device byte the session
 * holds: its allocations (cuMemAlloc*, stream-ordered ones, cuMemCreate: stats.mem_used), its
 * modules' images and globals (cuMemGetInfo deltas around the loads), and its context's own
 * reservation as the driver reported it when the device was opened. Past the quota an
 * allocation fails with CUDA_ERROR_OUT_OF_MEMORY, as on a full GPU of the quota's size, and
 * cuMemGetInfo says total = quota. With a quota the GPU is shared, so the scrub between leases
 * cannot run: everything is zeroed before it goes back to the driver.
 */
#ifndef GP_WORKER_QUOTA_H
#define GP_WORKER_QUOTA_H

#include <stdint.h>

#include "gp_cuda.h"
#include "idmap.h"

struct worker;
struct wk_obj;

struct wk_quota {
    uint64_t limit;       /* bytes the tenant may hold; 0: no quota (nothing counted or zeroed) */
    uint64_t context;     /* the context's reservation (real driver: total - free at open) */
    uint64_t modules;     /* module images and globals: the driver's free memory they took */
    struct idmap globals; /* globals handed out, by address (wk_obj: owner module id, size) */
};

/* wk_device_open: the context's reservation, read once the primary context is current. */
void wk_quota_measure_context(struct worker *w);
/* The session's quota (worker_session's memory_quota, --memory-quota; 0: none). */
void wk_quota_start(struct worker *w, uint64_t limit);
/* Bytes the tenant holds now. */
uint64_t wk_quota_used(const struct worker *w);
/* Whether `bytes` more fit: CUDA_SUCCESS, or CUDA_ERROR_OUT_OF_MEMORY (always fits: no quota). */
CUresult wk_quota_admit(const struct worker *w, uint64_t bytes);
/* cuMemGetInfo as the tenant must see it: the driver's answer, or the quota's. */
CUresult wk_quota_mem_info(struct worker *w, uint64_t *free_bytes, uint64_t *total);

/* Module memory: the driver's free memory before a load or a first global (0 without a quota),
 * then what the call took is charged to module `mod` (kept in mod->size). CUDA_SUCCESS, or
 * CUDA_ERROR_OUT_OF_MEMORY when the tenant now holds more than its quota. */
uint64_t wk_quota_probe(struct worker *w);
CUresult wk_quota_charge_module(struct worker *w, struct wk_obj *mod, uint64_t free_before);
/* A global handed out (get_global): zeroed when its module goes. */
void wk_quota_note_global(struct worker *w, uint64_t module_id, uint64_t dptr, uint64_t size);
/* Before module `id` (record mod) is unloaded: its globals zeroed, its charge returned. */
void wk_quota_module_gone(struct worker *w, uint64_t id, struct wk_obj *mod);
/* wk_obj_destroy_module after wk_quota_module_gone: what the worker's unloads call (here, so
 * that objects.c need not call quota.c: tests/test_layout.py wants no circle). */
void wk_quota_destroy_module(struct worker *w, uint64_t id, struct wk_obj *mod);
/* Before the program's context ctx_id (handle h) is destroyed, which unloads its modules: the
 * same for each of them, with h current (their globals are that context's memory). */
void wk_quota_ctx_gone(struct worker *w, uint64_t ctx_id, CUcontext h);

/* Zeroing (only with a quota; a no-op otherwise). The device range [ptr, ptr+size), mapped
 * read-write; and the physical allocation h of `size` bytes, mapped for the purpose. Both wait
 * for the zeros to be written. */
void wk_quota_zero_range(struct worker *w, uint64_t ptr, uint64_t size);
void wk_quota_zero_handle(struct worker *w, CUmemGenericAllocationHandle h, uint64_t size);

/* The session's end, after everything was released. */
void wk_quota_end(struct worker *w);

#endif /* GP_WORKER_QUOTA_H */
