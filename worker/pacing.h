/*
 * pacing.h: fair GPU time between the shares of one GPU (issue 32, item 4; pacing.c).
 *
 * Kept apart from worker.h so that a test can link pacing.c alone with the simulated device.
 */
#ifndef GP_WORKER_PACING_H
#define GP_WORKER_PACING_H

#include <stddef.h>
#include <stdint.h>

/* Environment of a worker of a shared GPU (gpupoold's supervisor sets them):
 *   GPUPOOL_WORKER_PACE_DIR     folder of the per-GPU records (absolute); unset: no pacing
 *   GPUPOOL_WORKER_PACE_GPU     the GPU's key there (its UUID: letters, digits, '-', up to 64)
 *   GPUPOOL_WORKER_SHARE_WEIGHT this share's weight, 1..1000 (default 1) */
#define WK_PACE_DIR_ENV "GPUPOOL_WORKER_PACE_DIR"
#define WK_PACE_GPU_ENV "GPUPOOL_WORKER_PACE_GPU"
#define WK_PACE_WEIGHT_ENV "GPUPOOL_WORKER_SHARE_WEIGHT"

/* Around every kernel launch. Begin may sleep: while another share of the GPU wants to launch and
 * this one has had more than its weight's part of the GPU's recent time. `drv_lib` is the driver's
 * dlopen handle (NULL: the process's own symbols), looked at once. End records the kernel's GPU
 * time and returns the nanoseconds the launch waited inside the simulated device for its turn on a
 * shared GPU (0 elsewhere), which the caller takes off its busy time. */
void wk_pace_launch_begin(void *drv_lib);
uint64_t wk_pace_launch_end(void);
/* The share was restored on another GPU (idle detach), whose UUID is uuid (len bytes, not
 * NUL-terminated): its GPU time counts in that GPU's record from its next launch. */
void wk_pace_move(const char *uuid, size_t len);

#endif /* GP_WORKER_PACING_H */
