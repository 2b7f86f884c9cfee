/*
 * nvml.c: our libnvidia-ml.so.1 (docs/architecture.md, "The NVML shim"): the NVML entry
 * points that tools (pynvml, nvitop, PyTorch) use, answered from gpupool servers' `info`
 * replies instead of a local driver.
 *
 * Which GPUs: when this process's libcuda.so.1 is ours and holds a lease (gpupool_shim_lease
 * says so), exactly the lease's GPUs, in CUDA's order with CUDA's UUIDs and PCI bus ids. Their
 * values come from the lease's server only when it is a configured one (host case-insensitive,
 * a bare host meaning port 7070): the configured token and TLS files go nowhere else.
 * Otherwise each GPU shows what CUDA says of it (name, UUID, memory), without live values.
 * Without a lease: every GPU of every configured server that answers, in configuration order then
 * server index, that meets the configured requirements. The list is fixed at nvmlInit (NVML
 * numbers devices once); their values come from one `info` request per server at init and again
 * when a query finds them older than REFRESH_S (one connection per refresh; between refreshes
 * every query answers from the cache). After a failed refresh the server is asked again only
 * after RETRY_FIRST_S, doubling up to RETRY_MAX_S, and the last values stay meanwhile.
 *
 * No server configured or none reachable: nvmlInit still succeeds, with 0 devices and one line
 * on stderr saying why, so that tools and PyTorch keep working; the CUDA side reports the real
 * error when the program uses the GPU.
 *
 * Locking. `lock` guards all state (st) and is never held during network I/O:
 * - a refresh is started under it (one per server at a time: `refreshing`), fetched and decoded
 *   without it, and swapped in under it again; queries meanwhile answer from the cache. The
 *   fetching query itself waits at most the fetch timeout (probe_timeout, FETCH_TIMEOUT_S when
 *   that is 0: an NVML query never waits forever).
 * - nvmlInit and nvmlShutdown are serialised by `init_lock` (taken before `lock`). nvmlInit does
 *   its requests holding only init_lock, while st.refcount is 0: every other thread then reads
 *   nothing but refcount (under `lock`) and gets NVML_ERROR_UNINITIALIZED; refcount becomes 1
 *   under `lock` once the state is built. st.warned is guarded by init_lock.
 * - the configuration is reference-counted (config_ref): a refresh in flight keeps the one it
 *   started with alive across nvmlShutdown, and drops its result when NVML was shut down or
 *   initialised again meanwhile (st.generation).
 * Every function NVML programs may look up that is not here answers NVML_ERROR_NOT_SUPPORTED
 * (generated/nvml_stubs.c).
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "client_config.h"
#include "gp_log.h"
#include "info_client.h"
#include "net.h"
#include "nvml_internal.h"
#include "nvml_view.h"

#define REFRESH_S 1.0       /* values older than this are fetched again */
#define RETRY_FIRST_S 10.0  /* after a failed fetch, the next try waits this long ... */
#define RETRY_MAX_S 60.0    /* ... doubling after each further failure, up to this */
#define FETCH_TIMEOUT_S 2.0 /* the limit of one fetch when probe_timeout is 0 ("no limit") */
#define MAX_DEVICES GP_NVML_MAX_DEVICES

/* The configuration, shared by the state and the refreshes in flight. */
typedef struct config_ref {
    int refs; /* guarded by lock */
    gp_client_config cfg;
} config_ref;

typedef struct server_state {
    const gp_server_config *srv; /* into st.conf->cfg */
    char desc[300];              /* "host:port" for messages */
    int answered;                /* its info arrived at least once */
    int refreshing;              /* a query is fetching its info now (without the lock) */
    double next_fetch;           /* monotonic seconds: no refresh before this */
    double retry_s;              /* the wait after the last failure; 0 after a success */
    gp_nvml_server info;
} server_state;

static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER; /* before `lock` */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
    int refcount;
    unsigned long generation; /* one more at each first nvmlInit */
    config_ref *conf;
    server_state servers[GP_MAX_SERVERS];
    int nservers;
    int system_server; /* the server that answers system queries; -1: none */
    unsigned ndevices;
    struct nvmlDevice_st devices[MAX_DEVICES];
    int warned;     /* the process has had its one warning (kept across nvmlShutdown; init_lock) */
    int lease_mode; /* the table is this process's lease (else the servers' GPUs) */
} st;               /* guarded by lock (see the top of this file for nvmlInit) */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* A problem that leaves NVML without (some) GPU values: one line on stderr per process (tools
 * that init and shut down NVML in a loop would repeat it), later ones at debug level. Called
 * only by nvmlInit (init_lock held). */
static void warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void warn(const char *fmt, ...)
{
    char line[1500];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (st.warned) {
        gp_log_debug("%s", line);
    } else {
        st.warned = 1;
        gp_log_info("%s", line);
    }
}

static void config_release(config_ref *conf)
{
    if (conf && --conf->refs == 0)
        free(conf);
}

/* ------------------------------------------------------------------------ info requests == */

/* Fetch srv's info reply: the decoded reply (free with doc_free), or NULL with why in err.
 * Touches no state (runs without the lock). */
static gp_info_result *fetch_doc(const gp_client_config *cfg, const gp_server_config *srv,
                                 char *err, size_t errcap)
{
    gp_info_result *r = calloc(1, sizeof *r);
    if (!r) {
        snprintf(err, errcap, "out of memory");
        return NULL;
    }
    double timeout = cfg->probe_timeout > 0 ? cfg->probe_timeout : FETCH_TIMEOUT_S;
    if (gp_info_fetch(cfg, srv, timeout, r, err, errcap) != 0) {
        gp_info_free(r);
        free(r);
        return NULL;
    }
    if (r->result != 0) {
        snprintf(err, errcap, "refused: %.400s", r->message[0] ? r->message : "no reason given");
        gp_info_free(r);
        free(r);
        return NULL;
    }
    return r;
}

static void doc_free(gp_info_result *doc)
{
    if (doc) {
        gp_info_free(doc);
        free(doc);
    }
}

/* Server s's fetch is over (doc, or NULL after a failure): when its values are next due. */
static void fetched(server_state *ss, const gp_info_result *doc)
{
    double t = now_s();
    if (doc) {
        gp_nvml_server_from_reply(&doc->reply, &ss->info);
        ss->answered = 1;
        ss->retry_s = 0;
        ss->next_fetch = t + REFRESH_S;
    } else {
        ss->retry_s = ss->retry_s > 0 ? ss->retry_s * 2 : RETRY_FIRST_S;
        if (ss->retry_s > RETRY_MAX_S)
            ss->retry_s = RETRY_MAX_S;
        ss->next_fetch = t + ss->retry_s;
    }
}

/* The GPU view of doc that device d shows, by UUID, else by the server's index: 0 with *view,
 * or -1. */
static int view_of(const gp_info_result *doc, const struct nvmlDevice_st *d, gp_info_gpu *view)
{
    if (d->gpu.uuid[0])
        return gp_nvml_find_gpu(&doc->reply, d->gpu.uuid, view);
    return gp_nvml_find_gpu_index(&doc->reply, d->gpu.server_index, view);
}

/* Called with the lock held by a query that wants d's live values: when they are due and no
 * other query is fetching them, fetch its server's info without the lock and take newer values
 * for every device of that server. On failure the last values stay (said at debug level) and
 * the server is asked again only after the retry wait. 0 with the lock held and the state
 * current; -1 with the lock held when NVML was shut down meanwhile; -2 when the lock could not
 * be taken again (not held). */
static int refresh(struct nvmlDevice_st *d)
{
    if (d->server < 0)
        return 0;
    server_state *ss = &st.servers[d->server];
    if (ss->refreshing || now_s() < ss->next_fetch)
        return 0;
    ss->refreshing = 1;
    config_ref *conf = st.conf;
    conf->refs++;
    unsigned long generation = st.generation;
    const gp_server_config *srv = ss->srv;
    char desc[sizeof ss->desc];
    memcpy(desc, ss->desc, sizeof desc);
    pthread_mutex_unlock(&lock);

    char err[512];
    gp_info_result *doc = fetch_doc(&conf->cfg, srv, err, sizeof err);
    if (!doc)
        gp_log_debug("nvml: refreshing %s failed (%s); showing the values from before", desc, err);

    if (pthread_mutex_lock(&lock) != 0) {
        doc_free(doc); /* conf stays referenced: better a leak than a free under a reader */
        return -2;
    }
    config_release(conf);
    if (st.refcount == 0 || st.generation != generation) {
        doc_free(doc); /* shut down (and maybe initialised again) meanwhile: not ours to show */
        return -1;
    }
    ss->refreshing = 0;
    fetched(ss, doc);
    if (doc) {
        for (unsigned i = 0; i < st.ndevices; i++) {
            struct nvmlDevice_st *o = &st.devices[i];
            if (o->server != d->server)
                continue;
            gp_info_gpu view;
            if (view_of(doc, o, &view) == 0)
                gp_nvml_live_from_view(&doc->reply, &view, &o->gpu.live);
            else
                gp_log_debug("nvml: %s no longer lists GPU %s", desc, o->gpu.uuid);
        }
        doc_free(doc);
    }
    return 0;
}

/* ------------------------------------------------------------------------------- init == */
/* Everything here runs in nvmlInit with init_lock held and st.refcount 0 (see the top). */

static int add_server(const gp_server_config *srv)
{
    if (st.nservers >= GP_MAX_SERVERS)
        return -1;
    server_state *ss = &st.servers[st.nservers];
    memset(ss, 0, sizeof *ss);
    ss->srv = srv;
    gp_server_desc(srv, ss->desc, sizeof ss->desc);
    return st.nservers++;
}

/* The first fetch of server s at init: its reply or NULL (err says why). */
static gp_info_result *init_fetch(const config_ref *conf, int s, char *err, size_t errcap)
{
    server_state *ss = &st.servers[s];
    gp_info_result *doc = fetch_doc(&conf->cfg, ss->srv, err, errcap);
    fetched(ss, doc);
    return doc;
}

static void add_device(int server, const gp_nvml_gpu *g)
{
    if (st.ndevices >= MAX_DEVICES) {
        gp_log_debug("nvml: more than %d GPUs; GPU %s of %s is left out", MAX_DEVICES, g->uuid,
                     server >= 0 ? st.servers[server].desc : "its server");
        return;
    }
    struct nvmlDevice_st *d = &st.devices[st.ndevices];
    d->index = (int)st.ndevices++;
    d->server = server;
    d->machine = server >= 0 ? server : GP_LEASE_MACHINE;
    d->ordinal = -1;
    memset(d->peer, GP_PEER_UNKNOWN, sizeof d->peer);
    memset(d->peer_atomics, GP_PEER_UNKNOWN, sizeof d->peer_atomics);
    d->gpu = *g;
}

/* A function of the process's libcuda.so.1, if it is loaded (never loads it), else NULL. The
 * process may have loaded it with RTLD_LOCAL (ctypes, cudart's dlopen), which RTLD_DEFAULT does
 * not search: ask the loader for the library itself. */
static void *libcuda_sym(const char *name)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    void *sym = dlsym(lib ? lib : RTLD_DEFAULT, name);
    if (lib)
        dlclose(lib); /* the library stays loaded: the program holds it */
    return sym;
}

/* This process's lease as our libcuda.so.1 describes it (gpupool_shim_lease). */
typedef struct shim_lease {
    char server[300], uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE], name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    unsigned long long session_id;
    int simulated;
} shim_lease;

/* This process's lease from our libcuda.so.1, if it is loaded and holds one: 1 with *out, else
 * 0. */
static int lease_of_this_process(shim_lease *out)
{
    void *sym = libcuda_sym("gpupool_shim_lease");
    if (!sym)
        return 0;
    int (*lease)(char *, size_t, char *, size_t, char *, size_t, unsigned long long *, int *);
    memcpy(&lease, &sym, sizeof lease); /* object pointer -> function pointer */
    memset(out, 0, sizeof *out);
    return lease(out->server, sizeof out->server, out->uuid, sizeof out->uuid, out->name,
                 sizeof out->name, &out->session_id, &out->simulated) == 1;
}

/* Two port numbers as written ("7070", "07070"): 1 when the same. */
static int same_port(const char *a, const char *b)
{
    char *ea, *eb;
    unsigned long x = strtoul(a, &ea, 10), y = strtoul(b, &eb, 10);
    return *a && *b && !*ea && !*eb && x == y;
}

/* The configured server a lease's "host:port" names (host case-insensitive, a bare host meaning
 * port GP_DEFAULT_PORT, as GPUPOOL_SERVER reads it), added to st.servers; -1 when none does:
 * the configured token and TLS files belong to their servers and go nowhere else. */
static int lease_server(const gp_client_config *cfg, const char *where)
{
    char host[256], port[32];
    if (gp_split_hostport(where, host, sizeof host, port, sizeof port) != 0)
        return -1;
    for (int i = 0; i < cfg->nservers; i++) {
        const gp_server_config *srv = &cfg->servers[i];
        if (strcasecmp(srv->host, host) == 0 && same_port(srv->port, port))
            return add_server(srv);
    }
    return -1;
}

/* The leased GPU as the lease itself describes it: no live values. */
static void gpu_from_lease(const shim_lease *lease, gp_nvml_gpu *g)
{
    memset(g, 0, sizeof *g);
    snprintf(g->name, sizeof g->name, "%s", lease->name);
    snprintf(g->uuid, sizeof g->uuid, "%s", lease->uuid);
    g->simulated = lease->simulated != 0;
    g->cc_major = g->cc_minor = -1;
}

static int parse_bus_id(const char *s, unsigned v[4]);

/* The CUDA driver API of our libcuda.so.1, which answers these from its device snapshots. */
typedef struct cuda_api {
    int (*count)(int *);
    int (*get)(int *, int);
    int (*uuid)(unsigned char *, int); /* cuDeviceGetUuid: a CUuuid is 16 bytes */
    int (*name)(char *, int, int);
    int (*bus_id)(char *, int, int);
    int (*total_mem)(size_t *, int);
    int (*attr)(int *, int, int);
    int (*can_access_peer)(int *, int, int);
    int (*p2p_attr)(int *, int, int, int);
} cuda_api;

#define CUDA_FN(field, name)                                                                       \
    do {                                                                                           \
        void *sym_ = libcuda_sym(name);                                                            \
        memcpy(&api->field, &sym_, sizeof api->field); /* object pointer -> function pointer */    \
    } while (0)

/* 1 when every function the lease's devices need is there (our libcuda.so.1 has them all). */
static int cuda_api_load(cuda_api *api)
{
    CUDA_FN(count, "cuDeviceGetCount");
    CUDA_FN(get, "cuDeviceGet");
    CUDA_FN(uuid, "cuDeviceGetUuid");
    CUDA_FN(name, "cuDeviceGetName");
    CUDA_FN(bus_id, "cuDeviceGetPCIBusId");
    CUDA_FN(total_mem, "cuDeviceTotalMem_v2");
    CUDA_FN(attr, "cuDeviceGetAttribute");
    CUDA_FN(can_access_peer, "cuDeviceCanAccessPeer");
    CUDA_FN(p2p_attr, "cuDeviceGetP2PAttribute"); /* optional: atomics stay unknown */
    return api->count && api->get && api->uuid && api->name && api->bus_id && api->total_mem &&
           api->attr && api->can_access_peer;
}

/* CUDA device `dev` as CUDA itself describes it (no live values): 0, or -1 when CUDA cannot
 * say which GPU it is. */
static int gpu_from_cuda(const cuda_api *api, int dev, gp_nvml_gpu *g)
{
    unsigned char u[16];
    memset(g, 0, sizeof *g);
    g->cc_major = g->cc_minor = -1;
    if (api->uuid(u, dev) != 0)
        return -1;
    snprintf(g->uuid, sizeof g->uuid,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1],
             u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14],
             u[15]);
    if (api->name(g->name, (int)sizeof g->name, dev) != 0)
        g->name[0] = '\0';
    char bus[32];
    unsigned v[4];
    if (api->bus_id(bus, (int)sizeof bus, dev) == 0 && parse_bus_id(bus, v) == 0)
        snprintf(g->pci_bus_id, sizeof g->pci_bus_id, "%08x:%02x:%02x.%x", v[0], v[1], v[2], v[3]);
    size_t total = 0;
    if (api->total_mem(&total, dev) == 0 && total > 0) {
        g->live.has_memory_total = 1;
        g->live.memory_total = total;
    }
    return 0;
}

/* What CUDA says of peer access between the lease's devices, asked once here (CUDA's answer
 * may take a request to the server; NVML answers from this table). */
static void lease_peers(const cuda_api *api)
{
    for (unsigned a = 0; a < st.ndevices; a++) {
        struct nvmlDevice_st *da = &st.devices[a];
        for (unsigned b = 0; b < st.ndevices; b++) {
            const struct nvmlDevice_st *db = &st.devices[b];
            int can = 0, atomics = 0;
            if (a == b || da->ordinal < 0 || db->ordinal < 0)
                continue;
            if (api->can_access_peer(&can, da->ordinal, db->ordinal) == 0)
                da->peer[b] = can ? GP_PEER_YES : GP_PEER_NO;
            /* CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED = 3 */
            if (api->p2p_attr && api->p2p_attr(&atomics, 3, da->ordinal, db->ordinal) == 0)
                da->peer_atomics[b] = atomics ? GP_PEER_YES : GP_PEER_NO;
        }
    }
}

/* Lease mode: the lease's GPUs as devices 0..N-1, in CUDA's order and with CUDA's UUIDs and
 * PCI bus ids (NCCL finds its GPU in NVML by the bus id CUDA gives), the live values of each
 * from the lease's server when it is a configured one. */
static void init_lease(const config_ref *conf, const shim_lease *lease)
{
    const char *where = lease->server;
    cuda_api api;
    int count = 0;
    if (!cuda_api_load(&api) || api.count(&count) != 0 || count < 1)
        count = 0; /* the lease itself still names device 0 */
    int s = lease_server(&conf->cfg, where);
    gp_info_result *doc = NULL;
    char err[512] = "";
    if (s < 0) {
        gp_log_debug("nvml: this process's GPU lease is on server \"%s\", which is none of the "
                     "configured servers; NVML shows its GPUs without live values (it sends the "
                     "configured credentials to no other server)",
                     where);
    } else {
        st.system_server = s;
        doc = init_fetch(conf, s, err, sizeof err);
    }
    for (int i = 0; i < (count ? count : 1); i++) {
        gp_nvml_gpu g, cuda;
        int dev = -1, known = 0;
        if (count && api.get(&dev, i) == 0 && gpu_from_cuda(&api, dev, &cuda) == 0)
            known = 1;
        else if (i == 0)
            gpu_from_lease(lease, &cuda); /* what the lease itself says of device 0 */
        else
            continue;
        gp_info_gpu view;
        if (doc && gp_nvml_find_gpu(&doc->reply, cuda.uuid, &view) == 0 &&
            gp_nvml_gpu_from_view(&doc->reply, &view, &g) == 0) {
            add_device(s, &g);
        } else {
            add_device(s, &cuda);
            if (s >= 0) {
                if (doc)
                    snprintf(err, sizeof err, "it does not list GPU %.100s", cuda.uuid);
                warn("nvml: cannot read the values of this process's GPU %s from %s (%s); NVML "
                     "shows the GPU without them",
                     cuda.uuid, st.servers[s].desc, err);
            }
        }
        struct nvmlDevice_st *d = &st.devices[st.ndevices - 1];
        d->ordinal = known ? dev : -1;
        if (d->gpu.cc_major < 0 && known) {
            int major = -1, minor = -1;
            /* CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75, _MINOR = 76 */
            if (api.attr(&major, 75, dev) == 0 && api.attr(&minor, 76, dev) == 0 && major >= 0 &&
                minor >= 0) {
                d->gpu.cc_major = major;
                d->gpu.cc_minor = minor;
            }
        }
        if (known && cuda.pci_bus_id[0]) /* CUDA's, which programs look the GPU up by */
            snprintf(d->gpu.pci_bus_id, sizeof d->gpu.pci_bus_id, "%s", cuda.pci_bus_id);
    }
    doc_free(doc);
    if (count)
        lease_peers(&api);
}

/* Every matching GPU of every configured server that answers. */
static void init_servers(const config_ref *conf)
{
    const gp_client_config *cfg = &conf->cfg;
    char why[1024] = "";
    size_t wl = 0;
    int answered = 0;
    for (int i = 0; i < cfg->nservers; i++) {
        int s = add_server(&cfg->servers[i]);
        if (s < 0)
            break;
        char err[512];
        gp_info_result *doc = init_fetch(conf, s, err, sizeof err);
        if (!doc) {
            if (wl < sizeof why - 1) {
                int n = snprintf(why + wl, sizeof why - wl, "%s%s: %s", wl ? "; " : "",
                                 st.servers[s].desc, err);
                if (n > 0)
                    wl += (size_t)n < sizeof why - wl ? (size_t)n : sizeof why - wl - 1;
            }
            continue;
        }
        answered++;
        if (st.system_server < 0)
            st.system_server = s;
        unsigned matching = 0, count = doc->reply.gpu_views.count;
        gp_record_span views = doc->reply.gpu_views;
        gp_info_gpu view;
        while (gp_info_gpu_next(&views, &view) == 0) {
            gp_nvml_gpu g;
            if (gp_nvml_gpu_from_view(&doc->reply, &view, &g) != 0)
                continue;
            if (!gp_nvml_gpu_matches(&g, cfg->gpu, cfg->model, cfg->min_memory))
                continue;
            add_device(s, &g);
            matching++;
        }
        gp_log_debug("nvml: %s: %u GPUs, %u meet the requirements", st.servers[s].desc, count,
                     matching);
        doc_free(doc);
    }
    if (!answered)
        warn("nvml: no GPU server answered (%s); NVML shows 0 GPUs (`gpupool doctor` checks "
             "the setup)",
             why);
}

/* Build the state (init_lock held, st.refcount 0, st.generation already moved on). */
static nvmlReturn_t build_state(config_ref **out)
{
    memset(&st.servers, 0, sizeof st.servers);
    st.nservers = 0;
    st.ndevices = 0;
    st.system_server = -1;
    st.lease_mode = 0;
    config_ref *conf = calloc(1, sizeof *conf);
    if (!conf)
        return NVML_ERROR_MEMORY;
    conf->refs = 1;
    char err[1024];
    shim_lease lease;
    if (gp_client_config_load(&conf->cfg, err, sizeof err) != 0) {
        warn("nvml: %s; NVML shows 0 GPUs", err);
        conf->cfg.nservers = 0;
    } else if (lease_of_this_process(&lease)) {
        st.lease_mode = 1;
        init_lease(conf, &lease);
    } else if (conf->cfg.nservers == 0) {
        warn("nvml: no GPU server is configured (set GPUPOOL_SERVER, or run `gpupool login URL "
             "--token TOKEN`); NVML shows 0 GPUs");
    } else {
        init_servers(conf);
    }
    *out = conf;
    return NVML_SUCCESS;
}

/* Which library this is, for `gpupool doctor` (libcuda.so.1 exports the same name). */
GP_NVML_EXPORT const char *gpupool_shim_version(void)
{
    return GPUPOOL_VERSION;
}

GP_NVML_EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags; /* NO_GPUS / NO_ATTACH: init never fails for want of GPUs anyway */
    if (pthread_mutex_lock(&init_lock) != 0)
        return NVML_ERROR_UNKNOWN;
    nvmlReturn_t r = NVML_SUCCESS;
    shim_lease lease;
    int leased = lease_of_this_process(&lease); /* asked without `lock`, as build_state does */
    if (pthread_mutex_lock(&lock) != 0) {
        pthread_mutex_unlock(&init_lock);
        return NVML_ERROR_UNKNOWN;
    }
    /* A process that initialised NVML before its first CUDA call (PyTorch counts devices with
     * NVML) and holds a lease now gets its lease's GPUs at its next nvmlInit, as NCCL's: the
     * table is built again, as after a shutdown (queries meanwhile answer UNINITIALIZED). */
    int first = st.refcount == 0, uses = 1;
    int relist = !first && !st.lease_mode && leased;
    if (relist) {
        uses = st.refcount + 1;
        st.refcount = 0;
        config_release(st.conf);
        st.conf = NULL;
    }
    if (first || relist)
        st.generation++; /* a refresh still in flight from before keeps off */
    else
        st.refcount++;
    pthread_mutex_unlock(&lock);
    if (first || relist) {
        config_ref *conf = NULL;
        r = build_state(&conf); /* the requests: without `lock` */
        if (pthread_mutex_lock(&lock) != 0) {
            free(conf);
            r = NVML_ERROR_UNKNOWN;
        } else {
            st.conf = conf; /* NULL after a failure: then no devices either */
            st.refcount = r == NVML_SUCCESS ? uses : uses - 1;
            pthread_mutex_unlock(&lock);
        }
    }
    pthread_mutex_unlock(&init_lock);
    return r;
}

GP_NVML_EXPORT nvmlReturn_t nvmlInit_v2(void)
{
    return nvmlInitWithFlags(0);
}
GP_NVML_EXPORT nvmlReturn_t nvmlInit(void)
{
    return nvmlInitWithFlags(0);
}

GP_NVML_EXPORT nvmlReturn_t nvmlShutdown(void)
{
    if (pthread_mutex_lock(&init_lock) != 0)
        return NVML_ERROR_UNKNOWN;
    if (pthread_mutex_lock(&lock) != 0) {
        pthread_mutex_unlock(&init_lock);
        return NVML_ERROR_UNKNOWN;
    }
    nvmlReturn_t r = NVML_SUCCESS;
    if (st.refcount == 0) {
        r = NVML_ERROR_UNINITIALIZED;
    } else if (--st.refcount == 0) {
        config_release(st.conf); /* a refresh in flight holds its own reference */
        st.conf = NULL;
        st.ndevices = 0;
        st.nservers = 0;
        st.system_server = -1;
    }
    pthread_mutex_unlock(&lock);
    pthread_mutex_unlock(&init_lock);
    return r;
}

GP_NVML_EXPORT const char *nvmlErrorString(nvmlReturn_t result)
{
    return gp_nvml_error_string(result);
}

nvmlReturn_t gp_nvml_unsupported(const char *name)
{
    if (pthread_mutex_lock(&lock) != 0)
        return NVML_ERROR_UNKNOWN;
    int initialised = st.refcount > 0;
    pthread_mutex_unlock(&lock);
    gp_log_debug("nvml: %s is not supported by gpupool's NVML", name);
    return initialised ? NVML_ERROR_NOT_SUPPORTED : NVML_ERROR_UNINITIALIZED;
}

/* ------------------------------------------------------------------------ system queries == */

/* Lock and check init; on NVML_SUCCESS the caller holds the lock and must unlock. */
static nvmlReturn_t enter(void)
{
    if (pthread_mutex_lock(&lock) != 0)
        return NVML_ERROR_UNKNOWN;
    if (st.refcount == 0) {
        pthread_mutex_unlock(&lock);
        return NVML_ERROR_UNINITIALIZED;
    }
    return NVML_SUCCESS;
}

void gp_nvml_leave(void)
{
    pthread_mutex_unlock(&lock);
}

/* The system server's info, or NULL (caller holds the lock). */
static const gp_nvml_server *system_info(void)
{
    if (st.system_server < 0 || !st.servers[st.system_server].answered)
        return NULL;
    return &st.servers[st.system_server].info;
}

GP_NVML_EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    nvmlReturn_t r = enter();
    if (r != NVML_SUCCESS)
        return r;
    const gp_nvml_server *s = system_info();
    if (!version)
        r = NVML_ERROR_INVALID_ARGUMENT;
    else if (!s || !s->driver_version[0])
        r = NVML_ERROR_NOT_SUPPORTED;
    else
        r = gp_nvml_copy_string(s->driver_version, version, length);
    gp_nvml_leave();
    return r;
}

GP_NVML_EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    nvmlReturn_t r = enter();
    if (r != NVML_SUCCESS)
        return r;
    const gp_nvml_server *s = system_info();
    if (!version) {
        r = NVML_ERROR_INVALID_ARGUMENT;
    } else if (!s || !s->driver_version[0] || !s->cuda_driver_version) {
        r = NVML_ERROR_NOT_SUPPORTED;
    } else {
        /* NVML's own form: the CUDA major version, then the driver version ("13.580.65.06") */
        char text[NVML_SYSTEM_NVML_VERSION_BUFFER_SIZE];
        snprintf(text, sizeof text, "%d.%s", s->cuda_driver_version / 1000, s->driver_version);
        r = gp_nvml_copy_string(text, version, length);
    }
    gp_nvml_leave();
    return r;
}

GP_NVML_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion)
{
    nvmlReturn_t r = enter();
    if (r != NVML_SUCCESS)
        return r;
    const gp_nvml_server *s = system_info();
    if (!cudaDriverVersion)
        r = NVML_ERROR_INVALID_ARGUMENT;
    else if (!s || !s->cuda_driver_version)
        r = NVML_ERROR_NOT_SUPPORTED;
    else
        *cudaDriverVersion = s->cuda_driver_version;
    gp_nvml_leave();
    return r;
}

GP_NVML_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion)
{
    return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}

GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    nvmlReturn_t r = enter();
    if (r != NVML_SUCCESS)
        return r;
    if (!deviceCount)
        r = NVML_ERROR_INVALID_ARGUMENT;
    else
        *deviceCount = st.ndevices;
    gp_nvml_leave();
    return r;
}

GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount)
{
    return nvmlDeviceGetCount_v2(deviceCount);
}

/* --------------------------------------------------------------------------- handles == */

GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    nvmlReturn_t r = enter();
    if (r != NVML_SUCCESS)
        return r;
    if (!device || index >= st.ndevices)
        r = NVML_ERROR_INVALID_ARGUMENT;
    else
        *device = &st.devices[index];
    gp_nvml_leave();
    return r;
}

GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    nvmlReturn_t r = enter();
    if (r != NVML_SUCCESS)
        return r;
    if (!uuid || !device) {
        r = NVML_ERROR_INVALID_ARGUMENT;
    } else {
        r = NVML_ERROR_NOT_FOUND;
        for (unsigned i = 0; i < st.ndevices; i++) {
            if (st.devices[i].gpu.uuid[0] && strcasecmp(st.devices[i].gpu.uuid, uuid) == 0) {
                *device = &st.devices[i];
                r = NVML_SUCCESS;
                break;
            }
        }
    }
    gp_nvml_leave();
    return r;
}

/* "domain:bus:device.function" in either width: 0 with the numbers, else -1. */
static int parse_bus_id(const char *s, unsigned v[4])
{
    char extra;
    if (sscanf(s, "%x:%x:%x.%x%c", &v[0], &v[1], &v[2], &v[3], &extra) == 4)
        return 0;
    v[3] = 0;
    if (sscanf(s, "%x:%x:%x%c", &v[0], &v[1], &v[2], &extra) == 3)
        return 0;
    return -1;
}

GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId,
                                                             nvmlDevice_t *device)
{
    nvmlReturn_t r = enter();
    if (r != NVML_SUCCESS)
        return r;
    unsigned want[4], have[4];
    if (!pciBusId || !device || parse_bus_id(pciBusId, want) != 0) {
        r = NVML_ERROR_INVALID_ARGUMENT;
    } else {
        r = NVML_ERROR_NOT_FOUND;
        for (unsigned i = 0; i < st.ndevices; i++) {
            if (parse_bus_id(st.devices[i].gpu.pci_bus_id, have) == 0 &&
                memcmp(want, have, sizeof want) == 0) {
                *device = &st.devices[i];
                r = NVML_SUCCESS;
                break;
            }
        }
    }
    gp_nvml_leave();
    return r;
}

GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *pciBusId,
                                                          nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByPciBusId_v2(pciBusId, device);
}

struct nvmlDevice_st *gp_nvml_device_locked(nvmlDevice_t device)
{
    uintptr_t p = (uintptr_t)device, base = (uintptr_t)st.devices;
    if (p < base || p >= base + st.ndevices * sizeof st.devices[0] ||
        (p - base) % sizeof st.devices[0] != 0)
        return NULL;
    return &st.devices[(p - base) / sizeof st.devices[0]];
}

nvmlReturn_t gp_nvml_enter_device(nvmlDevice_t device, int live, struct nvmlDevice_st **out)
{
    nvmlReturn_t r = enter();
    if (r != NVML_SUCCESS)
        return r;
    uintptr_t p = (uintptr_t)device, base = (uintptr_t)st.devices;
    if (p < base || p >= base + st.ndevices * sizeof st.devices[0] ||
        (p - base) % sizeof st.devices[0] != 0) {
        gp_nvml_leave();
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *out = &st.devices[(p - base) / sizeof st.devices[0]];
    if (live) {
        int rc = refresh(*out);
        if (rc == -2)
            return NVML_ERROR_UNKNOWN; /* the lock is not held */
        if (rc == -1) {
            gp_nvml_leave();
            return NVML_ERROR_UNINITIALIZED; /* nvmlShutdown ran meanwhile */
        }
    }
    return NVML_SUCCESS;
}

GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t r = gp_nvml_enter_device(device, 0, &d);
    if (r != NVML_SUCCESS)
        return r;
    if (!index)
        r = NVML_ERROR_INVALID_ARGUMENT;
    else
        *index = (unsigned)(d - st.devices);
    gp_nvml_leave();
    return r;
}

GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor)
{
    return nvmlDeviceGetIndex(device, minor);
}

GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t r = gp_nvml_enter_device(device, 0, &d);
    if (r != NVML_SUCCESS)
        return r;
    r = gp_nvml_copy_string(d->gpu.name, name, length);
    gp_nvml_leave();
    return r;
}

GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t r = gp_nvml_enter_device(device, 0, &d);
    if (r != NVML_SUCCESS)
        return r;
    r = d->gpu.uuid[0] ? gp_nvml_copy_string(d->gpu.uuid, uuid, length) : NVML_ERROR_NOT_SUPPORTED;
    gp_nvml_leave();
    return r;
}

GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t device, char *serial,
                                                unsigned int length)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t r = gp_nvml_enter_device(device, 0, &d);
    if (r != NVML_SUCCESS)
        return r;
    r = serial ? NVML_ERROR_NOT_SUPPORTED : NVML_ERROR_INVALID_ARGUMENT;
    (void)length;
    gp_nvml_leave();
    return r;
}

GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t device, nvmlBrandType_t *type)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t r = gp_nvml_enter_device(device, 0, &d);
    if (r != NVML_SUCCESS)
        return r;
    if (!type)
        r = NVML_ERROR_INVALID_ARGUMENT;
    else
        *type = gp_nvml_brand(d->gpu.name);
    gp_nvml_leave();
    return r;
}

GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major,
                                                               int *minor)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t r = gp_nvml_enter_device(device, 0, &d);
    if (r != NVML_SUCCESS)
        return r;
    if (!major || !minor) {
        r = NVML_ERROR_INVALID_ARGUMENT;
    } else if (d->gpu.cc_major < 0) {
        r = NVML_ERROR_NOT_SUPPORTED;
    } else {
        *major = d->gpu.cc_major;
        *minor = d->gpu.cc_minor;
    }
    gp_nvml_leave();
    return r;
}

static nvmlReturn_t pci(nvmlDevice_t device, void *p, int version)
{
    struct nvmlDevice_st *d;
    nvmlReturn_t r = gp_nvml_enter_device(device, 0, &d);
    if (r != NVML_SUCCESS)
        return r;
    r = gp_nvml_pci_info(&d->gpu, p, version);
    gp_nvml_leave();
    return r;
}

GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *p)
{
    return pci(device, p, 3);
}
GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_v2_t *p)
{
    return pci(device, p, 2);
}
GP_NVML_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_v2_t *p)
{
    return pci(device, p, 1);
}
