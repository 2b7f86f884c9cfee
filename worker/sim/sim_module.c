/*
 * sim_module.c: modules (cuModule*, owned by a context) and libraries (cuLibrary*, context-
 * independent), their functions/kernels and globals.
 *
 * Names: when the image's code could be read (an uncompressed cubin for the device), only its
 * kernels and globals exist and other names give CUDA_ERROR_NOT_FOUND. When it could not (PTX,
 * compressed code) any kernel name is accepted, since the real driver might well find it.
 *
 * Parameter layouts: the sim's own table for gp_test_* kernels (the ones it can run), else the
 * cubin's KPARAM_INFO records, else unknown (cuFuncGetParamInfo: CUDA_ERROR_NOT_SUPPORTED).
 *
 * Globals get device memory in the sim heap on first request, per context, initialised from the
 * image (or zero), like the driver's module data.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim_api.h"
#include "sim_internal.h"

#define DEFAULT_REGS 32 /* when the image does not say */

struct global_copy {
    size_t gidx;  /* into img.elf.globals */
    uint64_t ctx; /* the context it was allocated for */
    uint64_t dptr;
};

struct sim_module {
    uint64_t handle;
    bool library;
    uint64_t ctx; /* modules: the owning context; libraries: 0 */
    struct sim_image img;
    struct sim_func **funcs;
    size_t nfuncs;
    struct global_copy *globals;
    size_t nglobals;
};

struct sim_func *sim_func_get(uint64_t h)
{
    struct sim_func *f = sim_handle_get(h, SIM_K_FUNC);
    return f ? f : sim_handle_get(h, SIM_K_KERNEL);
}

static int dev_sm(int dev)
{
    (void)dev; /* all simulated devices share their compute capability */
    return sim_cfg.cc_major * 10 + sim_cfg.cc_minor;
}

static void func_free(struct sim_func *f)
{
    sim_handle_del(f->fh);
    if (f->kh)
        sim_handle_del(f->kh);
    free(f->name);
    free(f);
}

static void module_free(struct sim_module *m)
{
    for (size_t i = 0; i < m->nfuncs; i++)
        func_free(m->funcs[i]);
    for (size_t i = 0; i < m->nglobals; i++)
        if (sim_heap_free(m->globals[i].dptr, true) != CUDA_SUCCESS)
            fprintf(stderr, "gpupool-sim: module global at 0x%llx was already gone\n",
                    (unsigned long long)m->globals[i].dptr);
    sim_handle_del(m->handle);
    sim_image_free(&m->img);
    free(m->funcs);
    free(m->globals);
    free(m);
}

static void drop_ctx_module(uint64_t h, void *obj, void *arg)
{
    (void)h;
    struct sim_module *m = obj;
    if (m->ctx == *(uint64_t *)arg)
        module_free(m);
}

static void drop_ctx_globals(uint64_t h, void *obj, void *arg)
{
    (void)h;
    struct sim_module *m = obj;
    uint64_t ctx = *(uint64_t *)arg;
    /* The memory itself belongs to the context and goes with it; forget the addresses. */
    size_t k = 0;
    for (size_t i = 0; i < m->nglobals; i++)
        if (m->globals[i].ctx != ctx)
            m->globals[k++] = m->globals[i];
    m->nglobals = k;
}

void sim_module_release_ctx(uint64_t ctx)
{
    sim_handle_foreach(SIM_K_MODULE, drop_ctx_module, &ctx);
    sim_handle_foreach(SIM_K_LIBRARY, drop_ctx_globals, &ctx);
}

static CUresult module_new(const void *image, bool library, uint64_t ctx, int dev,
                           struct sim_module **out)
{
    struct sim_module *m = calloc(1, sizeof(*m));
    if (!m)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = sim_image_load(image, dev_sm(dev), &m->img);
    if (rc != CUDA_SUCCESS) {
        free(m);
        return rc;
    }
    m->library = library;
    m->ctx = ctx;
    m->handle = sim_handle_new(library ? SIM_K_LIBRARY : SIM_K_MODULE, m);
    if (m->handle == 0) {
        sim_image_free(&m->img);
        free(m);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *out = m;
    return CUDA_SUCCESS;
}

static bool same_layout(int n, const struct sim_param *a, const struct sim_param *b)
{
    for (int i = 0; i < n; i++)
        if (a[i].offset != b[i].offset || a[i].size != b[i].size)
            return false;
    return true;
}

/* The function `name` of module m, created on first request (same handle afterwards). */
static CUresult get_func(struct sim_module *m, const char *name, struct sim_func **out)
{
    for (size_t i = 0; i < m->nfuncs; i++)
        if (strcmp(m->funcs[i]->name, name) == 0) {
            *out = m->funcs[i];
            return CUDA_SUCCESS;
        }
    const struct sim_elf_kernel *k = NULL;
    for (size_t i = 0; i < m->img.elf.nkernels && !k; i++)
        if (strcmp(m->img.elf.kernels[i].name, name) == 0)
            k = &m->img.elf.kernels[i];
    if (!k && !m->img.any_name)
        return CUDA_ERROR_NOT_FOUND;
    struct sim_func **nf = realloc(m->funcs, (m->nfuncs + 1) * sizeof(*nf));
    if (!nf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    m->funcs = nf;
    struct sim_func *f = calloc(1, sizeof(*f));
    if (!f || !(f->name = strdup(name))) {
        free(f);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    f->mod = m;
    f->def = sim_kernel_find(name);
    f->nparams = -1;
    if (f->def && k && k->nparams >= 0 &&
        (k->nparams != f->def->nparams || !same_layout(k->nparams, k->params, f->def->params))) {
        /* Same name, different kernel: running our host version would misread its arguments. */
        fprintf(stderr,
                "gpupool-sim: kernel '%s' in this image does not have the parameters of "
                "the simulated one; it will not be simulated\n",
                name);
        f->def = NULL;
    }
    if (f->def) {
        f->nparams = f->def->nparams;
        f->params = f->def->params;
    } else if (k && k->nparams >= 0) {
        f->nparams = k->nparams;
        f->params = k->params;
    }
    f->regs = k && k->regs >= 0 ? k->regs : DEFAULT_REGS;
    f->attr[SIM_FUNC_ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES] =
        sim_config_attr(&sim_cfg, 0, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK);
    f->attr[SIM_FUNC_ATTR_PREFERRED_SHARED_MEMORY_CARVEOUT] = -1;
    f->fh = sim_handle_new(SIM_K_FUNC, f);
    f->kh = m->library && f->fh ? sim_handle_new(SIM_K_KERNEL, f) : 0;
    if (!f->fh || (m->library && !f->kh)) {
        if (f->fh)
            sim_handle_del(f->fh);
        free(f->name);
        free(f);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    m->funcs[m->nfuncs++] = f;
    *out = f;
    return CUDA_SUCCESS;
}

static CUresult get_global(struct sim_module *m, struct sim_ctx *c, const char *name,
                           CUdeviceptr *dptr, size_t *bytes)
{
    size_t gi = 0;
    while (gi < m->img.elf.nglobals && strcmp(m->img.elf.globals[gi].name, name) != 0)
        gi++;
    if (gi == m->img.elf.nglobals) {
        if (m->img.any_name)
            sim_detail("global '%s': the simulated device cannot see the globals of PTX or "
                       "compressed code",
                       name);
        return CUDA_ERROR_NOT_FOUND;
    }
    const struct sim_elf_global *g = &m->img.elf.globals[gi];
    uint64_t p = 0;
    for (size_t i = 0; i < m->nglobals && !p; i++)
        if (m->globals[i].gidx == gi && m->globals[i].ctx == c->handle)
            p = m->globals[i].dptr;
    if (!p) {
        struct global_copy *ng = realloc(m->globals, (m->nglobals + 1) * sizeof(*ng));
        if (!ng)
            return CUDA_ERROR_OUT_OF_MEMORY;
        m->globals = ng;
        CUresult rc = sim_heap_alloc(c->dev, c->handle, g->size, SIM_SEG_GLOBAL, &p);
        if (rc != CUDA_SUCCESS)
            return rc;
        if (g->init) /* fresh heap pages are zero already */
            memcpy((void *)(uintptr_t)p, g->init, g->size);
        m->globals[m->nglobals++] = (struct global_copy){.gidx = gi, .ctx = c->handle, .dptr = p};
    }
    if (dptr)
        *dptr = p;
    if (bytes)
        *bytes = (size_t)g->size;
    return CUDA_SUCCESS;
}

long sim_module_foreach_function(uint64_t hmod, void (*fn)(void *arg, uint64_t fh), void *arg)
{
    struct sim_module *m = sim_handle_get(hmod, SIM_K_MODULE);
    if (!m)
        return -1;
    long n = 0;
    for (size_t i = 0; i < m->img.elf.nkernels; i++) {
        struct sim_func *f = NULL;
        if (get_func(m, m->img.elf.kernels[i].name, &f) != CUDA_SUCCESS)
            continue; /* out of memory: that one is left out, as the count says */
        fn(arg, f->fh);
        n++;
    }
    return n;
}

/* ---- modules ----------------------------------------------------------------------------- */

CUresult cuModuleLoadData(CUmodule *module, const void *image)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!module || !image)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    struct sim_module *m = NULL;
    rc = module_new(image, false, c->handle, c->dev, &m);
    if (rc == CUDA_SUCCESS)
        *module = (CUmodule)(uintptr_t)m->handle;
    return sim_leave(rc);
}

CUresult cuModuleUnload(CUmodule hmod)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    struct sim_module *m = sim_handle_get((uint64_t)(uintptr_t)hmod, SIM_K_MODULE);
    if (!m)
        return sim_leave(CUDA_ERROR_INVALID_HANDLE);
    module_free(m);
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!hfunc || !name)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    struct sim_module *m = sim_handle_get((uint64_t)(uintptr_t)hmod, SIM_K_MODULE);
    if (!m)
        return sim_leave(CUDA_ERROR_INVALID_HANDLE);
    struct sim_func *f = NULL;
    rc = get_func(m, name, &f);
    if (rc == CUDA_SUCCESS)
        *hfunc = (CUfunction)(uintptr_t)f->fh;
    return sim_leave(rc);
}

CUresult cuModuleGetGlobal_v2(CUdeviceptr *dptr, size_t *bytes, CUmodule hmod, const char *name)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!name)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    struct sim_module *m = sim_handle_get((uint64_t)(uintptr_t)hmod, SIM_K_MODULE);
    if (!m)
        return sim_leave(CUDA_ERROR_INVALID_HANDLE);
    return sim_leave(get_global(m, c, name, dptr, bytes));
}

/* ---- libraries --------------------------------------------------------------------------- */

CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                           void **jitOptionsValues, unsigned int numJitOptions,
                           CUlibraryOption *libraryOptions, void **libraryOptionValues,
                           unsigned int numLibraryOptions)
{
    (void)jitOptionsValues;
    (void)libraryOptionValues; /* may be NULL (cuBLASLt passes NULL) */
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!library || !code || (numJitOptions > 0 && !jitOptions) ||
        (numLibraryOptions > 0 && !libraryOptions))
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    for (unsigned i = 0; i < numLibraryOptions; i++)
        if (libraryOptions[i] != CU_LIBRARY_HOST_UNIVERSAL_FUNCTION_AND_DATA_TABLE &&
            libraryOptions[i] != CU_LIBRARY_BINARY_IS_PRESERVED)
            return sim_leave(CUDA_ERROR_INVALID_VALUE);
    struct sim_module *m = NULL;
    rc = module_new(code, true, 0, 0, &m);
    if (rc == CUDA_SUCCESS)
        *library = (CUlibrary)(uintptr_t)m->handle;
    return sim_leave(rc);
}

CUresult cuLibraryUnload(CUlibrary library)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    struct sim_module *m = sim_handle_get((uint64_t)(uintptr_t)library, SIM_K_LIBRARY);
    if (!m)
        return sim_leave(CUDA_ERROR_INVALID_HANDLE);
    module_free(m);
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!pKernel || !name)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    struct sim_module *m = sim_handle_get((uint64_t)(uintptr_t)library, SIM_K_LIBRARY);
    if (!m)
        return sim_leave(CUDA_ERROR_INVALID_HANDLE);
    struct sim_func *f = NULL;
    rc = get_func(m, name, &f);
    if (rc == CUDA_SUCCESS)
        *pKernel = (CUkernel)(uintptr_t)f->kh;
    return sim_leave(rc);
}

CUresult cuLibraryGetGlobal(CUdeviceptr *dptr, size_t *bytes, CUlibrary library, const char *name)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c); /* the global of the current context */
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!name)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    struct sim_module *m = sim_handle_get((uint64_t)(uintptr_t)library, SIM_K_LIBRARY);
    if (!m)
        return sim_leave(CUDA_ERROR_INVALID_HANDLE);
    return sim_leave(get_global(m, c, name, dptr, bytes));
}

CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!pFunc)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    struct sim_func *f = sim_handle_get((uint64_t)(uintptr_t)kernel, SIM_K_KERNEL);
    if (!f)
        return sim_leave(CUDA_ERROR_INVALID_HANDLE);
    *pFunc = (CUfunction)(uintptr_t)f->fh;
    return sim_leave(CUDA_SUCCESS);
}

/* ---- parameter layouts ------------------------------------------------------------------- */

static CUresult param_info(struct sim_func *f, size_t idx, size_t *off, size_t *size)
{
    if (!f)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!off)
        return CUDA_ERROR_INVALID_VALUE;
    if (f->nparams < 0) {
        sim_detail("kernel '%s': the simulated device does not know its parameters (not a "
                   "gp_test_* kernel and no parameter records in the image)",
                   f->name);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    if (idx >= (size_t)f->nparams)
        return CUDA_ERROR_INVALID_VALUE;
    *off = f->params[idx].offset;
    if (size)
        *size = f->params[idx].size;
    return CUDA_SUCCESS;
}

CUresult cuFuncGetParamInfo(CUfunction func, size_t paramIndex, size_t *paramOffset,
                            size_t *paramSize)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    struct sim_func *f = sim_handle_get((uint64_t)(uintptr_t)func, SIM_K_FUNC);
    return sim_leave(param_info(f, paramIndex, paramOffset, paramSize));
}

CUresult cuKernelGetParamInfo(CUkernel kernel, size_t paramIndex, size_t *paramOffset,
                              size_t *paramSize)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    struct sim_func *f = sim_handle_get((uint64_t)(uintptr_t)kernel, SIM_K_KERNEL);
    return sim_leave(param_info(f, paramIndex, paramOffset, paramSize));
}
