/*
 * session.c: bring the device up (before the client comes, in control mode), answer the client's
 * hello with the device snapshot, and release everything at the end.
 *
 * The snapshot lets the client answer device queries (attributes, limits, name...) locally, so
 * it carries every attribute the driver knows, not only the ones a test happens to use.
 */
#include <stdio.h>
#include <stdlib.h>
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

#include "worker.h"

static void server_name(char out[256])
{
    if (gethostname(out, 256) != 0)
        snprintf(out, 256, "unknown");
    out[255] = '\0';
}

void wk_hello_refuse(struct worker *w, uint64_t req, int32_t result, const char *fmt, ...)
{
    char msg[4096], host[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (n < 0)
        msg[0] = '\0';
    server_name(host);
    wk_warn("refusing the session: %s", msg);
    /* Kept for the control channel's `refused` event. */
    w->refused_code = result;
    snprintf(w->refused_text, sizeof w->refused_text, "%s", msg);
    gp_hello_reply r = {0};
    r.result = result;
    r.major = GP_PROTO_MAJOR;
    r.minor = GP_PROTO_MINOR;
    r.message = msg;
    r.message_len = (uint32_t)strlen(msg);
    r.server = host;
    r.server_len = (uint32_t)strlen(host);
    r.simulated = (uint32_t)w->simulated;
    WK_REPLY(w, req, gp_hello_reply, &r);
    (void)wk_io_flush(w); /* the client may be gone already; nothing else to do either way */
}

/* What the hello reply (device 0) or device_snapshot (the others) says about a device. Read
 * while its primary context is current (limits and the priority range are per context). */
void wk_snapshot_take(struct worker *w, CUdevice dev, struct wk_snapshot *s)
{
    memset(s, 0, sizeof *s);
    if (DRV(w, cuDeviceGetName, s->name, (int)sizeof s->name, dev) != CUDA_SUCCESS)
        snprintf(s->name, sizeof s->name, "unknown device");
    s->name[sizeof s->name - 1] = '\0';
    CUuuid uuid;
    memset(&uuid, 0, sizeof uuid);
    if (DRV(w, cuDeviceGetUuid, &uuid, dev) == CUDA_SUCCESS)
        memcpy(s->uuid, uuid.bytes, 16);
    size_t total = 0;
    if (DRV(w, cuDeviceTotalMem, &total, dev) == CUDA_SUCCESS)
        s->total_mem = total;
    int v = 0;
    if (DRV(w, cuDriverGetVersion, &v) == CUDA_SUCCESS)
        s->driver_version = v;
    /* attrs[i] is attribute i; those the driver does not answer read 0. */
    for (int i = 0; i < CU_DEVICE_ATTRIBUTE_MAX; i++) {
        v = 0;
        if (w->drv.cuDeviceGetAttribute(&v, i, dev) != CUDA_SUCCESS)
            v = 0;
        gp_wr_u32(s->attrs + 4 * i, (uint32_t)v);
    }
    for (int i = 0; i < CU_LIMIT_MAX; i++) {
        size_t lv = 0;
        if (DRV(w, cuCtxGetLimit, &lv, i) != CUDA_SUCCESS)
            lv = 0;
        gp_wr_u64(s->limits + 8 * i, lv);
    }
    int least = 0, greatest = 0;
    if (DRV(w, cuCtxGetStreamPriorityRange, &least, &greatest) == CUDA_SUCCESS) {
        s->prio_least = least;
        s->prio_greatest = greatest;
    }
}

/* The hello reply with the device snapshot. */
static void hello_snapshot(struct worker *w, const struct wk_options *o)
{
    const struct wk_snapshot *s = &w->snap;
    char host[256];
    server_name(host);
    gp_hello_reply r = {0};
    r.major = GP_PROTO_MAJOR;
    r.minor = GP_PROTO_MINOR;
    r.server = host;
    r.server_len = (uint32_t)strlen(host);
    r.session_id = o->session_id;
    r.simulated = (uint32_t)o->simulated;
    r.name = s->name;
    r.name_len = (uint32_t)strlen(s->name);
    memcpy(r.uuid, s->uuid, 16);
    r.total_mem = s->total_mem;
    r.driver_version = s->driver_version;
    r.attributes = s->attrs;
    r.attributes_count = CU_DEVICE_ATTRIBUTE_MAX;
    r.pci_domain = gp_arr_i32(s->attrs, CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID);
    r.pci_bus = gp_arr_i32(s->attrs, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID);
    r.pci_device = gp_arr_i32(s->attrs, CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID);
    r.limits = s->limits;
    r.limits_count = CU_LIMIT_MAX;
    r.stream_priority_least = s->prio_least;
    r.stream_priority_greatest = s->prio_greatest;
    r.granularity = w->gran;
    r.va_base = w->va_base;
    r.va_size = w->va_size;
    r.features = w->cz.features;
    r.memory_quota = w->quota.limit;
    r.device_count = (uint32_t)w->ndev;
    WK_REPLY(w, o->hello_req, gp_hello_reply, &r);
    wk_log("session 0x%llx: serving %s (device %d%s%s), VA window 0x%llx+0x%llx",
           (unsigned long long)o->session_id, s->name, o->ordinal,
           o->simulated ? ", simulated" : "", w->drv.sim_host_pointer ? ", direct copies" : "",
           (unsigned long long)w->va_base, (unsigned long long)w->va_size);
}

int wk_device_open(struct worker *w, const char *driver, int ordinal, int32_t *code, char *err,
                   size_t errlen)
{
    w->ordinal = ordinal;
    if (wk_driver_load(&w->drv, driver, err, errlen) != 0) {
        *code = GP_EREFUSED;
        return -1;
    }
    CUresult rc = w->drv.cuInit(0);
    if (rc != CUDA_SUCCESS) {
        *code = rc;
        snprintf(err, errlen, "cuInit failed on the server: %s", wk_err_name(w, rc));
        return -1;
    }
    rc = w->drv.cuDeviceGet(&w->dev, ordinal);
    if (rc != CUDA_SUCCESS) {
        *code = rc;
        snprintf(err, errlen, "device %d is not available on the server: %s", ordinal,
                 wk_err_name(w, rc));
        return -1;
    }
    rc = w->drv.cuDevicePrimaryCtxRetain(&w->primary, w->dev);
    if (rc == CUDA_SUCCESS) {
        w->primary_retains = 1;
        rc = w->drv.cuCtxSetCurrent(w->primary);
    }
    if (rc != CUDA_SUCCESS) {
        *code = rc;
        snprintf(err, errlen, "cannot create a context on device %d: %s", ordinal,
                 wk_err_name(w, rc));
        return -1;
    }
    w->cur_ctx = WK_PRIMARY_CTX_ID;

    CUmemAllocationProp prop = {0};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = w->dev;
    size_t gran = 0;
    rc = w->drv.cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (rc == CUDA_SUCCESS && (gran == 0 || (gran & (gran - 1)) != 0))
        rc = CUDA_ERROR_NOT_SUPPORTED;
    if (rc != CUDA_SUCCESS) {
        *code = rc;
        snprintf(err, errlen, "device %d has no usable virtual memory management: %s", ordinal,
                 wk_err_name(w, rc));
        return -1;
    }
    w->gran = gran;
    wk_quota_measure_context(w); /* before any memory of a tenant */
    wk_snapshot_take(w, w->dev, &w->snap);
    w->ndev = 1;
    w->devs[0] = w->dev;
    w->prims[0] = w->primary;
    w->device_ready = 1;
    return 0;
}

/* The client's command line reduced to the program's name: its first word, without a folder.
 * The worker only logs it, and the arguments may hold secrets (`--api-key=...`) that log lines
 * must not carry; gpupoold keeps the whole line for the lease's owner and admins
 * (gpupoold/pool/privacy.py program_name says the same). */
static void keep_program_name(gp_hello *h)
{
    if (h->program == NULL || h->program_len == 0)
        return;
    const char *p = h->program;
    uint32_t n = h->program_len;
    while (n > 0 && (*p == ' ' || *p == '\t')) {
        p++;
        n--;
    }
    uint32_t word = 0;
    while (word < n && p[word] != ' ' && p[word] != '\t')
        word++;
    uint32_t start = 0;
    for (uint32_t i = 0; i < word; i++)
        if (p[i] == '/')
            start = i + 1;
    h->program = p + start;
    h->program_len = word - start;
}

/* The hello fields a minor version appended, oldest first (docs/protocol.md, "Versioning"): a
 * client of an older minor version ends its hello before them, and they read as 0 ("not said"). */
static const struct {
    uint16_t since; /* the minor version that appended them */
    size_t bytes;   /* their size as zeros */
} hello_appended[] = {
    {5, 4},  /* 1.5: u32 connect_timeout_ms */
    {6, 12}, /* 1.6: u32 gpus, u64 memory */
    {8, 16}, /* 1.8: u64 spread_group, u32 part, u32 parts */
};
/* An older client's hello with those zeros appended. One hello per worker process, so one
 * static copy, which the decoded strings point into for the rest of the process. The flag makes
 * it taken once: a second older hello in the same process (none is expected) is left as sent
 * and refused as malformed, rather than rewriting strings a first one still points into, from
 * whichever thread. */
static uint8_t older_hello[65536 + 64]; /* worker_session's hello: blob:65536 */
static atomic_flag older_hello_taken = ATOMIC_FLAG_INIT;

static const uint8_t *complete_hello(const uint8_t *body, size_t *len)
{
    if (*len < 8)
        return body;
    uint16_t minor = (uint16_t)(body[6] | body[7] << 8);
    size_t extra = 0;
    for (size_t i = 0; i < sizeof hello_appended / sizeof hello_appended[0]; i++)
        if (minor < hello_appended[i].since)
            extra += hello_appended[i].bytes;
    if (extra == 0 || *len + extra > sizeof older_hello ||
        atomic_flag_test_and_set(&older_hello_taken))
        return body;
    memcpy(older_hello, body, *len);
    memset(older_hello + *len, 0, extra);
    *len += extra;
    return older_hello;
}

int wk_hello_decode(const uint8_t *body, size_t len, gp_hello *h)
{
    /* As sent first: a hello of this version whose minor field is older (a test's, a hand-made
     * one) is whole and must read as such; only a body the decoder finds short is padded. */
    int rc = gp_hello_decode(body, len, h);
    if (rc != 0 && rc != GP_PROTO_ETRAILING) {
        size_t padded_len = len;
        const uint8_t *padded = complete_hello(body, &padded_len);
        if (padded != body)
            rc = gp_hello_decode(padded, padded_len, h);
    }
    /* A newer minor version appends fields: the ones we know are read, the rest skipped. */
    if (rc == GP_PROTO_ETRAILING && h->major == GP_PROTO_MAJOR && h->minor > GP_PROTO_MINOR)
        rc = 0;
    if (rc == 0)
        keep_program_name(h);
    return rc;
}

int wk_session_start(struct worker *w, const struct wk_options *o, const gp_hello *hello)
{
    uint64_t req = o->hello_req;
    w->ordinal = o->ordinal;
    w->simulated = o->simulated;
    if (hello->magic != GP_PROTO_MAGIC) {
        wk_hello_refuse(w, req, GP_EPROTO, "bad hello magic 0x%x", hello->magic);
        return -1;
    }
    if (hello->major != GP_PROTO_MAJOR) {
        wk_hello_refuse(w, req, GP_EVERSION,
                        "protocol %u.%u is not supported (server speaks %d.%d)", hello->major,
                        hello->minor, GP_PROTO_MAJOR, GP_PROTO_MINOR);
        return -1;
    }
    if (!w->device_ready) {
        char err[512];
        int32_t code = 0;
        if (wk_device_open(w, o->driver, o->ordinal, &code, err, sizeof err) != 0) {
            wk_hello_refuse(w, req, code, "%s", err);
            return -1;
        }
    }
    {
        char err[512];
        int32_t code = 0;
        if (wk_devices_open(w, o, &code, err, sizeof err) != 0) {
            wk_hello_refuse(w, req, code, "%s", err);
            return -1;
        }
    }
    size_t gran = (size_t)w->gran;

    /* The window must be ours at exactly the client's addresses; any other outcome is a
     * GP_EVAWINDOW refusal and the client tries another base. */
    w->va_base = hello->va_base;
    w->va_size = hello->va_size / gran * gran;
    if (w->va_base % gran != 0 || w->va_size == 0 || w->va_base + w->va_size < w->va_base) {
        wk_hello_refuse(
            w, req, GP_EVAWINDOW,
            "VA window 0x%llx+0x%llx is not aligned to the allocation granularity 0x%zx",
            (unsigned long long)hello->va_base, (unsigned long long)hello->va_size, gran);
        return -1;
    }
    CUresult rc = wk_va_reserve(w);
    if (rc != CUDA_SUCCESS) {
        wk_hello_refuse(w, req, GP_EVAWINDOW,
                        "the server cannot reserve the VA window 0x%llx+0x%llx: %s",
                        (unsigned long long)w->va_base, (unsigned long long)w->va_size,
                        rc == (CUresult)-1 ? "the range is in use" : wk_err_name(w, rc));
        return -1;
    }
    if (wk_vm_init(&w->vm, w->va_base, w->va_size, w->gran) != 0 ||
        wk_modcache_init(&w->mc, o->cache_dir, hello->token, hello->token_len) != 0) {
        wk_hello_refuse(w, req, CUDA_ERROR_OUT_OF_MEMORY, "the server is out of memory");
        return -1;
    }
    w->cz.features = wk_cz_negotiate(w, hello->flags);
    /* Keepalives (heartbeat.c) for a client that asked: promised in the reply only once the
     * thread runs. */
    if ((hello->flags & GP_HELLO_KEEPALIVE) && wk_hb_start(w) == 0)
        w->cz.features |= GP_HELLO_KEEPALIVE;
    wk_quota_start(w, o->memory_quota);
    hello_snapshot(w, o);
    return 0;
}

/* A context the client created, at the end of the session. */
static void destroy_ctx(struct worker *w, uint64_t id, struct wk_obj *o)
{
    CUresult rc = wk_ctx_teardown(w, id, o);
    if (rc != CUDA_SUCCESS)
        wk_warn("destroying context 0x%llx: %s", (unsigned long long)id, wk_err_name(w, rc));
}

void wk_session_end(struct worker *w)
{
    wk_hb_stop(w); /* before anything else: the thread may write to the client socket */
    /* h_peer.c: the links' sockets closed, their keys cleared */
    wk_peer_close_all(w);
    wk_cz_end(w);
    if (w->drv.lib && w->primary) {
        /* Unloading and destroying need a context; the primary owns what is left after the
         * client's own contexts are gone. */
        CUresult rc = w->drv.cuCtxSetCurrent(w->primary);
        if (rc != CUDA_SUCCESS)
            wk_warn("making the primary context current for cleanup: %s", wk_err_name(w, rc));
        w->cur_ctx = WK_PRIMARY_CTX_ID;
        wk_staging_release(w);
        wk_graph_release_all(w);
        wk_obj_purge(w, &w->ctxs, 0, 0, destroy_ctx);
        wk_obj_purge(w, &w->modules, 0, 0, wk_quota_destroy_module);
        wk_obj_purge(w, &w->funcs, 0, 0, NULL);
        wk_obj_purge(w, &w->events, 0, 0, wk_obj_destroy_event);
        wk_obj_purge(w, &w->streams, 0, 0, wk_obj_destroy_stream);
        wk_obj_purge(w, &w->allocs, 0, 0, wk_obj_destroy_alloc);
        wk_vmm_release_all(w);
        wk_quota_end(w);
        wk_va_release(w);
        wk_devices_close(w);
        for (; w->primary_retains > 0; w->primary_retains--) {
            rc = DRV(w, cuDevicePrimaryCtxRelease, w->dev);
            if (rc != CUDA_SUCCESS)
                wk_warn("releasing the primary context: %s", wk_err_name(w, rc));
        }
    }
    /* The driver library stays loaded: libcuda does not support being unloaded, and the process
     * ends right after this. */
    wk_idmap_clear(&w->ctxs);
    wk_idmap_clear(&w->streams);
    wk_idmap_clear(&w->events);
    wk_idmap_clear(&w->modules);
    wk_idmap_clear(&w->funcs);
    wk_idmap_clear(&w->allocs);
    wk_idmap_clear(&w->graphs);
    wk_idmap_clear(&w->graph_execs);
    wk_idmap_clear(&w->vmm_handles);
    wk_idmap_clear(&w->vmm_resvs);
    wk_idmap_clear(&w->vmm_maps);
    wk_vm_destroy(&w->vm);
    wk_modcache_free(&w->mc);
    free(w->params_buf);
    w->params_buf = NULL;
}
