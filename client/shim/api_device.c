/*
 * api_device.c: the devices of a lease of several GPUs (issue 37): their snapshots, asked once at
 * the first cuInit (device_props: the client side of the worker's h_device.c), and the peer
 * questions answered from them.
 */
#include <pthread.h>

#include "shim.h"
#include "shim_core.h"

/* gp_check_dev's answer (api_init.c), here so that this file calls nothing of api_init.c. */
static CUresult check_dev(CUdevice dev)
{
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    return gp_device(dev) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

GP_EXPORT CUresult cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev)
{
    if (!canAccessPeer)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = check_dev(dev);
    if (r == CUDA_SUCCESS)
        r = check_dev(peerDev);
    if (r != CUDA_SUCCESS)
        return r;
    /* What the server's driver answered (device_props), 0 between a device and itself. */
    *canAccessPeer = gp_device_can_access_peer(dev, peerDev);
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuDeviceGetP2PAttribute(int *value, int attrib, /* CUdevice_P2PAttribute */
                                           CUdevice srcDevice, CUdevice dstDevice)
{
    if (!value || (int)attrib < 1 || (int)attrib > 4)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = check_dev(srcDevice);
    if (r == CUDA_SUCCESS)
        r = check_dev(dstDevice);
    if (r != CUDA_SUCCESS)
        return r;
    if (srcDevice == dstDevice)
        return CUDA_ERROR_INVALID_DEVICE; /* as the driver: a device is not its own peer */
    *value = gp_device_p2p_attribute(srcDevice, dstDevice, (int)attrib);
    return CUDA_SUCCESS;
}

void gp_devices_fetch(void)
{
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&lock);
    int n = gp_device_announced(), k = 0;
    for (k = 0; n > 1 && gp_device_count() < n && k < n; k++) {
        /* A spread lease: each device is asked of its part, by that worker's ordinal. */
        int part = gp_conn_part_of_device(k), first = k - gp_conn_local_device(k);
        gp_device_props m = {.device = k - first};
        GP_FRAME(buf, len, gp_device_props, &m);
        gp_reply rep = {0};
        gp_conn_route(part);
        CUresult r = buf ? gp_request(buf, len, NULL, 0, NULL, 0, &rep) : CUDA_ERROR_OUT_OF_MEMORY;
        gp_conn_route(-1);
        if (buf)
            GP_FRAME_FREE(buf);
        gp_device_props_reply pr;
        if (r == CUDA_SUCCESS && gp_device_props_reply_decode(rep.body, rep.len, &pr) != 0)
            r = CUDA_ERROR_INVALID_VALUE;
        if (r == CUDA_SUCCESS)
            gp_state_add_device(k, first, &pr);
        gp_reply_free(&rep);
        if (r != CUDA_SUCCESS) {
            gp_log_error("the server's lease has %d GPUs but device %d could not be read (error "
                         "%d); the program sees %d device(s)",
                         n, k, (int)r, k > 0 ? k : 1);
            break;
        }
    }
    if (n > 1 && k > 1)
        gp_state_devices_ready(k);
    pthread_mutex_unlock(&lock);
}
