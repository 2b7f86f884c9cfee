/*
 * api_occupancy.c: the occupancy calculator (cuOccupancy*).
 *
 * The answers depend only on the function, its attributes and the arguments, and programs ask
 * the same questions again and again (PyTorch's cuBLAS asks cuOccupancyMaxActiveClusters 47
 * times in a short run), so every answer is cached by its full argument tuple plus the
 * function's attribute generation (a cuFuncSetAttribute retires the function's answers).
 * cuOccupancyMaxPotentialBlockSize is computed here from the cached max-active-blocks query,
 * as the driver documents it: the largest block size that reaches the best occupancy.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "gp_cuda_launch.h"
#include "shim.h"

enum {
    OCC_MAX_ACTIVE_BLOCKS = 0,
    OCC_AVAILABLE_DYN_SMEM = 1,
    OCC_MAX_CLUSTER_SIZE = 2,
    OCC_MAX_ACTIVE_CLUSTERS = 3,
};

#define OCC_BUCKETS 1024
#define OCC_MAX_ENTRIES 16384 /* beyond this the cache starts over */
#define MAX_ATTRS_WIRE 65536u

typedef struct occ_entry {
    struct occ_entry *next;
    uint64_t hash;
    gp_occupancy key; /* key.attrs points at attrs[] below */
    uint32_t gen;
    int64_t value;
    uint8_t attrs[];
} occ_entry;

static pthread_mutex_t occ_lock = PTHREAD_MUTEX_INITIALIZER;
static occ_entry *occ_table[OCC_BUCKETS];
static size_t occ_count;

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

static uint64_t key_hash(const gp_occupancy *k, uint32_t gen)
{
    uint64_t h = 14695981039346656037ull;
    uint64_t f[] = {k->kind,     k->func,    (uint64_t)(uint32_t)k->block_size,
                    k->dyn_smem, k->flags,   k->grid_x,
                    k->grid_y,   k->grid_z,  k->block_x,
                    k->block_y,  k->block_z, gen,
                    k->attrs_len};
    h = fnv(h, f, sizeof f);
    return k->attrs_len ? fnv(h, k->attrs, k->attrs_len) : h;
}

static int key_equal(const occ_entry *e, const gp_occupancy *k, uint32_t gen)
{
    const gp_occupancy *a = &e->key;
    return e->gen == gen && a->kind == k->kind && a->func == k->func &&
           a->block_size == k->block_size && a->dyn_smem == k->dyn_smem && a->flags == k->flags &&
           a->grid_x == k->grid_x && a->grid_y == k->grid_y && a->grid_z == k->grid_z &&
           a->block_x == k->block_x && a->block_y == k->block_y && a->block_z == k->block_z &&
           a->attrs_len == k->attrs_len &&
           (!k->attrs_len || memcmp(a->attrs, k->attrs, k->attrs_len) == 0);
}

static void occ_clear_locked(void)
{
    for (int b = 0; b < OCC_BUCKETS; b++) {
        occ_entry *e = occ_table[b];
        while (e) {
            occ_entry *next = e->next;
            free(e);
            e = next;
        }
        occ_table[b] = NULL;
    }
    occ_count = 0;
}

static CUresult occ_query(gp_func *fn, gp_occupancy *m, int64_t *value)
{
    m->func = fn->wire;
    uint32_t gen = atomic_load(&fn->attr_gen);
    uint64_t h = key_hash(m, gen);
    pthread_mutex_lock(&occ_lock);
    for (occ_entry *e = occ_table[h % OCC_BUCKETS]; e; e = e->next) {
        if (e->hash == h && key_equal(e, m, gen)) {
            *value = e->value;
            pthread_mutex_unlock(&occ_lock);
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&occ_lock);

    GP_FRAME(frame, flen, gp_occupancy, m);
    if (!frame)
        return CUDA_ERROR_OUT_OF_MEMORY;
    gp_reply reply;
    CUresult r = gp_request(frame, flen, NULL, 0, NULL, 0, &reply);
    GP_FRAME_FREE(frame);
    if (r != CUDA_SUCCESS)
        return gp_server_result(r, "occupancy");
    gp_occupancy_reply rep = {0};
    if (gp_occupancy_reply_decode(reply.body, reply.len, &rep)) {
        gp_log_error("occupancy: malformed reply");
        r = CUDA_ERROR_UNKNOWN;
    }
    gp_reply_free(&reply);
    if (r != CUDA_SUCCESS)
        return r;
    *value = rep.value;

    occ_entry *e = malloc(sizeof *e + m->attrs_len);
    if (!e)
        return CUDA_SUCCESS; /* the answer stands; it just is not remembered */
    e->hash = h;
    e->key = *m;
    e->gen = gen;
    e->value = rep.value;
    if (m->attrs_len)
        memcpy(e->attrs, m->attrs, m->attrs_len);
    e->key.attrs = e->attrs;
    pthread_mutex_lock(&occ_lock);
    if (occ_count >= OCC_MAX_ENTRIES)
        occ_clear_locked();
    e->next = occ_table[h % OCC_BUCKETS];
    occ_table[h % OCC_BUCKETS] = e;
    occ_count++;
    pthread_mutex_unlock(&occ_lock);
    return CUDA_SUCCESS;
}

static CUresult enter_func(CUfunction func, gp_func **fn)
{
    CUresult r = gp_ctx_enter();
    if (r != CUDA_SUCCESS)
        return r;
    *fn = gp_func_lookup((uint64_t)(uintptr_t)func);
    if (!*fn)
        return CUDA_ERROR_INVALID_HANDLE;
    gp_func_use_ctx(*fn);
    return CUDA_SUCCESS;
}

static CUresult max_active_blocks(gp_func *fn, int block_size, size_t smem, unsigned flags,
                                  int *blocks)
{
    gp_occupancy m = {
        .kind = OCC_MAX_ACTIVE_BLOCKS, .block_size = block_size, .dyn_smem = smem, .flags = flags};
    int64_t v;
    CUresult r = occ_query(fn, &m, &v);
    if (r == CUDA_SUCCESS)
        *blocks = (int)v;
    return r;
}

GP_EXPORT CUresult cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(
    int *numBlocks, CUfunction func, int blockSize, size_t dynamicSMemSize, unsigned int flags)
{
    if (!numBlocks)
        return CUDA_ERROR_INVALID_VALUE;
    gp_func *fn;
    CUresult r = enter_func(func, &fn);
    if (r != CUDA_SUCCESS)
        return r;
    return max_active_blocks(fn, blockSize, dynamicSMemSize, flags, numBlocks);
}

GP_EXPORT CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *numBlocks, CUfunction func,
                                                               int blockSize,
                                                               size_t dynamicSMemSize)
{
    return cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(
        numBlocks, func, blockSize, dynamicSMemSize, CU_OCCUPANCY_DEFAULT);
}

GP_EXPORT CUresult cuOccupancyAvailableDynamicSMemPerBlock(size_t *dynamicSmemSize, CUfunction func,
                                                           int numBlocks, int blockSize)
{
    if (!dynamicSmemSize)
        return CUDA_ERROR_INVALID_VALUE;
    gp_func *fn;
    CUresult r = enter_func(func, &fn);
    if (r != CUDA_SUCCESS)
        return r;
    /* The wire carries num_blocks in dyn_smem (sign-extended, so the server sees the int). */
    gp_occupancy m = {.kind = OCC_AVAILABLE_DYN_SMEM,
                      .block_size = blockSize,
                      .dyn_smem = (uint64_t)(int64_t)numBlocks};
    int64_t v;
    r = occ_query(fn, &m, &v);
    if (r == CUDA_SUCCESS)
        *dynamicSmemSize = (size_t)v;
    return r;
}

static CUresult cluster_query(uint32_t kind, int *out, CUfunction func,
                              const CUlaunchConfig *config)
{
    if (!out || !config)
        return CUDA_ERROR_INVALID_VALUE;
    if (config->numAttrs && !config->attrs)
        return CUDA_ERROR_INVALID_VALUE;
    size_t alen = (size_t)config->numAttrs * sizeof(CUlaunchAttribute);
    if (alen > MAX_ATTRS_WIRE)
        return CUDA_ERROR_INVALID_VALUE;
    gp_func *fn;
    CUresult r = enter_func(func, &fn);
    if (r != CUDA_SUCCESS)
        return r;
    /* A launch configuration may carry event attributes (our handles, meaningless to the
     * server's driver and irrelevant to occupancy): they travel as CU_LAUNCH_ATTRIBUTE_IGNORE. */
    CUlaunchAttribute stack[8], *attrs = alen > sizeof stack ? malloc(alen) : stack;
    if (!attrs)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (alen)
        memcpy(attrs, config->attrs, alen);
    for (unsigned int i = 0; i < config->numAttrs; i++)
        if (attrs[i].id == CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_EVENT ||
            attrs[i].id == CU_LAUNCH_ATTRIBUTE_LAUNCH_COMPLETION_EVENT)
            memset(&attrs[i], 0, sizeof attrs[i]);
    gp_occupancy m = {
        .kind = kind,
        .dyn_smem = config->sharedMemBytes,
        .grid_x = config->gridDimX,
        .grid_y = config->gridDimY,
        .grid_z = config->gridDimZ,
        .block_x = config->blockDimX,
        .block_y = config->blockDimY,
        .block_z = config->blockDimZ,
        .attrs = alen ? (const uint8_t *)attrs : NULL,
        .attrs_len = (uint32_t)alen,
    };
    int64_t v;
    r = occ_query(fn, &m, &v);
    if (attrs != stack)
        free(attrs);
    if (r == CUDA_SUCCESS)
        *out = (int)v;
    return r;
}

GP_EXPORT CUresult cuOccupancyMaxPotentialClusterSize(int *clusterSize, CUfunction func,
                                                      const CUlaunchConfig *config)
{
    return cluster_query(OCC_MAX_CLUSTER_SIZE, clusterSize, func, config);
}

GP_EXPORT CUresult cuOccupancyMaxActiveClusters(int *numClusters, CUfunction func,
                                                const CUlaunchConfig *config)
{
    return cluster_query(OCC_MAX_ACTIVE_CLUSTERS, numClusters, func, config);
}

static int dev_attr(int attr, int fallback)
{
    const gp_device_snapshot *d = gp_device(0);
    return d && d->attributes[attr] > 0 ? d->attributes[attr] : fallback;
}

GP_EXPORT CUresult cuOccupancyMaxPotentialBlockSizeWithFlags(
    int *minGridSize, int *blockSize, CUfunction func,
    CUoccupancyB2DSize blockSizeToDynamicSMemSize, size_t dynamicSMemSize, int blockSizeLimit,
    unsigned int flags)
{
    if (!minGridSize || !blockSize)
        return CUDA_ERROR_INVALID_VALUE;
    gp_func *fn;
    CUresult r = enter_func(func, &fn);
    if (r != CUDA_SUCCESS)
        return r;
    int func_max;
    r = gp_func_attr(fn, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, &func_max);
    if (r != CUDA_SUCCESS)
        return r;
    int limit = dev_attr(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK, 1024);
    if (func_max > 0 && func_max < limit)
        limit = func_max;
    if (blockSizeLimit > 0 && blockSizeLimit < limit)
        limit = blockSizeLimit;
    const int warp = dev_attr(CU_DEVICE_ATTRIBUTE_WARP_SIZE, 32);
    const int per_sm = dev_attr(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, 2048);
    const int sms = dev_attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 1);

    int best_threads = 0, best_block = 0, best_blocks = 0;
    for (int aligned = (limit + warp - 1) / warp * warp; aligned > 0; aligned -= warp) {
        int bs = aligned < limit ? aligned : limit;
        size_t smem = blockSizeToDynamicSMemSize ? blockSizeToDynamicSMemSize(bs) : dynamicSMemSize;
        int blocks;
        r = max_active_blocks(fn, bs, smem, flags, &blocks);
        if (r != CUDA_SUCCESS)
            return r;
        if (blocks * bs > best_threads) {
            best_threads = blocks * bs;
            best_block = bs;
            best_blocks = blocks;
        }
        if (best_threads >= per_sm)
            break;
    }
    *minGridSize = best_blocks * sms;
    *blockSize = best_block;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuOccupancyMaxPotentialBlockSize(int *minGridSize, int *blockSize,
                                                    CUfunction func,
                                                    CUoccupancyB2DSize blockSizeToDynamicSMemSize,
                                                    size_t dynamicSMemSize, int blockSizeLimit)
{
    return cuOccupancyMaxPotentialBlockSizeWithFlags(minGridSize, blockSize, func,
                                                     blockSizeToDynamicSMemSize, dynamicSMemSize,
                                                     blockSizeLimit, CU_OCCUPANCY_DEFAULT);
}
