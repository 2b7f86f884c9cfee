/*
 * hooks.c: what the shim core answers to code outside it: the NVML shim and `gpupool doctor`
 * (gpupool_shim_version, gpupool_shim_lease, found by dlsym / ctypes), the export tables and the
 * integrity check (export_tables.h, integrity.h: the hooks they declare and the core defines).
 * Each answer joins the local state (state.c) with the connection's status (conn.c).
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "export_tables.h"
#include "integrity.h"
#include "shim.h"
#include "shim_core.h"

/* ---- for the NVML shim and `gpupool doctor` (docs/architecture.md, "Server selection") ---- */

#ifndef GPUPOOL_VERSION
#error "GPUPOOL_VERSION must be defined (shim.mk passes the version of client/gpupool/__init__.py)"
#endif

GP_EXPORT const char *gpupool_shim_version(void)
{
    return GPUPOOL_VERSION;
}

/* This process's lease (libnvidia-ml.so.1 and `gpupool doctor` ask, by dlsym / ctypes): 1 with
 * its server ("host:port" as connected), the GPU's UUID ("GPU-...") and name, the session id and
 * whether the GPU is simulated, each string NUL-terminated, valid UTF-8 and cut to its buffer;
 * 0 (nothing written) when this library holds no lease. Plain arguments rather than a struct or
 * a text format: the callers need no copy of any layout. */
GP_EXPORT int gpupool_shim_lease(char *server, size_t server_cap, char *uuid, size_t uuid_cap,
                                 char *name, size_t name_cap, unsigned long long *session,
                                 int *simulated)
{
    const gp_device_snapshot *d = gp_device(0);
    if (!d || gp_check_init() != CUDA_SUCCESS)
        return 0;
    const uint8_t *u = (const uint8_t *)d->uuid.bytes;
    snprintf(uuid, uuid_cap,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1],
             u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14],
             u[15]);
    gp_utf8_clean(server, server_cap, gp_conn_server(), strlen(gp_conn_server()));
    gp_utf8_clean(name, name_cap, d->name, strnlen(d->name, sizeof d->name));
    *session = (unsigned long long)gp_session_id();
    *simulated = d->simulated ? 1 : 0;
    return 1;
}

/* This process's memory quota on a shared GPU (issue 32; libnvidia-ml.so.1 asks, by dlsym): 1
 * with the worker's cuMemGetInfo answer for device 0 (total = the quota, free = what is left of
 * it), so that NVML says what CUDA says; 0 when the lease has no quota, or the request failed.
 * Needs no current context (the worker answers from its own). */
GP_EXPORT int gpupool_shim_memory_quota(unsigned long long *free_bytes, unsigned long long *total)
{
    const gp_device_snapshot *d = gp_device(0);
    if (!d || gp_check_init() != CUDA_SUCCESS || d->memory_quota == 0)
        return 0;
    gp_mem_get_info m = {0};
    GP_FRAME(buf, len, gp_mem_get_info, &m);
    if (!buf)
        return 0;
    gp_reply rep;
    gp_conn_route(0); /* device 0's part, whatever context the thread last used */
    CUresult r = gp_request(buf, len, NULL, 0, NULL, 0, &rep);
    gp_conn_route(-1);
    GP_FRAME_FREE(buf);
    if (r != CUDA_SUCCESS)
        return 0;
    gp_mem_get_info_reply a;
    int ok = gp_mem_get_info_reply_decode(rep.body, rep.len, &a) == 0 && a.result == 0;
    gp_reply_free(&rep);
    if (!ok)
        return 0;
    *free_bytes = a.free;
    *total = a.total;
    return 1;
}

/* ---- hooks for the export tables and the integrity check ---------------------------------- */

int gp_integrity_driver_version(void)
{
    return gp_reported_driver_version();
}

int gp_integrity_devices(CUuuid *uuids, int *pci_domain, int *pci_bus, int *pci_dev, int max)
{
    if (gp_check_init() != CUDA_SUCCESS)
        return -1;
    int n = gp_device_count();
    if (n > max)
        n = max;
    for (int i = 0; i < n; i++) {
        const gp_device_snapshot *d = gp_device(i);
        uuids[i] = d->uuid;
        pci_domain[i] = d->pci_domain;
        pci_bus[i] = d->pci_bus;
        pci_dev[i] = d->pci_device;
    }
    return n;
}

CUcontext gp_ctx_current_for_tables(void)
{
    return (CUcontext)(uintptr_t)gp_ctx_current();
}

CUcontext gp_ctx_primary_for_tables(int dev)
{
    return gp_device(dev) ? (CUcontext)(uintptr_t)GP_PRIMARY_CTX_OF(dev) : NULL;
}
