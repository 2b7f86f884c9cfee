/*
 * devices.c: the lease's devices when it has several (issue 37). Device 0 is the worker's own
 * (--device: w->dev, w->primary, opened by session.c before any client); the others are opened
 * when the session starts, each with its retained primary context, so that the program's
 * contexts, streams and allocations on device k live on that GPU of the server. All of them
 * share the one VA window: pointers of different devices never overlap, and memory is made
 * accessible to every device the driver says can access it as a peer, so copies between devices
 * run on the server at the GPUs' own speed.
 */
#include <stdio.h>

#include "worker.h"

int wk_ctx_device(struct worker *w, uint64_t ctx)
{
    int k = wk_primary_index(w, ctx);
    if (k > 0 || ctx == 0 || wk_ctx_canon(ctx) == WK_PRIMARY_CTX_ID)
        return k;
    struct wk_obj *o = wk_idmap_get(&w->ctxs, ctx);
    return o && o->kind < (uint32_t)w->ndev ? (int)o->kind : 0;
}

int wk_cur_device(struct worker *w)
{
    return wk_ctx_device(w, w->cur_ctx);
}

size_t wk_access_descs(const struct worker *w, int dev, CUmemAccessDesc *out)
{
    size_t n = 0;
    int ndev = w->ndev > 0 ? w->ndev : 1;
    for (int k = 0; k < ndev; k++) {
        if (k != dev && !w->peer[k][dev])
            continue;
        out[n].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        out[n].location.id = k == 0 ? w->dev : w->devs[k];
        out[n].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        n++;
    }
    return n;
}

int wk_devices_open(struct worker *w, const struct wk_options *o, int32_t *code, char *err,
                    size_t errlen)
{
    w->ndev = 1;
    w->devs[0] = w->dev;
    w->prims[0] = w->primary;
    if (o->ndevices <= 1)
        return 0;
    if (o->devices[0] != o->ordinal) {
        *code = GP_EREFUSED;
        snprintf(err, errlen,
                 "the lease's first device is GPU %d but this worker serves GPU %d; gpupoold and "
                 "gpupool-worker do not match: reinstall gpupool",
                 o->devices[0], o->ordinal);
        return -1;
    }
    for (int k = 1; k < o->ndevices && k < WK_MAX_DEVICES; k++) {
        CUresult rc = w->drv.cuDeviceGet(&w->devs[k], o->devices[k]);
        if (rc == CUDA_SUCCESS)
            rc = w->drv.cuDevicePrimaryCtxRetain(&w->prims[k], w->devs[k]);
        if (rc != CUDA_SUCCESS) {
            *code = rc;
            snprintf(err, errlen, "GPU %d of the lease (device %d) is not available: %s",
                     o->devices[k], k, wk_err_name(w, rc));
            return -1;
        }
        w->ndev = k + 1;
    }
    /* Which device reaches which: the driver's answer, asked once (the client gets each row
     * with its device's snapshot). A driver without the call answers no peers. */
    for (int i = 0; i < w->ndev; i++)
        for (int j = 0; j < w->ndev; j++) {
            int v = 0;
            if (i != j && w->drv.cuDeviceCanAccessPeer &&
                w->drv.cuDeviceCanAccessPeer(&v, w->devs[i], w->devs[j]) != CUDA_SUCCESS)
                v = 0;
            w->peer[i][j] = v != 0;
        }
    wk_log("the lease has %d devices (GPUs %d..)", w->ndev, o->devices[0]);
    return 0;
}

void wk_devices_close(struct worker *w)
{
    for (; w->ndev > 1; w->ndev--) {
        int k = w->ndev - 1;
        CUresult rc = DRV(w, cuDevicePrimaryCtxRelease, w->devs[k]);
        if (rc != CUDA_SUCCESS)
            wk_warn("releasing the primary context of device %d: %s", k, wk_err_name(w, rc));
        w->prims[k] = NULL;
    }
}
