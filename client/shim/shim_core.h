/*
 * shim_core.h: declarations shared by the shim core's own files (the connection: connect.c,
 * conn.c, conn_route.c, conn_life.c, conn_read.c, conn_write.c, keepalive.c, pending.c,
 * request_ids.c; the local state: state.c, vamap.c, call_entry.c, hooks.c; and api_init.c,
 * api_ctx.c, api_memory.c, api_stream.c, api_event.c, api_vmm.c...). Other shim code uses
 * shim.h only.
 */
#ifndef GP_SHIM_CORE_H
#define GP_SHIM_CORE_H

#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>

#include "client_config.h"
#include "gp_cuda_more.h"
#include "gp_tls.h"
#include "shim.h"

/* What cuDriverGetVersion reports when no server could be asked: the CUDA version this shim
 * was written against. cudart 13 needs at least 13000, so with this value it goes on to cuInit,
 * which then fails with CUDA_ERROR_NO_DEVICE and the reason printed once. */
#define GP_FALLBACK_DRIVER_VERSION 13000

/* CLOCK_MONOTONIC in nanoseconds. */
static inline uint64_t gp_mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- vamap.c: the window (conn.c reserves it before connecting) ---------------------------- */
int gp_vamap_reserve_window(uint64_t base, uint64_t size); /* 0, or -1 with errno */
void gp_vamap_release_window(void);

/* ---- conn.c, conn_life.c --------------------------------------------------------------------- */
/* cuInit: gp_conn_ensure, then the calls that need initialisation work. */
CUresult gp_conn_init(void);
/* 1 once gp_conn_ensure has been tried in this process (whatever the outcome). */
int gp_conn_attempted(void);
/* Server description for messages ("host:port"), "" before connecting. */
const char *gp_conn_server(void);

/* ---- keepalive.c, conn_read.c, conn_write.c: one connection's clock and streams, in
 * conn_state.h (the connection's own files only) ----------------------------------------------- */

/* ---- pending.c ------------------------------------------------------------------------------- */
/* A fire-and-forget call failed with `code` (a CUresult or GP_E* code; 0: nothing): the next
 * synchronising call returns it, unless an earlier one is still pending. */
void gp_pending_record(int32_t code);
/* A notice frame from the server during the session: print its text once per distinct text and
 * record its code as the pending error; an informational code (gp_code_is_info) is printed every
 * time and never recorded. (Notices before the hello reply are connect.c's: never recorded.) */
void gp_pending_notice(const uint8_t *body, size_t len);

/* ---- connect.c ------------------------------------------------------------------------------- */
/* Load the configuration (client_config.c), pick a server (one configured: it; several: probe
 * each with `info` and take the best: docs/architecture.md, "Server selection"), reserve the
 * window, connect and say hello; on success the snapshot is stored (gp_state_set_snapshot),
 * *sock_out is the connected socket, *tls_out the TLS session with the worker (NULL for
 * plaintext), *features_out what both sides agreed in the hello (GP_HELLO_LZ4: compressed
 * copies; GP_HELLO_KEEPALIVE: the server is never silent towards a waiting client, so a silent
 * one may be timed out) and server_desc names the server ("host:port"). Otherwise one line went
 * to stderr: CUDA_ERROR_NO_DEVICE. */
CUresult gp_connect(int *sock_out, gp_tls **tls_out, unsigned *features_out, char *server_desc,
                    size_t desc_cap);
/* A fresh request id (one counter for every frame of the process's connections). */
uint64_t gp_conn_new_req(void);
/* ---- close_hook.c ---------------------------------------------------------------------------- */
/* fn runs at exit while the session is still open, before the goodbye (the profile asks the
 * worker for its times: profile.c); set once, when the library loads. The connection runs it
 * (gp_conn_close_hook_run) without naming what it is, so that conn.c depends on nothing above. */
void gp_conn_set_close_hook(void (*fn)(void));
void gp_conn_close_hook_run(void);
/* GPUPOOL_SERVER_TIMEOUT: seconds of silence after which a server that sends keepalives is
 * given up (3 to 86400; 0: never); 30 when unset or invalid (said once). */
double gp_server_timeout_setting(void);

/* ---- state.c --------------------------------------------------------------------------------- */
/* Called by conn.c with a successful hello reply: stores the device snapshot. */
void gp_state_set_snapshot(const gp_hello_reply *r);
/* The driver version reported by cuDriverGetVersion and hashed by the integrity check. */
int gp_reported_driver_version(void);
/* The lease's session id (from the hello reply), 0 before it. */
uint64_t gp_session_id(void);
/* spread_copy of the client configuration (GP_SPREAD_COPY_*), stored when connecting. */
void gp_state_set_spread_copy(int mode);
int gp_state_spread_copy(void);

typedef struct gp_ctx_obj {
    uint64_t id;
    int device;
    int primary;
    unsigned flags;
    int cache_config;
    int shmem_config;
    uint64_t limit_set; /* bit i: limit i was set by the program (value in limit_val[i]) */
    uint64_t limit_val[64];
    _Atomic uint64_t peer_on; /* bit d: cuCtxEnablePeerAccess to a context of device d (issue 37) */
} gp_ctx_obj;

/* The live context object behind handle h (primary included), or NULL. */
gp_ctx_obj *gp_ctx_obj_get(uint64_t h);
/* The calling thread's current context object, or NULL. */
gp_ctx_obj *gp_ctx_current_obj(void);
/* Drop everything the client knows about a context's resources (device ranges, streams,
 * events). Used by cuCtxDestroy and primary context reset, after the context-local storage
 * (export_tables.c, gp_cls_context_destroyed). */
void gp_ctx_forget_resources(uint64_t ctx);

/* Thread-local context stack. */
int gp_ctx_stack_push(uint64_t ctx); /* 0, or -1 when full */
uint64_t gp_ctx_stack_pop(void);     /* the popped handle, 0 if the stack was empty */
void gp_ctx_stack_set_top(uint64_t ctx);

/* Primary context bookkeeping, per device (dev: a valid ordinal). */
typedef struct gp_primary_state {
    int retained; /* retain count */
    unsigned flags;
} gp_primary_state;
void gp_primary_get(int dev, gp_primary_state *out);
int gp_primary_retain(int dev);                 /* returns the new count */
int gp_primary_release(int dev, int *was_last); /* -1 if it was not retained */
void gp_primary_set_flags(int dev, unsigned flags);
void gp_primary_reset_local(int dev);
/* k if h is device k's primary context (GP_PRIMARY_CTX_OF(k), k < the device count), else -1. */
int gp_primary_index(uint64_t h);

/* A lease of several devices (issue 37): the hello reply's device_count (0 before a connect),
 * each device's snapshot and peer rows from device_props (k = 0 takes only the rows), and the
 * count the program sees once they are in. */
int gp_device_announced(void);
/* first: the first device of k's part (0 for a lease of one server): the reply's peer arrays
 * count from there, and a part's first device keeps what its hello reply said. */
void gp_state_add_device(int k, int first, const gp_device_props_reply *r);
void gp_state_devices_ready(int n);
/* api_device.c: the snapshots of a lease's other devices, asked once, at the first cuInit
 * (api_init.c); the program sees them only when all are in (one that cannot be read ends the
 * list there, with a line). */
void gp_devices_fetch(void);
/* The server driver's cuDeviceCanAccessPeer(dev, peer) and cuDeviceGetP2PAttribute(attr, dev,
 * peer) (attr 1..4); 0 for anything out of range. */
int gp_device_can_access_peer(int dev, int peer_dev);
int gp_device_p2p_attribute(int dev, int peer_dev, int attr);

/* ---- streams and events (api_stream.c / api_event.c) ------------------------------------- */
typedef struct gp_stream_obj {
    uint64_t id;
    uint64_t ctx;
    unsigned flags;
    int priority;
} gp_stream_obj;

typedef struct gp_event_obj {
    uint64_t id;
    uint64_t ctx;
    unsigned flags;
} gp_event_obj;
/* A new event of the calling thread's current context with these flags, under a new handle
 * (api_event.c; the caller tells the worker); NULL when out of memory. */
gp_event_obj *gp_event_new(unsigned flags);
/* Wait on the host until event e of context ctx has happened (api_event.c; a spread lease's
 * cuStreamWaitEvent on an event of another part). */
CUresult gp_event_wait_host(uint64_t e, uint64_t ctx);

/* Resolve a program's stream for a call: sets *wire and, for a created stream, makes the
 * worker use the stream's context; for the default streams the calling thread needs a current
 * context (gp_ctx_enter). Returns CUDA_SUCCESS or the error to return. */
CUresult gp_stream_enter(CUstream s, uint64_t *wire);

/* The dummy default memory pool handle (api_init.c). */
uint64_t gp_default_mempool(void);

/* Sync calls: the server's result, or the pending error of an earlier asynchronous call. */
CUresult gp_sync_result(CUresult r);

#endif /* GP_SHIM_CORE_H */
