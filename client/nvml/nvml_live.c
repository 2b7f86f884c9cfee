/*
 * nvml_live.c: the NVML queries of a device's live values (memory, utilisation, temperature,
 * power, energy, clocks, processes), answered from the values nvml.c keeps for the device and
 * refreshes when they are due (gp_nvml_enter_device); nvml_view.c reads them out of the info
 * reply in NVML's units.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "nvml_internal.h"
#include "nvml_view.h"

/* Device 0 of a lease with a memory quota (issue 32): its memory is the quota and what the
 * tenant holds of it, as the worker answers cuMemGetInfo through our libcuda.so.1
 * (gpupool_shim_memory_quota), so that NVML and CUDA agree by construction. 1 with the values
 * (d->ordinal read under the lock), 0 otherwise: the GPU's own values stand. */
static int lease_quota(const struct nvmlDevice_st *d, unsigned long long *used,
                       unsigned long long *total)
{
    if (d->ordinal != 0)
        return 0;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    void *sym = lib ? dlsym(lib, "gpupool_shim_memory_quota") : NULL;
    if (lib)
        dlclose(lib); /* the program holds the library: it stays loaded */
    int (*quota)(unsigned long long *, unsigned long long *);
    memcpy(&quota, &sym, sizeof quota); /* object pointer -> function pointer */
    unsigned long long fr = 0;
    if (!sym || quota(&fr, total) != 1 || fr > *total)
        return 0;
    *used = *total - fr;
    return 1;
}

GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t r = gp_nvml_enter_device(device, 1, &d);
    if (r != NVML_SUCCESS)
        return r;
    r = gp_nvml_memory(&d->gpu, memory);
    unsigned long long used, total;
    if (memory && (r == NVML_SUCCESS || r == NVML_ERROR_NOT_SUPPORTED) &&
        lease_quota(d, &used, &total)) {
        *memory = (nvmlMemory_t){.total = total, .used = used, .free = total - used};
        r = NVML_SUCCESS;
    }
    gp_nvml_leave();
    return r;
}

GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t r = gp_nvml_enter_device(device, 1, &d);
    if (r != NVML_SUCCESS)
        return r;
    r = gp_nvml_memory_v2(&d->gpu, memory);
    unsigned long long used, total;
    if ((r == NVML_SUCCESS || r == NVML_ERROR_NOT_SUPPORTED) && lease_quota(d, &used, &total)) {
        memory->total = total;
        memory->reserved = 0;
        memory->used = used;
        memory->free = total - used;
        r = NVML_SUCCESS;
    }
    gp_nvml_leave();
    return r;
}

GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device,
                                                          nvmlUtilization_t *utilization)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t r = gp_nvml_enter_device(device, 1, &d);
    if (r != NVML_SUCCESS)
        return r;
    r = gp_nvml_utilization(&d->gpu, utilization);
    gp_nvml_leave();
    return r;
}

GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device,
                                                     nvmlTemperatureSensors_t sensor,
                                                     unsigned int *temp)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t r = gp_nvml_enter_device(device, 1, &d);
    if (r != NVML_SUCCESS)
        return r;
    r = gp_nvml_temperature(&d->gpu, (int)sensor, temp);
    gp_nvml_leave();
    return r;
}

GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t r = gp_nvml_enter_device(device, 1, &d);
    if (r != NVML_SUCCESS)
        return r;
    r = gp_nvml_power_usage(&d->gpu, power);
    gp_nvml_leave();
    return r;
}

GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device,
                                                            unsigned int *limit)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t r = gp_nvml_enter_device(device, 1, &d);
    if (r != NVML_SUCCESS)
        return r;
    r = gp_nvml_power_limit(&d->gpu, limit);
    gp_nvml_leave();
    return r;
}

GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t device,
                                                              unsigned int *limit)
{
    return nvmlDeviceGetEnforcedPowerLimit(device, limit);
}

GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t device,
                                                                unsigned long long *energy)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t r = gp_nvml_enter_device(device, 1, &d);
    if (r != NVML_SUCCESS)
        return r;
    r = gp_nvml_energy(&d->gpu, energy);
    gp_nvml_leave();
    return r;
}

GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, nvmlClockType_t type,
                                                   unsigned int *clock)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t r = gp_nvml_enter_device(device, 1, &d);
    if (r != NVML_SUCCESS)
        return r;
    r = gp_nvml_clock(&d->gpu, (int)type, 0, clock);
    gp_nvml_leave();
    return r;
}

GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t device, nvmlClockType_t type,
                                                      unsigned int *clock)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t r = gp_nvml_enter_device(device, 1, &d);
    if (r != NVML_SUCCESS)
        return r;
    r = gp_nvml_clock(&d->gpu, (int)type, 1, clock);
    gp_nvml_leave();
    return r;
}

static nvmlReturn_t compute_procs(nvmlDevice_t device, unsigned *count, void *infos, int version)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t r = gp_nvml_enter_device(device, 1, &d);
    if (r != NVML_SUCCESS)
        return r;
    r = gp_nvml_processes(&d->gpu, count, infos, version);
    unsigned long long used, total;
    if (r == NVML_SUCCESS && infos && lease_quota(d, &used, &total)) {
        /* This process on its share: what it holds of its quota, not the GPU's whole use. */
        for (unsigned i = 0; i < *count; i++) {
            if (version == 1 && ((nvmlProcessInfo_v1_t *)infos)[i].pid == (unsigned)getpid())
                ((nvmlProcessInfo_v1_t *)infos)[i].usedGpuMemory = used;
            else if (version != 1 && ((nvmlProcessInfo_t *)infos)[i].pid == (unsigned)getpid())
                ((nvmlProcessInfo_t *)infos)[i].usedGpuMemory = used;
        }
    }
    gp_nvml_leave();
    return r;
}

GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device,
                                                                    unsigned int *infoCount,
                                                                    nvmlProcessInfo_t *infos)
{
    return compute_procs(device, infoCount, infos, 3);
}
GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device,
                                                                    unsigned int *infoCount,
                                                                    nvmlProcessInfo_t *infos)
{
    return compute_procs(device, infoCount, infos, 2);
}
GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device,
                                                                 unsigned int *infoCount,
                                                                 nvmlProcessInfo_v1_t *infos)
{
    return compute_procs(device, infoCount, infos, 1);
}

/* No graphics contexts run on gpupool's GPUs for clients. */
static nvmlReturn_t no_procs(nvmlDevice_t device, unsigned *count)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t r = gp_nvml_enter_device(device, 0, &d);
    if (r != NVML_SUCCESS)
        return r;
    if (!count)
        r = NVML_ERROR_INVALID_ARGUMENT;
    else
        *count = 0;
    gp_nvml_leave();
    return r;
}

GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device,
                                                                     unsigned int *infoCount,
                                                                     nvmlProcessInfo_t *infos)
{
    (void)infos;
    return no_procs(device, infoCount);
}
GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t device,
                                                                     unsigned int *infoCount,
                                                                     nvmlProcessInfo_t *infos)
{
    (void)infos;
    return no_procs(device, infoCount);
}
GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t device,
                                                                  unsigned int *infoCount,
                                                                  nvmlProcessInfo_v1_t *infos)
{
    (void)infos;
    return no_procs(device, infoCount);
}
