/*
 * api_module.c: modules, libraries, kernels and their globals (cuModule*, cuLibrary*,
 * cuKernelGetFunction / GetLibrary / GetName, cuFuncGetName / GetModule; cuLink* is
 * api_link.c's).
 *
 * Loading: the image's size comes from its headers (image.c), its SHA-256 names it on the
 * server. The first module_load carries no image; only when the worker answers GP_ENEEDIMAGE is
 * the image sent, so an image crosses the network at most once per server. Hashes the server
 * has confirmed are remembered for the process (cheap repeat loads, and the debug log says why).
 *
 * Objects: a gp_module per CUmodule / CUlibrary (cuLibraryGetModule's CUmodule is a second
 * handle to it), a gp_func per CUfunction / CUkernel in a per-module hash table by name, and a
 * per-module list of globals: repeated GetFunction / GetKernel / GetGlobal cost no round trip.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gp_cuda_launch.h"
#include "image.h"
#include "module_phases.h"
#include "sha256.h"
#include "shim.h"

#define FUNC_BUCKETS 256
#define MAX_NAME 4095

typedef struct gp_global {
    char *name;
    uint64_t dptr, size;
    int in_vamap; /* we added [dptr, dptr+size) to the VA map and remove it at unload */
    int part;     /* a library of a spread lease has its globals on every part, one each */
    uint64_t ctx; /* the context whose copy it is (in the VA map under it) */
    struct gp_global *next;
} gp_global;

struct gp_module {
    uint64_t handle;       /* GP_H_MODULE or GP_H_LIBRARY handle: the wire id */
    uint32_t kind;         /* GP_MODKIND_MODULE / GP_MODKIND_LIBRARY */
    uint64_t module_alias; /* libraries: CUmodule handle from cuLibraryGetModule, or 0 */
    uint64_t ctx;          /* context current at load (modules belong to it) */
    const void *image;     /* the loaded bytes (fatbin / ELF / text), for the param fallback */
    size_t image_size;
    void *image_owned; /* our copy, when the caller's memory may go away */
    pthread_mutex_t lock;
    gp_func *funcs[FUNC_BUCKETS];
    gp_global *globals;
};

/* ---- small helpers ---------------------------------------------------------------------- */

CUresult gp_server_result(int32_t result, const char *what)
{
    if (result >= 100000 || result < 0) {
        gp_log_error("%s: the server answered protocol error %d", what, (int)result);
        return CUDA_ERROR_UNKNOWN;
    }
    return (CUresult)result;
}

static uint32_t name_hash(const char *s)
{
    uint32_t h = 2166136261u; /* FNV-1a */
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 16777619u;
    return h;
}

/* Spread lease: a module's calls go to its context's part; a library's, to any (on each). */
static void module_use_ctx(const gp_module *mod)
{
    if (gp_conn_parts() > 1 && mod->kind == GP_MODKIND_MODULE && mod->ctx)
        gp_conn_use_ctx(mod->ctx);
}
void gp_func_use_ctx(const gp_func *fn)
{
    module_use_ctx(fn->mod);
}

gp_func *gp_func_lookup(uint64_t h)
{
    int k = gp_handle_kind_of(h);
    if (k != GP_H_FUNC && k != GP_H_KERNEL)
        return NULL;
    return gp_handle_get(h, (enum gp_handle_kind)k);
}

pthread_mutex_t *gp_func_lock(gp_func *fn)
{
    return &fn->mod->lock;
}

/* Context check for calls that work without a current context (library API): initialised and
 * connected is enough. */
static CUresult enter_any_ctx(void)
{
    CUresult r = gp_ctx_enter();
    return r == CUDA_ERROR_INVALID_CONTEXT ? CUDA_SUCCESS : r;
}

/* ---- hashes the server confirmed -------------------------------------------------------- */

static pthread_mutex_t known_lock = PTHREAD_MUTEX_INITIALIZER;
static uint8_t (*known)[32];
static size_t known_count, known_cap;

static int known_has(const uint8_t sha[32])
{
    int found = 0;
    pthread_mutex_lock(&known_lock);
    for (size_t i = 0; i < known_count && !found; i++)
        found = memcmp(known[i], sha, 32) == 0;
    pthread_mutex_unlock(&known_lock);
    return found;
}

static void known_add(const uint8_t sha[32])
{
    pthread_mutex_lock(&known_lock);
    int found = 0;
    for (size_t i = 0; i < known_count && !found; i++)
        found = memcmp(known[i], sha, 32) == 0;
    if (!found) {
        if (known_count == known_cap) {
            size_t cap = known_cap ? 2 * known_cap : 64;
            void *n = realloc(known, cap * 32);
            if (n) {
                known = n;
                known_cap = cap;
            }
        }
        if (known_count < known_cap)
            memcpy(known[known_count++], sha, 32);
    }
    pthread_mutex_unlock(&known_lock);
}

/* ---- loading ---------------------------------------------------------------------------- */

/* One module_load; returns gp_request's answer as is (GP_ENEEDIMAGE included). */
static CUresult send_load(uint64_t id, uint32_t kind, const uint8_t sha[32], const void *data,
                          uint64_t size, int with_image)
{
    gp_module_load m = {
        .module = id, .kind = kind, .image_size = size, .data_len = with_image ? size : 0};
    memcpy(m.sha256, sha, 32);
    GP_FRAME(frame, flen, gp_module_load, &m);
    if (!frame)
        return CUDA_ERROR_OUT_OF_MEMORY;
    gp_reply reply;
    CUresult r =
        gp_request(frame, flen, with_image ? data : NULL, with_image ? size : 0, NULL, 0, &reply);
    GP_FRAME_FREE(frame);
    gp_reply_free(&reply);
    return r;
}

/* One module_unload, fire and forget, to the part the thread's next frame goes to. */
static CUresult send_unload(const gp_module *mod)
{
    gp_module_unload m = {.module = mod->handle, .kind = mod->kind};
    GP_FRAME(frame, flen, gp_module_unload, &m);
    if (!frame)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = gp_post(frame, flen, NULL, 0);
    GP_FRAME_FREE(frame);
    return r;
}

/* A library's unload on parts 0..parts-1 of a spread lease (each loaded it: load_image). */
static CUresult send_unload_parts(const gp_module *mod, int parts)
{
    CUresult r = CUDA_SUCCESS;
    for (int k = 0; k < parts; k++) {
        gp_conn_route(k);
        CUresult u = send_unload(mod);
        if (r == CUDA_SUCCESS)
            r = u;
    }
    gp_conn_route(-1);
    return r;
}

static void module_free(gp_module *mod)
{
    for (int b = 0; b < FUNC_BUCKETS; b++) {
        gp_func *fn = mod->funcs[b];
        while (fn) {
            gp_func *next = fn->next_hash;
            free(fn->name);
            free(fn->param_offsets);
            free(fn->param_sizes);
            free(fn);
            fn = next;
        }
    }
    gp_global *g = mod->globals;
    while (g) {
        gp_global *next = g->next;
        free(g->name);
        free(g);
        g = next;
    }
    free(mod->image_owned);
    pthread_mutex_destroy(&mod->lock);
    free(mod);
}

/* Load `image` (avail: bytes known to be there, SIZE_MAX if unknown) as a module or library.
 * owned: image is our malloc'ed buffer, now the module's. preserved: the caller keeps the
 * image alive until unload (no copy needed). */
static CUresult load_image(uint32_t kind, const void *image, size_t avail, void *owned,
                           int preserved, uint64_t *out)
{
    size_t size;
    int ikind;
    if (gp_image_size_n(image, avail, &size, &ikind) != 0) {
        free(owned);
        gp_log_debug("module load: not a fatbin, cubin or PTX image");
        return CUDA_ERROR_INVALID_IMAGE;
    }
    const void *data = gp_image_data(image, ikind);
    gp_module *mod = calloc(1, sizeof *mod);
    if (!mod) {
        free(owned);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (pthread_mutex_init(&mod->lock, NULL) != 0) {
        free(mod);
        free(owned);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    mod->kind = kind;
    mod->ctx = gp_ctx_current();
    mod->image_owned = owned;
    if (owned || preserved || ikind == GP_IMAGE_WRAPPER) {
        /* A wrapper's fatbin lives in the program's binary: it stays. */
        mod->image = data;
    } else {
        /* The caller may free its buffer after the call (as the driver allows): keep a copy
         * for the parameter fallback. Without memory for it, the load still goes ahead. */
        mod->image_owned = malloc(size);
        if (mod->image_owned)
            memcpy(mod->image_owned, data, size);
        mod->image = mod->image_owned;
    }
    mod->image_size = mod->image ? size : 0;

    uint8_t sha[32];
    uint64_t t0 = gp_module_phase_now_ns();
    gp_sha256(data, size, sha);
    uint64_t t1 = gp_module_phase_now_ns();
    gp_module_phase_add(GP_MODPHASE_HASH, size, t1 - t0);
    int was_known = known_has(sha);
    mod->handle = gp_handle_new(kind == GP_MODKIND_LIBRARY ? GP_H_LIBRARY : GP_H_MODULE, mod);
    if (!mod->handle) {
        module_free(mod);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    /* A library belongs to no context: on a spread lease every part's worker loads it under the
     * same handle, so its kernels launch on any device (cudart 12 loads every fatbin so). A
     * module is its context's: its part only (the thread's context routes it). */
    int parts = kind == GP_MODKIND_LIBRARY ? gp_conn_parts() : 1;
    CUresult r = CUDA_SUCCESS;
    int loaded = 0;
    for (; loaded < parts && r == CUDA_SUCCESS; loaded++) {
        if (parts > 1)
            gp_conn_route(loaded);
        r = send_load(mod->handle, kind, sha, data, size, 0);
        uint64_t t2 = gp_module_phase_now_ns();
        gp_module_phase_add(GP_MODPHASE_PROBE, 0, t2 - t1);
        if (r == GP_ENEEDIMAGE) {
            if (was_known)
                gp_log_debug("module load: the server no longer has a %zu-byte image, resending",
                             size);
            r = send_load(mod->handle, kind, sha, data, size, 1);
            gp_module_phase_add(GP_MODPHASE_UPLOAD, size, gp_module_phase_now_ns() - t2);
        }
        r = gp_server_result(r, "module load");
        t1 = gp_module_phase_now_ns();
    }
    if (r != CUDA_SUCCESS && parts > 1) /* the parts that loaded it unload it again */
        send_unload_parts(mod, loaded - 1);
    if (parts > 1)
        gp_conn_route(-1);
    if (r != CUDA_SUCCESS) {
        gp_handle_remove(mod->handle, kind == GP_MODKIND_LIBRARY ? GP_H_LIBRARY : GP_H_MODULE);
        module_free(mod);
        return r;
    }
    known_add(sha);
    *out = mod->handle;
    return CUDA_SUCCESS;
}

/* Read a whole file into a NUL-terminated buffer (PTX files need the terminator). */
static CUresult read_file(const char *path, void **buf, size_t *len)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return CUDA_ERROR_FILE_NOT_FOUND;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        close(fd);
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    if (!S_ISREG(st.st_mode) || st.st_size < 0 || (uint64_t)st.st_size >= GP_IMAGE_MAX_SIZE) {
        close(fd);
        return S_ISREG(st.st_mode) ? CUDA_ERROR_INVALID_IMAGE : CUDA_ERROR_FILE_NOT_FOUND;
    }
    size_t n = (size_t)st.st_size;
    uint8_t *p = malloc(n + 1);
    if (!p) {
        close(fd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    size_t got = 0;
    while (got < n) {
        ssize_t k = read(fd, p + got, n - got);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            break;
        got += (size_t)k;
    }
    close(fd);
    if (got != n) {
        free(p);
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    p[n] = 0;
    *buf = p;
    *len = n + 1;
    return CUDA_SUCCESS;
}

/* ---- unloading -------------------------------------------------------------------------- */

static CUresult unload(gp_module *mod)
{
    pthread_mutex_lock(&mod->lock);
    for (int b = 0; b < FUNC_BUCKETS; b++) {
        for (gp_func *fn = mod->funcs[b]; fn; fn = fn->next_hash) {
            gp_handle_remove(fn->handle, (enum gp_handle_kind)gp_handle_kind_of(fn->handle));
            if (fn->func_alias)
                gp_handle_remove(fn->func_alias, GP_H_FUNC);
        }
    }
    for (gp_global *g = mod->globals; g; g = g->next) {
        if (g->in_vamap && gp_vamap_remove_global(g->dptr, g->ctx) != 0)
            gp_log_debug("global %s was no longer in the VA map", g->name);
    }
    if (mod->module_alias)
        gp_handle_remove(mod->module_alias, GP_H_MODULE);
    pthread_mutex_unlock(&mod->lock);

    CUresult r = mod->kind == GP_MODKIND_LIBRARY && gp_conn_parts() > 1
                     ? send_unload_parts(mod, gp_conn_parts())
                     : send_unload(mod);
    module_free(mod);
    return r;
}

/* ---- functions and kernels -------------------------------------------------------------- */

static gp_func *find_func(gp_module *mod, const char *name, uint32_t h)
{
    for (gp_func *fn = mod->funcs[h % FUNC_BUCKETS]; fn; fn = fn->next_hash)
        if (strcmp(fn->name, name) == 0)
            return fn;
    return NULL;
}

static void store_layout(gp_func *fn, const gp_get_function_reply *rep, const gp_module *mod)
{
    int count = rep->param_count;
    uint32_t *offs = NULL, *sizes = NULL;
    if (count >= 0 && (uint32_t)count == rep->param_offsets_count &&
        (uint32_t)count == rep->param_sizes_count) {
        offs = malloc(sizeof *offs * (size_t)(count ? count : 1));
        sizes = malloc(sizeof *sizes * (size_t)(count ? count : 1));
        if (offs && sizes) {
            for (int i = 0; i < count; i++) {
                offs[i] = gp_arr_u32(rep->param_offsets, (uint32_t)i);
                sizes[i] = gp_arr_u32(rep->param_sizes, (uint32_t)i);
            }
        } else {
            count = -1;
        }
    } else {
        /* The server cannot tell: read the cubin's own records. */
        enum {
            MAXP = 8192
        };
        offs = malloc(sizeof *offs * MAXP);
        sizes = malloc(sizeof *sizes * MAXP);
        count = offs && sizes && mod->image
                    ? gp_image_param_info(mod->image, mod->image_size, fn->name, offs, sizes, MAXP)
                    : -1;
        gp_log_debug("%s: parameter layout from the image: %d parameters", fn->name, count);
    }
    if (count < 0) {
        free(offs);
        free(sizes);
        offs = sizes = NULL;
        count = -1;
    }
    uint32_t total = 0;
    for (int i = 0; i < count; i++) {
        uint64_t end = (uint64_t)offs[i] + sizes[i];
        if (end > 0x100000u) { /* more than the wire allows: treat as unknown */
            free(offs);
            free(sizes);
            offs = sizes = NULL;
            count = -1;
            total = 0;
            break;
        }
        if (end > total)
            total = (uint32_t)end;
    }
    fn->param_count = count;
    fn->param_bytes = total;
    fn->param_offsets = offs;
    fn->param_sizes = sizes;
}

/* The function or kernel `name` of mod, from the table or with one get_function request.
 * Called with mod->lock held (held across the request, so concurrent lookups of one module
 * do not race to bind two ids). */
static CUresult get_func_locked(gp_module *mod, const char *name, gp_func **out)
{
    uint32_t h = name_hash(name);
    gp_func *fn = find_func(mod, name, h);
    if (fn) {
        *out = fn;
        return CUDA_SUCCESS;
    }
    size_t nlen = strlen(name);
    if (nlen > MAX_NAME) {
        gp_log_error("kernel name of %zu bytes is longer than gpupool supports (%d)", nlen,
                     MAX_NAME);
        return CUDA_ERROR_NOT_FOUND;
    }
    fn = calloc(1, sizeof *fn);
    if (!fn || !(fn->name = strdup(name))) {
        free(fn);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    fn->mod = mod;
    fn->param_count = -1;
    atomic_flag_clear(&fn->warned_params);
    enum gp_handle_kind hk = mod->kind == GP_MODKIND_LIBRARY ? GP_H_KERNEL : GP_H_FUNC;
    fn->handle = fn->wire = gp_handle_new(hk, fn);
    if (!fn->handle) {
        free(fn->name);
        free(fn);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    gp_get_function m = {.module = mod->handle,
                         .kind = mod->kind,
                         .func = fn->wire,
                         .name = name,
                         .name_len = (uint32_t)nlen};
    GP_FRAME(frame, flen, gp_get_function, &m);
    CUresult r = CUDA_ERROR_OUT_OF_MEMORY;
    gp_reply reply = {0};
    if (frame) {
        /* A library's kernel launches on any part (each loaded the library): each part's worker
         * learns the handle; part 0's reply gives the layout. */
        int parts = mod->kind == GP_MODKIND_LIBRARY ? gp_conn_parts() : 1;
        for (int k = 0; k < parts && (k == 0 || r == CUDA_SUCCESS); k++) {
            gp_reply more = {0};
            if (parts > 1)
                gp_conn_route(k);
            r = gp_server_result(gp_request(frame, flen, NULL, 0, NULL, 0, k ? &more : &reply),
                                 "get function");
            gp_reply_free(&more);
        }
        if (parts > 1)
            gp_conn_route(-1);
        GP_FRAME_FREE(frame);
    }
    gp_get_function_reply rep = {0};
    if (r == CUDA_SUCCESS && gp_get_function_reply_decode(reply.body, reply.len, &rep) != 0) {
        gp_log_error("get function: malformed reply");
        r = CUDA_ERROR_UNKNOWN;
    }
    if (r == CUDA_SUCCESS)
        store_layout(fn, &rep, mod);
    gp_reply_free(&reply);
    if (r != CUDA_SUCCESS) {
        gp_handle_remove(fn->handle, hk);
        free(fn->name);
        free(fn);
        return r;
    }
    fn->next_hash = mod->funcs[h % FUNC_BUCKETS];
    mod->funcs[h % FUNC_BUCKETS] = fn;
    *out = fn;
    return CUDA_SUCCESS;
}

/* The CUfunction handle of a kernel (created on first use). Called with mod->lock held. */
static CUresult kernel_func_alias_locked(gp_func *fn, uint64_t *out)
{
    if (gp_handle_kind_of(fn->handle) == GP_H_FUNC) {
        *out = fn->handle;
        return CUDA_SUCCESS;
    }
    if (!fn->func_alias) {
        fn->func_alias = gp_handle_new(GP_H_FUNC, fn);
        if (!fn->func_alias)
            return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *out = fn->func_alias;
    return CUDA_SUCCESS;
}

/* The CUmodule handle of a library (created on first use). Called with mod->lock held. */
static CUresult library_module_alias_locked(gp_module *mod, uint64_t *out)
{
    if (mod->kind == GP_MODKIND_MODULE) {
        *out = mod->handle;
        return CUDA_SUCCESS;
    }
    if (!mod->module_alias) {
        mod->module_alias = gp_handle_new(GP_H_MODULE, mod);
        if (!mod->module_alias)
            return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *out = mod->module_alias;
    return CUDA_SUCCESS;
}

/* ---- globals ---------------------------------------------------------------------------- */

static CUresult get_global(gp_module *mod, CUdeviceptr *dptr, size_t *bytes, const char *name)
{
    if (!name || (!dptr && !bytes))
        return CUDA_ERROR_INVALID_VALUE;
    size_t nlen = strlen(name);
    if (nlen > MAX_NAME)
        return CUDA_ERROR_NOT_FOUND;
    module_use_ctx(mod);
    int spread_lib = gp_conn_parts() > 1 && mod->kind == GP_MODKIND_LIBRARY;
    int part = spread_lib ? gp_conn_next_part() : 0; /* the part that answers */
    pthread_mutex_lock(&mod->lock);
    gp_global *g;
    for (g = mod->globals; g; g = g->next)
        if (g->part == part && strcmp(g->name, name) == 0)
            break;
    CUresult r = CUDA_SUCCESS;
    if (!g) {
        gp_get_global m = {
            .module = mod->handle, .kind = mod->kind, .name = name, .name_len = (uint32_t)nlen};
        GP_FRAME(frame, flen, gp_get_global, &m);
        gp_reply reply = {0};
        r = CUDA_ERROR_OUT_OF_MEMORY;
        if (frame) {
            r = gp_server_result(gp_request(frame, flen, NULL, 0, NULL, 0, &reply), "get global");
            GP_FRAME_FREE(frame);
        }
        if (r == CUDA_SUCCESS) {
            gp_get_global_reply rep = {0};
            if (gp_get_global_reply_decode(reply.body, reply.len, &rep)) {
                gp_log_error("get global: malformed reply");
                r = CUDA_ERROR_UNKNOWN;
            }
            if (r == CUDA_SUCCESS) {
                g = calloc(1, sizeof *g);
                if (!g || !(g->name = strdup(name))) {
                    free(g);
                    g = NULL;
                    r = CUDA_ERROR_OUT_OF_MEMORY;
                } else {
                    g->dptr = rep.dptr;
                    g->size = rep.size;
                    g->part = part;
                    uint64_t ctx_answered = spread_lib ? gp_ctx_current() : mod->ctx;
                    g->ctx = ctx_answered;
                    g->in_vamap = gp_vamap_add_global(g->dptr, g->size, ctx_answered) == 0;
                    if (!g->in_vamap)
                        gp_log_error("global %s at 0x%llx (%llu bytes) overlaps other memory "
                                     "known to gpupool; copies to or from it may be refused",
                                     name, (unsigned long long)g->dptr,
                                     (unsigned long long)g->size);
                    g->next = mod->globals;
                    mod->globals = g;
                }
            }
            gp_reply_free(&reply);
        }
    }
    if (g) {
        if (dptr)
            *dptr = g->dptr;
        if (bytes)
            *bytes = g->size;
    }
    pthread_mutex_unlock(&mod->lock);
    return r;
}

/* ---- JIT options ------------------------------------------------------------------------ */

/* The compiler runs on the server with its defaults; what the options would return is filled in
 * here: no wall time, an empty info log, and on failure one line in the error log. */
static void jit_outputs(unsigned int n, const CUjit_option *options, void **values, CUresult r)
{
    if (!options || !values)
        return;
    char *logs[2] = {NULL, NULL};
    size_t caps[2] = {0, 0};
    for (unsigned int i = 0; i < n; i++) {
        switch (options[i]) {
        case CU_JIT_INFO_LOG_BUFFER:
            logs[0] = values[i];
            break;
        case CU_JIT_ERROR_LOG_BUFFER:
            logs[1] = values[i];
            break;
        case CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES:
            caps[0] = (uintptr_t)values[i];
            break;
        case CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES:
            caps[1] = (uintptr_t)values[i];
            break;
        default:
            break;
        }
    }
    size_t used[2] = {0, 0};
    for (int k = 0; k < 2; k++) {
        if (!logs[k] || !caps[k])
            continue;
        if (k == 1 && r != CUDA_SUCCESS) {
            int len =
                snprintf(logs[k], caps[k],
                         "gpupool: the server's driver refused this image (CUresult %d)", (int)r);
            used[k] = len < 0 ? 0 : (size_t)len + 1 < caps[k] ? (size_t)len + 1 : caps[k];
        } else {
            logs[k][0] = '\0';
        }
    }
    for (unsigned int i = 0; i < n; i++) {
        if (options[i] == CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES && logs[0])
            values[i] = (void *)(uintptr_t)used[0];
        else if (options[i] == CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES && logs[1])
            values[i] = (void *)(uintptr_t)used[1];
        else if (options[i] == CU_JIT_WALL_TIME) {
            float ms = 0.0f;
            void *v = NULL;
            memcpy(&v, &ms, sizeof ms); /* the float travels in the pointer-sized slot */
            values[i] = v;
        }
    }
}

/* ---- entry points: modules -------------------------------------------------------------- */

GP_EXPORT CUresult cuModuleLoadData(CUmodule *module, const void *image)
{
    if (!module || !image)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_ctx_enter();
    if (r != CUDA_SUCCESS)
        return r;
    uint64_t h;
    r = load_image(GP_MODKIND_MODULE, image, SIZE_MAX, NULL, 0, &h);
    if (r == CUDA_SUCCESS)
        *module = (CUmodule)(uintptr_t)h;
    return r;
}

GP_EXPORT CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                                      CUjit_option *options, void **optionValues)
{
    /* JIT options only affect compiling PTX, which the server's driver does with its defaults. */
    CUresult r = cuModuleLoadData(module, image);
    jit_outputs(numOptions, options, optionValues, r);
    return r;
}

GP_EXPORT CUresult cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin)
{
    return cuModuleLoadData(module, fatCubin);
}

GP_EXPORT CUresult cuModuleLoad(CUmodule *module, const char *fname)
{
    if (!module || !fname)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_ctx_enter();
    if (r != CUDA_SUCCESS)
        return r;
    void *buf;
    size_t len;
    r = read_file(fname, &buf, &len);
    if (r != CUDA_SUCCESS)
        return r;
    uint64_t h;
    r = load_image(GP_MODKIND_MODULE, buf, len, buf, 1, &h);
    if (r == CUDA_SUCCESS)
        *module = (CUmodule)(uintptr_t)h;
    return r;
}

GP_EXPORT CUresult cuModuleUnload(CUmodule hmod)
{
    CUresult r = enter_any_ctx();
    if (r == CUDA_ERROR_NOT_INITIALIZED)
        return r;
    uint64_t h = (uint64_t)(uintptr_t)hmod;
    gp_module *mod = gp_handle_get(h, GP_H_MODULE);
    if (!mod)
        return CUDA_ERROR_INVALID_HANDLE;
    if (mod->kind != GP_MODKIND_MODULE)
        return CUDA_ERROR_NOT_PERMITTED; /* cuLibraryGetModule's */
    if (gp_handle_remove(h, GP_H_MODULE) != mod)
        return CUDA_ERROR_INVALID_HANDLE;
    module_use_ctx(mod);
    CUresult u = unload(mod);
    return r != CUDA_SUCCESS ? r : u;
}

GP_EXPORT CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name)
{
    if (!hfunc || !name)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_ctx_enter();
    if (r != CUDA_SUCCESS)
        return r;
    gp_module *mod = gp_handle_get((uint64_t)(uintptr_t)hmod, GP_H_MODULE);
    if (!mod)
        return CUDA_ERROR_INVALID_HANDLE;
    module_use_ctx(mod);
    pthread_mutex_lock(&mod->lock);
    gp_func *fn;
    uint64_t h = 0;
    r = get_func_locked(mod, name, &fn);
    if (r == CUDA_SUCCESS)
        r = kernel_func_alias_locked(fn, &h);
    pthread_mutex_unlock(&mod->lock);
    if (r == CUDA_SUCCESS)
        *hfunc = (CUfunction)(uintptr_t)h;
    return r;
}

GP_EXPORT CUresult cuModuleGetGlobal_v2(CUdeviceptr *dptr, size_t *bytes, CUmodule hmod,
                                        const char *name)
{
    CUresult r = gp_ctx_enter();
    if (r != CUDA_SUCCESS)
        return r;
    gp_module *mod = gp_handle_get((uint64_t)(uintptr_t)hmod, GP_H_MODULE);
    if (!mod)
        return CUDA_ERROR_INVALID_HANDLE;
    return get_global(mod, dptr, bytes, name);
}

/* ---- entry points: libraries ------------------------------------------------------------ */

static int library_preserved(CUlibraryOption *opts, void **values, unsigned int n)
{
    if (!opts)
        return 0;
    for (unsigned int i = 0; i < n; i++)
        if (opts[i] == CU_LIBRARY_BINARY_IS_PRESERVED && (!values || values[i]))
            return 1;
    return 0;
}

GP_EXPORT CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                                     void **jitOptionsValues, unsigned int numJitOptions,
                                     CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                     unsigned int numLibraryOptions)
{
    if (!library || !code)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = enter_any_ctx();
    if (r != CUDA_SUCCESS)
        return r;
    uint64_t h;
    r = load_image(GP_MODKIND_LIBRARY, code, SIZE_MAX, NULL,
                   library_preserved(libraryOptions, libraryOptionValues, numLibraryOptions), &h);
    if (r == CUDA_SUCCESS)
        *library = (CUlibrary)(uintptr_t)h;
    jit_outputs(numJitOptions, jitOptions, jitOptionsValues, r);
    return r;
}

GP_EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *library, const char *fileName,
                                         CUjit_option *jitOptions, void **jitOptionsValues,
                                         unsigned int numJitOptions,
                                         CUlibraryOption *libraryOptions,
                                         void **libraryOptionValues, unsigned int numLibraryOptions)
{
    if (!library || !fileName)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = enter_any_ctx();
    if (r != CUDA_SUCCESS)
        return r;
    void *buf;
    size_t len;
    r = read_file(fileName, &buf, &len);
    uint64_t h;
    if (r == CUDA_SUCCESS)
        r = load_image(GP_MODKIND_LIBRARY, buf, len, buf, 1, &h);
    if (r == CUDA_SUCCESS)
        *library = (CUlibrary)(uintptr_t)h;
    jit_outputs(numJitOptions, jitOptions, jitOptionsValues, r);
    return r;
}

GP_EXPORT CUresult cuLibraryUnload(CUlibrary library)
{
    CUresult r = enter_any_ctx();
    if (r == CUDA_ERROR_NOT_INITIALIZED)
        return r;
    gp_module *mod = gp_handle_remove((uint64_t)(uintptr_t)library, GP_H_LIBRARY);
    if (!mod)
        return CUDA_ERROR_INVALID_HANDLE;
    CUresult u = unload(mod);
    return r != CUDA_SUCCESS ? r : u;
}

GP_EXPORT CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name)
{
    if (!pKernel || !name)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = enter_any_ctx();
    if (r != CUDA_SUCCESS)
        return r;
    gp_module *mod = gp_handle_get((uint64_t)(uintptr_t)library, GP_H_LIBRARY);
    if (!mod)
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&mod->lock);
    gp_func *fn;
    r = get_func_locked(mod, name, &fn);
    pthread_mutex_unlock(&mod->lock);
    if (r == CUDA_SUCCESS)
        *pKernel = (CUkernel)(uintptr_t)fn->handle;
    return r;
}

GP_EXPORT CUresult cuLibraryGetModule(CUmodule *pMod, CUlibrary library)
{
    if (!pMod)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_ctx_enter();
    if (r != CUDA_SUCCESS)
        return r;
    gp_module *mod = gp_handle_get((uint64_t)(uintptr_t)library, GP_H_LIBRARY);
    if (!mod)
        return CUDA_ERROR_INVALID_HANDLE;
    uint64_t h = 0;
    pthread_mutex_lock(&mod->lock);
    r = library_module_alias_locked(mod, &h);
    pthread_mutex_unlock(&mod->lock);
    if (r == CUDA_SUCCESS)
        *pMod = (CUmodule)(uintptr_t)h;
    return r;
}

GP_EXPORT CUresult cuLibraryGetGlobal(CUdeviceptr *dptr, size_t *bytes, CUlibrary library,
                                      const char *name)
{
    CUresult r = gp_ctx_enter();
    if (r != CUDA_SUCCESS)
        return r;
    gp_module *mod = gp_handle_get((uint64_t)(uintptr_t)library, GP_H_LIBRARY);
    if (!mod)
        return CUDA_ERROR_INVALID_HANDLE;
    return get_global(mod, dptr, bytes, name);
}

/* ---- entry points: kernels and functions ------------------------------------------------ */

GP_EXPORT CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel)
{
    if (!pFunc)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_ctx_enter();
    if (r != CUDA_SUCCESS)
        return r;
    gp_func *fn = gp_handle_get((uint64_t)(uintptr_t)kernel, GP_H_KERNEL);
    if (!fn)
        return CUDA_ERROR_INVALID_HANDLE;
    uint64_t h = 0;
    pthread_mutex_lock(&fn->mod->lock);
    r = kernel_func_alias_locked(fn, &h);
    pthread_mutex_unlock(&fn->mod->lock);
    if (r == CUDA_SUCCESS)
        *pFunc = (CUfunction)(uintptr_t)h;
    return r;
}

GP_EXPORT CUresult cuKernelGetLibrary(CUlibrary *pLib, CUkernel kernel)
{
    if (!pLib)
        return CUDA_ERROR_INVALID_VALUE;
    gp_func *fn = gp_handle_get((uint64_t)(uintptr_t)kernel, GP_H_KERNEL);
    if (!fn)
        return CUDA_ERROR_INVALID_HANDLE;
    *pLib = (CUlibrary)(uintptr_t)fn->mod->handle;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuKernelGetName(const char **name, CUkernel hfunc)
{
    if (!name || !hfunc)
        return CUDA_ERROR_INVALID_VALUE;
    gp_func *fn = gp_handle_get((uint64_t)(uintptr_t)hfunc, GP_H_KERNEL);
    if (!fn)
        return CUDA_ERROR_INVALID_HANDLE;
    *name = fn->name;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuFuncGetName(const char **name, CUfunction hfunc)
{
    if (!name || !hfunc)
        return CUDA_ERROR_INVALID_VALUE;
    gp_func *fn = gp_func_lookup((uint64_t)(uintptr_t)hfunc);
    if (!fn)
        return CUDA_ERROR_INVALID_HANDLE;
    *name = fn->name;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuFuncGetModule(CUmodule *hmod, CUfunction hfunc)
{
    if (!hmod)
        return CUDA_ERROR_INVALID_VALUE;
    gp_func *fn = gp_func_lookup((uint64_t)(uintptr_t)hfunc);
    if (!fn)
        return CUDA_ERROR_INVALID_HANDLE;
    uint64_t h = 0;
    pthread_mutex_lock(&fn->mod->lock);
    CUresult r = library_module_alias_locked(fn->mod, &h);
    pthread_mutex_unlock(&fn->mod->lock);
    if (r == CUDA_SUCCESS)
        *hmod = (CUmodule)(uintptr_t)h;
    return r;
}
