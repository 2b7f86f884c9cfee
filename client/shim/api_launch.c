/*
 * api_launch.c: kernel launches (cuLaunchKernel, cuLaunchKernelEx, cuLaunchCooperativeKernel
 * and their per-thread-default-stream _ptsz twins).
 *
 * A launch is validated here against the device snapshot (what the driver would refuse at once
 * is refused at once), its arguments are packed into one buffer at the offsets of the function's
 * parameter layout (or taken as-is from `extra`), and the launch frame is queued without waiting
 * (gp_post): failures on the server come back as the pending error of the next synchronising
 * call, as with the real driver's asynchronous errors.
 *
 * This is the hot path (hundreds of thousands of calls a second): no allocation for argument
 * blocks up to PARAM_STACK bytes, one handle lookup, no lock of our own.
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "gp_cuda_launch.h"
#include "shim.h"

#define PARAM_STACK 4096
#define FRAME_STACK (PARAM_STACK + 512)
#define MAX_PARAMS_WIRE (1u << 20) /* blob limit of launch.params */
#define MAX_ATTRS_WIRE 65536u      /* blob limit of launch.attrs */

_Static_assert(sizeof(CUlaunchAttribute) == 72, "CUlaunchAttribute is 72 bytes in the ABI");

static inline int over(uint64_t v, int max)
{
    return max > 0 && v > (uint64_t)max;
}

static CUresult check_config(gp_func *fn, const unsigned g[3], const unsigned b[3], unsigned smem)
{
    if (!g[0] || !g[1] || !g[2] || !b[0] || !b[1] || !b[2])
        return CUDA_ERROR_INVALID_VALUE;
    const gp_device_snapshot *d = gp_device(0);
    uint64_t threads = (uint64_t)b[0] * b[1] * b[2];
    if (d) {
        const int *a = d->attributes;
        if (over(b[0], a[CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X]) ||
            over(b[1], a[CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y]) ||
            over(b[2], a[CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z]) ||
            over(threads, a[CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK]) ||
            over(g[0], a[CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X]) ||
            over(g[1], a[CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y]) ||
            over(g[2], a[CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z]) ||
            over(smem, a[CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN]))
            return CUDA_ERROR_INVALID_VALUE;
    }
    /* The function's own limit (registers), when an earlier query cached it. */
    if (atomic_load_explicit(&fn->attr_valid, memory_order_acquire) &
        (1u << CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)) {
        int max = atomic_load_explicit(&fn->attr_val[CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK],
                                       memory_order_relaxed);
        if (over(threads, max))
            return CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES;
    }
    return CUDA_SUCCESS;
}

/* extra = {CU_LAUNCH_PARAM_BUFFER_POINTER, buf, CU_LAUNCH_PARAM_BUFFER_SIZE, &size, ...,
 * CU_LAUNCH_PARAM_END}. */
static CUresult parse_extra(void **extra, const uint8_t **buf, size_t *len)
{
    const void *p = NULL;
    const size_t *sz = NULL;
    for (int i = 0; i < 64; i += 2) {
        void *key = extra[i];
        if (key == CU_LAUNCH_PARAM_END) {
            if (!p || !sz || *sz > MAX_PARAMS_WIRE)
                return CUDA_ERROR_INVALID_VALUE;
            *buf = p;
            *len = *sz;
            return CUDA_SUCCESS;
        }
        if (key == CU_LAUNCH_PARAM_BUFFER_POINTER)
            p = extra[i + 1];
        else if (key == CU_LAUNCH_PARAM_BUFFER_SIZE)
            sz = extra[i + 1];
        else
            return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_ERROR_INVALID_VALUE; /* no CU_LAUNCH_PARAM_END in sight */
}

static CUresult launch(CUfunction f, const unsigned grid[3], const unsigned block[3], unsigned smem,
                       CUstream stream, int ptsz, void **params, void **extra, const void *attrs,
                       size_t attrs_len)
{
    CUresult r = gp_ctx_enter();
    if (r != CUDA_SUCCESS)
        return r;
    gp_func *fn = gp_func_lookup((uint64_t)(uintptr_t)f);
    if (!fn)
        return CUDA_ERROR_INVALID_HANDLE;
    r = check_config(fn, grid, block, smem);
    if (r != CUDA_SUCCESS)
        return r;
    if (ptsz && !stream)
        stream = CU_STREAM_PER_THREAD;
    uint64_t swire;
    if (gp_stream_wire(stream, &swire) != 0)
        return CUDA_ERROR_INVALID_HANDLE;
    if (params && extra)
        return CUDA_ERROR_INVALID_VALUE;

    uint8_t pstack[PARAM_STACK];
    uint8_t *pheap = NULL;
    const uint8_t *pbuf = NULL;
    size_t plen = 0;
    if (extra) {
        r = parse_extra(extra, &pbuf, &plen);
        if (r != CUDA_SUCCESS)
            return r;
    } else if (fn->param_count > 0) {
        if (!params)
            return CUDA_ERROR_INVALID_VALUE;
        plen = fn->param_bytes;
        uint8_t *b = pstack;
        if (plen > sizeof pstack && !(b = pheap = malloc(plen)))
            return CUDA_ERROR_OUT_OF_MEMORY;
        memset(b, 0, plen);
        for (int i = 0; i < fn->param_count; i++) {
            if (!params[i]) {
                free(pheap);
                return CUDA_ERROR_INVALID_VALUE;
            }
            memcpy(b + fn->param_offsets[i], params[i], fn->param_sizes[i]);
        }
        pbuf = b;
    } else if (fn->param_count < 0 && params) {
        if (!atomic_flag_test_and_set(&fn->warned_params)) {
            const gp_device_snapshot *dev = gp_device(0);
            if (dev && dev->simulated)
                /* The usual reason on the simulated device: it only knows its gp_test_*
                 * kernels, so it cannot describe (or run) this one. Say that, not a riddle. */
                gp_log_error("cannot launch %s: the server's GPU is simulated and runs only "
                             "the gp_test_* test kernels; run this program against a server "
                             "with a real GPU",
                             fn->name);
            else
                gp_log_error("cannot launch %s: its parameter layout is unknown (the server's "
                             "driver could not tell and the image has no readable records); "
                             "launching it with `extra` (CU_LAUNCH_PARAM_BUFFER_POINTER) works",
                             fn->name);
        }
        return CUDA_ERROR_NOT_SUPPORTED;
    }

    gp_launch m = {
        .func = fn->wire,
        .grid_x = grid[0],
        .grid_y = grid[1],
        .grid_z = grid[2],
        .block_x = block[0],
        .block_y = block[1],
        .block_z = block[2],
        .shared_mem = smem,
        .stream = swire,
        .params = pbuf,
        .params_len = (uint32_t)plen,
        .attrs = attrs,
        .attrs_len = (uint32_t)attrs_len,
    };
    uint8_t fstack[FRAME_STACK];
    size_t flen = 16 + gp_launch_size(&m);
    uint8_t *frame = flen <= sizeof fstack ? fstack : malloc(flen);
    if (!frame) {
        free(pheap);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    gp_launch_frame(frame, 0, &m);
    r = gp_post(frame, flen, NULL, 0);
    if (frame != fstack)
        free(frame);
    free(pheap);
    return r;
}

/* ---- entry points ----------------------------------------------------------------------- */

GP_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                  unsigned int gridDimZ, unsigned int blockDimX,
                                  unsigned int blockDimY, unsigned int blockDimZ,
                                  unsigned int sharedMemBytes, CUstream hStream,
                                  void **kernelParams, void **extra)
{
    const unsigned g[3] = {gridDimX, gridDimY, gridDimZ}, b[3] = {blockDimX, blockDimY, blockDimZ};
    return launch(f, g, b, sharedMemBytes, hStream, 0, kernelParams, extra, NULL, 0);
}

GP_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                       unsigned int gridDimZ, unsigned int blockDimX,
                                       unsigned int blockDimY, unsigned int blockDimZ,
                                       unsigned int sharedMemBytes, CUstream hStream,
                                       void **kernelParams, void **extra)
{
    const unsigned g[3] = {gridDimX, gridDimY, gridDimZ}, b[3] = {blockDimX, blockDimY, blockDimZ};
    return launch(f, g, b, sharedMemBytes, hStream, 1, kernelParams, extra, NULL, 0);
}

static CUresult launch_ex(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                          void **extra, int ptsz)
{
    if (!config)
        return CUDA_ERROR_INVALID_VALUE;
    if (config->numAttrs && !config->attrs)
        return CUDA_ERROR_INVALID_VALUE;
    size_t alen = (size_t)config->numAttrs * sizeof(CUlaunchAttribute);
    if (alen > MAX_ATTRS_WIRE)
        return CUDA_ERROR_INVALID_VALUE;
    /* The attributes travel raw; the two that carry an event handle would reach the server's
     * driver as our handle value, not its event. */
    for (unsigned int i = 0; i < config->numAttrs; i++) {
        int id = config->attrs[i].id;
        if (id == CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_EVENT ||
            id == CU_LAUNCH_ATTRIBUTE_LAUNCH_COMPLETION_EVENT) {
            static atomic_flag said = ATOMIC_FLAG_INIT;
            if (!atomic_flag_test_and_set(&said))
                gp_log_error("launch attribute %d (an event the kernel triggers) is not "
                             "supported by gpupool yet",
                             id);
            return CUDA_ERROR_NOT_SUPPORTED;
        }
    }
    const unsigned g[3] = {config->gridDimX, config->gridDimY, config->gridDimZ};
    const unsigned b[3] = {config->blockDimX, config->blockDimY, config->blockDimZ};
    return launch(f, g, b, config->sharedMemBytes, config->hStream, ptsz, kernelParams, extra,
                  alen ? config->attrs : NULL, alen);
}

GP_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                                    void **extra)
{
    return launch_ex(config, f, kernelParams, extra, 0);
}

GP_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f,
                                         void **kernelParams, void **extra)
{
    return launch_ex(config, f, kernelParams, extra, 1);
}

static CUresult launch_cooperative(CUfunction f, const unsigned g[3], const unsigned b[3],
                                   unsigned smem, CUstream s, void **params, int ptsz)
{
    CUlaunchAttribute attr;
    memset(&attr, 0, sizeof attr);
    attr.id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
    attr.value.cooperative = 1;
    return launch(f, g, b, smem, s, ptsz, params, NULL, &attr, sizeof attr);
}

GP_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX,
                                             unsigned int gridDimY, unsigned int gridDimZ,
                                             unsigned int blockDimX, unsigned int blockDimY,
                                             unsigned int blockDimZ, unsigned int sharedMemBytes,
                                             CUstream hStream, void **kernelParams)
{
    const unsigned g[3] = {gridDimX, gridDimY, gridDimZ}, b[3] = {blockDimX, blockDimY, blockDimZ};
    return launch_cooperative(f, g, b, sharedMemBytes, hStream, kernelParams, 0);
}

GP_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gridDimX,
                                                  unsigned int gridDimY, unsigned int gridDimZ,
                                                  unsigned int blockDimX, unsigned int blockDimY,
                                                  unsigned int blockDimZ,
                                                  unsigned int sharedMemBytes, CUstream hStream,
                                                  void **kernelParams)
{
    const unsigned g[3] = {gridDimX, gridDimY, gridDimZ}, b[3] = {blockDimX, blockDimY, blockDimZ};
    return launch_cooperative(f, g, b, sharedMemBytes, hStream, kernelParams, 1);
}
