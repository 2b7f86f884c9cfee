/*
 * sim_context.c: primary and created contexts, the current context, limits.
 *
 * Each device has one primary context object for the life of the process, so its handle is the
 * same on every retain (as with the driver); it is usable only while retained. Destroying or
 * resetting a context frees what it owns (streams, events, modules, cuMemAlloc memory) and clears
 * its sticky error, which is how a program recovers from a faulting kernel.
 */
#include <stdlib.h>

#include "sim_api.h"
#include "sim_internal.h"

static struct sim_ctx *primaries[SIM_MAX_DEVICES];

/* Defaults of the 13.0 driver for a fresh context, by CUlimit. */
static const size_t default_limits[SIM_LIMIT_COUNT] = {
    1024,    /* STACK_SIZE */
    1048576, /* PRINTF_FIFO_SIZE */
    8388608, /* MALLOC_HEAP_SIZE */
    2,       /* DEV_RUNTIME_SYNC_DEPTH */
    2048,    /* DEV_RUNTIME_PENDING_LAUNCH_COUNT */
    64,      /* MAX_L2_FETCH_GRANULARITY */
    0,       /* PERSISTING_L2_CACHE_SIZE */
    0,       /* SHMEM_SIZE (CIG contexts only) */
    0,       /* CIG_ENABLED */
    0,       /* CIG_SHMEM_FALLBACK_ENABLED */
};

static void reset_state(struct sim_ctx *c)
{
    c->sticky = CUDA_SUCCESS;
    for (int i = 0; i < SIM_LIMIT_COUNT; i++)
        c->limits[i] = default_limits[i];
}

static struct sim_ctx *ctx_new(int dev, bool primary, unsigned flags)
{
    struct sim_ctx *c = calloc(1, sizeof(*c));
    if (!c)
        return NULL;
    c->dev = dev;
    c->primary = primary;
    c->flags = flags;
    reset_state(c);
    c->handle = sim_handle_new(SIM_K_CTX, c);
    if (c->handle == 0) {
        free(c);
        return NULL;
    }
    return c;
}

CUresult sim_ctx_create_primaries(void)
{
    for (int d = 0; d < sim_cfg.device_count; d++) {
        primaries[d] = ctx_new(d, true, 0);
        if (!primaries[d])
            return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return CUDA_SUCCESS;
}

CUresult sim_ctx_create_primary(int dev)
{
    if (dev < 0 || dev >= SIM_MAX_DEVICES)
        return CUDA_ERROR_INVALID_DEVICE;
    if (!primaries[dev] && !(primaries[dev] = ctx_new(dev, true, 0)))
        return CUDA_ERROR_OUT_OF_MEMORY;
    return CUDA_SUCCESS;
}

void sim_ctx_release_resources(struct sim_ctx *ctx)
{
    sim_stream_release_ctx(ctx->handle);
    sim_module_release_ctx(ctx->handle);
    sim_heap_free_owner(ctx->handle);
    reset_state(ctx);
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!pctx)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    if (!sim_dev_valid(dev))
        return sim_leave(CUDA_ERROR_INVALID_DEVICE);
    struct sim_ctx *p = primaries[dev];
    if (!p->active) {
        p->active = true;
        p->refcount = 0;
        reset_state(p);
    }
    p->refcount++;
    *pctx = (CUcontext)(uintptr_t)p->handle;
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!sim_dev_valid(dev))
        return sim_leave(CUDA_ERROR_INVALID_DEVICE);
    struct sim_ctx *p = primaries[dev];
    if (!p->active || p->refcount == 0)
        return sim_leave(CUDA_ERROR_INVALID_CONTEXT);
    if (--p->refcount == 0) {
        sim_ctx_release_resources(p);
        p->active = false;
    }
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!sim_dev_valid(dev))
        return sim_leave(CUDA_ERROR_INVALID_DEVICE);
    struct sim_ctx *p = primaries[dev];
    if (p->active) {
        sim_ctx_release_resources(p);
        p->active = false;
        p->refcount = 0;
    }
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!flags || !active)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    if (!sim_dev_valid(dev))
        return sim_leave(CUDA_ERROR_INVALID_DEVICE);
    *flags = primaries[dev]->flags;
    *active = primaries[dev]->active ? 1 : 0;
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    /* Scheduling mode in the low 3 bits (0, 1, 2 or 4), then MAP_HOST, LMEM_RESIZE_TO_MAX,
     * COREDUMP, USER_COREDUMP, SYNC_MEMOPS. */
    unsigned sched = flags & 0x7;
    if (!pctx || (flags & ~0xffu) != 0 || sched == 3 || sched > 4)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    if (!sim_dev_valid(dev))
        return sim_leave(CUDA_ERROR_INVALID_DEVICE);
    struct sim_ctx *c = ctx_new(dev, false, flags);
    if (!c)
        return sim_leave(CUDA_ERROR_OUT_OF_MEMORY);
    c->active = true;
    sim_set_current_ctx(c->handle); /* a new context becomes the calling thread's current one */
    *pctx = (CUcontext)(uintptr_t)c->handle;
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    struct sim_ctx *c = sim_handle_get((uint64_t)(uintptr_t)ctx, SIM_K_CTX);
    /* Primary contexts are released, never destroyed. */
    if (!c || c->primary)
        return sim_leave(CUDA_ERROR_INVALID_CONTEXT);
    sim_ctx_release_resources(c);
    sim_handle_del(c->handle);
    if (sim_current_ctx() == c->handle)
        sim_set_current_ctx(0);
    free(c);
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuCtxSetCurrent(CUcontext ctx)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (ctx && !sim_ctx_get(ctx))
        return sim_leave(CUDA_ERROR_INVALID_CONTEXT);
    sim_set_current_ctx((uint64_t)(uintptr_t)ctx);
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!pctx)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    uint64_t h = sim_current_ctx();
    *pctx = sim_ctx_get((CUcontext)(uintptr_t)h) ? (CUcontext)(uintptr_t)h : NULL;
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuCtxSynchronize(void)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    /* All work completes inside the call that submits it; nothing is ever outstanding. */
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuCtxGetLimit(size_t *pvalue, CUlimit limit)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!pvalue)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    if (limit < 0 || limit >= SIM_LIMIT_COUNT)
        return sim_leave(SIM_ERR_UNSUPPORTED_LIMIT);
    *pvalue = c->limits[limit];
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuCtxSetLimit(CUlimit limit, size_t value)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    /* SHMEM_SIZE and CIG_ENABLED can only be queried. */
    if (limit < 0 || limit >= SIM_LIMIT_COUNT || limit == 7 || limit == 8)
        return sim_leave(SIM_ERR_UNSUPPORTED_LIMIT);
    if (limit == 5 && value > 128) /* MAX_L2_FETCH_GRANULARITY: 0..128 bytes */
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    if (limit == 6 && value > (size_t)sim_config_attr(&sim_cfg, c->dev, 108))
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    c->limits[limit] = value;
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuCtxGetStreamPriorityRange(int *leastPriority, int *greatestPriority)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    /* Either pointer may be NULL. Lower numbers are higher priorities, as on an H100. */
    if (leastPriority)
        *leastPriority = 0;
    if (greatestPriority)
        *greatestPriority = -5;
    return sim_leave(CUDA_SUCCESS);
}
