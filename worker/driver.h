/*
 * driver.h: the table of driver entry points the worker calls, filled by dlsym() from the
 * library named by --driver (the real libcuda.so.1 or the simulated device).
 *
 * We never link against libcuda: the same binary must run against either library, and a missing
 * optional entry point must become CUDA_ERROR_NOT_SUPPORTED for that one call instead of a load
 * failure. Each entry lists the exported names to try, in order (the spec says why the versioned
 * name comes first).
 */
#ifndef GP_WORKER_DRIVER_H
#define GP_WORKER_DRIVER_H

#include "gp_cuda.h"

/* GP_DRIVER_FUNCS(X): X(required, field, parameter list, "name [alternative ...]") for each
 * entry point, generated from [worker] driver_functions in protocol/gpupool.toml (which says how
 * the names are chosen). A new entry point is a line there and `make gen`. */
#include "generated/wk_driver_funcs.h"

struct gp_driver {
    void *lib; /* dlopen() handle */
#define GP_DRIVER_FIELD(req_, name_, params_, syms_) CUresult(*name_) params_;
    GP_DRIVER_FUNCS(GP_DRIVER_FIELD)
#undef GP_DRIVER_FIELD
    /* Not a driver function: the simulated device's explanation of its last error. */
    const char *(*sim_last_error_detail)(void);
    /* Not a driver function either: the simulated device's gpupoolSimHostPointer (the host
     * address backing a device range), used by h_copy.c to skip the staging copy. NULL on a real
     * driver. */
    CUresult (*sim_host_pointer)(CUdeviceptr, size_t, void **);
};

/* dlopen() path and fill the table. Returns 0, or -1 with a one-line reason in err. */
int wk_driver_load(struct gp_driver *d, const char *path, char *err, size_t errlen);

/* Calls an optional entry point, or yields CUDA_ERROR_NOT_SUPPORTED when the library lacks it. */
#define DRV(w_, fn_, ...) ((w_)->drv.fn_ ? (w_)->drv.fn_(__VA_ARGS__) : CUDA_ERROR_NOT_SUPPORTED)

#endif /* GP_WORKER_DRIVER_H */
