/*
 * nvml_view.h: from a server's `info` reply (docs/protocol.md, "info": the spec's info_gpu and
 * info_lease records) to NVML's answers. Pure functions over the decoded reply and plain
 * structs: no connections, no locks, no global state, so the C unit test (test_nvml_view.c)
 * drives them with replies it encodes itself.
 *
 * nvml.c owns the devices, the locking and the refreshes; it calls these to build a device
 * from a GPU view and to answer each query from the device's cached values.
 */
#ifndef GP_NVML_VIEW_H
#define GP_NVML_VIEW_H

#include <stddef.h>
#include <stdint.h>

#include "gp_protocol.h"
#include "nvml_types.h"
#include "utf8.h"

#define GP_NVML_MAX_PIDS 64

/* Live values of one GPU; a has_* of 0 means the server did not report it (-1 or NaN in the
 * reply), and the matching NVML query answers NVML_ERROR_NOT_SUPPORTED. */
typedef struct gp_nvml_live {
    int has_memory_total; /* the size is known (live, else the view's memory_total) */
    int has_memory;       /* and so is the use: the memory queries answer */
    uint64_t memory_total, memory_used, memory_free;
    int has_util;
    unsigned gpu_util, memory_util; /* percent, rounded */
    int has_temperature;
    unsigned temperature_c;
    int has_power, has_power_limit, has_energy;
    unsigned power_mw, power_limit_mw;
    uint64_t energy_mj;
    int has_sm_clock, has_mem_clock, has_max_sm_clock, has_max_mem_clock;
    unsigned sm_clock_mhz, mem_clock_mhz, max_sm_clock_mhz, max_mem_clock_mhz;
    unsigned npids; /* this client's leases on the GPU ("mine"), their client pids */
    unsigned pids[GP_NVML_MAX_PIDS];
} gp_nvml_live;

/* One GPU as NVML shows it. */
typedef struct gp_nvml_gpu {
    unsigned server_index; /* the GPU's index on its server (the API's "index") */
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    char pci_bus_id[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE]; /* "00000000:18:00.0" or "" */
    int simulated;
    int cc_major, cc_minor; /* compute capability; -1 when not known (the reply has none) */
    gp_nvml_live live;
} gp_nvml_gpu;

/* What a server's reply says about the server itself. */
typedef struct gp_nvml_server {
    char driver_version[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE]; /* "" unknown (simulated) */
    int cuda_driver_version;                                     /* 13000; 0 unknown */
} gp_nvml_server;

void gp_nvml_server_from_reply(const gp_info_reply *r, gp_nvml_server *out);

/* The GPU view of r whose uuid is `uuid` (case-insensitive), or whose server index is `index`,
 * into *out (its strings point into the reply's body): 0, or -1 when there is none. */
int gp_nvml_find_gpu(const gp_info_reply *r, const char *uuid, gp_info_gpu *out);
int gp_nvml_find_gpu_index(const gp_info_reply *r, unsigned index, gp_info_gpu *out);

/* Fill *out from a GPU view of r (identity and live values; pids from r's lease views marked
 * mine on this GPU). 0, or -1 when the view has no usable index or name. */
int gp_nvml_gpu_from_view(const gp_info_reply *r, const gp_info_gpu *view, gp_nvml_gpu *out);

/* Only the live values (and pids) of a GPU from a newer reply's view of the same GPU. */
void gp_nvml_live_from_view(const gp_info_reply *r, const gp_info_gpu *view, gp_nvml_live *out);

/* 1 when g meets the client's requirements as the server reads them (gpupoold/pool/requirements.py):
 * gpu = server index (digits) or UUID prefix (case-insensitive), model = substring of the name
 * (case-insensitive), min_memory <= total memory. Empty/0 requirements match anything. */
int gp_nvml_gpu_matches(const gp_nvml_gpu *g, const char *gpu, const char *model,
                        uint64_t min_memory);

/* ---- answers (no locking: the caller holds the device) ---------------------------------- */
nvmlReturn_t gp_nvml_copy_string(const char *s, char *buf, unsigned length);
nvmlReturn_t gp_nvml_memory(const gp_nvml_gpu *g, nvmlMemory_t *m);
nvmlReturn_t gp_nvml_memory_v2(const gp_nvml_gpu *g, nvmlMemory_v2_t *m);
nvmlReturn_t gp_nvml_utilization(const gp_nvml_gpu *g, nvmlUtilization_t *u);
/* version 1 (plain) and 2 fill the 52-byte nvmlPciInfo_v2_t layout, 3 nvmlPciInfo_t. */
nvmlReturn_t gp_nvml_pci_info(const gp_nvml_gpu *g, void *pci, int version);
nvmlReturn_t gp_nvml_temperature(const gp_nvml_gpu *g, int sensor, unsigned *temp);
nvmlReturn_t gp_nvml_power_usage(const gp_nvml_gpu *g, unsigned *mw);
nvmlReturn_t gp_nvml_power_limit(const gp_nvml_gpu *g, unsigned *mw);
nvmlReturn_t gp_nvml_energy(const gp_nvml_gpu *g, unsigned long long *mj);
nvmlReturn_t gp_nvml_clock(const gp_nvml_gpu *g, int type, int max, unsigned *mhz);
/* The running compute processes: NVML's count protocol (*count in: capacity, out: entries;
 * NVML_ERROR_INSUFFICIENT_SIZE with the needed count when infos is too small). version 1 fills
 * nvmlProcessInfo_v1_t, 2 and 3 nvmlProcessInfo_t. */
nvmlReturn_t gp_nvml_processes(const gp_nvml_gpu *g, unsigned *count, void *infos, int version);

/* The brand a GPU name shows (GeForce, Quadro, TITAN, Tesla); NVML_BRAND_UNKNOWN otherwise. */
nvmlBrandType_t gp_nvml_brand(const char *name);

/* nvmlErrorString's text for a return code. */
const char *gp_nvml_error_string(nvmlReturn_t r);

#endif
