/*
 * nvml_internal.h: what nvml.c shares with the generated stubs (generated/nvml_stubs.c).
 */
#ifndef GP_NVML_INTERNAL_H
#define GP_NVML_INTERNAL_H

#include "nvml_types.h"

/* An NVML entry point of libnvidia-ml.so.1 (everything else is hidden). */
#define GP_NVML_EXPORT __attribute__((visibility("default")))

/* The answer of every function gpupool does not implement: NVML_ERROR_NOT_SUPPORTED once
 * initialised (NVML_ERROR_UNINITIALIZED before), with a debug line naming the function. */
nvmlReturn_t gp_nvml_unsupported(const char *name);

/* A stub: exported under NVML's name, arguments ignored (the C calling convention lets a
 * function that takes none be called with any). */
#define GP_NVML_STUB(name)                                                                         \
    GP_NVML_EXPORT nvmlReturn_t name(void);                                                        \
    GP_NVML_EXPORT nvmlReturn_t name(void)                                                         \
    {                                                                                              \
        return gp_nvml_unsupported(#name);                                                         \
    }

#endif
