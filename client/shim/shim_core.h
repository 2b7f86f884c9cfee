/*
 * shim_core.h: declarations shared by the shim core's own files (conn.c, state.c, vamap.c,
 * api_init.c, api_memory.c, api_stream.c, api_event.c). Other shim code uses shim.h only.
 */
#ifndef GP_SHIM_CORE_H
#define GP_SHIM_CORE_H

#include <stdint.h>
#include <sys/types.h>

#include "client_config.h"
#include "gp_cuda_more.h"
#include "gp_tls.h"
#include "shim.h"

/* What cuDriverGetVersion reports when no server could be asked: the CUDA version this shim
 * was written against. cudart 13 needs at least 13000, so with this value it goes on to cuInit,
 * which then fails with CUDA_ERROR_NO_DEVICE and the reason printed once. */
#define GP_FALLBACK_DRIVER_VERSION 13000

/* ---- vamap.c: the window (conn.c reserves it before connecting) ---------------------------- */
int gp_vamap_reserve_window(uint64_t base, uint64_t size); /* 0, or -1 with errno */
void gp_vamap_release_window(void);

/* ---- conn.c ---------------------------------------------------------------------------------- */
/* cuInit: gp_conn_ensure, then the calls that need initialisation work. */
CUresult gp_conn_init(void);
/* 1 once gp_conn_ensure has been tried in this process (whatever the outcome). */
int gp_conn_attempted(void);
/* Server description for messages ("host:port"), "" before connecting. */
const char *gp_conn_server(void);
/* A fresh request id. */
uint64_t gp_conn_new_req(void);
/* A notice frame from the server during the session: print its text once per distinct text and
 * record its code as the pending error; an informational code (gp_code_is_info) is printed every
 * time and never recorded. (Notices before the hello reply are connect.c's: never recorded.) */
void gp_conn_notice(const uint8_t *body, size_t len);

/* ---- connect.c ------------------------------------------------------------------------------- */
/* Load the configuration (client_config.c), pick a server (one configured: it; several: probe
 * each with `info` and take the best: docs/architecture.md, "Server selection"), reserve the
 * window, connect and say hello; on success the snapshot is stored (gp_state_set_snapshot),
 * *sock_out is the connected socket, *tls_out the TLS session with the worker (NULL for
 * plaintext) and server_desc names the server ("host:port"). Otherwise one line went to stderr:
 * CUDA_ERROR_NO_DEVICE. */
CUresult gp_connect(int *sock_out, gp_tls **tls_out, char *server_desc, size_t desc_cap);

/* ---- state.c --------------------------------------------------------------------------------- */
/* Called by conn.c with a successful hello reply: stores the device snapshot. */
void gp_state_set_snapshot(const gp_hello_reply *r);
/* The driver version reported by cuDriverGetVersion and hashed by the integrity check. */
int gp_reported_driver_version(void);

typedef struct gp_ctx_obj {
    uint64_t id;
    int device;
    int primary;
    unsigned flags;
    int cache_config;
    int shmem_config;
    uint64_t limit_set; /* bit i: limit i was set by the program (value in limit_val[i]) */
    uint64_t limit_val[64];
} gp_ctx_obj;

/* The live context object behind handle h (primary included), or NULL. */
gp_ctx_obj *gp_ctx_obj_get(uint64_t h);
/* The calling thread's current context object, or NULL. */
gp_ctx_obj *gp_ctx_current_obj(void);
/* Drop everything the client knows about a context's resources (device ranges, streams,
 * events) and its context-local storage. Used by cuCtxDestroy and primary context reset. */
void gp_ctx_forget_resources(uint64_t ctx);

/* Thread-local context stack. */
int gp_ctx_stack_push(uint64_t ctx); /* 0, or -1 when full */
uint64_t gp_ctx_stack_pop(void);     /* the popped handle, 0 if the stack was empty */
void gp_ctx_stack_set_top(uint64_t ctx);

/* Primary context bookkeeping (one device). */
typedef struct gp_primary_state {
    int retained; /* retain count */
    unsigned flags;
} gp_primary_state;
void gp_primary_get(gp_primary_state *out);
int gp_primary_retain(void);           /* returns the new count */
int gp_primary_release(int *was_last); /* -1 if it was not retained */
void gp_primary_set_flags(unsigned flags);
void gp_primary_reset_local(void);

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

/* Resolve a program's stream for a call: sets *wire and, for a created stream, makes the
 * worker use the stream's context; for the default streams the calling thread needs a current
 * context (gp_ctx_enter). Returns CUDA_SUCCESS or the error to return. */
CUresult gp_stream_enter(CUstream s, uint64_t *wire);

/* The dummy default memory pool handle (api_init.c). */
uint64_t gp_default_mempool(void);

/* Sync calls: the server's result, or the pending error of an earlier asynchronous call. */
CUresult gp_sync_result(CUresult r);

#endif /* GP_SHIM_CORE_H */
