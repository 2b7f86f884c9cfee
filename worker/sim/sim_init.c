/*
 * sim_init.c: cuInit, which reads the configuration and starts the simulator's parts (memory,
 * the primary contexts, the checkpoint listener), and cuDriverGetVersion, which works before it.
 * Above every other file of the simulator: nothing calls into this one.
 */
#include <stdbool.h>

#include "sim_api.h"
#include "sim_internal.h"

/* Guarded by the simulator's lock (sim_core.c). */
static bool cfg_loaded;
static CUresult cfg_rc;
static bool init_done;

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
    sim_enter_uninitialised();
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
            sim_set_phys_dev(d, d);
        if (rc == CUDA_SUCCESS)
            sim_checkpoint_listen(); /* a failure is said on stderr; the rest works without it */
        sim_set_init_result(rc);
    }
    CUresult rc = sim_init_result();
    if (rc != CUDA_SUCCESS)
        sim_detail_init_error();
    return sim_leave(rc);
}

CUresult cuDriverGetVersion(int *driverVersion)
{
    if (!driverVersion)
        return CUDA_ERROR_INVALID_VALUE;
    sim_enter_uninitialised();
    CUresult rc = ensure_config();
    if (rc == CUDA_SUCCESS)
        *driverVersion = sim_cfg.driver_version;
    else
        sim_detail_init_error();
    return sim_leave(rc);
}
