/*
 * nvml_topo.c: which GPUs can reach each other (docs/multi-gpu.md, "NVML"): P2P status and the
 * topology's common ancestor, as NCCL and `nvidia-smi topo` ask.
 *
 * The truth as gpupool knows it: GPUs of different servers never have peer access (and no
 * common ancestor: they are not in one machine); between two GPUs of this process's lease,
 * peer access is what CUDA answered at nvmlInit (nvml.c asks cuDeviceCanAccessPeer, which the
 * lease's server answers from its driver); between other GPUs of one server it is unknown.
 * A device always reaches itself. NCCL's init fails unless every pair of devices has an answer
 * (nvmlDeviceGetP2PStatus succeeding), so every pair gets one.
 */
#include "nvml_internal.h"

/* The second device of a pair query: the lock is held (gp_nvml_enter_device). */
static nvmlReturn_t other(nvmlDevice_t device, struct nvmlDevice_st **out)
{
    *out = gp_nvml_device_locked(device);
    return *out ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
}

/* One capability from a -> b (lock held). */
static nvmlGpuP2PStatus_t p2p_status(const struct nvmlDevice_st *a, const struct nvmlDevice_st *b,
                                     nvmlGpuP2PCapsIndex_t what)
{
    if (what == NVML_P2P_CAPS_INDEX_NVLINK || what == NVML_P2P_CAPS_INDEX_PROP)
        return a == b ? NVML_P2P_STATUS_NOT_SUPPORTED : NVML_P2P_STATUS_UNKNOWN;
    if (a == b)
        return NVML_P2P_STATUS_OK;
    if (a->machine != b->machine)
        return NVML_P2P_STATUS_NOT_SUPPORTED; /* different machines: no bus between them */
    signed char known =
        what == NVML_P2P_CAPS_INDEX_ATOMICS ? a->peer_atomics[b->index] : a->peer[b->index];
    if (known == GP_PEER_YES)
        return NVML_P2P_STATUS_OK;
    if (known == GP_PEER_NO)
        return NVML_P2P_STATUS_NOT_SUPPORTED;
    return NVML_P2P_STATUS_UNKNOWN;
}

GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetP2PStatus(nvmlDevice_t device1, nvmlDevice_t device2,
                                                   nvmlGpuP2PCapsIndex_t p2pIndex,
                                                   nvmlGpuP2PStatus_t *p2pStatus)
{
    struct nvmlDevice_st *a, *b;
    nvmlReturn_t r = gp_nvml_enter_device(device1, 0, &a);
    if (r != NVML_SUCCESS)
        return r;
    r = other(device2, &b);
    if (r == NVML_SUCCESS && (!p2pStatus || (unsigned)p2pIndex >= NVML_P2P_CAPS_INDEX_UNKNOWN))
        r = NVML_ERROR_INVALID_ARGUMENT;
    if (r == NVML_SUCCESS)
        *p2pStatus = p2p_status(a, b, p2pIndex);
    gp_nvml_leave();
    return r;
}

GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t device1,
                                                                nvmlDevice_t device2,
                                                                nvmlGpuTopologyLevel_t *pathInfo)
{
    struct nvmlDevice_st *a, *b;
    nvmlReturn_t r = gp_nvml_enter_device(device1, 0, &a);
    if (r != NVML_SUCCESS)
        return r;
    r = other(device2, &b);
    if (r == NVML_SUCCESS && !pathInfo)
        r = NVML_ERROR_INVALID_ARGUMENT;
    if (r == NVML_SUCCESS) {
        if (a == b)
            *pathInfo = NVML_TOPOLOGY_INTERNAL;
        else if (a->machine != b->machine)
            r = NVML_ERROR_NOT_SUPPORTED; /* not in one machine: no common ancestor */
        else
            /* The server's PCI tree is not known here: the widest level inside one machine,
             * which never claims a closer link than there is. */
            *pathInfo = NVML_TOPOLOGY_SYSTEM;
    }
    gp_nvml_leave();
    return r;
}
