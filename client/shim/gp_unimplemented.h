/*
 * gp_unimplemented.h: what a driver function the shim does not implement answers.
 *
 * The generated weak stubs (generated/gp_stubs.c) call gp_unimplemented() for every exported
 * name without a hand-written definition. Libraries such as cuBLASLt dlsym() many names they
 * never call, so the names must exist; a program that does call one learns which name failed.
 */
#ifndef GP_UNIMPLEMENTED_H
#define GP_UNIMPLEMENTED_H

#include "gp_cuda.h"

/* Logs "gpupool: NAME is not implemented by the gpupool shim (returned
 * CUDA_ERROR_NOT_SUPPORTED); please report it" to stderr the first time NAME is seen (unless
 * GPUPOOL_LOG=quiet) and returns CUDA_ERROR_NOT_SUPPORTED. Thread-safe. `name` must point to
 * storage that lives as long as the process (a string literal): it is remembered, not copied. */
CUresult gp_unimplemented(const char *name);

#endif /* GP_UNIMPLEMENTED_H */
