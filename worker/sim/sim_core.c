/*
 * sim_core.c: initialisation, the global lock, the calling thread's current context and error
 * detail, and the few entry points that work before cuInit (cuDriverGetVersion, the detail).
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
static bool cfg_loaded;
static CUresult cfg_rc;
static bool init_done;
static CUresult init_rc = CUDA_ERROR_NOT_INITIALIZED;
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

bool sim_dev_valid(CUdevice dev)
{
    return dev >= 0 && dev < sim_cfg.device_count;
}

uint64_t sim_now_ns(void)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0)
        return 0; /* cannot fail for CLOCK_MONOTONIC on Linux; 0 keeps callers defined */
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The configuration is read once per process, by cuInit or cuDriverGetVersion, whichever runs
 * first; a failure is remembered like the driver remembers a failed cuInit. */
static CUresult ensure_config(void)
{
    if (!cfg_loaded) {
        cfg_rc = sim_config_load(&sim_cfg);
        cfg_loaded = true;
    }
    return cfg_rc;
}

CUresult cuInit(unsigned int Flags)
{
    if (Flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    lock();
    tl_detail[0] = '\0';
    if (!init_done) {
        init_done = true;
        CUresult rc = ensure_config();
        if (rc == CUDA_SUCCESS && sim_cfg.device_count == 0)
            rc = CUDA_ERROR_NO_DEVICE;
        if (rc == CUDA_SUCCESS)
            rc = sim_memory_init();
        if (rc == CUDA_SUCCESS)
            rc = sim_ctx_create_primaries();
        for (int d = 0; d < SIM_MAX_DEVICES; d++)
            phys_of[d] = d;
        if (rc == CUDA_SUCCESS)
            sim_checkpoint_listen(); /* a failure is said on stderr; the rest works without it */
        init_rc = rc;
    }
    if (init_rc != CUDA_SUCCESS && init_error[0])
        sim_detail("%s", init_error);
    return sim_leave(init_rc);
}

CUresult cuDriverGetVersion(int *driverVersion)
{
    if (!driverVersion)
        return CUDA_ERROR_INVALID_VALUE;
    lock();
    tl_detail[0] = '\0';
    CUresult rc = ensure_config();
    if (rc == CUDA_SUCCESS)
        *driverVersion = sim_cfg.driver_version;
    else if (init_error[0])
        sim_detail("%s", init_error);
    return sim_leave(rc);
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
