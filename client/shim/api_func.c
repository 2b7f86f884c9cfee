/*
 * api_func.c: function and kernel attributes, cache configuration, parameter info and loading
 * state (cuFunc* / cuKernel* of that kind).
 *
 * A function's attributes only change when the program sets one, so every answer is cached in
 * the function object (gp_func.attr_*); a successful set drops the whole cache of that function
 * (the driver may round or derive values) and bumps attr_gen, which also retires the function's
 * occupancy answers (api_occupancy.c keys them by it). cuKernel* calls take a device: gpupool
 * serves one device per connection, so the cache is effectively per (kernel, device).
 *
 * Libraries set the same attribute to the same value before every launch (cuDNN, Triton and
 * cudart's cudaFuncSetAttribute: 24-68 such calls per PyTorch step, docs/benchmarks.md "Link
 * model"). A set of the value the last successful set of that attribute gave it changes nothing,
 * so it is answered here: no round trip, and the attribute cache stays. Whether a set can succeed
 * depends on the attribute, the value and the device, none of which changed. A read the driver
 * refuses with CUDA_ERROR_INVALID_VALUE (an attribute number this driver does not have: cuDNN
 * probes CU_FUNC_ATTRIBUTE_MAX, 40 times a step in a CNN) is refused the same way from then on.
 */
#include <stdatomic.h>

#include "gp_cuda_launch.h"
#include "shim.h"

static CUresult enter_any_ctx(void)
{
    CUresult r = gp_ctx_enter();
    return r == CUDA_ERROR_INVALID_CONTEXT ? CUDA_SUCCESS : r;
}

static int valid_device(CUdevice dev)
{
    return dev >= 0 && dev < gp_device_count();
}

CUresult gp_func_attr(gp_func *fn, int attr, int *value)
{
    int cacheable = attr >= 0 && attr < GP_FUNC_ATTR_CACHE;
    if (cacheable && (atomic_load_explicit(&fn->attr_valid, memory_order_acquire) & (1u << attr))) {
        *value = atomic_load_explicit(&fn->attr_val[attr], memory_order_relaxed);
        return CUDA_SUCCESS;
    }
    if (cacheable && (atomic_load_explicit(&fn->attr_unknown, memory_order_relaxed) & (1u << attr)))
        return CUDA_ERROR_INVALID_VALUE;
    uint32_t gen = atomic_load(&fn->attr_gen);
    gp_func_get_attribute m = {.func = fn->wire, .attribute = attr};
    GP_FRAME(frame, flen, gp_func_get_attribute, &m);
    if (!frame)
        return CUDA_ERROR_OUT_OF_MEMORY;
    gp_reply reply;
    CUresult r = gp_request(frame, flen, NULL, 0, NULL, 0, &reply);
    GP_FRAME_FREE(frame);
    if (r == CUDA_ERROR_INVALID_VALUE && cacheable) /* see the top */
        atomic_fetch_or_explicit(&fn->attr_unknown, 1u << attr, memory_order_relaxed);
    if (r != CUDA_SUCCESS)
        return gp_server_result(r, "function attribute");
    gp_func_get_attribute_reply rep = {0};
    if (gp_func_get_attribute_reply_decode(reply.body, reply.len, &rep)) {
        gp_log_error("function attribute: malformed reply");
        r = CUDA_ERROR_UNKNOWN;
    }
    gp_reply_free(&reply);
    if (r != CUDA_SUCCESS)
        return r;
    *value = rep.value;
    if (cacheable) {
        pthread_mutex_t *lock = gp_func_lock(fn);
        pthread_mutex_lock(lock);
        if (atomic_load(&fn->attr_gen) == gen) { /* no set in between */
            atomic_store_explicit(&fn->attr_val[attr], rep.value, memory_order_relaxed);
            atomic_fetch_or_explicit(&fn->attr_valid, 1u << attr, memory_order_release);
        }
        pthread_mutex_unlock(lock);
    }
    return CUDA_SUCCESS;
}

static CUresult set_attr(gp_func *fn, int attr, int value)
{
    int known = attr >= 0 && attr < GP_FUNC_ATTR_CACHE;
    if (known && (atomic_load_explicit(&fn->set_known, memory_order_acquire) & (1u << attr)) &&
        atomic_load_explicit(&fn->set_val[attr], memory_order_relaxed) == value)
        return CUDA_SUCCESS; /* the value it has (see the top) */
    gp_func_set_attribute m = {.func = fn->wire, .attribute = attr, .value = value};
    GP_FRAME(frame, flen, gp_func_set_attribute, &m);
    if (!frame)
        return CUDA_ERROR_OUT_OF_MEMORY;
    gp_reply reply;
    CUresult r = gp_request(frame, flen, NULL, 0, NULL, 0, &reply);
    GP_FRAME_FREE(frame);
    gp_reply_free(&reply);
    r = gp_server_result(r, "set function attribute");
    if (r != CUDA_SUCCESS || attr < 0)
        return r; /* the cache config changes no attribute */
    pthread_mutex_t *lock = gp_func_lock(fn);
    pthread_mutex_lock(lock);
    atomic_store(&fn->attr_valid, 0);
    atomic_fetch_add(&fn->attr_gen, 1);
    if (known) {
        atomic_store_explicit(&fn->set_val[attr], value, memory_order_relaxed);
        atomic_fetch_or_explicit(&fn->set_known, 1u << attr, memory_order_release);
    }
    pthread_mutex_unlock(lock);
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuFuncGetAttribute(int *pi, CUfunction_attribute attrib, CUfunction hfunc)
{
    if (!pi)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_ctx_enter();
    if (r != CUDA_SUCCESS)
        return r;
    gp_func *fn = gp_func_lookup((uint64_t)(uintptr_t)hfunc);
    if (!fn)
        return CUDA_ERROR_INVALID_HANDLE;
    gp_func_use_ctx(fn);
    return gp_func_attr(fn, attrib, pi);
}

GP_EXPORT CUresult cuKernelGetAttribute(int *pi, CUfunction_attribute attrib, CUkernel kernel,
                                        CUdevice dev)
{
    if (!pi)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = enter_any_ctx();
    if (r != CUDA_SUCCESS)
        return r;
    if (!valid_device(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    gp_func *fn = gp_func_lookup((uint64_t)(uintptr_t)kernel);
    if (!fn)
        return CUDA_ERROR_INVALID_HANDLE;
    return gp_func_attr(fn, attrib, pi);
}

GP_EXPORT CUresult cuFuncSetAttribute(CUfunction hfunc, CUfunction_attribute attrib, int value)
{
    CUresult r = gp_ctx_enter();
    if (r != CUDA_SUCCESS)
        return r;
    gp_func *fn = gp_func_lookup((uint64_t)(uintptr_t)hfunc);
    if (!fn)
        return CUDA_ERROR_INVALID_HANDLE;
    gp_func_use_ctx(fn);
    if (attrib < 0)
        return CUDA_ERROR_INVALID_VALUE; /* -1 means cache config on the wire */
    return set_attr(fn, attrib, value);
}

GP_EXPORT CUresult cuKernelSetAttribute(CUfunction_attribute attrib, int val, CUkernel kernel,
                                        CUdevice dev)
{
    CUresult r = enter_any_ctx();
    if (r != CUDA_SUCCESS)
        return r;
    if (!valid_device(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    gp_func *fn = gp_func_lookup((uint64_t)(uintptr_t)kernel);
    if (!fn)
        return CUDA_ERROR_INVALID_HANDLE;
    if (attrib < 0)
        return CUDA_ERROR_INVALID_VALUE;
    return set_attr(fn, attrib, val);
}

GP_EXPORT CUresult cuFuncSetCacheConfig(CUfunction hfunc, CUfunc_cache config)
{
    CUresult r = gp_ctx_enter();
    if (r != CUDA_SUCCESS)
        return r;
    gp_func *fn = gp_func_lookup((uint64_t)(uintptr_t)hfunc);
    if (!fn)
        return CUDA_ERROR_INVALID_HANDLE;
    gp_func_use_ctx(fn);
    return set_attr(fn, -1, config);
}

/* The pre-CUDA 4 launch state (cuFuncSetBlockShape, cuFuncSetSharedSize, then cuParamSet* and
 * cuLaunchGrid). pycuda still sets the block shape before every cuLaunchKernel, which does not
 * read it: the two setters check their arguments and succeed; the launch half of that API
 * (cuParamSet*, cuLaunch, cuLaunchGrid) is not implemented and says so. */
GP_EXPORT CUresult cuFuncSetBlockShape(CUfunction hfunc, int x, int y, int z)
{
    CUresult r = gp_ctx_enter();
    if (r != CUDA_SUCCESS)
        return r;
    if (!gp_func_lookup((uint64_t)(uintptr_t)hfunc))
        return CUDA_ERROR_INVALID_HANDLE;
    return x > 0 && y > 0 && z > 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

GP_EXPORT CUresult cuFuncSetSharedSize(CUfunction hfunc, unsigned int bytes)
{
    (void)bytes;
    CUresult r = gp_ctx_enter();
    if (r != CUDA_SUCCESS)
        return r;
    return gp_func_lookup((uint64_t)(uintptr_t)hfunc) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

GP_EXPORT CUresult cuKernelSetCacheConfig(CUkernel kernel, CUfunc_cache config, CUdevice dev)
{
    CUresult r = enter_any_ctx();
    if (r != CUDA_SUCCESS)
        return r;
    if (!valid_device(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    gp_func *fn = gp_func_lookup((uint64_t)(uintptr_t)kernel);
    if (!fn)
        return CUDA_ERROR_INVALID_HANDLE;
    return set_attr(fn, -1, config);
}

static CUresult param_info(uint64_t h, size_t index, size_t *offset, size_t *size)
{
    if (!offset)
        return CUDA_ERROR_INVALID_VALUE;
    gp_func *fn = gp_func_lookup(h);
    if (!fn)
        return CUDA_ERROR_INVALID_HANDLE;
    if (fn->param_count < 0) {
        if (!atomic_flag_test_and_set(&fn->warned_params))
            gp_log_info("the parameter layout of %s is unknown (the server's driver could not tell "
                        "and the image has no readable records)",
                        fn->name);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    if (index >= (size_t)fn->param_count)
        return CUDA_ERROR_INVALID_VALUE;
    *offset = fn->param_offsets[index];
    if (size)
        *size = fn->param_sizes[index];
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuFuncGetParamInfo(CUfunction func, size_t paramIndex, size_t *paramOffset,
                                      size_t *paramSize)
{
    return param_info((uint64_t)(uintptr_t)func, paramIndex, paramOffset, paramSize);
}

GP_EXPORT CUresult cuKernelGetParamInfo(CUkernel kernel, size_t paramIndex, size_t *paramOffset,
                                        size_t *paramSize)
{
    return param_info((uint64_t)(uintptr_t)kernel, paramIndex, paramOffset, paramSize);
}

/* The server's driver loads a function when it is bound, so every function is loaded. */
GP_EXPORT CUresult cuFuncIsLoaded(CUfunctionLoadingState *state, CUfunction function)
{
    if (!state)
        return CUDA_ERROR_INVALID_VALUE;
    if (!gp_func_lookup((uint64_t)(uintptr_t)function))
        return CUDA_ERROR_INVALID_HANDLE;
    *state = CU_FUNCTION_LOADING_STATE_LOADED;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuFuncLoad(CUfunction function)
{
    return gp_func_lookup((uint64_t)(uintptr_t)function) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}
