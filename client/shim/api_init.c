/*
 * api_init.c: initialisation, versions, errors and devices, answered from the snapshot the
 * server sent with its hello; contexts are in api_ctx.c (the worker's h_ctx.c).
 */
#include <ctype.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "export_tables.h"
#include "generated/gp_cuda_tables.h"
#include "shim.h"
#include "shim_core.h"

/* From generated/gp_errors.c; weak so that the core links without the tables. */
const char *gp_cuda_error_name(CUresult err) __attribute__((weak));
const char *gp_cuda_error_string(CUresult err) __attribute__((weak));

CUresult gp_check_dev(CUdevice dev)
{
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    return gp_device(dev) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

/* ============================================================ init and versions == */

GP_EXPORT CUresult cuInit(unsigned int flags)
{
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_conn_init();
    if (r == CUDA_SUCCESS && gp_device_announced() > gp_device_count())
        gp_devices_fetch();
    return r;
}

/* The real driver answers without cuInit, and cudart asks right before cuInit: we connect here
 * already (cuInit would a moment later anyway), so the version is the server driver's. When no
 * server can be reached we report GP_FALLBACK_DRIVER_VERSION (13000): cudart then calls cuInit,
 * which fails with CUDA_ERROR_NO_DEVICE after one line saying why. */
GP_EXPORT CUresult cuDriverGetVersion(int *driverVersion)
{
    if (!driverVersion)
        return CUDA_ERROR_INVALID_VALUE;
    if (!gp_conn_attempted())
        gp_conn_ensure();
    *driverVersion = gp_reported_driver_version();
    static atomic_int said;
    if (!atomic_exchange(&said, 1))
        gp_log_debug("cuDriverGetVersion -> %d%s", *driverVersion,
                     gp_device_count() ? " (the server's driver)" : " (no server)");
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuGetErrorName(CUresult error, const char **pStr)
{
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    *pStr = gp_cuda_error_name ? gp_cuda_error_name(error) : NULL;
    return *pStr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

GP_EXPORT CUresult cuGetErrorString(CUresult error, const char **pStr)
{
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    *pStr = gp_cuda_error_string ? gp_cuda_error_string(error) : NULL;
    return *pStr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* Lazy loading: a module crosses the network only when a kernel of it is first used.
 * CUDA_MODULE_LOADING=EAGER asks for the other mode. */
GP_EXPORT CUresult cuModuleGetLoadingMode(CUmoduleLoadingMode *mode)
{
    if (!mode)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    const char *env = getenv("CUDA_MODULE_LOADING");
    *mode = env && strcasecmp(env, "EAGER") == 0 ? CU_MODULE_EAGER_LOADING : CU_MODULE_LAZY_LOADING;
    return CUDA_SUCCESS;
}

/* The driver's own log messages: we produce none, so a callback is accepted and never called. */
GP_EXPORT CUresult cuLogsRegisterCallback(CUlogsCallback callbackFunc, void *userData,
                                          CUlogsCallbackHandle *callback_out)
{
    (void)userData;
    if (!callbackFunc)
        return CUDA_ERROR_INVALID_VALUE;
    if (callback_out)
        *callback_out = (CUlogsCallbackHandle)(uintptr_t)0x1;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuLogsUnregisterCallback(CUlogsCallbackHandle callback)
{
    (void)callback;
    return CUDA_SUCCESS;
}

/* =============================================================== device queries == */

GP_EXPORT CUresult cuDeviceGetCount(int *count)
{
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    *count = gp_device_count();
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_check_dev(ordinal);
    if (r != CUDA_SUCCESS)
        return r;
    *device = ordinal;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    if (!name || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_check_dev(dev);
    if (r != CUDA_SUCCESS)
        return r;
    snprintf(name, (size_t)len, "%s", gp_device(dev)->name);
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
    if (!uuid)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_check_dev(dev);
    if (r != CUDA_SUCCESS)
        return r;
    *uuid = gp_device(dev)->uuid;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)
{
    return cuDeviceGetUuid(uuid, dev);
}

GP_EXPORT CUresult cuDeviceGetLuid(char *luid, unsigned int *deviceNodeMask, CUdevice dev)
{
    (void)luid, (void)deviceNodeMask, (void)dev;
    return CUDA_ERROR_NOT_SUPPORTED; /* a Windows (WDDM) notion */
}

GP_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_check_dev(dev);
    if (r != CUDA_SUCCESS)
        return r;
    const gp_device_snapshot *d = gp_device(dev);
    /* A share of a GPU (issue 32) is a GPU of its quota's size, as cuMemGetInfo and NVML say. */
    *bytes = (size_t)(d->memory_quota ? d->memory_quota : d->total_mem);
    return CUDA_SUCCESS;
}

/* The CUDA 3.1 signature (32-bit size). */
GP_EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev)
{
    size_t b;
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = cuDeviceTotalMem_v2(&b, dev);
    if (r == CUDA_SUCCESS)
        *bytes = b > UINT_MAX ? UINT_MAX : (unsigned int)b;
    return r;
}

GP_EXPORT CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)
{
    if (!pi)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_check_dev(dev);
    if (r != CUDA_SUCCESS)
        return r;
    const gp_device_snapshot *d = gp_device(dev);
    if (attrib <= 0 || attrib >= d->attribute_count)
        return CUDA_ERROR_INVALID_VALUE;
    *pi = d->attributes[attrib];
    return CUDA_SUCCESS;
}

static int attr(const gp_device_snapshot *d, int a)
{
    return a > 0 && a < d->attribute_count ? d->attributes[a] : 0;
}

GP_EXPORT CUresult cuDeviceComputeCapability(int *major, int *minor, CUdevice dev)
{
    if (!major || !minor)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_check_dev(dev);
    if (r != CUDA_SUCCESS)
        return r;
    *major = attr(gp_device(dev), CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
    *minor = attr(gp_device(dev), CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuDeviceGetProperties(CUdevprop *prop, CUdevice dev)
{
    if (!prop)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_check_dev(dev);
    if (r != CUDA_SUCCESS)
        return r;
    const gp_device_snapshot *d = gp_device(dev);
    prop->maxThreadsPerBlock = attr(d, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK);
    prop->maxThreadsDim[0] = attr(d, CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X);
    prop->maxThreadsDim[1] = attr(d, CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y);
    prop->maxThreadsDim[2] = attr(d, CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z);
    prop->maxGridSize[0] = attr(d, CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X);
    prop->maxGridSize[1] = attr(d, CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y);
    prop->maxGridSize[2] = attr(d, CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z);
    prop->sharedMemPerBlock = attr(d, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK);
    prop->totalConstantMemory = attr(d, CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY);
    prop->SIMDWidth = attr(d, CU_DEVICE_ATTRIBUTE_WARP_SIZE);
    prop->memPitch = attr(d, CU_DEVICE_ATTRIBUTE_MAX_PITCH);
    prop->regsPerBlock = attr(d, CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK);
    prop->clockRate = attr(d, CU_DEVICE_ATTRIBUTE_CLOCK_RATE);
    prop->textureAlign = attr(d, CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT);
    return CUDA_SUCCESS;
}

/* "0000:3B:00.0": four hex digits of domain, then bus and device, upper case, function 0. */
GP_EXPORT CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev)
{
    if (!pciBusId || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_check_dev(dev);
    if (r != CUDA_SUCCESS)
        return r;
    const gp_device_snapshot *d = gp_device(dev);
    snprintf(pciBusId, (size_t)len, "%04X:%02X:%02X.0", (unsigned)d->pci_domain,
             (unsigned)d->pci_bus, (unsigned)d->pci_device);
    return CUDA_SUCCESS;
}

/* Accepts "domain:bus:device.function" and "bus:device.function", hex, any case. */
GP_EXPORT CUresult cuDeviceGetByPCIBusId(CUdevice *dev, const char *pciBusId)
{
    if (!dev || !pciBusId)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    unsigned v[4];
    int n = 0;
    const char *p = pciBusId;
    while (n < 4) {
        char *end;
        unsigned long x = strtoul(p, &end, 16);
        if (end == p)
            break;
        v[n++] = (unsigned)x;
        p = end;
        if (*p == ':' || *p == '.')
            p++;
        else
            break;
    }
    unsigned domain, bus, device;
    if (n == 4 || (n == 3 && strchr(pciBusId, '.') == NULL)) {
        domain = v[0], bus = v[1], device = v[2];
    } else if (n == 3) {
        domain = 0, bus = v[0], device = v[1];
    } else {
        return CUDA_ERROR_INVALID_VALUE;
    }
    for (int i = 0; i < gp_device_count(); i++) {
        const gp_device_snapshot *d = gp_device(i);
        if ((unsigned)d->pci_domain == domain && (unsigned)d->pci_bus == bus &&
            (unsigned)d->pci_device == device) {
            *dev = i;
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_INVALID_DEVICE;
}

/* Memory pools are not remoted: one dummy pool per device, which cuMemAllocFromPoolAsync and
 * cuDeviceSetMemPool accept as "the default pool". */
static atomic_uint_fast64_t default_pool;

uint64_t gp_default_mempool(void)
{
    uint64_t p = atomic_load(&default_pool);
    if (p)
        return p;
    uint64_t h = gp_handle_new(GP_H_MEMPOOL, NULL);
    uint64_t expected = 0;
    if (!atomic_compare_exchange_strong(&default_pool, &expected, h)) {
        gp_handle_remove(h, GP_H_MEMPOOL);
        return expected;
    }
    return h;
}

GP_EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev)
{
    if (!pool_out)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_check_dev(dev);
    if (r != CUDA_SUCCESS)
        return r;
    *pool_out = (CUmemoryPool)(uintptr_t)gp_default_mempool();
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev)
{
    return cuDeviceGetDefaultMemPool(pool, dev);
}
