/*
 * h_device.c: device_props, what the hello reply says of device 0 for each other device of a
 * lease of several GPUs (issue 37), with the rows of the peer matrices the driver answers. The
 * client asks for each once, at connect, and answers device queries locally from then on.
 */
#include <string.h>

#include "worker.h"

WK_HANDLER(device_props)
{
    gp_device_props_reply r = {0};
    if (m->device < 0 || m->device >= w->ndev) {
        r.result = CUDA_ERROR_INVALID_DEVICE;
        WK_REPLY(w, req, gp_device_props_reply, &r);
        return;
    }
    int d = m->device;
    CUdevice dev = w->devs[d];
    /* Limits and the priority range are read in the device's primary context. */
    CUcontext back = w->cur_ctx ? wk_ctx_handle(w, w->cur_ctx) : NULL;
    CUresult rc = w->drv.cuCtxSetCurrent(w->prims[d]);
    if (rc != CUDA_SUCCESS) {
        r.result = rc;
        WK_REPLY(w, req, gp_device_props_reply, &r);
        return;
    }
    static struct wk_snapshot s; /* 2.6 KiB: off the stack; one handler runs at a time */
    wk_snapshot_take(w, dev, &s);
    rc = w->drv.cuCtxSetCurrent(back);
    if (rc != CUDA_SUCCESS)
        wk_warn("restoring the current context after a device snapshot: %s", wk_err_name(w, rc));

    CUmemAllocationProp prop = {0};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    size_t gran = 0;
    if (w->drv.cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) !=
        CUDA_SUCCESS)
        gran = (size_t)w->gran;

    uint8_t peers[4 * WK_MAX_DEVICES], p2p[4 * 4 * WK_MAX_DEVICES];
    memset(p2p, 0, sizeof p2p);
    for (int p = 0; p < w->ndev; p++) {
        gp_wr_u32(peers + 4 * p, w->peer[d][p]);
        for (int a = 1; a <= 4 && p != d; a++) {
            int v = 0;
            if (DRV(w, cuDeviceGetP2PAttribute, &v, a, dev, w->devs[p]) != CUDA_SUCCESS)
                v = 0;
            gp_wr_u32(p2p + 4 * (4 * p + a - 1), (uint32_t)v);
        }
    }
    r.name = s.name;
    r.name_len = (uint32_t)strlen(s.name);
    memcpy(r.uuid, s.uuid, 16);
    r.total_mem = s.total_mem;
    r.pci_domain = gp_arr_i32(s.attrs, CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID);
    r.pci_bus = gp_arr_i32(s.attrs, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID);
    r.pci_device = gp_arr_i32(s.attrs, CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID);
    r.attributes = s.attrs;
    r.attributes_count = CU_DEVICE_ATTRIBUTE_MAX;
    r.limits = s.limits;
    r.limits_count = CU_LIMIT_MAX;
    r.granularity = gran;
    r.can_access_peer = peers;
    r.can_access_peer_count = (uint32_t)w->ndev;
    r.p2p_attributes = p2p;
    r.p2p_attributes_count = (uint32_t)(4 * w->ndev);
    WK_REPLY(w, req, gp_device_props_reply, &r);
}
