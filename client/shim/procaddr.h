/*
 * procaddr.h: driver-function lookup by name and CUDA version (the engine of cuGetProcAddress).
 *
 * client/shim/procaddr.c defines the exported cuGetProcAddress and cuGetProcAddress_v2 on top
 * of these; other shim code may use them directly (e.g. to log what a name resolves to).
 */
#ifndef GP_PROCADDR_H
#define GP_PROCADDR_H

#include "generated/gp_cuda_tables.h"
#include "gp_cuda.h"

/* Resolve `symbol` (a base name such as "cuMemAlloc", or an exact exported name such as
 * "cuMemAlloc_v2") as a caller compiled for `cuda_version` expects it. With
 * CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM in `flags`, the _ptds/_ptsz variant is preferred
 * where one exists. Returns CUDA_SUCCESS, or CUDA_ERROR_NOT_FOUND with *status saying
 * VERSION_NOT_SUFFICIENT (the name exists only in newer revisions) or SYMBOL_NOT_FOUND.
 * *fn is NULL unless it succeeds. `symbol`, `fn` and `status` must not be NULL. */
CUresult gp_procaddr_lookup(const char *symbol, int cuda_version, cuuint64_t flags, gp_cu_fn *fn,
                            CUdriverProcAddressQueryResult *status);

/* The exported function with exactly this name, or NULL. */
gp_cu_fn gp_symbol_lookup(const char *name);

#endif /* GP_PROCADDR_H */
