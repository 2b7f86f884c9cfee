/*
 * sim_core.c: the base of the simulated driver: the global lock, the result of cuInit, the
 * calling thread's current context and error detail, the clock. It calls no other file of the
 * simulator but the handle table; cuInit, which starts the others, is in sim_init.c.
 */
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "sim_api.h"
#include "sim_internal.h"

struct sim_config sim_cfg;

/* Guards everything below and all state in the other files (see sim_internal.h). */
static pthread_mutex_t sim_mu = PTHREAD_MUTEX_INITIALIZER;
static CUresult init_rc = CUDA_ERROR_NOT_INITIALIZED; /* sim_init.c sets it, once */
static char init_error[512]; /* why configuration or cuInit failed, or "" */

/* Which simulated GPU each device ordinal of this process is (identity until a checkpoint is
 * restored onto other GPUs: sim_checkpoint.c). */
static int phys_of[SIM_MAX_DEVICES];

/* Per thread, as in the driver: the current context and the detail of the last error. */
static _Thread_local uint64_t tl_ctx;
static _Thread_local char tl_detail[512];

static void lock(void)
{
    int e = pthread_mutex_lock(&sim_mu);
    if (e != 0) {
        /* Only possible if the mutex is corrupt; going on would race on every structure. */
        fprintf(stderr, "gpupool-sim: pthread_mutex_lock failed (%d)\n", e);
        abort();
    }
}

static void unlock(void)
{
    int e = pthread_mutex_unlock(&sim_mu);
    if (e != 0) {
        fprintf(stderr, "gpupool-sim: pthread_mutex_unlock failed (%d)\n", e);
        abort();
    }
}

CUresult sim_leave(CUresult rc)
{
    unlock();
    return rc;
}

CUresult sim_enter(void)
{
    lock();
    tl_detail[0] = '\0';
    if (init_rc != CUDA_SUCCESS)
        return sim_leave(CUDA_ERROR_NOT_INITIALIZED);
    return CUDA_SUCCESS;
}

struct sim_ctx *sim_ctx_get(CUcontext h)
{
    struct sim_ctx *c = sim_handle_get((uint64_t)(uintptr_t)h, SIM_K_CTX);
    if (c && c->primary && !c->active)
        return NULL;
    return c;
}

CUresult sim_enter_ctx(struct sim_ctx **ctx)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    struct sim_ctx *c = sim_ctx_get((CUcontext)(uintptr_t)tl_ctx);
    if (!c)
        return sim_leave(CUDA_ERROR_INVALID_CONTEXT);
    if (c->sticky != CUDA_SUCCESS)
        return sim_leave(c->sticky);
    *ctx = c;
    return CUDA_SUCCESS;
}

void sim_detail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tl_detail, sizeof(tl_detail), fmt, ap);
    va_end(ap);
    if (n < 0)
        tl_detail[0] = '\0';
}

void sim_init_fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(init_error, sizeof(init_error), fmt, ap);
    va_end(ap);
    if (n < 0)
        snprintf(init_error, sizeof(init_error), "%s", "initialisation failed");
    fprintf(stderr, "gpupool-sim: %s\n", init_error);
}

const char *gpupoolSimLastErrorDetail(void)
{
    return tl_detail;
}

int sim_phys_dev(int dev)
{
    return phys_of[dev];
}

void sim_set_phys_dev(int dev, int phys)
{
    phys_of[dev] = phys;
}

int sim_lock_wait(unsigned timeout_ms)
{
    if (timeout_ms == 0)
        return pthread_mutex_lock(&sim_mu);
    struct timespec until;
    if (clock_gettime(CLOCK_REALTIME, &until) != 0)
        return errno;
    until.tv_sec += (time_t)(timeout_ms / 1000);
    until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    return pthread_mutex_timedlock(&sim_mu, &until);
}

void sim_lock_release(void)
{
    unlock();
}

/* Peers opened as devices of this process (sim_device.c cuDeviceGet, issue 37): ordinals
 * device_count .. device_count + opened_peers - 1, each naming its peer through phys_of. */
static int opened_peers;

bool sim_dev_valid(CUdevice dev)
{
    return dev >= 0 && dev < sim_cfg.device_count + opened_peers;
}

int sim_opened_peer(int phys)
{
    for (int d = sim_cfg.device_count; d < sim_cfg.device_count + opened_peers; d++)
        if (phys_of[d] == phys)
            return d;
    return -1;
}

int sim_next_peer_device(void)
{
    return sim_cfg.device_count + opened_peers;
}

void sim_add_opened_peer(int dev, int phys)
{
    phys_of[dev] = phys;
    opened_peers++;
}

uint64_t sim_now_ns(void)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0)
        return 0; /* cannot fail for CLOCK_MONOTONIC on Linux; 0 keeps callers defined */
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- for sim_init.c: cuInit and cuDriverGetVersion ----------------------------------------- */
void sim_enter_uninitialised(void)
{
    lock();
    tl_detail[0] = '\0';
}

void sim_set_init_result(CUresult rc)
{
    init_rc = rc;
}

CUresult sim_init_result(void)
{
    return init_rc;
}

void sim_detail_init_error(void)
{
    if (init_error[0])
        sim_detail("%s", init_error);
}

/* ---- the current context (used by sim_context.c) ----------------------------------------- */
uint64_t sim_current_ctx(void)
{
    return tl_ctx;
}
void sim_set_current_ctx(uint64_t h)
{
    tl_ctx = h;
}
