/*
 * nvml_internal.h: what nvml.c shares with the live-value queries (nvml_live.c) and the
 * generated stubs (generated/nvml_stubs.c).
 */
#ifndef GP_NVML_INTERNAL_H
#define GP_NVML_INTERNAL_H

#include "nvml_types.h"
#include "nvml_view.h"

/* An NVML entry point of libnvidia-ml.so.1 (everything else is hidden). */
#define GP_NVML_EXPORT __attribute__((visibility("default")))

#define GP_NVML_MAX_DEVICES 64

/* What is known of peer access from one device to another (docs/multi-gpu.md, "NVML"). */
enum {
    GP_PEER_UNKNOWN = -1,
    GP_PEER_NO = 0,
    GP_PEER_YES = 1
};

/* A device handle (nvmlDevice_t) points at one of these, in nvml.c's table of devices. */
struct nvmlDevice_st {
    int server; /* index into st.servers; -1: none (a lease on a server not configured here) */
    int index;  /* its place in the table: NVML's index of the device */
    /* Which machine holds the GPU: equal for GPUs of one server, different across servers
     * (the server's index, GP_LEASE_MACHINE for a lease's server that is not configured). */
    int machine;
    int ordinal; /* the CUDA ordinal in this process (a device of its lease); -1: none */
    /* Towards each device of the table, by index: peer access (CUDA's answer) and native
     * atomics over it; GP_PEER_UNKNOWN where CUDA was not asked (not both of this process). */
    signed char peer[GP_NVML_MAX_DEVICES], peer_atomics[GP_NVML_MAX_DEVICES];
    gp_nvml_gpu gpu;
};
#define GP_LEASE_MACHINE 1000 /* beyond any server index (GP_MAX_SERVERS) */

/* Lock, check init and the handle, refresh its values when `live` and they are due (which may
 * fetch them, without the lock). On NVML_SUCCESS the caller holds the lock and must call
 * gp_nvml_leave(). */
nvmlReturn_t gp_nvml_enter_device(nvmlDevice_t device, int live, struct nvmlDevice_st **out);
void gp_nvml_leave(void);
/* The device of a handle, with the lock held (after gp_nvml_enter_device): NULL when the handle
 * is not one of the table's. */
struct nvmlDevice_st *gp_nvml_device_locked(nvmlDevice_t device);

/* The answer of every function gpupool does not implement: NVML_ERROR_NOT_SUPPORTED once
 * initialised (NVML_ERROR_UNINITIALIZED before), with a debug line naming the function. */
nvmlReturn_t gp_nvml_unsupported(const char *name);

/* A stub: exported under NVML's name, arguments ignored (the C calling convention lets a
 * function that takes none be called with any). */
#define GP_NVML_STUB(name)                                                                         \
    GP_NVML_EXPORT nvmlReturn_t name(void);                                                        \
    GP_NVML_EXPORT nvmlReturn_t name(void)                                                         \
    {                                                                                              \
        return gp_nvml_unsupported(#name);                                                         \
    }

#endif
