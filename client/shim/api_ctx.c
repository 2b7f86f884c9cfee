/*
 * api_ctx.c: primary and regular contexts, the current-context stack, context limits and
 * queries, and profiler control: the client side of the worker's `ctx` group (h_ctx.c).
 * Context questions are answered from the local context state (state.c); only creating,
 * destroying, synchronising, resetting and setting limits talk to the server.
 */
#include <ctype.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "export_tables.h"
#include "generated/gp_cuda_tables.h"
#include "shim.h"
#include "shim_core.h"

/* ============================================================ primary context == */

GP_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_check_dev(dev);
    if (r != CUDA_SUCCESS)
        return r;
    gp_primary_retain(dev);
    *pctx = (CUcontext)(uintptr_t)GP_PRIMARY_CTX_OF(dev);
    return CUDA_SUCCESS;
}

/* Forget a context on this side: its context-local storage first (export_tables.c: the
 * destructors are cudart code that may still free what it allocated in the context, so the
 * context's ranges and handles must be known then), then its ranges, streams and events. */
static void forget_context(uint64_t ctx)
{
    gp_cls_context_destroyed((CUcontext)(uintptr_t)ctx);
    gp_ctx_forget_resources(ctx);
}

/* Drop the primary context's state everywhere: on the worker (its allocations, streams,
 * modules) and here. The handle itself stays valid, as the driver's does. */
static CUresult primary_reset(void)
{
    forget_context(GP_PRIMARY_CTX_ID);
    gp_primary_reset_local(0);
    gp_conn_use_ctx(GP_PRIMARY_CTX_ID);
    gp_primary_ctx_reset m = {0};
    GP_FRAME(buf, len, gp_primary_ctx_reset, &m);
    if (!buf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    gp_reply rep;
    CUresult r = gp_request(buf, len, NULL, 0, NULL, 0, &rep);
    GP_FRAME_FREE(buf);
    gp_reply_free(&rep);
    gp_conn_forget_ctx();
    return gp_cu_result(r);
}

GP_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    CUresult r = gp_check_dev(dev);
    if (r != CUDA_SUCCESS)
        return r;
    int last = 0;
    if (gp_primary_release(dev, &last) != 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    /* The last release destroys the primary context, as in the driver. Another device's
     * (issue 37) keeps its server state until the session ends: the worker resets device 0's
     * primary only; the program sees the context inactive all the same. */
    if (last && dev != 0) {
        gp_primary_reset_local(dev);
        return CUDA_SUCCESS;
    }
    return last ? primary_reset() : CUDA_SUCCESS;
}

GP_EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice dev)
{
    return cuDevicePrimaryCtxRelease_v2(dev);
}

GP_EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active)
{
    if (!flags || !active)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_check_dev(dev);
    if (r != CUDA_SUCCESS)
        return r;
    gp_primary_state st;
    gp_primary_get(dev, &st);
    *flags = st.flags;
    *active = st.retained > 0;
    return CUDA_SUCCESS;
}

static CUresult check_ctx_flags(unsigned int flags)
{
    unsigned sched = flags & CU_CTX_SCHED_MASK;
    if ((flags & ~(unsigned)CU_CTX_FLAGS_MASK) || sched == 3 || sched > 4)
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags)
{
    CUresult r = gp_check_dev(dev);
    if (r == CUDA_SUCCESS)
        r = check_ctx_flags(flags);
    if (r != CUDA_SUCCESS)
        return r;
    gp_primary_set_flags(dev, flags); /* scheduling flags only matter on the server: kept locally */
    return CUDA_SUCCESS;
}

/* Version 1 refuses to change the flags of an active primary context. */
GP_EXPORT CUresult cuDevicePrimaryCtxSetFlags(CUdevice dev, unsigned int flags)
{
    CUresult r = gp_check_dev(dev);
    if (r != CUDA_SUCCESS)
        return r;
    gp_primary_state st;
    gp_primary_get(dev, &st);
    if (st.retained > 0)
        return CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE;
    return cuDevicePrimaryCtxSetFlags_v2(dev, flags);
}

GP_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    CUresult r = gp_check_dev(dev);
    if (r != CUDA_SUCCESS)
        return r;
    if (dev != 0) {
        gp_log_error("cuDevicePrimaryCtxReset of device %d: gpupool resets only device 0's "
                     "primary context; destroy the objects made in it instead",
                     (int)dev);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    return primary_reset();
}

GP_EXPORT CUresult cuDevicePrimaryCtxReset(CUdevice dev)
{
    return cuDevicePrimaryCtxReset_v2(dev);
}

/* ============================================================ regular contexts == */

static CUresult ctx_create(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_check_dev(dev);
    if (r == CUDA_SUCCESS)
        r = check_ctx_flags(flags);
    if (r != CUDA_SUCCESS)
        return r;
    gp_ctx_obj *c = calloc(1, sizeof *c);
    if (!c)
        return CUDA_ERROR_OUT_OF_MEMORY;
    c->device = dev;
    c->flags = flags;
    c->id = gp_handle_new(GP_H_CTX, c);
    if (!c->id) {
        free(c);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    gp_conn_use_ctx(0); /* creating needs no current context */
    gp_reply rep = {0};
    /* A spread lease: created on the device's part, as that worker numbers it. */
    int local = gp_conn_local_device(dev);
    gp_conn_route(gp_conn_part_of_device(dev));
    if (local == 0) {
        gp_ctx_create m = {.ctx = c->id, .flags = flags};
        GP_FRAME(buf, len, gp_ctx_create, &m);
        r = buf ? gp_request(buf, len, NULL, 0, NULL, 0, &rep) : CUDA_ERROR_OUT_OF_MEMORY;
        if (buf)
            GP_FRAME_FREE(buf);
    } else { /* another device of the lease (protocol 1.6, issue 37) */
        gp_ctx_create_on m = {.ctx = c->id, .flags = flags, .device = local};
        GP_FRAME(buf, len, gp_ctx_create_on, &m);
        r = buf ? gp_request(buf, len, NULL, 0, NULL, 0, &rep) : CUDA_ERROR_OUT_OF_MEMORY;
        if (buf)
            GP_FRAME_FREE(buf);
    }
    gp_conn_route(-1);
    gp_reply_free(&rep);
    gp_conn_forget_ctx(); /* the worker's driver made the new context current */
    if (r != CUDA_SUCCESS) {
        free(gp_handle_remove(c->id, GP_H_CTX));
        return gp_cu_result(r);
    }
    if (gp_ctx_stack_push(c->id) != 0)
        gp_ctx_stack_set_top(c->id);
    *pctx = (CUcontext)(uintptr_t)c->id;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    return ctx_create(pctx, flags, dev);
}

GP_EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    return ctx_create(pctx, flags, dev);
}

GP_EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams,
                                  unsigned int flags, CUdevice dev)
{
    if (numParams < 0 || (numParams > 0 && !paramsArray))
        return CUDA_ERROR_INVALID_VALUE;
    if (numParams > 0)
        return CUDA_ERROR_NOT_SUPPORTED; /* execution affinity is not remoted */
    return ctx_create(pctx, flags, dev);
}

GP_EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams,
                                  unsigned int flags, CUdevice dev)
{
    if (ctxCreateParams &&
        (ctxCreateParams->numExecAffinityParams > 0 || ctxCreateParams->cigParams))
        return CUDA_ERROR_NOT_SUPPORTED;
    return ctx_create(pctx, flags, dev);
}

GP_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    uint64_t h = (uint64_t)(uintptr_t)ctx;
    if (gp_primary_index(h) >= 0 || !gp_handle_get(h, GP_H_CTX))
        return CUDA_ERROR_INVALID_CONTEXT;
    /* What the client knows goes first (context-local storage destructors may still use the
     * context), then the server's context (on its device's part, for a spread lease). */
    const gp_ctx_obj *co = gp_ctx_obj_get(h);
    int part = co ? gp_conn_part_of_device(co->device) : 0;
    forget_context(h);
    gp_ctx_destroy m = {.ctx = h};
    GP_FRAME(buf, len, gp_ctx_destroy, &m);
    if (!buf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    gp_conn_use_ctx(0);
    gp_reply rep;
    gp_conn_route(part);
    r = gp_request(buf, len, NULL, 0, NULL, 0, &rep);
    gp_conn_route(-1);
    GP_FRAME_FREE(buf);
    gp_reply_free(&rep);
    gp_conn_forget_ctx();
    if (r != CUDA_SUCCESS && r != GP_LOST_CONNECTION_ERROR)
        return gp_cu_result(r);
    gp_ctx_obj *obj = gp_handle_remove(h, GP_H_CTX);
    if (gp_ctx_current() == h)
        gp_ctx_stack_pop();
    free(obj);
    return r;
}

GP_EXPORT CUresult cuCtxDestroy(CUcontext ctx)
{
    return cuCtxDestroy_v2(ctx);
}

/* The pre-CUDA 4 way to end a context (pycuda still calls it): it drops one use of a context that
 * cuCtxCreate made, which must be current, and destroys it at none. gpupool has no cuCtxAttach, so
 * a context has one use and goes at once. */
GP_EXPORT CUresult cuCtxDetach(CUcontext ctx)
{
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    if (!ctx || gp_ctx_current() != (uint64_t)(uintptr_t)ctx)
        return CUDA_ERROR_INVALID_CONTEXT;
    return cuCtxDestroy_v2(ctx);
}

/* ========================================================= the context stack == */

GP_EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    uint64_t h = gp_ctx_check(ctx);
    if (!h)
        return CUDA_ERROR_INVALID_CONTEXT;
    return gp_ctx_stack_push(h) == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

GP_EXPORT CUresult cuCtxPushCurrent(CUcontext ctx)
{
    return cuCtxPushCurrent_v2(ctx);
}

GP_EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *pctx)
{
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    if (gp_ctx_current() == 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    uint64_t h = gp_ctx_stack_pop();
    if (pctx)
        *pctx = (CUcontext)(uintptr_t)h;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuCtxPopCurrent(CUcontext *pctx)
{
    return cuCtxPopCurrent_v2(pctx);
}

GP_EXPORT CUresult cuCtxSetCurrent(CUcontext ctx)
{
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    uint64_t h = 0;
    if (ctx && !(h = gp_ctx_check(ctx)))
        return CUDA_ERROR_INVALID_CONTEXT;
    gp_ctx_stack_set_top(h);
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    *pctx = (CUcontext)(uintptr_t)gp_ctx_current();
    return CUDA_SUCCESS;
}

/* ctx NULL means the current one; CUDA_SUCCESS with *out set, or the error. */
static CUresult ctx_arg(CUcontext ctx, gp_ctx_obj **out)
{
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    uint64_t h = ctx ? (uint64_t)(uintptr_t)ctx : gp_ctx_current();
    if (!h)
        return CUDA_ERROR_INVALID_CONTEXT;
    *out = gp_ctx_obj_get(h);
    if (!*out)
        return ctx ? CUDA_ERROR_INVALID_CONTEXT : CUDA_ERROR_CONTEXT_IS_DESTROYED;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuCtxGetDevice_v2(CUdevice *device, CUcontext ctx)
{
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    gp_ctx_obj *c;
    CUresult r = ctx_arg(ctx, &c);
    if (r != CUDA_SUCCESS)
        return r;
    *device = c->device;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuCtxGetDevice(CUdevice *device)
{
    return cuCtxGetDevice_v2(device, NULL);
}

GP_EXPORT CUresult cuCtxSynchronize_v2(CUcontext ctx)
{
    gp_ctx_obj *c;
    CUresult r = ctx_arg(ctx, &c);
    if (r != CUDA_SUCCESS)
        return r;
    gp_conn_use_ctx(c->id);
    gp_ctx_synchronize m = {0};
    GP_FRAME(buf, len, gp_ctx_synchronize, &m);
    if (!buf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    gp_reply rep;
    r = gp_request(buf, len, NULL, 0, NULL, 0, &rep);
    GP_FRAME_FREE(buf);
    gp_reply_free(&rep);
    return gp_sync_result(r);
}

GP_EXPORT CUresult cuCtxSynchronize(void)
{
    return cuCtxSynchronize_v2(NULL);
}

/* Profiler control. The work runs on the server, so a profiler (Nsight Systems, Nsight Compute)
 * is attached to the worker there; on the client no tool is attached, and the driver's answer
 * then is success with no effect. The context checks are the driver's. */
GP_EXPORT CUresult cuProfilerStart(void)
{
    gp_ctx_obj *c;
    return ctx_arg(NULL, &c);
}

GP_EXPORT CUresult cuProfilerStop(void)
{
    gp_ctx_obj *c;
    return ctx_arg(NULL, &c);
}

/* Deprecated: from CUDA 12.0 the driver always answers NOT_SUPPORTED (cudaProfiler.h). The last
 * argument is a CUoutput_mode, an int-sized enum. */
GP_EXPORT CUresult cuProfilerInitialize(const char *configFile, const char *outputFile,
                                        int outputMode)
{
    (void)configFile;
    (void)outputFile;
    (void)outputMode;
    return CUDA_ERROR_NOT_SUPPORTED;
}

GP_EXPORT CUresult cuCtxGetLimit(size_t *pvalue, CUlimit limit)
{
    if (!pvalue)
        return CUDA_ERROR_INVALID_VALUE;
    gp_ctx_obj *c;
    CUresult r = ctx_arg(NULL, &c);
    if (r != CUDA_SUCCESS)
        return r;
    if (limit < 0 || limit >= 64)
        return CUDA_ERROR_INVALID_VALUE;
    if (c->limit_set & (1ull << limit)) {
        *pvalue = (size_t)c->limit_val[limit];
        return CUDA_SUCCESS;
    }
    const gp_device_snapshot *d = gp_device(c->device);
    if (limit >= d->limit_count)
        return CUDA_ERROR_UNSUPPORTED_LIMIT;
    *pvalue = (size_t)d->limits[limit];
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuCtxSetLimit(CUlimit limit, size_t value)
{
    if (limit < 0 || limit >= 64)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_ctx_enter();
    if (r != CUDA_SUCCESS)
        return r;
    gp_ctx_obj *c = gp_ctx_current_obj();
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    gp_ctx_set_limit m = {.limit = (uint32_t)limit, .value = value};
    GP_FRAME(buf, len, gp_ctx_set_limit, &m);
    if (!buf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    gp_reply rep;
    r = gp_request(buf, len, NULL, 0, NULL, 0, &rep);
    GP_FRAME_FREE(buf);
    gp_reply_free(&rep);
    if (r != CUDA_SUCCESS)
        return gp_cu_result(r);
    /* The driver may round the value: remember what it actually set. */
    uint64_t actual = value;
    gp_ctx_get_limit q = {.limit = (uint32_t)limit};
    GP_FRAME(qbuf, qlen, gp_ctx_get_limit, &q);
    if (qbuf) {
        if (gp_request(qbuf, qlen, NULL, 0, NULL, 0, &rep) == CUDA_SUCCESS) {
            gp_ctx_get_limit_reply gr;
            if (gp_ctx_get_limit_reply_decode(rep.body, rep.len, &gr) == 0)
                actual = gr.value;
        }
        gp_reply_free(&rep);
        GP_FRAME_FREE(qbuf);
    }
    c->limit_val[limit] = actual;
    c->limit_set |= 1ull << limit;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuCtxGetStreamPriorityRange(int *leastPriority, int *greatestPriority)
{
    gp_ctx_obj *c;
    CUresult r = ctx_arg(NULL, &c);
    if (r != CUDA_SUCCESS)
        return r;
    const gp_device_snapshot *d = gp_device(c->device);
    if (leastPriority)
        *leastPriority = d->stream_priority_least;
    if (greatestPriority)
        *greatestPriority = d->stream_priority_greatest;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuCtxGetCacheConfig(CUfunc_cache *pconfig)
{
    if (!pconfig)
        return CUDA_ERROR_INVALID_VALUE;
    gp_ctx_obj *c;
    CUresult r = ctx_arg(NULL, &c);
    if (r != CUDA_SUCCESS)
        return r;
    *pconfig = (CUfunc_cache)c->cache_config;
    return CUDA_SUCCESS;
}

/* A preference only: kept locally, not forwarded. */
GP_EXPORT CUresult cuCtxSetCacheConfig(CUfunc_cache config)
{
    if ((int)config < 0 || config > CU_FUNC_CACHE_PREFER_EQUAL)
        return CUDA_ERROR_INVALID_VALUE;
    gp_ctx_obj *c;
    CUresult r = ctx_arg(NULL, &c);
    if (r != CUDA_SUCCESS)
        return r;
    c->cache_config = (int)config;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuCtxGetSharedMemConfig(CUsharedconfig *pConfig)
{
    if (!pConfig)
        return CUDA_ERROR_INVALID_VALUE;
    gp_ctx_obj *c;
    CUresult r = ctx_arg(NULL, &c);
    if (r != CUDA_SUCCESS)
        return r;
    *pConfig = c->shmem_config ? (CUsharedconfig)c->shmem_config
                               : CU_SHARED_MEM_CONFIG_FOUR_BYTE_BANK_SIZE;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuCtxSetSharedMemConfig(CUsharedconfig config)
{
    if ((int)config < 0 || config > CU_SHARED_MEM_CONFIG_EIGHT_BYTE_BANK_SIZE)
        return CUDA_ERROR_INVALID_VALUE;
    gp_ctx_obj *c;
    CUresult r = ctx_arg(NULL, &c);
    if (r != CUDA_SUCCESS)
        return r;
    c->shmem_config = (int)config;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned int *version)
{
    if (!version)
        return CUDA_ERROR_INVALID_VALUE;
    gp_ctx_obj *c;
    CUresult r = ctx_arg(ctx, &c);
    if (r != CUDA_SUCCESS)
        return r;
    *version = 3020; /* the context API revision every context since CUDA 3.2 reports */
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuCtxGetFlags(unsigned int *flags)
{
    if (!flags)
        return CUDA_ERROR_INVALID_VALUE;
    gp_ctx_obj *c;
    CUresult r = ctx_arg(NULL, &c);
    if (r != CUDA_SUCCESS)
        return r;
    *flags = c->flags;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuCtxSetFlags(unsigned int flags)
{
    CUresult r = check_ctx_flags(flags);
    if (r != CUDA_SUCCESS)
        return r;
    gp_ctx_obj *c;
    r = ctx_arg(NULL, &c);
    if (r != CUDA_SUCCESS)
        return r;
    if (c->primary)
        gp_primary_set_flags(c->device, flags);
    else
        c->flags = flags;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuCtxGetId(CUcontext ctx, unsigned long long *ctxId)
{
    if (!ctxId)
        return CUDA_ERROR_INVALID_VALUE;
    gp_ctx_obj *c;
    CUresult r = ctx_arg(ctx, &c);
    if (r != CUDA_SUCCESS)
        return r;
    *ctxId = c->id & ((1ull << 40) - 1);
    return CUDA_SUCCESS;
}

/* ================================================================ peer access == */

/* Issue 37. The worker makes every allocation accessible from the lease's devices that the
 * server's driver says can reach it, so enabling is bookkeeping here, with the driver's answers:
 * a device is not its own peer, a pair the driver cannot connect is refused, and enabling twice
 * or disabling what was never enabled is an error. */
static CUresult peer_args(CUcontext peerContext, gp_ctx_obj **cur, int *peer_dev)
{
    CUresult r = ctx_arg(NULL, cur);
    if (r != CUDA_SUCCESS)
        return r;
    gp_ctx_obj *p = peerContext ? gp_ctx_obj_get((uint64_t)(uintptr_t)peerContext) : NULL;
    if (!p)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (p->device == (*cur)->device)
        return CUDA_ERROR_INVALID_DEVICE;
    *peer_dev = p->device;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int Flags)
{
    if (Flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    gp_ctx_obj *c;
    int d;
    CUresult r = peer_args(peerContext, &c, &d);
    if (r != CUDA_SUCCESS)
        return r;
    if (!gp_device_can_access_peer(c->device, d))
        return CUDA_ERROR_PEER_ACCESS_UNSUPPORTED;
    uint64_t bit = 1ull << d;
    return atomic_fetch_or(&c->peer_on, bit) & bit ? CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
                                                   : CUDA_SUCCESS;
}

GP_EXPORT CUresult cuCtxDisablePeerAccess(CUcontext peerContext)
{
    gp_ctx_obj *c;
    int d;
    CUresult r = peer_args(peerContext, &c, &d);
    if (r != CUDA_SUCCESS)
        return r;
    uint64_t bit = 1ull << d;
    return atomic_fetch_and(&c->peer_on, ~bit) & bit ? CUDA_SUCCESS
                                                     : CUDA_ERROR_PEER_ACCESS_NOT_ENABLED;
}
