/*
 * nvml_view.c: an info reply's GPU views (records of protocol/gpupool.toml, info_gpu) as NVML
 * answers (nvml_view.h). Units: the reply speaks bytes, percent, degrees C, watts, joules and
 * MHz; NVML speaks bytes, percent, degrees, milliwatts, millijoules and MHz. A value the server
 * reports as unknown (-1, NaN) stays "not supported": nothing here invents a number.
 */
#include "nvml_view.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

static int contains_ci(const char *hay, const char *needle)
{
    size_t n = strlen(needle), h = strlen(hay);
    for (size_t i = 0; i + n <= h; i++)
        if (strncasecmp(hay + i, needle, n) == 0)
            return 1;
    return 0;
}

/* A reply string (not NUL-terminated) into dst as valid UTF-8. */
static void copy_text(char *dst, size_t cap, const char *src, uint32_t len)
{
    gp_utf8_clean(dst, cap, src ? src : "", src ? len : 0);
}

void gp_nvml_server_from_reply(const gp_info_reply *r, gp_nvml_server *out)
{
    memset(out, 0, sizeof *out);
    copy_text(out->driver_version, sizeof out->driver_version, r->driver_version,
              r->driver_version_len);
    if (r->cuda_driver_version > 0 && r->cuda_driver_version < 1000000)
        out->cuda_driver_version = r->cuda_driver_version;
}

int gp_nvml_find_gpu(const gp_info_reply *r, const char *uuid, gp_info_gpu *out)
{
    if (!uuid || !uuid[0])
        return -1;
    size_t n = strlen(uuid);
    gp_record_span s = r->gpu_views;
    while (gp_info_gpu_next(&s, out) == 0)
        if (out->uuid_len == n && strncasecmp(out->uuid, uuid, n) == 0)
            return 0;
    return -1;
}

int gp_nvml_find_gpu_index(const gp_info_reply *r, unsigned index, gp_info_gpu *out)
{
    gp_record_span s = r->gpu_views;
    while (gp_info_gpu_next(&s, out) == 0)
        if (out->index == index)
            return 0;
    return -1;
}

/* A non-negative reply number as an unsigned, rounded to nearest; 0 (not known) when unknown,
 * negative or too big. */
static int known_uint(double d, double scale, unsigned *out)
{
    if (!isfinite(d) || d < 0)
        return 0;
    d = floor(d * scale + 0.5);
    if (d > 4294967294.0)
        return 0; /* 0xFFFFFFFF is NVML's "not available" */
    *out = (unsigned)d;
    return 1;
}

static int known_u64(double d, double scale, uint64_t *out)
{
    if (!isfinite(d) || d < 0)
        return 0;
    d = floor(d * scale + 0.5);
    if (d >= 18446744073709549568.0)
        return 0;
    *out = (uint64_t)d;
    return 1;
}

/* An integer reply value: -1 (or any negative) is unknown. */
static int known_int(int64_t v, uint64_t *out)
{
    if (v < 0)
        return 0;
    *out = (uint64_t)v;
    return 1;
}

void gp_nvml_live_from_view(const gp_info_reply *r, const gp_info_gpu *view, gp_nvml_live *out)
{
    memset(out, 0, sizeof *out);
    uint64_t total = 0, used = 0, freeb = 0;
    int has_total = known_int(view->live_memory_total, &total);
    if (!has_total && view->memory_total) {
        total = view->memory_total;
        has_total = 1;
    }
    int has_used = known_int(view->memory_used, &used);
    int has_free = known_int(view->memory_free, &freeb);
    /* The size alone (requirements need it) even when the use is not reported. */
    out->has_memory_total = has_total;
    out->memory_total = has_total ? total : 0;
    if (has_total && has_used) {
        out->has_memory = 1;
        out->memory_used = used;
        out->memory_free = has_free ? freeb : (used < total ? total - used : 0);
    }
    out->has_util = known_uint(view->gpu_util, 1.0, &out->gpu_util);
    if (out->has_util && !known_uint(view->memory_util, 1.0, &out->memory_util))
        out->memory_util = 0;
    if (out->gpu_util > 100)
        out->gpu_util = 100;
    if (out->memory_util > 100)
        out->memory_util = 100;
    out->has_temperature = known_uint(view->temperature_c, 1.0, &out->temperature_c);
    out->has_power = known_uint(view->power_w, 1000.0, &out->power_mw);
    out->has_power_limit = known_uint(view->power_limit_w, 1000.0, &out->power_limit_mw);
    out->has_energy = known_u64(view->energy_j, 1000.0, &out->energy_mj);
    out->has_sm_clock = known_uint(view->sm_clock_mhz, 1.0, &out->sm_clock_mhz);
    out->has_mem_clock = known_uint(view->mem_clock_mhz, 1.0, &out->mem_clock_mhz);
    /* The reply carries no maximum clocks: those queries answer "not supported". */

    /* This client's processes on the GPU: the leases the server marked "mine". */
    gp_record_span s = r->lease_views;
    gp_info_lease l;
    while (out->npids < GP_NVML_MAX_PIDS && gp_info_lease_next(&s, &l) == 0) {
        if (!l.mine || l.gpu != view->index || l.client_pid == 0 || l.client_pid > 0x7FFFFFFF)
            continue;
        out->pids[out->npids++] = l.client_pid;
    }
}

int gp_nvml_gpu_from_view(const gp_info_reply *r, const gp_info_gpu *view, gp_nvml_gpu *out)
{
    memset(out, 0, sizeof *out);
    if (view->index > 0xFFFF || view->name_len == 0)
        return -1;
    out->server_index = view->index;
    copy_text(out->name, sizeof out->name, view->name, view->name_len);
    copy_text(out->uuid, sizeof out->uuid, view->uuid, view->uuid_len);
    copy_text(out->pci_bus_id, sizeof out->pci_bus_id, view->pci_bus_id, view->pci_bus_id_len);
    out->simulated = view->simulated != 0;
    out->cc_major = out->cc_minor = -1; /* not in the reply: the lease's libcuda knows it */
    gp_nvml_live_from_view(r, view, &out->live);
    return 0;
}

int gp_nvml_gpu_matches(const gp_nvml_gpu *g, const char *gpu, const char *model,
                        uint64_t min_memory)
{
    if (gpu && gpu[0]) {
        int digits = 1;
        for (const char *p = gpu; *p; p++)
            digits &= isdigit((unsigned char)*p) != 0;
        if (digits) {
            if (strtoul(gpu, NULL, 10) != g->server_index || strlen(gpu) > 9)
                return 0;
        } else if (!g->uuid[0] || strncasecmp(g->uuid, gpu, strlen(gpu)) != 0) {
            return 0;
        }
    }
    if (model && model[0]) {
        /* case-insensitive substring (ASCII folding, as the server's str.lower() on names) */
        if (!contains_ci(g->name, model))
            return 0;
    }
    if (min_memory) {
        uint64_t total = g->live.has_memory_total ? g->live.memory_total : 0;
        if (total < min_memory)
            return 0;
    }
    return 1;
}

/* ------------------------------------------------------------------------------ answers == */

nvmlReturn_t gp_nvml_copy_string(const char *s, char *buf, unsigned length)
{
    if (!buf)
        return NVML_ERROR_INVALID_ARGUMENT;
    size_t n = strlen(s);
    if (length == 0 || n + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(buf, s, n + 1);
    return NVML_SUCCESS;
}

nvmlReturn_t gp_nvml_memory(const gp_nvml_gpu *g, nvmlMemory_t *m)
{
    if (!m)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!g->live.has_memory)
        return NVML_ERROR_NOT_SUPPORTED;
    m->total = g->live.memory_total;
    m->used = g->live.memory_used;
    m->free = g->live.memory_free;
    return NVML_SUCCESS;
}

nvmlReturn_t gp_nvml_memory_v2(const gp_nvml_gpu *g, nvmlMemory_v2_t *m)
{
    if (!m)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (m->version != nvmlMemory_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (!g->live.has_memory)
        return NVML_ERROR_NOT_SUPPORTED;
    m->total = g->live.memory_total;
    m->reserved = 0;
    m->used = g->live.memory_used;
    m->free = g->live.memory_free;
    return NVML_SUCCESS;
}

nvmlReturn_t gp_nvml_utilization(const gp_nvml_gpu *g, nvmlUtilization_t *u)
{
    if (!u)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!g->live.has_util)
        return NVML_ERROR_NOT_SUPPORTED;
    u->gpu = g->live.gpu_util;
    u->memory = g->live.memory_util;
    return NVML_SUCCESS;
}

nvmlReturn_t gp_nvml_pci_info(const gp_nvml_gpu *g, void *pci, int version)
{
    if (!pci)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned domain, bus, device, function;
    char extra;
    if (sscanf(g->pci_bus_id, "%x:%x:%x.%x%c", &domain, &bus, &device, &function, &extra) != 4 ||
        bus > 0xFF || device > 0x1F || function > 7)
        return NVML_ERROR_NOT_SUPPORTED;
    char legacy[NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE];
    snprintf(legacy, sizeof legacy, "%04X:%02X:%02X.%X", domain & 0xFFFF, bus, device, function);
    if (version >= 3) {
        nvmlPciInfo_t *p = pci;
        memset(p, 0, sizeof *p);
        memcpy(p->busIdLegacy, legacy, sizeof legacy);
        p->domain = domain;
        p->bus = bus;
        p->device = device;
        snprintf(p->busId, sizeof p->busId, "%08X:%02X:%02X.%X", domain, bus, device, function);
    } else {
        nvmlPciInfo_v2_t *p = pci;
        memset(p, 0, sizeof *p);
        memcpy(p->busId, legacy, sizeof legacy);
        p->domain = domain;
        p->bus = bus;
        p->device = device;
    }
    return NVML_SUCCESS;
}

nvmlReturn_t gp_nvml_temperature(const gp_nvml_gpu *g, int sensor, unsigned *temp)
{
    if (!temp || sensor != NVML_TEMPERATURE_GPU)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!g->live.has_temperature)
        return NVML_ERROR_NOT_SUPPORTED;
    *temp = g->live.temperature_c;
    return NVML_SUCCESS;
}

nvmlReturn_t gp_nvml_power_usage(const gp_nvml_gpu *g, unsigned *mw)
{
    if (!mw)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!g->live.has_power)
        return NVML_ERROR_NOT_SUPPORTED;
    *mw = g->live.power_mw;
    return NVML_SUCCESS;
}

nvmlReturn_t gp_nvml_power_limit(const gp_nvml_gpu *g, unsigned *mw)
{
    if (!mw)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!g->live.has_power_limit)
        return NVML_ERROR_NOT_SUPPORTED;
    *mw = g->live.power_limit_mw;
    return NVML_SUCCESS;
}

nvmlReturn_t gp_nvml_energy(const gp_nvml_gpu *g, unsigned long long *mj)
{
    if (!mj)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!g->live.has_energy)
        return NVML_ERROR_NOT_SUPPORTED;
    *mj = g->live.energy_mj;
    return NVML_SUCCESS;
}

nvmlReturn_t gp_nvml_clock(const gp_nvml_gpu *g, int type, int max, unsigned *mhz)
{
    if (!mhz || type < NVML_CLOCK_GRAPHICS || type > NVML_CLOCK_VIDEO)
        return NVML_ERROR_INVALID_ARGUMENT;
    const gp_nvml_live *l = &g->live;
    int has;
    unsigned v;
    switch (type) {
    case NVML_CLOCK_GRAPHICS: /* the graphics and SM clocks are one clock on current GPUs */
    case NVML_CLOCK_SM:
        has = max ? l->has_max_sm_clock : l->has_sm_clock;
        v = max ? l->max_sm_clock_mhz : l->sm_clock_mhz;
        break;
    case NVML_CLOCK_MEM:
        has = max ? l->has_max_mem_clock : l->has_mem_clock;
        v = max ? l->max_mem_clock_mhz : l->mem_clock_mhz;
        break;
    default:
        return NVML_ERROR_NOT_SUPPORTED;
    }
    if (!has)
        return NVML_ERROR_NOT_SUPPORTED;
    *mhz = v;
    return NVML_SUCCESS;
}

nvmlReturn_t gp_nvml_processes(const gp_nvml_gpu *g, unsigned *count, void *infos, int version)
{
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned n = g->live.npids;
    if (*count < n || (n > 0 && !infos)) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    /* Memory per process is not known; each lease holds the whole GPU, so its process uses
     * what the GPU has in use (NVML's "not available" when that is not reported either). */
    unsigned long long used = g->live.has_memory ? g->live.memory_used : ~0ULL;
    for (unsigned i = 0; i < n; i++) {
        if (version == 1) {
            nvmlProcessInfo_v1_t *p = (nvmlProcessInfo_v1_t *)infos + i;
            memset(p, 0, sizeof *p);
            p->pid = g->live.pids[i];
            p->usedGpuMemory = used;
        } else {
            nvmlProcessInfo_t *p = (nvmlProcessInfo_t *)infos + i;
            memset(p, 0, sizeof *p);
            p->pid = g->live.pids[i];
            p->usedGpuMemory = used;
            p->gpuInstanceId = 0xFFFFFFFFu;
            p->computeInstanceId = 0xFFFFFFFFu;
        }
    }
    *count = n;
    return NVML_SUCCESS;
}

nvmlBrandType_t gp_nvml_brand(const char *name)
{
    if (contains_ci(name, "GeForce"))
        return NVML_BRAND_GEFORCE;
    if (contains_ci(name, "Quadro"))
        return NVML_BRAND_QUADRO;
    if (contains_ci(name, "TITAN"))
        return NVML_BRAND_TITAN;
    if (contains_ci(name, "Tesla"))
        return NVML_BRAND_TESLA;
    return NVML_BRAND_UNKNOWN;
}

const char *gp_nvml_error_string(nvmlReturn_t r)
{
    switch (r) {
    case NVML_SUCCESS:
        return "Success";
    case NVML_ERROR_UNINITIALIZED:
        return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT:
        return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED:
        return "Not Supported";
    case NVML_ERROR_NO_PERMISSION:
        return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED:
        return "Already Initialized";
    case NVML_ERROR_NOT_FOUND:
        return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE:
        return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER:
        return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED:
        return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT:
        return "Timeout";
    case NVML_ERROR_IRQ_ISSUE:
        return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND:
        return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND:
        return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM:
        return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST:
        return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED:
        return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM:
        return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH:
        return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_IN_USE:
        return "In use by another client";
    case NVML_ERROR_MEMORY:
        return "Insufficient Memory";
    case NVML_ERROR_NO_DATA:
        return "No data";
    case NVML_ERROR_VGPU_ECC_NOT_SUPPORTED:
        return "ECC is not supported on this vGPU";
    case NVML_ERROR_INSUFFICIENT_RESOURCES:
        return "Insufficient resources";
    case NVML_ERROR_FREQ_NOT_SUPPORTED:
        return "Frequency not supported";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH:
        return "Argument version mismatch";
    case NVML_ERROR_DEPRECATED:
        return "Deprecated";
    case NVML_ERROR_NOT_READY:
        return "Not ready";
    case NVML_ERROR_GPU_NOT_FOUND:
        return "GPU not found";
    case NVML_ERROR_INVALID_STATE:
        return "Invalid state";
    case NVML_ERROR_RESET_TYPE_NOT_SUPPORTED:
        return "Reset type not supported";
    case NVML_ERROR_UNKNOWN:
        return "Unknown Error";
    }
    return "Unknown Error";
}
