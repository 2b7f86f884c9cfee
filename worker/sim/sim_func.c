/*
 * sim_func.c: function/kernel attributes and the occupancy calculator.
 *
 * Occupancy follows the usual per-SM limits (threads, blocks, registers, shared memory) with the
 * device's attribute values, so the answers are deterministic and of the right size for an H100;
 * they do not claim to match the hardware's exact register allocation granularity.
 */
#include "sim_api.h"
#include "sim_internal.h"

/* Attributes gp_cuda.h does not name. */
enum {
    ATTR_MAX_REGS_PER_SM = 82,
    ATTR_MAX_BLOCKS_PER_SM = 106,
    ATTR_RESERVED_SMEM = 111
};

static int dev_attr(int id)
{
    return sim_config_attr(&sim_cfg, 0, id);
}

/* For values used as divisors or counts: attr.<N> overrides may say 0 or less. */
static int dev_attr_pos(int id)
{
    int v = dev_attr(id);
    return v > 0 ? v : 1;
}

static int cc(void)
{
    return sim_cfg.cc_major * 10 + sim_cfg.cc_minor;
}

/* Registers a warp holds: per-thread count times 32, in units of 256. */
static int regs_per_warp(const struct sim_func *f)
{
    int r = f->regs > 0 ? f->regs : 1;
    return (r * 32 + 255) / 256 * 256;
}

int sim_func_attr_value(const struct sim_func *f, int attrib)
{
    switch (attrib) {
    case SIM_FUNC_ATTR_MAX_THREADS_PER_BLOCK: {
        int warps = dev_attr_pos(CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK) / regs_per_warp(f);
        int by_regs = warps * 32, lim = dev_attr_pos(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK);
        return by_regs < lim ? by_regs : lim;
    }
    case SIM_FUNC_ATTR_SHARED_SIZE_BYTES:
    case SIM_FUNC_ATTR_CONST_SIZE_BYTES:
    case SIM_FUNC_ATTR_LOCAL_SIZE_BYTES:
    case SIM_FUNC_ATTR_CACHE_MODE_CA:
        return 0;
    case SIM_FUNC_ATTR_NUM_REGS:
        return f->regs;
    case SIM_FUNC_ATTR_PTX_VERSION:
    case SIM_FUNC_ATTR_BINARY_VERSION:
        return cc();
    default:
        return f->attr[attrib];
    }
}

static CUresult get_attr(int *pi, int attrib, struct sim_func *f)
{
    if (!pi || attrib < 0 || attrib >= SIM_FUNC_ATTR_COUNT)
        return CUDA_ERROR_INVALID_VALUE;
    if (!f)
        return CUDA_ERROR_INVALID_HANDLE;
    *pi = sim_func_attr_value(f, attrib);
    return CUDA_SUCCESS;
}

static CUresult set_attr(struct sim_func *f, int attrib, int value)
{
    if (!f)
        return CUDA_ERROR_INVALID_HANDLE;
    bool ok;
    switch (attrib) {
    case SIM_FUNC_ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES:
        ok = value >= 0 && value <= dev_attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN);
        break;
    case SIM_FUNC_ATTR_PREFERRED_SHARED_MEMORY_CARVEOUT:
        ok = value >= -1 && value <= 100;
        break;
    case SIM_FUNC_ATTR_REQUIRED_CLUSTER_WIDTH:
    case SIM_FUNC_ATTR_REQUIRED_CLUSTER_HEIGHT:
    case SIM_FUNC_ATTR_REQUIRED_CLUSTER_DEPTH:
        ok = value >= 0;
        break;
    case SIM_FUNC_ATTR_NON_PORTABLE_CLUSTER_SIZE_ALLOWED:
        ok = value == 0 || value == 1;
        break;
    case SIM_FUNC_ATTR_CLUSTER_SCHEDULING_POLICY_PREFERENCE:
        ok = value >= 0 && value <= 2;
        break;
    default:
        ok = false; /* read-only or unknown */
    }
    if (!ok)
        return CUDA_ERROR_INVALID_VALUE;
    f->attr[attrib] = value;
    return CUDA_SUCCESS;
}

static struct sim_func *kernel_of(CUkernel k)
{
    return sim_handle_get((uint64_t)(uintptr_t)k, SIM_K_KERNEL);
}

CUresult cuFuncGetAttribute(int *pi, CUfunction_attribute attrib, CUfunction hfunc)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    return sim_leave(get_attr(pi, attrib, sim_handle_get((uint64_t)(uintptr_t)hfunc, SIM_K_FUNC)));
}

CUresult cuFuncSetAttribute(CUfunction hfunc, CUfunction_attribute attrib, int value)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    struct sim_func *f = sim_handle_get((uint64_t)(uintptr_t)hfunc, SIM_K_FUNC);
    return sim_leave(set_attr(f, attrib, value));
}

/* Per-device kernel attributes are kept once per kernel: all simulated devices are alike. */
CUresult cuKernelGetAttribute(int *pi, CUfunction_attribute attrib, CUkernel kernel, CUdevice dev)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!sim_dev_valid(dev))
        return sim_leave(CUDA_ERROR_INVALID_DEVICE);
    return sim_leave(get_attr(pi, attrib, kernel_of(kernel)));
}

CUresult cuKernelSetAttribute(CUfunction_attribute attrib, int val, CUkernel kernel, CUdevice dev)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!sim_dev_valid(dev))
        return sim_leave(CUDA_ERROR_INVALID_DEVICE);
    return sim_leave(set_attr(kernel_of(kernel), attrib, val));
}

static CUresult set_cache_config(struct sim_func *f, int config)
{
    if (!f)
        return CUDA_ERROR_INVALID_HANDLE;
    if (config < 0 || config > 3) /* PREFER_NONE, _SHARED, _L1, _EQUAL */
        return CUDA_ERROR_INVALID_VALUE;
    f->cache_config = config; /* a preference only, as on the device */
    return CUDA_SUCCESS;
}

CUresult cuFuncSetCacheConfig(CUfunction hfunc, int config)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    return sim_leave(
        set_cache_config(sim_handle_get((uint64_t)(uintptr_t)hfunc, SIM_K_FUNC), config));
}

CUresult cuKernelSetCacheConfig(CUkernel kernel, int config, CUdevice dev)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!sim_dev_valid(dev))
        return sim_leave(CUDA_ERROR_INVALID_DEVICE);
    return sim_leave(set_cache_config(kernel_of(kernel), config));
}

/* ---- occupancy --------------------------------------------------------------------------- */

static int min_int(int a, int b)
{
    return a < b ? a : b;
}

/* Resident blocks per SM for a launch of block_size threads with dyn bytes of dynamic shared
 * memory. */
static int blocks_per_sm(const struct sim_func *f, int block_size, size_t dyn)
{
    if (block_size > sim_func_attr_value(f, SIM_FUNC_ATTR_MAX_THREADS_PER_BLOCK) ||
        dyn > (size_t)f->attr[SIM_FUNC_ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES])
        return 0;
    int warps = (block_size + 31) / 32;
    int n = dev_attr_pos(ATTR_MAX_BLOCKS_PER_SM);
    n = min_int(n, dev_attr_pos(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR) / 32 / warps);
    n = min_int(n, dev_attr_pos(ATTR_MAX_REGS_PER_SM) / (regs_per_warp(f) * warps));
    size_t per_block = dyn + (size_t)dev_attr_pos(ATTR_RESERVED_SMEM);
    size_t by_smem =
        (size_t)dev_attr_pos(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR) / per_block;
    return by_smem < (size_t)n ? (int)by_smem : n;
}

static CUresult max_blocks(int *numBlocks, CUfunction func, int blockSize, size_t dyn,
                           unsigned flags)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!numBlocks || blockSize <= 0 || (flags & ~1u) != 0) /* 1: DISABLE_CACHING_OVERRIDE */
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    struct sim_func *f = sim_func_get((uint64_t)(uintptr_t)func);
    if (!f)
        return sim_leave(CUDA_ERROR_INVALID_HANDLE);
    *numBlocks = blocks_per_sm(f, blockSize, dyn);
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *numBlocks, CUfunction func, int blockSize,
                                                     size_t dynamicSMemSize)
{
    return max_blocks(numBlocks, func, blockSize, dynamicSMemSize, 0);
}

CUresult cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int *numBlocks, CUfunction func,
                                                              int blockSize, size_t dynamicSMemSize,
                                                              unsigned int flags)
{
    return max_blocks(numBlocks, func, blockSize, dynamicSMemSize, flags);
}

CUresult cuOccupancyAvailableDynamicSMemPerBlock(size_t *dynamicSmemSize, CUfunction func,
                                                 int numBlocks, int blockSize)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!dynamicSmemSize || numBlocks <= 0 || blockSize <= 0)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    struct sim_func *f = sim_func_get((uint64_t)(uintptr_t)func);
    if (!f)
        return sim_leave(CUDA_ERROR_INVALID_HANDLE);
    size_t avail = 0;
    if (blocks_per_sm(f, blockSize, 0) >= numBlocks) {
        size_t share =
            (size_t)dev_attr_pos(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR) /
            (size_t)numBlocks;
        size_t reserved = (size_t)dev_attr_pos(ATTR_RESERVED_SMEM);
        avail = share > reserved ? share - reserved : 0;
        size_t cap = (size_t)f->attr[SIM_FUNC_ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES];
        if (avail > cap)
            avail = cap;
    }
    *dynamicSmemSize = avail;
    return sim_leave(CUDA_SUCCESS);
}

/* Cluster limits: 8 blocks portably, 16 when the kernel allows non-portable sizes. */
static int cluster_limit(const struct sim_func *f)
{
    return f->attr[SIM_FUNC_ATTR_NON_PORTABLE_CLUSTER_SIZE_ALLOWED] ? 16 : 8;
}

/* SMs per GPC: clusters are scheduled within one GPC (an H100 has 132 SMs in 8 of them). */
static int sms_per_gpc(void)
{
    int sms = dev_attr_pos(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
    int gpcs = (sms + 17) / 18;
    return sms / gpcs > 0 ? sms / gpcs : 1;
}

static CUresult check_config(const CUlaunchConfig *config, struct sim_func *f, int *block_size)
{
    if (!config || (config->numAttrs > 0 && !config->attrs))
        return CUDA_ERROR_INVALID_VALUE;
    if (!f)
        return CUDA_ERROR_INVALID_HANDLE;
    uint64_t bs = (uint64_t)config->blockDimX * config->blockDimY * config->blockDimZ;
    if (bs == 0 || bs > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    *block_size = (int)bs;
    return CUDA_SUCCESS;
}

CUresult cuOccupancyMaxPotentialClusterSize(int *clusterSize, CUfunction func,
                                            const CUlaunchConfig *config)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    struct sim_func *f = sim_func_get((uint64_t)(uintptr_t)func);
    int bs = 0;
    if (!clusterSize)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    if ((rc = check_config(config, f, &bs)) != CUDA_SUCCESS)
        return sim_leave(rc);
    int per_sm = blocks_per_sm(f, bs, config->sharedMemBytes);
    *clusterSize = min_int(cluster_limit(f), per_sm * sms_per_gpc());
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuOccupancyMaxActiveClusters(int *numClusters, CUfunction func,
                                      const CUlaunchConfig *config)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    struct sim_func *f = sim_func_get((uint64_t)(uintptr_t)func);
    int bs = 0;
    if (!numClusters)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    if ((rc = check_config(config, f, &bs)) != CUDA_SUCCESS)
        return sim_leave(rc);
    /* The cluster shape: from the launch attributes, else the kernel's required one, else 1. */
    uint64_t cs = 1;
    int w = f->attr[SIM_FUNC_ATTR_REQUIRED_CLUSTER_WIDTH];
    if (w > 0)
        cs = (uint64_t)w * (uint64_t)f->attr[SIM_FUNC_ATTR_REQUIRED_CLUSTER_HEIGHT] *
             (uint64_t)f->attr[SIM_FUNC_ATTR_REQUIRED_CLUSTER_DEPTH];
    for (unsigned i = 0; i < config->numAttrs; i++) {
        if (config->attrs[i].id != SIM_LAUNCH_ATTR_CLUSTER_DIMENSION)
            continue;
        const CUlaunchAttributeValue *v = &config->attrs[i].value;
        cs = (uint64_t)v->clusterDim.x * v->clusterDim.y * v->clusterDim.z;
    }
    if (cs == 0 || cs > (uint64_t)cluster_limit(f))
        return sim_leave(SIM_ERR_INVALID_CLUSTER_SIZE);
    int per_sm = blocks_per_sm(f, bs, config->sharedMemBytes);
    int sms = dev_attr_pos(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT), per_gpc = sms_per_gpc();
    *numClusters = (int)((uint64_t)per_sm * (uint64_t)per_gpc / cs) * (sms / per_gpc);
    return sim_leave(CUDA_SUCCESS);
}
