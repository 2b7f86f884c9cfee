/*
 * Unit test of the shim's module / launch / function-attribute / occupancy entry points
 * (client/shim/api_module.c, api_launch.c, api_func.c, api_occupancy.c) against a fake shim
 * core: the gp_* functions of shim.h are defined here, and gp_request / gp_post answer like a
 * small worker (a fake server with an image cache). Checks the wire traffic (what is sent, how
 * often), argument packing, the caches, error codes, thread safety, and measures how many
 * launches per second the client side alone can issue.
 *
 * Usage: test_module_api
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gp_cuda_launch.h"
#include "sha256.h"
#include "shim.h"
#include "synth_image.h"

#include "gp_check_said.h"
#define CHECK_RC(expr, want)                                                                       \
    do {                                                                                           \
        CUresult rc_ = (expr);                                                                     \
        CHECK(rc_ == (want), "returned %d, expected %d", (int)rc_, (int)(want));                   \
    } while (0)

/* ==== the fake shim core ================================================================== */

static pthread_mutex_t fake_lock = PTHREAD_MUTEX_INITIALIZER;
static int log_errors;

void gp_log_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("  (log) ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    __atomic_add_fetch(&log_errors, 1, __ATOMIC_RELAXED);
}
void gp_log_info(const char *fmt, ...)
{
    (void)fmt;
}
void gp_log_debug(const char *fmt, ...)
{
    (void)fmt;
}

/* Handles. */
#define MAX_HANDLES 4096
static struct {
    uint64_t h;
    void *obj;
} handles[MAX_HANDLES];
static uint64_t next_n = 16;

static size_t slot_of(uint64_t h)
{
    return (size_t)(h & (MAX_HANDLES - 1));
}

uint64_t gp_handle_new(enum gp_handle_kind kind, void *obj)
{
    pthread_mutex_lock(&fake_lock);
    uint64_t h = 0;
    for (int tries = 0; tries < MAX_HANDLES && !h; tries++) {
        uint64_t n = next_n++;
        if (handles[slot_of(n)].h)
            continue;
        h = GP_HANDLE_TAG | (uint64_t)kind << 40 | n;
        handles[slot_of(n)].h = h;
        handles[slot_of(n)].obj = obj;
    }
    pthread_mutex_unlock(&fake_lock);
    return h;
}
void *gp_handle_get(uint64_t h, enum gp_handle_kind kind)
{
    if (gp_handle_kind_of(h) != (int)kind)
        return NULL;
    void *obj = NULL;
    pthread_mutex_lock(&fake_lock);
    if (handles[slot_of(h)].h == h)
        obj = handles[slot_of(h)].obj;
    pthread_mutex_unlock(&fake_lock);
    return obj;
}
void *gp_handle_remove(uint64_t h, enum gp_handle_kind kind)
{
    if (gp_handle_kind_of(h) != (int)kind)
        return NULL;
    void *obj = NULL;
    pthread_mutex_lock(&fake_lock);
    if (handles[slot_of(h)].h == h) {
        obj = handles[slot_of(h)].obj;
        handles[slot_of(h)].h = 0;
    }
    pthread_mutex_unlock(&fake_lock);
    return obj;
}

/* VA map: just counts. */
static int vamap_globals, vamap_removed;
static uint64_t last_global_base;
int gp_vamap_add_global(uint64_t base, uint64_t size, uint64_t ctx)
{
    (void)size, (void)ctx;
    __atomic_add_fetch(&vamap_globals, 1, __ATOMIC_RELAXED);
    last_global_base = base;
    return 0;
}
int gp_vamap_remove_global(uint64_t base, uint64_t ctx)
{
    (void)ctx;
    __atomic_add_fetch(&vamap_removed, 1, __ATOMIC_RELAXED);
    return base == last_global_base ? 0 : -1;
}

/* Device and context. */
static gp_device_snapshot dev;
static CUresult ctx_result = CUDA_SUCCESS;
int gp_device_count(void)
{
    return 1;
}
const gp_device_snapshot *gp_device(int ordinal)
{
    return ordinal == 0 ? &dev : NULL;
}
uint64_t gp_ctx_current(void)
{
    return GP_PRIMARY_CTX_ID;
}
CUresult gp_ctx_enter(void)
{
    return ctx_result;
}
int gp_stream_wire(CUstream s, uint64_t *wire)
{
    uint64_t v = (uint64_t)(uintptr_t)s;
    if (v > 2 && gp_handle_kind_of(v) != GP_H_STREAM)
        return -1;
    *wire = v;
    return 0;
}

/* The fake server. */
static struct {
    int requests[128], posts[128];
    uint64_t bulk_bytes;
    uint8_t have[64][32];
    int nhave;
    uint8_t last_post[1 << 17];
    size_t last_post_len;
} srv;

static int posts_of(int op)
{
    return __atomic_load_n(&srv.posts[op], __ATOMIC_RELAXED);
}
static int requests_of(int op)
{
    return __atomic_load_n(&srv.requests[op], __ATOMIC_RELAXED);
}

CUresult gp_post(uint8_t *frame, size_t frame_len, const void *bulk, uint64_t bulk_len)
{
    (void)bulk, (void)bulk_len;
    uint16_t op = gp_rd_u16(frame + 4);
    if (gp_rd_u32(frame) != frame_len - 16) {
        fprintf(stderr, "posted frame length mismatch\n");
        abort();
    }
    pthread_mutex_lock(&fake_lock);
    srv.posts[op]++;
    if (frame_len <= sizeof srv.last_post) {
        memcpy(srv.last_post, frame, frame_len);
        srv.last_post_len = frame_len;
    }
    pthread_mutex_unlock(&fake_lock);
    return CUDA_SUCCESS;
}

static int attr_value(int attr)
{
    return attr == CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK ? 768 : attr * 10;
}

#define REPLY(type, msg)                                                                           \
    do {                                                                                           \
        reply->len = type##_size(&(msg));                                                          \
        reply->body = malloc(reply->len);                                                          \
        type##_encode(reply->body, &(msg));                                                        \
        reply->result = (msg).result;                                                              \
    } while (0)

CUresult gp_request(uint8_t *frame, size_t frame_len, const void *bulk, uint64_t bulk_len,
                    void *bulk_dst, uint64_t bulk_cap, gp_reply *reply)
{
    (void)bulk_dst, (void)bulk_cap;
    uint16_t op = gp_rd_u16(frame + 4);
    const uint8_t *body = frame + 16;
    size_t blen = frame_len - 16;
    if (gp_rd_u32(frame) != blen)
        abort();
    pthread_mutex_lock(&fake_lock);
    srv.requests[op]++;
    memset(reply, 0, sizeof *reply);
    switch (op) {
    case GP_OP_MODULE_LOAD: {
        gp_module_load m;
        if (gp_module_load_decode(body, blen, &m))
            abort();
        gp_module_load_reply rep = {0};
        int have = 0;
        for (int i = 0; i < srv.nhave; i++)
            have |= !memcmp(srv.have[i], m.sha256, 32);
        if (m.data_len) {
            uint8_t sha[32];
            if (m.data_len != bulk_len || m.image_size != bulk_len)
                abort();
            gp_sha256(bulk, bulk_len, sha);
            if (memcmp(sha, m.sha256, 32))
                abort();
            srv.bulk_bytes += bulk_len;
            if (!have && srv.nhave < 64)
                memcpy(srv.have[srv.nhave++], sha, 32);
        } else if (!have) {
            rep.result = GP_ENEEDIMAGE;
        }
        REPLY(gp_module_load_reply, rep);
        break;
    }
    case GP_OP_GET_FUNCTION: {
        gp_get_function m;
        if (gp_get_function_decode(body, blen, &m))
            abort();
        char name[64] = {0};
        memcpy(name, m.name, m.name_len < 63 ? m.name_len : 63);
        uint8_t offs[16], sizes[16];
        gp_get_function_reply rep = {0};
        rep.param_offsets = offs, rep.param_sizes = sizes;
        if (!strcmp(name, "k4")) { /* (float, ptr, ptr, int) */
            const uint32_t o[] = {0, 8, 16, 24}, s[] = {4, 8, 8, 4};
            for (int i = 0; i < 4; i++) {
                gp_wr_u32(offs + 4 * i, o[i]);
                gp_wr_u32(sizes + 4 * i, s[i]);
            }
            rep.param_count = 4, rep.param_offsets_count = rep.param_sizes_count = 4;
        } else if (!strcmp(name, "big")) { /* (struct of 400 bytes, ptr): above the stack buffer */
            gp_wr_u32(offs, 0), gp_wr_u32(sizes, 5000);
            gp_wr_u32(offs + 4, 5000), gp_wr_u32(sizes + 4, 8);
            rep.param_count = 2, rep.param_offsets_count = rep.param_sizes_count = 2;
        } else if (!strcmp(name, "noargs")) {
            rep.param_count = 0;
        } else if (!strcmp(name, "missing")) {
            rep.result = CUDA_ERROR_NOT_FOUND;
        } else { /* "kern" (in the synthetic image) and "nolayout" (not in it) */
            rep.param_count = -1;
        }
        REPLY(gp_get_function_reply, rep);
        break;
    }
    case GP_OP_GET_GLOBAL: {
        gp_get_global m;
        if (gp_get_global_decode(body, blen, &m))
            abort();
        gp_get_global_reply rep = {0};
        if (m.name_len == 1 && m.name[0] == 'g')
            rep.dptr = 0x200000001000ull, rep.size = 64;
        else
            rep.result = CUDA_ERROR_NOT_FOUND;
        REPLY(gp_get_global_reply, rep);
        break;
    }
    case GP_OP_FUNC_GET_ATTRIBUTE: {
        gp_func_get_attribute m;
        if (gp_func_get_attribute_decode(body, blen, &m))
            abort();
        gp_func_get_attribute_reply rep = {0};
        if (m.attribute < 0 || m.attribute >= CU_FUNC_ATTRIBUTE_MAX)
            rep.result = CUDA_ERROR_INVALID_VALUE;
        else
            rep.value = attr_value(m.attribute);
        REPLY(gp_func_get_attribute_reply, rep);
        break;
    }
    case GP_OP_FUNC_SET_ATTRIBUTE: {
        gp_func_set_attribute m;
        if (gp_func_set_attribute_decode(body, blen, &m))
            abort();
        gp_func_set_attribute_reply rep = {0};
        REPLY(gp_func_set_attribute_reply, rep);
        break;
    }
    case GP_OP_OCCUPANCY: {
        gp_occupancy m;
        if (gp_occupancy_decode(body, blen, &m))
            abort();
        gp_occupancy_reply rep = {0};
        if (m.kind == 0) {
            /* Pretend registers allow 40960 threads' worth... simple model: 2048 threads per
             * SM, at most 32 blocks, and dynamic shared memory of 100 KB per block at most 2. */
            int64_t by_threads = 2048 / m.block_size, by_blocks = 32;
            int64_t by_smem = m.dyn_smem ? 232448 / (int64_t)m.dyn_smem : 1000;
            rep.value = by_threads < by_blocks ? by_threads : by_blocks;
            if (by_smem < rep.value)
                rep.value = by_smem;
        } else if (m.kind == 1) {
            rep.value = 232448;
        } else if (m.kind == 2) {
            rep.value = 8;
        } else {
            int64_t size = 1;
            for (uint32_t i = 0; i + 72 <= m.attrs_len; i += 72)
                if (gp_rd_u32(m.attrs + i) == CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)
                    size = (int64_t)gp_rd_u32(m.attrs + i + 8) * gp_rd_u32(m.attrs + i + 12) *
                           gp_rd_u32(m.attrs + i + 16);
            rep.value = size > 16 ? 0 : 132 / size;
        }
        REPLY(gp_occupancy_reply, rep);
        break;
    }
    default:
        abort();
    }
    pthread_mutex_unlock(&fake_lock);
    /* As conn.c: a non-zero result is the return value, and the body is already freed. */
    if (reply->result != 0) {
        free(reply->body);
        reply->body = NULL;
        reply->len = 0;
    }
    return reply->result;
}

void gp_reply_free(gp_reply *reply)
{
    free(reply->body);
    reply->body = NULL;
}

/* ==== tests ================================================================================ */

static gp_launch last_launch(void)
{
    gp_launch m;
    memset(&m, 0, sizeof m);
    CHECK(gp_rd_u16(srv.last_post + 4) == GP_OP_LAUNCH, "last post is op %u",
          gp_rd_u16(srv.last_post + 4));
    CHECK(gp_launch_decode(srv.last_post + 16, srv.last_post_len - 16, &m) == 0,
          "launch frame decodes");
    return m;
}

static uint8_t *elf_image;
static size_t elf_len;

static void test_module_load_and_functions(void)
{
    CUmodule mod, mod2;
    int before = requests_of(GP_OP_MODULE_LOAD);
    CHECK_RC(cuModuleLoadData(&mod, elf_image), CUDA_SUCCESS);
    CHECK(requests_of(GP_OP_MODULE_LOAD) - before == 2, "first load: probe + image, got %d",
          requests_of(GP_OP_MODULE_LOAD) - before);
    CHECK(srv.bulk_bytes == elf_len, "image bytes sent %llu, image %zu",
          (unsigned long long)srv.bulk_bytes, elf_len);
    CHECK(gp_handle_kind_of((uint64_t)(uintptr_t)mod) == GP_H_MODULE, "module handle kind");
    before = requests_of(GP_OP_MODULE_LOAD);
    CHECK_RC(cuModuleLoadData(&mod2, elf_image), CUDA_SUCCESS);
    CHECK(requests_of(GP_OP_MODULE_LOAD) - before == 1, "second load: probe only");
    CHECK(srv.bulk_bytes == elf_len, "the image crossed once");
    CHECK(mod != mod2, "two loads, two modules");

    /* Function lookups are cached per (module, name). */
    CUfunction f, f2;
    before = requests_of(GP_OP_GET_FUNCTION);
    CHECK_RC(cuModuleGetFunction(&f, mod, "k4"), CUDA_SUCCESS);
    CHECK_RC(cuModuleGetFunction(&f2, mod, "k4"), CUDA_SUCCESS);
    CHECK(f == f2, "same handle for the same name");
    CHECK(requests_of(GP_OP_GET_FUNCTION) - before == 1, "one get_function request");
    CHECK(gp_handle_kind_of((uint64_t)(uintptr_t)f) == GP_H_FUNC, "function handle kind");
    CHECK_RC(cuModuleGetFunction(&f2, mod2, "k4"), CUDA_SUCCESS);
    CHECK(f != f2, "other module, other function");
    CHECK_RC(cuModuleGetFunction(&f2, mod, "missing"), CUDA_ERROR_NOT_FOUND);
    CHECK_RC(cuModuleGetFunction(&f2, (CUmodule)(uintptr_t)0x1234, "k4"),
             CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cuModuleGetFunction(NULL, mod, "k4"), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuModuleGetFunction(&f2, mod, NULL), CUDA_ERROR_INVALID_VALUE);
    const char *name;
    CHECK_RC(cuFuncGetName(&name, f), CUDA_SUCCESS);
    CHECK(strcmp(name, "k4") == 0, "name %s", name);
    CUmodule back;
    CHECK_RC(cuFuncGetModule(&back, f), CUDA_SUCCESS);
    CHECK(back == mod, "cuFuncGetModule");

    /* Parameter info from the server's layout. */
    size_t off, size;
    CHECK_RC(cuFuncGetParamInfo(f, 1, &off, &size), CUDA_SUCCESS);
    CHECK(off == 8 && size == 8, "param 1 at %zu size %zu", off, size);
    CHECK_RC(cuFuncGetParamInfo(f, 3, &off, NULL), CUDA_SUCCESS);
    CHECK(off == 24, "param 3 at %zu", off);
    CHECK_RC(cuFuncGetParamInfo(f, 4, &off, &size), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuFuncGetParamInfo(f, 0, NULL, &size), CUDA_ERROR_INVALID_VALUE);

    /* Fallback: the server says -1, the layout comes from the image's .nv.info.kern. */
    CUfunction fk;
    CHECK_RC(cuModuleGetFunction(&fk, mod, "kern"), CUDA_SUCCESS);
    CHECK_RC(cuFuncGetParamInfo(fk, 2, &off, &size), CUDA_SUCCESS);
    CHECK(off == 16 && size == 8, "fallback param 2 at %zu size %zu", off, size);
    CUfunction fn;
    CHECK_RC(cuModuleGetFunction(&fn, mod, "nolayout"), CUDA_SUCCESS);
    CHECK_RC(cuFuncGetParamInfo(fn, 0, &off, &size), CUDA_ERROR_NOT_SUPPORTED);

    CUfunctionLoadingState st = -1;
    CHECK_RC(cuFuncIsLoaded(&st, f), CUDA_SUCCESS);
    CHECK(st == CU_FUNCTION_LOADING_STATE_LOADED, "loaded");
    CHECK_RC(cuFuncLoad(f), CUDA_SUCCESS);

    /* Globals: cached, recorded in the VA map once, removed at unload. */
    CUdeviceptr g;
    size_t gsize;
    int greq = requests_of(GP_OP_GET_GLOBAL), gadd = vamap_globals;
    CHECK_RC(cuModuleGetGlobal_v2(&g, &gsize, mod, "g"), CUDA_SUCCESS);
    CHECK(g == 0x200000001000ull && gsize == 64, "global %llx size %zu", (unsigned long long)g,
          gsize);
    CHECK_RC(cuModuleGetGlobal_v2(&g, NULL, mod, "g"), CUDA_SUCCESS);
    CHECK_RC(cuModuleGetGlobal_v2(NULL, &gsize, mod, "g"), CUDA_SUCCESS);
    CHECK(requests_of(GP_OP_GET_GLOBAL) - greq == 1, "one get_global request");
    CHECK(vamap_globals - gadd == 1, "one VA map entry");
    CHECK_RC(cuModuleGetGlobal_v2(&g, &gsize, mod, "nosuch"), CUDA_ERROR_NOT_FOUND);
    CHECK_RC(cuModuleGetGlobal_v2(NULL, NULL, mod, "g"), CUDA_ERROR_INVALID_VALUE);

    /* Unload: handles die, the server is told, the global leaves the VA map. */
    int unloads = posts_of(GP_OP_MODULE_UNLOAD), removed = vamap_removed;
    CHECK_RC(cuModuleUnload(mod), CUDA_SUCCESS);
    CHECK(posts_of(GP_OP_MODULE_UNLOAD) - unloads == 1, "module_unload posted");
    CHECK(vamap_removed - removed == 1, "global removed from the VA map");
    CHECK_RC(cuFuncGetName(&name, f), CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cuModuleUnload(mod), CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cuModuleUnload(mod2), CUDA_SUCCESS);

    /* Errors. */
    CHECK_RC(cuModuleLoadData(&mod, "\x01\x02garbage"), CUDA_ERROR_INVALID_IMAGE);
    CHECK_RC(cuModuleLoadData(NULL, elf_image), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuModuleLoad(&mod, "/nonexistent/file.cubin"), CUDA_ERROR_FILE_NOT_FOUND);
    ctx_result = CUDA_ERROR_INVALID_CONTEXT;
    CHECK_RC(cuModuleLoadData(&mod, elf_image), CUDA_ERROR_INVALID_CONTEXT);
    ctx_result = CUDA_ERROR_NOT_INITIALIZED;
    CHECK_RC(cuModuleLoadData(&mod, elf_image), CUDA_ERROR_NOT_INITIALIZED);
    ctx_result = CUDA_SUCCESS;
}

static void test_module_load_file(void)
{
    char path[] = "/tmp/gp_test_module_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0, "mkstemp");
    if (fd < 0)
        return;
    FILE *f = fdopen(fd, "wb");
    CHECK(f && fwrite(elf_image, 1, elf_len, f) == elf_len, "write");
    fclose(f);
    CUmodule mod;
    CHECK_RC(cuModuleLoad(&mod, path), CUDA_SUCCESS);
    CUfunction fk;
    CHECK_RC(cuModuleGetFunction(&fk, mod, "kern"), CUDA_SUCCESS);
    size_t off, size;
    CHECK_RC(cuFuncGetParamInfo(fk, 3, &off, &size), CUDA_SUCCESS);
    CHECK(off == 24 && size == 4, "file image fallback param 3 at %zu size %zu", off, size);
    CHECK_RC(cuModuleUnload(mod), CUDA_SUCCESS);
    CUlibrary lib;
    CHECK_RC(cuLibraryLoadFromFile(&lib, path, NULL, NULL, 0, NULL, NULL, 0), CUDA_SUCCESS);
    CHECK_RC(cuLibraryUnload(lib), CUDA_SUCCESS);
    remove(path);
}

static void test_library_and_kernels(void)
{
    entry es[] = {{2, 0x11, elf_image, elf_len}};
    size_t flen;
    uint8_t *fat = synth_fatbin(es, 1, &flen);
    wrapper w = {(int32_t)GP_FATBIN_WRAPPER_MAGIC, 1, fat, NULL};
    CUlibrary lib;
    CUlibraryOption opt = CU_LIBRARY_BINARY_IS_PRESERVED;
    void *val = (void *)(uintptr_t)1;
    uint64_t bytes = srv.bulk_bytes;
    CHECK_RC(cuLibraryLoadData(&lib, &w, NULL, NULL, 0, &opt, &val, 1), CUDA_SUCCESS);
    CHECK(srv.bulk_bytes - bytes == flen, "the wrapper's fatbin travelled (%llu of %zu)",
          (unsigned long long)(srv.bulk_bytes - bytes), flen);
    CHECK(gp_handle_kind_of((uint64_t)(uintptr_t)lib) == GP_H_LIBRARY, "library handle kind");
    /* cuBLASLt style: the option without a value array. */
    CUlibrary lib2;
    int loads = requests_of(GP_OP_MODULE_LOAD);
    CHECK_RC(cuLibraryLoadData(&lib2, elf_image, NULL, NULL, 0, &opt, NULL, 1), CUDA_SUCCESS);
    CHECK(requests_of(GP_OP_MODULE_LOAD) - loads == 1 && srv.bulk_bytes == bytes + flen, "cached");
    CHECK_RC(cuLibraryUnload(lib2), CUDA_SUCCESS);

    CUkernel k, k2;
    CHECK_RC(cuLibraryGetKernel(&k, lib, "k4"), CUDA_SUCCESS);
    CHECK_RC(cuLibraryGetKernel(&k2, lib, "k4"), CUDA_SUCCESS);
    CHECK(k == k2, "kernel lookup cached");
    CHECK(gp_handle_kind_of((uint64_t)(uintptr_t)k) == GP_H_KERNEL, "kernel handle kind");
    CUfunction f, f2;
    CHECK_RC(cuKernelGetFunction(&f, k), CUDA_SUCCESS);
    CHECK_RC(cuKernelGetFunction(&f2, k), CUDA_SUCCESS);
    CHECK(f == f2 && (void *)f != (void *)k, "one CUfunction per kernel");
    CHECK(gp_handle_kind_of((uint64_t)(uintptr_t)f) == GP_H_FUNC, "function handle kind");
    const char *name;
    CHECK_RC(cuKernelGetName(&name, k), CUDA_SUCCESS);
    CHECK(!strcmp(name, "k4"), "kernel name");
    CHECK_RC(cuFuncGetName(&name, f), CUDA_SUCCESS);
    CHECK(!strcmp(name, "k4"), "kernel function name");
    CUlibrary back;
    CHECK_RC(cuKernelGetLibrary(&back, k), CUDA_SUCCESS);
    CHECK(back == lib, "cuKernelGetLibrary");

    /* Launch through either handle: the wire id is the kernel's. */
    float a = 2.0f;
    uint64_t x = 0x200000000000ull, y = 0x200000100000ull;
    int n = 77;
    void *params[] = {&a, &x, &y, &n};
    CHECK_RC(cuLaunchKernel((CUfunction)k, 1, 1, 1, 32, 1, 1, 0, NULL, params, NULL), CUDA_SUCCESS);
    CHECK(last_launch().func == (uint64_t)(uintptr_t)k, "kernel launch wire id");
    CHECK_RC(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, NULL, params, NULL), CUDA_SUCCESS);
    CHECK(last_launch().func == (uint64_t)(uintptr_t)k, "function-of-kernel launch wire id");

    /* The library's module, and a module-style lookup through it. */
    CUmodule lm, lm2;
    CHECK_RC(cuLibraryGetModule(&lm, lib), CUDA_SUCCESS);
    CHECK_RC(cuLibraryGetModule(&lm2, lib), CUDA_SUCCESS);
    CHECK(lm == lm2, "one module per library");
    CUfunction f3;
    CHECK_RC(cuModuleGetFunction(&f3, lm, "k4"), CUDA_SUCCESS);
    CHECK(f3 == f, "cuModuleGetFunction on the library's module gives the kernel's function");
    CUmodule fm;
    CHECK_RC(cuFuncGetModule(&fm, f), CUDA_SUCCESS);
    CHECK(fm == lm, "cuFuncGetModule of a kernel's function");
    CHECK_RC(cuModuleUnload(lm), CUDA_ERROR_NOT_PERMITTED);

    CUdeviceptr g;
    size_t gsize;
    CHECK_RC(cuLibraryGetGlobal(&g, &gsize, lib, "g"), CUDA_SUCCESS);
    CHECK(g == 0x200000001000ull && gsize == 64, "library global");

    /* Kernel attributes with a device. */
    int v;
    CHECK_RC(cuKernelGetAttribute(&v, CU_FUNC_ATTRIBUTE_NUM_REGS, k, 0), CUDA_SUCCESS);
    CHECK(v == 40, "kernel attribute %d", v);
    CHECK_RC(cuKernelGetAttribute(&v, CU_FUNC_ATTRIBUTE_NUM_REGS, k, 1), CUDA_ERROR_INVALID_DEVICE);
    CHECK_RC(cuKernelSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 232448, k, 0),
             CUDA_SUCCESS);
    CHECK_RC(cuKernelSetCacheConfig(k, CU_FUNC_CACHE_PREFER_SHARED, 0), CUDA_SUCCESS);
    size_t off, size;
    CHECK_RC(cuKernelGetParamInfo(k, 0, &off, &size), CUDA_SUCCESS);
    CHECK(off == 0 && size == 4, "kernel param 0");

    CHECK_RC(cuLibraryUnload(lib), CUDA_SUCCESS);
    CHECK_RC(cuLibraryGetKernel(&k, lib, "k4"), CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cuKernelGetName(&name, k), CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cuLibraryUnload(lib), CUDA_ERROR_INVALID_HANDLE);
    free(fat);
}

static void test_launch(void)
{
    CUmodule mod;
    CHECK_RC(cuModuleLoadData(&mod, elf_image), CUDA_SUCCESS);
    CUfunction f, fbig, fnone, fnolayout;
    CHECK_RC(cuModuleGetFunction(&f, mod, "k4"), CUDA_SUCCESS);
    CHECK_RC(cuModuleGetFunction(&fbig, mod, "big"), CUDA_SUCCESS);
    CHECK_RC(cuModuleGetFunction(&fnone, mod, "noargs"), CUDA_SUCCESS);
    CHECK_RC(cuModuleGetFunction(&fnolayout, mod, "nolayout"), CUDA_SUCCESS);

    float a = 1.5f;
    uint64_t x = 0x200000000000ull, y = 0x200000100000ull;
    int n = 12345;
    void *params[] = {&a, &x, &y, &n};
    CUstream s = (CUstream)(uintptr_t)(GP_HANDLE_TAG | (uint64_t)GP_H_STREAM << 40 | 99);
    CHECK_RC(cuLaunchKernel(f, 3, 4, 5, 32, 2, 1, 128, s, params, NULL), CUDA_SUCCESS);
    gp_launch m = last_launch();
    CHECK(m.func == (uint64_t)(uintptr_t)f, "wire id");
    CHECK(m.grid_x == 3 && m.grid_y == 4 && m.grid_z == 5, "grid");
    CHECK(m.block_x == 32 && m.block_y == 2 && m.block_z == 1, "block");
    CHECK(m.shared_mem == 128 && m.stream == (uint64_t)(uintptr_t)s, "smem, stream");
    CHECK(m.params_len == 28 && m.attrs_len == 0, "params %u bytes", m.params_len);
    uint8_t want[28] = {0};
    memcpy(want, &a, 4), memcpy(want + 8, &x, 8), memcpy(want + 16, &y, 8);
    memcpy(want + 24, &n, 4);
    CHECK(m.params_len == 28 && !memcmp(m.params, want, 28), "packed arguments");

    /* Per-thread default stream. */
    CHECK_RC(cuLaunchKernel_ptsz(f, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL), CUDA_SUCCESS);
    CHECK(last_launch().stream == 2, "ptsz NULL stream is CU_STREAM_PER_THREAD");
    CHECK_RC(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL), CUDA_SUCCESS);
    CHECK(last_launch().stream == 0, "legacy NULL stream");
    CHECK_RC(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, (CUstream)(uintptr_t)0x77, params, NULL),
             CUDA_ERROR_INVALID_HANDLE);

    /* extra. */
    uint8_t buf[28];
    size_t bsz = sizeof buf;
    for (size_t i = 0; i < sizeof buf; i++)
        buf[i] = (uint8_t)(i * 7);
    void *extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, buf, CU_LAUNCH_PARAM_BUFFER_SIZE, &bsz,
                     CU_LAUNCH_PARAM_END};
    CHECK_RC(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, extra), CUDA_SUCCESS);
    m = last_launch();
    CHECK(m.params_len == 28 && !memcmp(m.params, buf, 28), "extra buffer as-is");
    CHECK_RC(cuLaunchKernel(fnolayout, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, extra), CUDA_SUCCESS);
    void *bad_extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, buf, CU_LAUNCH_PARAM_END};
    CHECK_RC(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, bad_extra),
             CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, params, extra), CUDA_ERROR_INVALID_VALUE);

    /* Unknown layout with kernelParams: refused with one message naming the kernel. */
    int errs = log_errors;
    CHECK_RC(cuLaunchKernel(fnolayout, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL),
             CUDA_ERROR_NOT_SUPPORTED);
    CHECK_RC(cuLaunchKernel(fnolayout, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL),
             CUDA_ERROR_NOT_SUPPORTED);
    CHECK(log_errors - errs == 1, "one message, got %d", log_errors - errs);
    CHECK_RC(cuLaunchKernel(fnolayout, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL), CUDA_SUCCESS);

    /* No arguments. */
    CHECK_RC(cuLaunchKernel(fnone, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL), CUDA_SUCCESS);
    CHECK(last_launch().params_len == 0, "no-arg params");
    CHECK_RC(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL), CUDA_ERROR_INVALID_VALUE);

    /* A big argument block (heap path). */
    uint8_t *big = malloc(5000);
    for (int i = 0; i < 5000; i++)
        big[i] = (uint8_t)(i * 13);
    uint64_t out = 0x200000200000ull;
    void *bparams[] = {big, &out};
    CHECK_RC(cuLaunchKernel(fbig, 1, 1, 1, 1, 1, 1, 0, NULL, bparams, NULL), CUDA_SUCCESS);
    m = last_launch();
    CHECK(m.params_len == 5008 && !memcmp(m.params, big, 5000) && !memcmp(m.params + 5000, &out, 8),
          "big argument block (%u bytes)", m.params_len);
    free(big);

    /* Validation against the device snapshot. */
    int launches = posts_of(GP_OP_LAUNCH);
    CHECK_RC(cuLaunchKernel(f, 0, 1, 1, 1, 1, 1, 0, NULL, params, NULL), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuLaunchKernel(f, 1, 1, 1, 1, 0, 1, 0, NULL, params, NULL), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuLaunchKernel(f, 1, 1, 1, 1025, 1, 1, 0, NULL, params, NULL),
             CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuLaunchKernel(f, 1, 1, 1, 1, 1, 65, 0, NULL, params, NULL), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuLaunchKernel(f, 1, 1, 1, 64, 32, 1, 0, NULL, params, NULL),
             CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuLaunchKernel(f, 1, 65536, 1, 1, 1, 1, 0, NULL, params, NULL),
             CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 232449, NULL, params, NULL),
             CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuLaunchKernel(f, 2147483647u, 65535, 65535, 1024, 1, 1, 232448, NULL, params, NULL),
             CUDA_SUCCESS);
    CHECK_RC(cuLaunchKernel(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL),
             CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cuLaunchKernel((CUfunction)(uintptr_t)mod, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL),
             CUDA_ERROR_INVALID_HANDLE);
    /* The function's own limit once known (the fake says 768). */
    int v;
    CHECK_RC(cuFuncGetAttribute(&v, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, f), CUDA_SUCCESS);
    CHECK_RC(cuLaunchKernel(f, 1, 1, 1, 1024, 1, 1, 0, NULL, params, NULL),
             CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES);
    CHECK(posts_of(GP_OP_LAUNCH) - launches == 1, "refused launches never reach the wire");
    ctx_result = CUDA_ERROR_INVALID_CONTEXT;
    CHECK_RC(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL),
             CUDA_ERROR_INVALID_CONTEXT);
    ctx_result = CUDA_SUCCESS;

    /* cuLaunchKernelEx: attributes travel raw. */
    CUlaunchAttribute attrs[2];
    memset(attrs, 0, sizeof attrs);
    attrs[0].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attrs[0].value.clusterDim.x = 2, attrs[0].value.clusterDim.y = 1;
    attrs[0].value.clusterDim.z = 1;
    attrs[1].id = 8; /* priority */
    CUlaunchConfig cfg = {4, 1, 1, 128, 1, 1, 64, s, attrs, 2};
    CHECK_RC(cuLaunchKernelEx(&cfg, f, params, NULL), CUDA_SUCCESS);
    m = last_launch();
    CHECK(m.grid_x == 4 && m.block_x == 128 && m.shared_mem == 64, "Ex config");
    CHECK(m.attrs_len == 144 && !memcmp(m.attrs, attrs, 144), "Ex attributes");
    cfg.hStream = NULL;
    CHECK_RC(cuLaunchKernelEx_ptsz(&cfg, f, params, NULL), CUDA_SUCCESS);
    CHECK(last_launch().stream == 2, "Ex ptsz");
    CHECK_RC(cuLaunchKernelEx(NULL, f, params, NULL), CUDA_ERROR_INVALID_VALUE);
    cfg.attrs = NULL;
    CHECK_RC(cuLaunchKernelEx(&cfg, f, params, NULL), CUDA_ERROR_INVALID_VALUE);
    /* Attributes carrying an event handle are refused (the server would see our handle). */
    attrs[1].id = CU_LAUNCH_ATTRIBUTE_LAUNCH_COMPLETION_EVENT;
    cfg.attrs = attrs;
    launches = posts_of(GP_OP_LAUNCH);
    CHECK_RC(cuLaunchKernelEx(&cfg, f, params, NULL), CUDA_ERROR_NOT_SUPPORTED);
    attrs[1].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_EVENT;
    CHECK_RC(cuLaunchKernelEx(&cfg, f, params, NULL), CUDA_ERROR_NOT_SUPPORTED);
    CHECK(posts_of(GP_OP_LAUNCH) == launches, "refused");
    /* ...but occupancy queries with such a configuration work: the event travels as IGNORE. */
    int clusters = 0;
    CHECK_RC(cuOccupancyMaxActiveClusters(&clusters, f, &cfg), CUDA_SUCCESS);
    CHECK(clusters == 66, "clusters of 2 with an event attribute: %d", clusters);

    /* Cooperative: one attribute, id 2, value 1. */
    CHECK_RC(cuLaunchCooperativeKernel(f, 2, 1, 1, 32, 1, 1, 0, s, params), CUDA_SUCCESS);
    m = last_launch();
    CHECK(m.attrs_len == 72 && gp_rd_u32(m.attrs) == CU_LAUNCH_ATTRIBUTE_COOPERATIVE &&
              gp_rd_u32(m.attrs + 8) == 1,
          "cooperative attribute");
    CHECK_RC(cuLaunchCooperativeKernel_ptsz(f, 2, 1, 1, 32, 1, 1, 0, NULL, params), CUDA_SUCCESS);
    CHECK(last_launch().stream == 2 && last_launch().attrs_len == 72, "cooperative ptsz");

    CHECK_RC(cuModuleUnload(mod), CUDA_SUCCESS);
}

static void test_attributes_and_occupancy(void)
{
    CUmodule mod;
    CHECK_RC(cuModuleLoadData(&mod, elf_image), CUDA_SUCCESS);
    CUfunction f;
    CHECK_RC(cuModuleGetFunction(&f, mod, "k4"), CUDA_SUCCESS);

    int v, req = requests_of(GP_OP_FUNC_GET_ATTRIBUTE);
    for (int i = 0; i < 10; i++) {
        CHECK_RC(cuFuncGetAttribute(&v, CU_FUNC_ATTRIBUTE_NUM_REGS, f), CUDA_SUCCESS);
        CHECK(v == 40, "attribute %d", v);
    }
    CHECK(requests_of(GP_OP_FUNC_GET_ATTRIBUTE) - req == 1, "attribute cached");
    CHECK_RC(cuFuncGetAttribute(&v, 99, f), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuFuncGetAttribute(NULL, 0, f), CUDA_ERROR_INVALID_VALUE);
    int sreq = requests_of(GP_OP_FUNC_SET_ATTRIBUTE);
    CHECK_RC(cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 100000),
             CUDA_SUCCESS);
    CHECK_RC(cuFuncSetCacheConfig(f, CU_FUNC_CACHE_PREFER_L1), CUDA_SUCCESS);
    CHECK(requests_of(GP_OP_FUNC_SET_ATTRIBUTE) - sreq == 2, "sets are requests");
    req = requests_of(GP_OP_FUNC_GET_ATTRIBUTE);
    CHECK_RC(cuFuncGetAttribute(&v, CU_FUNC_ATTRIBUTE_NUM_REGS, f), CUDA_SUCCESS);
    CHECK(requests_of(GP_OP_FUNC_GET_ATTRIBUTE) - req == 1, "a set drops the cache");

    /* Occupancy: cached by the whole argument tuple. */
    int occ = requests_of(GP_OP_OCCUPANCY);
    for (int i = 0; i < 5; i++) {
        CHECK_RC(cuOccupancyMaxActiveBlocksPerMultiprocessor(&v, f, 256, 0), CUDA_SUCCESS);
        CHECK(v == 8, "blocks %d", v);
    }
    CHECK_RC(cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(&v, f, 256, 0, 1), CUDA_SUCCESS);
    CHECK(requests_of(GP_OP_OCCUPANCY) - occ == 2, "flags are part of the key");
    size_t smem;
    CHECK_RC(cuOccupancyAvailableDynamicSMemPerBlock(&smem, f, 1, 1), CUDA_SUCCESS);
    CHECK(smem == 232448, "available smem %zu", smem);

    CUlaunchAttribute cl;
    memset(&cl, 0, sizeof cl);
    cl.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    cl.value.clusterDim.y = cl.value.clusterDim.z = 1;
    CUlaunchConfig cfg = {132, 1, 1, 1, 1, 1, 0, NULL, &cl, 1};
    occ = requests_of(GP_OP_OCCUPANCY);
    for (int round = 0; round < 2; round++) {
        for (unsigned c = 1; c <= 32; c++) {
            cl.value.clusterDim.x = c;
            int clusters;
            CHECK_RC(cuOccupancyMaxActiveClusters(&clusters, f, &cfg), CUDA_SUCCESS);
            CHECK(clusters == (c > 16 ? 0 : 132 / (int)c), "clusters of %u: %d", c, clusters);
        }
    }
    CHECK(requests_of(GP_OP_OCCUPANCY) - occ == 32, "47x-style repeats answered locally (%d)",
          requests_of(GP_OP_OCCUPANCY) - occ);
    int cs;
    CHECK_RC(cuOccupancyMaxPotentialClusterSize(&cs, f, &cfg), CUDA_SUCCESS);
    CHECK(cs == 8, "cluster size %d", cs);
    CHECK_RC(cuOccupancyMaxActiveClusters(NULL, f, &cfg), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuOccupancyMaxActiveClusters(&cs, f, NULL), CUDA_ERROR_INVALID_VALUE);

    /* Potential block size: the fake allows 2048 threads/SM, max 768 threads for this function
     * (its attribute): 768 gives 2 blocks = 1536 threads, 512 gives 4 blocks = 2048: best. */
    int grid, block;
    CHECK_RC(cuOccupancyMaxPotentialBlockSize(&grid, &block, f, NULL, 0, 0), CUDA_SUCCESS);
    CHECK(block == 512 && grid == 4 * 132, "block %d grid %d", block, grid);
    occ = requests_of(GP_OP_OCCUPANCY);
    CHECK_RC(cuOccupancyMaxPotentialBlockSize(&grid, &block, f, NULL, 0, 0), CUDA_SUCCESS);
    CHECK(requests_of(GP_OP_OCCUPANCY) == occ, "second computation from the cache");
    /* Limit 100: 100 -> 20 blocks (2000 threads), 96 -> 21 (2016), 64 -> 32 (2048). */
    CHECK_RC(cuOccupancyMaxPotentialBlockSize(&grid, &block, f, NULL, 0, 100), CUDA_SUCCESS);
    CHECK(block == 64 && grid == 32 * 132, "limited block %d grid %d", block, grid);
    /* Shared memory growing with the block size (the callback). */
    CHECK_RC(cuOccupancyMaxPotentialBlockSize(&grid, &block, f, NULL, 116224, 0), CUDA_SUCCESS);
    CHECK(block == 768 && grid == 2 * 132, "smem-limited block %d grid %d", block, grid);
    CHECK_RC(cuOccupancyMaxPotentialBlockSize(NULL, &block, f, NULL, 0, 0),
             CUDA_ERROR_INVALID_VALUE);

    /* A set retires the function's occupancy answers. */
    occ = requests_of(GP_OP_OCCUPANCY);
    CHECK_RC(cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 50000),
             CUDA_SUCCESS);
    CHECK_RC(cuOccupancyMaxActiveBlocksPerMultiprocessor(&v, f, 256, 0), CUDA_SUCCESS);
    CHECK(requests_of(GP_OP_OCCUPANCY) - occ == 1, "asked again after a set");
    CHECK_RC(cuModuleUnload(mod), CUDA_SUCCESS);
}

static size_t smem_per_block(int block_size)
{
    return (size_t)block_size * 256;
}

static void test_occupancy_callback(void)
{
    CUmodule mod;
    CHECK_RC(cuModuleLoadData(&mod, elf_image), CUDA_SUCCESS);
    CUfunction f;
    CHECK_RC(cuModuleGetFunction(&f, mod, "k4"), CUDA_SUCCESS);
    int grid, block;
    /* 256 bytes per thread: smem limits blocks to 232448 / (bs*256); threads = bs * that, best
     * near 908 threads: 768 -> 1 block (768); 448 -> 2 blocks (896); 896 > 768 is not allowed. */
    CHECK_RC(cuOccupancyMaxPotentialBlockSize(&grid, &block, f, smem_per_block, 0, 0),
             CUDA_SUCCESS);
    CHECK(block == 448 && grid == 2 * 132, "callback block %d grid %d", block, grid);
    CHECK_RC(cuModuleUnload(mod), CUDA_SUCCESS);
}

static void test_jit_outputs(void)
{
    char info[64], err[128];
    memset(info, 'x', sizeof info);
    memset(err, 'x', sizeof err);
    float wall = 123.0f;
    void *wall_v;
    memcpy(&wall_v, &wall, sizeof wall);
    CUjit_option opts[] = {CU_JIT_INFO_LOG_BUFFER,  CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
                           CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
                           CU_JIT_WALL_TIME,        0 /* max registers: ignored */};
    void *vals[] = {info,   (void *)(uintptr_t)sizeof info, err, (void *)(uintptr_t)sizeof err,
                    wall_v, (void *)(uintptr_t)32};
    CUmodule mod;
    CHECK_RC(cuModuleLoadDataEx(&mod, elf_image, 6, opts, vals), CUDA_SUCCESS);
    memcpy(&wall, &vals[4], sizeof wall);
    CHECK(info[0] == 0 && err[0] == 0 && vals[1] == NULL && vals[3] == NULL && wall == 0.0f,
          "empty logs and wall time on success");
    CHECK(vals[5] == (void *)(uintptr_t)32, "input options untouched");
    CHECK_RC(cuModuleUnload(mod), CUDA_SUCCESS);
    vals[1] = (void *)(uintptr_t)sizeof info;
    vals[3] = (void *)(uintptr_t)sizeof err;
    CHECK_RC(cuModuleLoadDataEx(&mod, "\x01garbage", 6, opts, vals), CUDA_ERROR_INVALID_IMAGE);
    CHECK(strstr(err, "gpupool") && (uintptr_t)vals[3] == strlen(err) + 1,
          "error log on failure: '%s' (%zu bytes)", err, (size_t)(uintptr_t)vals[3]);
    /* A tiny error buffer is never overrun. */
    char tiny[4];
    CUjit_option o2[] = {CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES, CU_JIT_ERROR_LOG_BUFFER};
    void *v2[] = {(void *)(uintptr_t)sizeof tiny, tiny};
    CHECK_RC(cuModuleLoadDataEx(&mod, "\x01garbage", 2, o2, v2), CUDA_ERROR_INVALID_IMAGE);
    CHECK(tiny[3] == 0 && (uintptr_t)v2[0] == sizeof tiny, "tiny error log");
    CHECK_RC(cuModuleLoadDataEx(&mod, elf_image, 3, NULL, NULL), CUDA_SUCCESS);
    CHECK_RC(cuModuleUnload(mod), CUDA_SUCCESS);
}

static void test_link_unsupported(void)
{
    CUlinkState st;
    int errs = log_errors;
    CHECK_RC(cuLinkCreate_v2(0, NULL, NULL, &st), CUDA_ERROR_NOT_SUPPORTED);
    CHECK_RC(cuLinkCreate(0, NULL, NULL, &st), CUDA_ERROR_NOT_SUPPORTED);
    CHECK_RC(cuLinkAddData_v2(NULL, 0, NULL, 0, NULL, 0, NULL, NULL), CUDA_ERROR_NOT_SUPPORTED);
    CHECK_RC(cuLinkComplete(NULL, NULL, NULL), CUDA_ERROR_NOT_SUPPORTED);
    CHECK(log_errors - errs == 1, "one message");
}

/* ---- threads ------------------------------------------------------------------------------ */

static CUmodule shared_mod;
static CUfunction thread_funcs[8];

static void *thread_main(void *arg)
{
    int id = (int)(intptr_t)arg;
    CUfunction f = NULL;
    for (int i = 0; i < 200; i++) {
        CUfunction g;
        if (cuModuleGetFunction(&g, shared_mod, "k4") != CUDA_SUCCESS)
            return (void *)1;
        if (f && g != f)
            return (void *)2;
        f = g;
        float a = 1;
        uint64_t x = 0, y = 0;
        int n = i;
        void *params[] = {&a, &x, &y, &n};
        if (cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, NULL, params, NULL) != CUDA_SUCCESS)
            return (void *)3;
        int v;
        if (cuOccupancyMaxActiveBlocksPerMultiprocessor(&v, f, 32 * (1 + (i + id) % 8), 0))
            return (void *)4;
        if (cuFuncGetAttribute(&v, (i + id) % 8, f) != CUDA_SUCCESS)
            return (void *)5;
        if (i % 50 == 0 && cuFuncSetAttribute(f, 8, 1000 + i) != CUDA_SUCCESS)
            return (void *)6;
    }
    thread_funcs[id] = f;
    return NULL;
}

static void test_threads(void)
{
    CHECK_RC(cuModuleLoadData(&shared_mod, elf_image), CUDA_SUCCESS);
    pthread_t t[8];
    for (int i = 0; i < 8; i++)
        pthread_create(&t[i], NULL, thread_main, (void *)(intptr_t)i);
    for (int i = 0; i < 8; i++) {
        void *ret;
        pthread_join(t[i], &ret);
        CHECK(ret == NULL, "thread %d failed at step %d", i, (int)(intptr_t)ret);
    }
    for (int i = 1; i < 8; i++)
        CHECK(thread_funcs[i] == thread_funcs[0], "same function");
    CHECK_RC(cuModuleUnload(shared_mod), CUDA_SUCCESS);
}

/* ---- client-side launch rate ------------------------------------------------------------- */

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void bench_launch(void)
{
    CUmodule mod;
    CHECK_RC(cuModuleLoadData(&mod, elf_image), CUDA_SUCCESS);
    CUfunction f0, f4;
    CHECK_RC(cuModuleGetFunction(&f0, mod, "noargs"), CUDA_SUCCESS);
    CHECK_RC(cuModuleGetFunction(&f4, mod, "k4"), CUDA_SUCCESS);
    float a = 1;
    uint64_t x = 0, y = 0;
    int n = 1;
    void *params[] = {&a, &x, &y, &n};
    const int iters = 1000000;
    double t0 = now();
    for (int i = 0; i < iters; i++)
        cuLaunchKernel(f0, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
    double t1 = now();
    for (int i = 0; i < iters; i++)
        cuLaunchKernel(f4, 1, 1, 1, 32, 1, 1, 0, NULL, params, NULL);
    double t2 = now();
    printf("client-side launch rate (fake core, fake handle map): no-arg %.2f M/s, 4 args "
           "%.2f M/s\n",
           iters / (t1 - t0) / 1e6, iters / (t2 - t1) / 1e6);
    CHECK_RC(cuModuleUnload(mod), CUDA_SUCCESS);
}

int main(void)
{
    dev.attributes[CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK] = 1024;
    dev.attributes[CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X] = 1024;
    dev.attributes[CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y] = 1024;
    dev.attributes[CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z] = 64;
    dev.attributes[CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X] = 2147483647;
    dev.attributes[CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y] = 65535;
    dev.attributes[CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z] = 65535;
    dev.attributes[CU_DEVICE_ATTRIBUTE_WARP_SIZE] = 32;
    dev.attributes[CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT] = 132;
    dev.attributes[CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR] = 2048;
    dev.attributes[CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN] = 232448;

    const uint32_t offs[] = {0, 8, 16, 24}, sizes[] = {4, 8, 8, 4};
    elf_image = synth_elf("kern", offs, sizes, 4, &elf_len);

    test_module_load_and_functions();
    test_module_load_file();
    test_library_and_kernels();
    test_launch();
    test_attributes_and_occupancy();
    test_occupancy_callback();
    test_jit_outputs();
    test_link_unsupported();
    test_threads();
    bench_launch();
    free(elf_image);
    if (failures) {
        fprintf(stderr, "test_module_api: %d of %d checks failed\n", failures, checks);
        return 1;
    }
    printf("test_module_api: %d checks passed\n", checks);
    return 0;
}
