/*
 * sim_launch.c: cuLaunchKernel / cuLaunchKernelEx.
 *
 * A launch is checked as the driver checks it (dimensions, shared memory, stream, parameters),
 * then runs the kernel's host version to completion. Only the kernels of sim_kernels.c can run;
 * any other fails with CUDA_ERROR_NOT_SUPPORTED and says so on stderr and in the error detail,
 * so nobody mistakes the simulated device for one that computes their program. The one
 * exception is the benchmark-only count mode (config key count_only, sim_config.c): there any
 * kernel is accepted and not run, its arguments packed as far as its layout is known (an unknown
 * layout packs nothing), so that a real program's call stream can be counted.
 *
 * Arguments come either as kernelParams (one pointer per parameter, sizes from the parameter
 * layout) or as one packed buffer in `extra`; both are copied into one buffer laid out as on the
 * device, which the kernel's host version unpacks.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim_api.h"
#include "sim_internal.h"
#include "sim_shared.h"

#define MAX_EXTRA_ITEMS 64 /* an `extra` list longer than this is garbage */

struct launch {
    unsigned grid[3], block[3];
    unsigned shmem;
    CUstream stream;
    void **params;
    void **extra;
    const CUlaunchAttribute *attrs;
    unsigned nattrs;
};

static CUresult check_dims(const struct launch *l, const struct sim_func *f)
{
    for (int i = 0; i < 3; i++)
        if (l->grid[i] == 0 || l->block[i] == 0)
            return CUDA_ERROR_INVALID_VALUE;
    uint64_t threads = (uint64_t)l->block[0] * l->block[1] * l->block[2];
    if (threads > (uint64_t)sim_func_attr_value(f, SIM_FUNC_ATTR_MAX_THREADS_PER_BLOCK))
        return CUDA_ERROR_INVALID_VALUE;
    for (int i = 0; i < 3; i++) {
        long long bmax = sim_config_attr(&sim_cfg, 0, CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X + i);
        long long gmax = sim_config_attr(&sim_cfg, 0, CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X + i);
        if ((long long)l->block[i] > bmax || (long long)l->grid[i] > gmax)
            return CUDA_ERROR_INVALID_VALUE;
    }
    if (l->shmem > (unsigned)f->attr[SIM_FUNC_ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES])
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

/* Cluster dimensions from the launch attributes must tile the grid. */
static CUresult check_attrs(const struct launch *l, const struct sim_func *f)
{
    for (unsigned i = 0; i < l->nattrs; i++) {
        if (l->attrs[i].id != SIM_LAUNCH_ATTR_CLUSTER_DIMENSION)
            continue; /* priorities, cooperative, ... change nothing in a synchronous sim */
        unsigned c[3] = {l->attrs[i].value.clusterDim.x, l->attrs[i].value.clusterDim.y,
                         l->attrs[i].value.clusterDim.z};
        int limit = f->attr[SIM_FUNC_ATTR_NON_PORTABLE_CLUSTER_SIZE_ALLOWED] ? 16 : 8;
        if (c[0] == 0 || c[1] == 0 || c[2] == 0 || (uint64_t)c[0] * c[1] * c[2] > (uint64_t)limit)
            return SIM_ERR_INVALID_CLUSTER_SIZE;
        for (int d = 0; d < 3; d++)
            if (l->grid[d] % c[d] != 0)
                return SIM_ERR_INVALID_CLUSTER_SIZE;
    }
    return CUDA_SUCCESS;
}

/* Packs the arguments into buf (total bytes, laid out by f's parameters). */
static CUresult pack_args(const struct launch *l, const struct sim_func *f, unsigned char *buf,
                          uint32_t total)
{
    if (l->params) {
        for (int i = 0; i < f->nparams; i++) {
            if (!l->params[i])
                return CUDA_ERROR_INVALID_VALUE;
            memcpy(buf + f->params[i].offset, l->params[i], f->params[i].size);
        }
        return CUDA_SUCCESS;
    }
    if (l->extra) {
        const void *ptr = NULL;
        const size_t *sizep = NULL;
        int i = 0;
        for (; i < MAX_EXTRA_ITEMS && l->extra[i] != CU_LAUNCH_PARAM_END; i += 2) {
            if (l->extra[i] == CU_LAUNCH_PARAM_BUFFER_POINTER)
                ptr = l->extra[i + 1];
            else if (l->extra[i] == CU_LAUNCH_PARAM_BUFFER_SIZE)
                sizep = l->extra[i + 1];
            else
                return CUDA_ERROR_INVALID_VALUE;
        }
        /* The buffer must hold every parameter; a longer one (padding) is fine. */
        if (i >= MAX_EXTRA_ITEMS || !sizep || (total > 0 && (!ptr || *sizep < total)))
            return CUDA_ERROR_INVALID_VALUE;
        if (total > 0)
            memcpy(buf, ptr, total);
        return CUDA_SUCCESS;
    }
    return total == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static CUresult launch(CUfunction fh, const struct launch *l)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    /* A CUkernel is accepted wherever a CUfunction is, as by the driver (cudart relies on it). */
    struct sim_func *f = sim_func_get((uint64_t)(uintptr_t)fh);
    if (!f)
        return sim_leave(CUDA_ERROR_INVALID_HANDLE);
    if ((rc = check_dims(l, f)) != CUDA_SUCCESS || (rc = check_attrs(l, f)) != CUDA_SUCCESS ||
        (rc = sim_stream_check(l->stream)) != CUDA_SUCCESS)
        return sim_leave(rc);
    if (l->params && l->extra)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    if (!f->def && !sim_cfg.count_only) {
        fprintf(stderr,
                "gpupool-sim: kernel '%s' cannot run on the simulated device (only gp_test_* "
                "kernels are simulated)\n",
                f->name);
        sim_detail("kernel '%s' cannot run on the simulated device (only gp_test_* kernels are "
                   "simulated)",
                   f->name);
        return sim_leave(CUDA_ERROR_NOT_SUPPORTED);
    }
    uint32_t total = sim_params_size(f->nparams, f->params);
    unsigned char *buf = calloc(1, total ? total : 1);
    if (!buf)
        return sim_leave(CUDA_ERROR_OUT_OF_MEMORY);
    rc = pack_args(l, f, buf, total);
    struct sim_graph *g = NULL;
    if (rc == CUDA_SUCCESS)
        rc = sim_capture_target(l->stream, &g);
    if (rc == CUDA_SUCCESS && g) {
        /* A capturing stream records the launch (sim_graph.c) with its packed arguments. */
        struct sim_op op = {.kind = SIM_OP_KERNEL,
                            .func = (uint64_t)(uintptr_t)fh,
                            .params = buf,
                            .params_len = total,
                            .dims = {{l->grid[0], l->grid[1], l->grid[2]},
                                     {l->block[0], l->block[1], l->block[2]}}};
        rc = sim_graph_add(g, &op);
    } else if (rc == CUDA_SUCCESS && !f->def) {
        /* Count mode (benchmarks only): accepted, checked as far as the sim can, not run. */
    } else if (rc == CUDA_SUCCESS) {
        struct sim_dims d = {{l->grid[0], l->grid[1], l->grid[2]},
                             {l->block[0], l->block[1], l->block[2]}};
        sim_shared_turn_begin(sim_phys_dev(c->dev)); /* a shared GPU: one process's kernel */
        rc = f->def->fn(buf, &d);
        sim_shared_turn_end(sim_phys_dev(c->dev));
        /* A faulting kernel leaves the context unusable, as on the device: every later call
         * returns the error until the context is destroyed or reset. */
        if (rc == CUDA_ERROR_ILLEGAL_ADDRESS)
            c->sticky = rc;
    }
    free(buf);
    return sim_leave(rc);
}

CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                        unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                        unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                        void **kernelParams, void **extra)
{
    struct launch l = {.grid = {gridDimX, gridDimY, gridDimZ},
                       .block = {blockDimX, blockDimY, blockDimZ},
                       .shmem = sharedMemBytes,
                       .stream = hStream,
                       .params = kernelParams,
                       .extra = extra};
    return launch(f, &l);
}

CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                          void **extra)
{
    if (!config || (config->numAttrs > 0 && !config->attrs)) {
        CUresult rc = sim_enter(); /* not-initialised wins over a bad argument */
        return rc != CUDA_SUCCESS ? rc : sim_leave(CUDA_ERROR_INVALID_VALUE);
    }
    struct launch l = {.grid = {config->gridDimX, config->gridDimY, config->gridDimZ},
                       .block = {config->blockDimX, config->blockDimY, config->blockDimZ},
                       .shmem = config->sharedMemBytes,
                       .stream = config->hStream,
                       .params = kernelParams,
                       .extra = extra,
                       .attrs = config->attrs,
                       .nattrs = config->numAttrs};
    return launch(f, &l);
}
