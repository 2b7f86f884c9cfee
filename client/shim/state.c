/*
 * state.c: what the shim knows locally: the device snapshot taken at connect, the contexts and
 * each thread's current-context stack. Everything here is answered without a round trip
 * (facts section 6: PyTorch asks cuCtxGetCurrent, cuDeviceGetAttribute and
 * cuDevicePrimaryCtxGetState hundreds of times). It asks nothing of the connection: conn.c and
 * connect.c sit above it (call_entry.c joins the two for the API calls, hooks.c answers those
 * outside the core).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shim.h"
#include "shim_core.h"

/* ================================================================== the snapshot == */

/* The lease's devices (issue 37): device 0 from the hello reply, the others from device_props
 * (api_init.c asks at cuInit); written before ndev is raised, read after. */
static gp_device_snapshot devs[GP_MAX_DEVICES];
#define dev0 devs[0]
static atomic_int ndev;
static int announced;       /* the hello reply's device_count (1 for an older server) */
static uint64_t session_id; /* of the lease; written before ndev is set, read after */
/* cuDeviceCanAccessPeer(d, p) and cuDeviceGetP2PAttribute(a, d, p) on the server. */
static uint8_t peer[GP_MAX_DEVICES][GP_MAX_DEVICES];
static int p2p[GP_MAX_DEVICES][GP_MAX_DEVICES][4];

/* Capabilities that a remote GPU cannot offer to this process's memory, whatever the server's
 * GPU says: its kernels cannot reach our pages, so no managed or pageable memory access. */
static const int remote_off[] = {
    CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY,
    CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS,
    CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS,
    CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES,
    CU_DEVICE_ATTRIBUTE_DIRECT_MANAGED_MEM_ACCESS_FROM_HOST,
    CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED,
    CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
};

/* One primary context per device, its id GP_PRIMARY_CTX_OF(k). */
static gp_ctx_obj primary_objs[GP_MAX_DEVICES];
static pthread_mutex_t primary_lock = PTHREAD_MUTEX_INITIALIZER;
static gp_primary_state primary_sts[GP_MAX_DEVICES]; /* guarded by primary_lock */

/* What the hello reply and device_props share: attributes (less what a remote GPU cannot offer
 * this process) and limits. */
static void set_attributes(gp_device_snapshot *d, const uint8_t *attrs, uint32_t nattrs,
                           const uint8_t *limits, uint32_t nlimits)
{
    d->attribute_count = (int)(nattrs < 512 ? nattrs : 512);
    for (int i = 0; i < d->attribute_count; i++)
        d->attributes[i] = gp_arr_i32(attrs, i);
    for (size_t i = 0; i < sizeof remote_off / sizeof remote_off[0]; i++)
        if (remote_off[i] < d->attribute_count)
            d->attributes[remote_off[i]] = 0;
    d->limit_count = (int)(nlimits < 64 ? nlimits : 64);
    for (int i = 0; i < d->limit_count; i++)
        d->limits[i] = gp_arr_u64(limits, i);
}

static void set_primary_obj(int k)
{
    primary_objs[k] = (gp_ctx_obj){.id = GP_PRIMARY_CTX_OF(k), .device = k, .primary = 1};
}

/* A hello reply's device (the first of its lease, or of its part) into d. */
static void snapshot_from_reply(gp_device_snapshot *d, const gp_hello_reply *r)
{
    memset(d, 0, sizeof *d);
    size_t nl = r->name_len < sizeof d->name - 1 ? r->name_len : sizeof d->name - 1;
    memcpy(d->name, r->name, nl);
    memcpy(d->uuid.bytes, r->uuid, 16);
    d->total_mem = r->total_mem;
    d->memory_quota = r->memory_quota;
    d->proto_minor = r->minor;
    d->driver_version = r->driver_version;
    d->pci_domain = r->pci_domain;
    d->pci_bus = r->pci_bus;
    d->pci_device = r->pci_device;
    set_attributes(d, r->attributes, r->attributes_count, r->limits, r->limits_count);
    d->stream_priority_least = r->stream_priority_least;
    d->stream_priority_greatest = r->stream_priority_greatest;
    d->granularity = r->granularity;
    d->simulated = (int)r->simulated;
}

void gp_state_set_snapshot(const gp_hello_reply *r)
{
    gp_device_snapshot *d = &dev0;
    snapshot_from_reply(d, r);
    announced = r->device_count == 0               ? 1
                : r->device_count > GP_MAX_DEVICES ? GP_MAX_DEVICES
                                                   : (int)r->device_count;
    memset(peer, 0, sizeof peer);
    memset(p2p, 0, sizeof p2p);
    set_primary_obj(0);
    session_id = r->session_id;
    gp_handle_register(GP_PRIMARY_CTX_ID, GP_H_CTX, &primary_objs[0]);
    gp_log_debug("device 0: %s, %llu MiB, compute %d.%d, server driver %d%s", d->name,
                 (unsigned long long)(d->total_mem >> 20),
                 d->attribute_count > 76 ? d->attributes[75] : -1,
                 d->attribute_count > 76 ? d->attributes[76] : -1, d->driver_version,
                 d->simulated ? " (simulated)" : "");
    atomic_store(&ndev, 1);
}

/* A part of a spread lease (issue 37, item 3; connect.c stores the parts in order once every one
 * is connected). Part 0 starts the snapshot as one server's reply does (its session is the one
 * gp_session_id names); each later part's reply describes the first of its devices, and its
 * devices join those announced. Peer access between parts stays 0: other machines. The devices
 * after a part's first come from device_props, as for one server (gp_state_add_device). */
void gp_state_set_part_snapshot(int first_device, int ndevices, const gp_hello_reply *r)
{
    if (first_device < 0 || ndevices < 1 || first_device + ndevices > GP_MAX_DEVICES)
        return;
    if (first_device == 0) {
        gp_state_set_snapshot(r);
        announced = ndevices;
        return;
    }
    snapshot_from_reply(&devs[first_device], r);
    set_primary_obj(first_device);
    announced = first_device + ndevices;
    gp_log_debug("device %d (a part's first): %s, %llu MiB, server driver %d%s", first_device,
                 devs[first_device].name, (unsigned long long)(devs[first_device].total_mem >> 20),
                 devs[first_device].driver_version,
                 devs[first_device].simulated ? " (simulated)" : "");
}

int gp_device_count(void)
{
    return atomic_load(&ndev);
}

int gp_device_announced(void)
{
    return atomic_load(&ndev) > 0 ? announced : 0;
}

void gp_state_add_device(int k, int first, const gp_device_props_reply *r)
{
    if (k < 0 || k >= announced || first < 0 || first > k)
        return;
    if (k > first) {
        gp_device_snapshot *d = &devs[k];
        memset(d, 0, sizeof *d);
        size_t nl = r->name_len < sizeof d->name - 1 ? r->name_len : sizeof d->name - 1;
        memcpy(d->name, r->name, nl);
        memcpy(d->uuid.bytes, r->uuid, 16);
        d->total_mem = r->total_mem;
        d->pci_domain = r->pci_domain;
        d->pci_bus = r->pci_bus;
        d->pci_device = r->pci_device;
        set_attributes(d, r->attributes, r->attributes_count, r->limits, r->limits_count);
        d->granularity = r->granularity;
        /* One driver and one process on the server: these are the same for every device. */
        d->driver_version = devs[first].driver_version;
        d->stream_priority_least = devs[first].stream_priority_least;
        d->stream_priority_greatest = devs[first].stream_priority_greatest;
        d->simulated = devs[first].simulated;
        set_primary_obj(k);
    }
    /* The worker numbers its part's devices from 0: its peers are first + p here (0 between
     * parts: other machines). */
    for (uint32_t p = 0; p < r->can_access_peer_count && first + p < GP_MAX_DEVICES; p++)
        peer[k][first + p] = gp_arr_i32(r->can_access_peer, p) != 0;
    for (uint32_t i = 0; i < r->p2p_attributes_count && first + i / 4 < GP_MAX_DEVICES; i++)
        p2p[k][first + i / 4][i % 4] = gp_arr_i32(r->p2p_attributes, i);
}

void gp_state_devices_ready(int n)
{
    if (n <= atomic_load(&ndev) || n > announced)
        return;
    for (int k = atomic_load(&ndev); k < n; k++)
        gp_handle_register(GP_PRIMARY_CTX_OF(k), GP_H_CTX, &primary_objs[k]);
    atomic_store(&ndev, n);
    gp_log_debug("%d devices", n);
}

const gp_device_snapshot *gp_device(int ordinal)
{
    return ordinal >= 0 && ordinal < atomic_load(&ndev) ? &devs[ordinal] : NULL;
}

const gp_device_snapshot *gp_device_current(void)
{
    const gp_ctx_obj *c = gp_ctx_current_obj();
    const gp_device_snapshot *d = c ? gp_device(c->device) : NULL;
    return d ? d : gp_device(0);
}

int gp_device_can_access_peer(int dev, int peer_dev)
{
    int n = atomic_load(&ndev);
    return dev >= 0 && dev < n && peer_dev >= 0 && peer_dev < n && peer[dev][peer_dev];
}

int gp_device_p2p_attribute(int dev, int peer_dev, int attr)
{
    int n = atomic_load(&ndev);
    if (dev < 0 || dev >= n || peer_dev < 0 || peer_dev >= n || attr < 1 || attr > 4)
        return 0;
    return p2p[dev][peer_dev][attr - 1];
}

int gp_primary_index(uint64_t h)
{
    uint64_t k = (h >> 32) & 0xff;
    if ((h & ~(0xffull << 32)) != GP_PRIMARY_CTX_ID || k >= (uint64_t)atomic_load(&ndev))
        return -1;
    return (int)k;
}

static atomic_int spread_copy; /* GP_SPREAD_COPY_* (client_config.h) */

void gp_state_set_spread_copy(int mode)
{
    atomic_store(&spread_copy, mode);
}

int gp_state_spread_copy(void)
{
    return atomic_load(&spread_copy);
}

uint64_t gp_session_id(void)
{
    return atomic_load(&ndev) > 0 ? session_id : 0;
}

int gp_reported_driver_version(void)
{
    if (atomic_load(&ndev) > 0 && dev0.driver_version > 0)
        return dev0.driver_version;
    return GP_FALLBACK_DRIVER_VERSION;
}

/* ================================================================ the context stack == */

#define STACK_MAX 64
static __thread uint64_t tl_stack[STACK_MAX];
static __thread int tl_depth;

uint64_t gp_ctx_current(void)
{
    return tl_depth > 0 ? tl_stack[tl_depth - 1] : 0;
}

int gp_ctx_stack_push(uint64_t ctx)
{
    if (tl_depth >= STACK_MAX)
        return -1;
    tl_stack[tl_depth++] = ctx;
    return 0;
}

uint64_t gp_ctx_stack_pop(void)
{
    return tl_depth > 0 ? tl_stack[--tl_depth] : 0;
}

void gp_ctx_stack_set_top(uint64_t ctx)
{
    if (ctx == 0) {
        if (tl_depth > 0)
            tl_depth--;
    } else if (tl_depth == 0) {
        tl_stack[tl_depth++] = ctx;
    } else {
        tl_stack[tl_depth - 1] = ctx;
    }
}

gp_ctx_obj *gp_ctx_obj_get(uint64_t h)
{
    int k = gp_primary_index(h);
    if (k >= 0)
        return &primary_objs[k];
    return gp_handle_get(h, GP_H_CTX);
}

gp_ctx_obj *gp_ctx_current_obj(void)
{
    uint64_t c = gp_ctx_current();
    return c ? gp_ctx_obj_get(c) : NULL;
}

uint64_t gp_ctx_check(CUcontext ctx)
{
    uint64_t h = (uint64_t)(uintptr_t)ctx;
    return h && gp_ctx_obj_get(h) ? h : 0;
}

/* ======================================================================= streams == */

int gp_stream_wire(CUstream s, uint64_t *wire)
{
    uint64_t h = (uint64_t)(uintptr_t)s;
    if (h > 2 && !gp_handle_get(h, GP_H_STREAM))
        return -1;
    if (wire)
        *wire = h;
    return 0;
}

/* ===================================================================== the primary == */

void gp_primary_get(int dev, gp_primary_state *out)
{
    pthread_mutex_lock(&primary_lock);
    *out = primary_sts[dev];
    pthread_mutex_unlock(&primary_lock);
}

int gp_primary_retain(int dev)
{
    pthread_mutex_lock(&primary_lock);
    int n = ++primary_sts[dev].retained;
    pthread_mutex_unlock(&primary_lock);
    return n;
}

int gp_primary_release(int dev, int *was_last)
{
    int rc = 0;
    pthread_mutex_lock(&primary_lock);
    if (primary_sts[dev].retained <= 0) {
        rc = -1;
    } else {
        primary_sts[dev].retained--;
        *was_last = primary_sts[dev].retained == 0;
    }
    pthread_mutex_unlock(&primary_lock);
    return rc;
}

void gp_primary_set_flags(int dev, unsigned flags)
{
    pthread_mutex_lock(&primary_lock);
    primary_sts[dev].flags = flags;
    primary_objs[dev].flags = flags;
    pthread_mutex_unlock(&primary_lock);
}

void gp_primary_reset_local(int dev)
{
    pthread_mutex_lock(&primary_lock);
    primary_sts[dev].retained = 0;
    primary_sts[dev].flags = 0;
    primary_objs[dev].flags = 0;
    primary_objs[dev].limit_set = 0;
    primary_objs[dev].cache_config = 0;
    primary_objs[dev].shmem_config = 0;
    pthread_mutex_unlock(&primary_lock);
}

/* ============================================================= forgetting a context == */

static int owned_by(uint64_t h, void *obj, void *arg)
{
    (void)h;
    uint64_t ctx = *(uint64_t *)arg;
    int kind = gp_handle_kind_of(h);
    if (kind == GP_H_STREAM)
        return ((gp_stream_obj *)obj)->ctx == ctx;
    if (kind == GP_H_EVENT)
        return ((gp_event_obj *)obj)->ctx == ctx;
    return 0;
}

void gp_ctx_forget_resources(uint64_t ctx)
{
    int nr = gp_vamap_remove_ctx(ctx);
    int ns = gp_handle_remove_if(GP_H_STREAM, owned_by, &ctx, free);
    int ne = gp_handle_remove_if(GP_H_EVENT, owned_by, &ctx, free);
    gp_log_debug("context 0x%llx gone: forgot %d ranges, %d streams, %d events",
                 (unsigned long long)ctx, nr, ns, ne);
}
