/*
 * loader.c: dlopen() the driver for gpupool-scrub and describe its errors.
 *
 * A loader of its own rather than the worker's driver.o: the worker's table has neither the
 * synchronous cuMemAlloc/cuMemFree/cuMemsetD8/cuMemcpyDtoH the scrub needs nor cuGetErrorString,
 * and it requires VMM entry points the scrub never calls.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "scrub.h"

/* POSIX guarantees that a function pointer survives a round trip through void * (dlsym relies on
 * it); the typed fields are filled by copying the pointer's bytes. */
_Static_assert(sizeof(void *) == sizeof(void (*)(void)), "function pointers must fit void *");

struct sym {
    bool required;
    size_t offset; /* of the field in struct scrub_drv */
    const char *name;
};

#define SYM(req_, field_, name_)                                                                   \
    {                                                                                              \
        req_, offsetof(struct scrub_drv, field_), name_                                            \
    }
static const struct sym syms[] = {
    SYM(true, cuInit, "cuInit"),
    SYM(true, cuDeviceGet, "cuDeviceGet"),
    SYM(true, cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain"),
    SYM(true, cuCtxSetCurrent, "cuCtxSetCurrent"),
    SYM(true, cuMemGetInfo, "cuMemGetInfo_v2"),
    SYM(true, cuMemAlloc, "cuMemAlloc_v2"),
    SYM(true, cuMemsetD8, "cuMemsetD8_v2"),
    SYM(true, cuCtxSynchronize, "cuCtxSynchronize"),
    SYM(true, cuMemcpyDtoH, "cuMemcpyDtoH_v2"),
    SYM(true, cuMemFree, "cuMemFree_v2"),
    SYM(false, cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2"),
    SYM(false, cuDeviceGetName, "cuDeviceGetName"),
    SYM(false, cuGetErrorName, "cuGetErrorName"),
    SYM(false, cuGetErrorString, "cuGetErrorString"),
    SYM(false, sim_detail, "gpupoolSimLastErrorDetail"),
};
#undef SYM

int scrub_load_driver(struct scrub_drv *d, const char *path, char *err, size_t errlen)
{
    memset(d, 0, sizeof(*d));
    /* RTLD_NOW: missing dependencies of the library fail here, with the loader's reason. */
    d->lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!d->lib) {
        const char *why = dlerror();
        snprintf(err, errlen,
                 "cannot load the driver %s: %s; check the path (gpupoold setting `driver`, or "
                 "`sim_lib` for simulated GPUs)",
                 path, why ? why : "unknown error");
        return -1;
    }
    for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++) {
        dlerror(); /* clear, so that a NULL result is told apart from an error */
        void *p = dlsym(d->lib, syms[i].name);
        if (dlerror() != NULL)
            p = NULL;
        if (!p && syms[i].required) {
            snprintf(err, errlen,
                     "the driver %s lacks the entry point %s: it is not a CUDA driver library, or "
                     "one too old for gpupool",
                     path, syms[i].name);
            return -1;
        }
        memcpy((char *)d + syms[i].offset, &p, sizeof(p));
    }
    return 0;
}

const char *scrub_describe(const struct scrub_drv *d, CUresult rc, char *buf, size_t len)
{
    /* The detail first: it belongs to the last call, and must be read before any other. */
    const char *detail = d->sim_detail ? d->sim_detail() : NULL;
    const char *name = NULL, *text = NULL;
    if (!d->cuGetErrorName || d->cuGetErrorName(rc, &name) != CUDA_SUCCESS || !name)
        name = NULL;
    if (!d->cuGetErrorString || d->cuGetErrorString(rc, &text) != CUDA_SUCCESS || !text)
        text = NULL;
    int n = name ? snprintf(buf, len, "%s", name) : snprintf(buf, len, "CUresult %d", (int)rc);
    if (n >= 0 && (size_t)n < len && text)
        n += snprintf(buf + n, len - (size_t)n, " (%s)", text);
    if (n >= 0 && (size_t)n < len && detail && *detail)
        snprintf(buf + n, len - (size_t)n, "; simulated device: %s", detail);
    return buf;
}
