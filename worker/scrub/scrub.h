/*
 * scrub.h: gpupool-scrub, the process that wipes a GPU's memory between tenants
 * (worker/scrub/README.md).
 *
 * It is a separate, short-lived process rather than part of the worker so that it starts with a
 * fresh CUDA context of its own, holding nothing of the previous tenant's, and so that a driver
 * hang or crash during the wipe takes down only the scrub (gpupoold then quarantines the GPU).
 * Single-threaded: the state below needs no lock.
 */
#ifndef GP_SCRUB_H
#define GP_SCRUB_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gp_cuda.h"

/* The driver entry points the scrub calls, by dlsym() from --driver (loader.c). Like the worker,
 * we never link against libcuda: the same binary runs on the real driver and the simulated one.
 * Only the versioned names are used for the size_t calls: the unversioned ones are the old 32-bit
 * ABI. */
struct scrub_drv {
    void *lib;
    CUresult (*cuInit)(unsigned int);
    CUresult (*cuDeviceGet)(CUdevice *, int);
    CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*cuCtxSetCurrent)(CUcontext);
    CUresult (*cuMemGetInfo)(size_t *, size_t *);
    CUresult (*cuMemAlloc)(CUdeviceptr *, size_t);
    CUresult (*cuMemsetD8)(CUdeviceptr, unsigned char, size_t);
    CUresult (*cuCtxSynchronize)(void);
    CUresult (*cuMemcpyDtoH)(void *, CUdeviceptr, size_t);
    CUresult (*cuMemFree)(CUdeviceptr);
    /* optional */
    CUresult (*cuDevicePrimaryCtxRelease)(CUdevice);
    CUresult (*cuDeviceGetName)(char *, int, CUdevice);
    CUresult (*cuGetErrorName)(CUresult, const char **);
    CUresult (*cuGetErrorString)(CUresult, const char **);
    const char *(*sim_detail)(void); /* the simulated device's gpupoolSimLastErrorDetail */
};

struct scrub_alloc {
    CUdeviceptr ptr;
    size_t size;
};

/* One run: the options, what was found, what was done, and why it failed. */
struct scrub_run {
    struct scrub_drv drv;
    bool simulated;
    int ordinal;
    uint64_t min_chunk;
    unsigned samples; /* --samples: spread over all allocations besides first and last */
    CUdevice dev;
    size_t free_before, total;
    struct scrub_alloc *allocs;
    size_t nallocs, cap;
    uint64_t bytes;        /* allocated (and so zeroed) */
    uint64_t samples_done; /* 4 KiB pieces copied back and checked */
    uint64_t rng;          /* xorshift state for the sample offsets */
    const char *stage;     /* on failure: init, alloc, memset, sync, verify or free */
    char error[2048];
};

/* Records a failure in stage `stage`; always returns -1. */
int scrub_fail(struct scrub_run *r, const char *stage, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* A CUDA call failed: "<what> failed: NAME (meaning)[; simulated device: ...]; <advice>". */
int scrub_fail_cu(struct scrub_run *r, const char *stage, CUresult rc, const char *what,
                  const char *advice);
/* Progress line on stderr. */
void scrub_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* The stages (wipe.c), in order; each returns 0 or fails through scrub_fail. */
int scrub_alloc_all(struct scrub_run *r);
int scrub_zero_all(struct scrub_run *r);
int scrub_sync(struct scrub_run *r);
int scrub_verify(struct scrub_run *r);
int scrub_free_all(struct scrub_run *r);

/* dlopen() path and resolve the table. 0, or -1 with a one-line reason in err. */
int scrub_load_driver(struct scrub_drv *d, const char *path, char *err, size_t errlen);

/* "CUDA_ERROR_OUT_OF_MEMORY (out of memory)" plus, on the simulated device, what lay behind it.
 * The text lives in buf. */
const char *scrub_describe(const struct scrub_drv *d, CUresult rc, char *buf, size_t len);

#endif /* GP_SCRUB_H */
