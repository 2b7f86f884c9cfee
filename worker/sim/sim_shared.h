/*
 * sim_shared.h: a simulated GPU shared by several processes (key shared_dir, sim_shared.c).
 *
 * Without shared_dir every process simulating a GPU believes it has the whole of it. With it,
 * every process simulating the same GPU (same UUID) takes that GPU's memory from one allocator
 * and runs its kernels in turns with the others, as the contexts of several processes on one
 * real GPU do. All of these expect the sim lock (sim_internal.h) to be held; `phys` is a
 * physical GPU (sim_phys_dev).
 */
#ifndef GP_SIM_SHARED_H
#define GP_SIM_SHARED_H

#include <stdbool.h>
#include <stdint.h>

#include "gp_cuda.h"

bool sim_shared_enabled(void);
/* cuInit, before the memory file is opened: with shared_dir and no memory_file, the memory file
 * becomes <shared_dir>/gpu-<UUID of device 0>.mem (every process of the GPU must map the same
 * bytes); then opens (creating if missing) the shared state of the process's devices and claims a
 * slot in each. A failure is said through sim_init_fail. CUDA_SUCCESS without shared_dir. */
CUresult sim_shared_init(void);

/* The allocator of GPU phys's part of the memory file, shared by every process of the GPU. Offsets
 * are relative to the part (0 .. its usable size). Ranges of processes that died are taken back
 * first (their bytes stay as they were, as in a GPU's DRAM). */
CUresult sim_shared_alloc(int phys, uint64_t len, uint64_t *rel_off);
void sim_shared_free(int phys, uint64_t rel_off);
/* Bytes of GPU phys held by all live processes together. */
uint64_t sim_shared_used(int phys);

/* A kernel of GPU phys runs between these two: one process's kernel at a time. */
void sim_shared_turn_begin(int phys);
void sim_shared_turn_end(int phys);

#endif /* GP_SIM_SHARED_H */
