/*
 * sim_device.c: device enumeration and properties, all from the configuration (sim_config.c).
 */
#include <stdio.h>
#include <string.h>

#include "sim_api.h"
#include "sim_internal.h"

CUresult cuDeviceGetCount(int *count)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!count)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    *count = sim_cfg.device_count;
    return sim_leave(CUDA_SUCCESS);
}

/* Peer `phys` as a device of this process, opened (its primary context made) the first time;
 * -1 when the process holds SIM_MAX_DEVICES already. */
static int open_peer(int phys)
{
    int d = sim_opened_peer(phys);
    if (d >= 0)
        return d;
    d = sim_next_peer_device();
    if (d >= SIM_MAX_DEVICES || sim_ctx_create_primary(d) != CUDA_SUCCESS)
        return -1;
    sim_add_opened_peer(d, phys);
    return d;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!device)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    if (ordinal >= sim_cfg.device_count && ordinal < sim_phys_count(&sim_cfg)) {
        /* A peer GPU (ordinal device_count + k is peer k; gpupoold's device_ordinal says the
         * same): opened as one more device of this process, for a lease of several GPUs whose
         * worker holds them all (issue 37). The device handle is its ordinal in this process. */
        int d = open_peer(ordinal);
        if (d < 0) {
            sim_detail("cuDeviceGet: a process of the simulated device holds at most %d devices",
                       SIM_MAX_DEVICES);
            return sim_leave(CUDA_ERROR_INVALID_DEVICE);
        }
        *device = d;
        return sim_leave(CUDA_SUCCESS);
    }
    if (!sim_dev_valid(ordinal))
        return sim_leave(CUDA_ERROR_INVALID_DEVICE);
    *device = ordinal;
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!name || len <= 0)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    if (!sim_dev_valid(dev))
        return sim_leave(CUDA_ERROR_INVALID_DEVICE);
    /* Like the driver: as much of the name as fits, always NUL-terminated. */
    size_t n = strlen(sim_cfg.name);
    if (n > (size_t)len - 1)
        n = (size_t)len - 1;
    memcpy(name, sim_cfg.name, n);
    name[n] = '\0';
    return sim_leave(CUDA_SUCCESS);
}

static CUresult get_uuid(CUuuid *uuid, CUdevice dev)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!uuid)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    if (!sim_dev_valid(dev))
        return sim_leave(CUDA_ERROR_INVALID_DEVICE);
    /* Devices must differ; the configured UUID is device 0's. An ordinal restored onto another
     * GPU (sim_checkpoint.c), a peer included, is that GPU. */
    unsigned char u[16];
    sim_phys_uuid(&sim_cfg, sim_phys_dev(dev), u);
    memcpy(uuid->bytes, u, 16);
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
    return get_uuid(uuid, dev);
}
CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)
{
    return get_uuid(uuid, dev);
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!bytes)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    if (!sim_dev_valid(dev))
        return sim_leave(CUDA_ERROR_INVALID_DEVICE);
    *bytes = (size_t)sim_cfg.total_memory;
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!pi || attrib < 1 || attrib >= CU_DEVICE_ATTRIBUTE_MAX)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    if (!sim_dev_valid(dev))
        return sim_leave(CUDA_ERROR_INVALID_DEVICE);
    *pi = sim_config_attr(&sim_cfg, sim_phys_dev(dev), attrib);
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!pciBusId || len <= 0)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    if (!sim_dev_valid(dev))
        return sim_leave(CUDA_ERROR_INVALID_DEVICE);
    /* domain:bus:device.function in hex, 13 bytes with the NUL; truncated to len like the
     * driver does. */
    char buf[32];
    int n = snprintf(
        buf, sizeof(buf), "%04x:%02x:%02x.0",
        (unsigned)sim_config_attr(&sim_cfg, sim_phys_dev(dev), CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID),
        (unsigned)sim_config_attr(&sim_cfg, sim_phys_dev(dev), CU_DEVICE_ATTRIBUTE_PCI_BUS_ID),
        (unsigned)sim_config_attr(&sim_cfg, sim_phys_dev(dev), CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID));
    if (n < 0)
        return sim_leave(CUDA_ERROR_UNKNOWN);
    size_t k = strlen(buf);
    if (k > (size_t)len - 1)
        k = (size_t)len - 1;
    memcpy(pciBusId, buf, k);
    pciBusId[k] = '\0';
    return sim_leave(CUDA_SUCCESS);
}

/* Peers (issue 37): the devices of one simulated process share its memory, so each reaches
 * every other, as GPUs on one NVLink switch do; a device is not its own peer (the driver
 * answers 0 for it). */
CUresult cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!canAccessPeer)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    if (!sim_dev_valid(dev) || !sim_dev_valid(peerDev))
        return sim_leave(CUDA_ERROR_INVALID_DEVICE);
    *canAccessPeer = dev != peerDev;
    return sim_leave(CUDA_SUCCESS);
}

/* Attributes 1..4: performance rank 0 (the best link), access, native atomics and CUDA array
 * access supported. The driver refuses a device paired with itself. */
CUresult cuDeviceGetP2PAttribute(int *value, int attrib, CUdevice srcDevice, CUdevice dstDevice)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!value || attrib < 1 || attrib > 4)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    if (!sim_dev_valid(srcDevice) || !sim_dev_valid(dstDevice) || srcDevice == dstDevice)
        return sim_leave(CUDA_ERROR_INVALID_DEVICE);
    *value = attrib == 1 ? 0 : 1;
    return sim_leave(CUDA_SUCCESS);
}
