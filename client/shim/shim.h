/*
 * shim.h: the internal contract of the client shim (our libcuda.so.1).
 *
 * Layers, bottom up (each file calls only those above it in this list, never one below: the
 * layout test, tests/test_layout.py, fails on a circle):
 *   handles.c    client-chosen handles (streams, events, contexts, modules, functions).
 *   vamap.c      the VA window and the map of every device/host range the program got from us.
 *   state.c      device snapshot, contexts (thread-local current context stack), primary.
 *   connect.c    configuration, server choice, VA window, hello: a connected socket.
 *   conn.c       the connection to the worker (one per part of a spread lease, each frame
 *                routed to its part: conn_route.c; started and ended: conn_life.c): send
 *                batching, the receiver thread, waiters, async device-to-host delivery, loss
 *                of connection.
 *   call_entry.c what a call does first: connection checked, context resolved and handed on.
 *   hooks.c      the answers to the NVML shim, `gpupool doctor`, the export tables.
 *   api_*.c      the cu* entry points, grouped by area, each a thin function on the above.
 * Everything here is thread-safe unless it says otherwise.
 */
#ifndef GP_SHIM_H
#define GP_SHIM_H

#include <stdint.h>
#include <stdlib.h>

#include "gp_cuda.h"
#include "gp_protocol.h"

#define GP_EXPORT __attribute__((visibility("default")))

/* ---- logging (log.c, gp_log.h) --------------------------------------------------------- */
#include "gp_log.h"

/* ---- connection (conn.c, conn_route.c, conn_life.c) ------------------------------------- */
/* Connects on first use (from cuInit): reads the client configuration (client_config.h: the
 * file, GPUPOOL_SERVER, GPUPOOL_TOKEN...), picks a server, reserves the VA window, sends hello,
 * stores the snapshot. Returns CUDA_SUCCESS, or CUDA_ERROR_NO_DEVICE
 * (server unreachable or refused; the reason has been printed once), or the loss error. */
CUresult gp_conn_ensure(void);

/* The error every call returns once the connection is lost. */
#define GP_LOST_CONNECTION_ERROR CUDA_ERROR_DEVICE_UNAVAILABLE

/* Queue a fire-and-forget frame (header + body already encoded in `frame`; the request id in
 * bytes 8..15 is assigned here). `bulk` (may be NULL/0) is streamed after it without copying
 * when large. Returns the loss error if the connection is gone, else CUDA_SUCCESS. */
CUresult gp_post(uint8_t *frame, size_t frame_len, const void *bulk, uint64_t bulk_len);
/* gp_post for a memcpy_htod of n bytes whose bulk goes as LZ4 blocks (compress.h): only when
 * gp_conn_lz4() and gp_cz_applies(n). Encodes piece by piece while it sends. */
CUresult gp_post_lz4(uint8_t *frame, size_t frame_len, const void *src, uint64_t n);
/* LZ4-compressed copies were negotiated in the hello (gp_connect's features). */
int gp_conn_lz4(void);

/* A decoded reply: `body` points at the reply body (starting with the i32 result). */
typedef struct gp_reply {
    int32_t result; /* the CUresult (or GP_E* code) the server returned */
    uint8_t *body;  /* malloc'ed reply body; free with gp_reply_free */
    size_t len;
    uint64_t bulk_len; /* bytes of reply bulk written to the caller's bulk_dst */
} gp_reply;

/* Send a request and wait for its reply. Reply bulk data (if any) is written straight into
 * bulk_dst (up to bulk_cap bytes; more is an error). The connection's pending batch is flushed
 * first, so the server sees every earlier frame before this one. On success the caller decodes
 * reply->body with the generated gp_*_reply_decode and calls gp_reply_free.
 * Returns CUDA_SUCCESS when the reply arrived with result 0; otherwise the transport error
 * (not initialised, lost connection) or the server's non-zero result (also in reply->result,
 * which may be a GP_E* code: see gp_cu_result). On a non-zero return reply->body is already
 * freed (NULL); gp_reply_free is harmless either way. */
CUresult gp_request(uint8_t *frame, size_t frame_len, const void *bulk, uint64_t bulk_len,
                    void *bulk_dst, uint64_t bulk_cap, gp_reply *reply);
void gp_reply_free(gp_reply *reply);

/* Waits until the worker has handled every frame sent before: a ping's round trip (replies come
 * in order). Session frames are the connection's to send, not an api_<group>.c's. */
CUresult gp_round_trip(void);

/* Send a request whose reply nobody waits for (async device-to-host copy): the receiver thread
 * writes the reply bulk into bulk_dst when it arrives and records a non-zero result as the
 * pending error. Data is guaranteed in place before any later reply is delivered. */
CUresult gp_request_detached(uint8_t *frame, size_t frame_len, void *bulk_dst, uint64_t bulk_cap);

/* Make sure the worker's current context is `ctx_id` before the next frame (sends
 * ctx_set_current only when it changes). The choice is per calling thread and is applied
 * atomically with each frame the thread sends (gp_post / gp_request / gp_request_detached), so
 * threads with different current contexts can interleave safely. gp_ctx_enter calls it with the
 * thread's current context; call it yourself for calls that name their context (a stream's or
 * an event's). 0 leaves the worker's context as it is. */
void gp_conn_use_ctx(uint64_t ctx_id);
/* The calling thread's context for the worker, as gp_conn_use_ctx last set it (0: none). */
uint64_t gp_conn_wire_ctx(void);
/* The worker dropped (or may have changed) its current context: resend before the next frame. */
void gp_conn_forget_ctx(void);
/* A lease spread over servers (docs/multi-gpu.md, "Across servers") has one connection per part;
 * a frame goes to the part of the calling thread's context unless the thread routes it elsewhere.
 * gp_conn_parts: the number of parts (1 for a lease of one server). gp_conn_part_of_device /
 * gp_conn_part_of_addr: the part holding device ordinal dev / device address a (-1: none).
 * gp_conn_next_part: the part the thread's next frame goes to (the part it routed to, else its
 * context's; 0 without a context). gp_conn_route(p):
 * the thread's next frames go to part p (-1: back to its context's part); the thread's context
 * switch is sent only to its own part, so on another part the worker uses the context it last
 * had (calls that name their device in the body or use unified addresses need no more).
 * gp_conn_local_device: dev as its part's worker numbers it (dev - the part's first device). */
int gp_conn_parts(void);
int gp_conn_part_of_device(int dev);
int gp_conn_part_of_addr(uint64_t a);
int gp_conn_next_part(void);
void gp_conn_route(int part);
int gp_conn_local_device(int dev);
/* Part p's first device ordinal and its server ("host:port", for messages); -1 / "" if none. */
int gp_conn_part_first_device(int p);
const char *gp_conn_part_server(int p);
/* Part p's connection runs inside TLS (set before it is ready, then read-only). */
int gp_conn_part_tls(int p);

/* api_peer.c: a copy of n bytes from src (on part ps, whose worker runs it in context sctx) to
 * dst (part pd, context dctx) of a spread lease, server to server (issue 37, item 3). The caller
 * waited for the stream's earlier work; this waits for the legacy streams of sctx and dctx. *through_client = 1: not done, the caller copies through
 * this process (spread_copy = client, a worker older than protocol 1.9, or "auto" after the
 * link failed; CUDA_SUCCESS); else the copy's result (CUDA_ERROR_NOT_SUPPORTED when "server"
 * cannot link). */
CUresult gp_spread_copy_direct(uint64_t dst, int pd, uint64_t dctx, uint64_t src, int ps,
                               uint64_t sctx, size_t n, int *through_client);

/* Error of an earlier fire-and-forget call that the server reported in a notice and no
 * synchronising call has returned yet: returns it and clears it (sticky ones stay). */
CUresult gp_take_pending_error(void);

/* A result from the server as a CUresult for the program: GP_E* protocol codes (>= 100000)
 * become CUDA_ERROR_UNKNOWN, everything else passes through. */
CUresult gp_cu_result(int32_t r);

/* CUDA_SUCCESS once cuInit succeeded and the connection is alive; CUDA_ERROR_NOT_INITIALIZED
 * before (or after a failed cuInit, or in a child after fork), CUDA_ERROR_DEINITIALIZED once the
 * process is exiting, the loss error once the connection is gone. Cheap (one atomic load). */
CUresult gp_check_init(void);

/* Waits for the work queued on stream `wire` (a stream_synchronize round trip), for the copies
 * that must see it done (api_stream.c). */
CUresult gp_stream_wait_wire(uint64_t wire);

/* gp_check_init, then a valid device ordinal: CUDA_SUCCESS, else the error to return
 * (api_init.c). */
CUresult gp_check_dev(CUdevice dev);

/* Encode generated message `type_` (e.g. gp_launch) pointed to by msgp_ into a frame buffer
 * named buf_ of length len_; small frames live on the stack. Pair with GP_FRAME_FREE. */
#define GP_FRAME(buf_, len_, type_, msgp_)                                                         \
    uint8_t buf_##_stack[1024];                                                                    \
    size_t len_ = 16 + type_##_size(msgp_);                                                        \
    uint8_t *buf_ = len_ <= sizeof buf_##_stack ? buf_##_stack : (uint8_t *)malloc(len_);          \
    if (buf_)                                                                                      \
    type_##_frame(buf_, 0, msgp_)
#define GP_FRAME_FREE(buf_)                                                                        \
    do {                                                                                           \
        if (buf_ != buf_##_stack)                                                                  \
            free(buf_);                                                                            \
    } while (0)

/* ---- handles (handles.c) ---------------------------------------------------------------- */
enum gp_handle_kind {
    GP_H_CTX = 1,
    GP_H_STREAM = 2,
    GP_H_EVENT = 3,
    GP_H_MODULE = 4,  /* CUmodule */
    GP_H_LIBRARY = 5, /* CUlibrary */
    GP_H_FUNC = 6,    /* CUfunction */
    GP_H_KERNEL = 7,  /* CUkernel */
    GP_H_MEMPOOL = 8,
    GP_H_LINK = 9,
};
#define GP_HANDLE_TAG 0x6750000000000000ull
/* Register obj under a fresh handle of that kind; returns the handle (also the wire id). */
uint64_t gp_handle_new(enum gp_handle_kind kind, void *obj);
/* The object behind h if h is a live handle of that kind, else NULL. */
void *gp_handle_get(uint64_t h, enum gp_handle_kind kind);
/* Unregister; returns the object (caller frees it) or NULL if h was not live. */
void *gp_handle_remove(uint64_t h, enum gp_handle_kind kind);
/* Register obj under a fixed handle value (e.g. GP_PRIMARY_CTX_ID): 0, or -1 if h is taken or
 * not a handle of that kind. */
int gp_handle_register(uint64_t h, enum gp_handle_kind kind, void *obj);
/* Remove every live handle of `kind` for which pred(h, obj, arg) returns non-zero, calling
 * dispose(obj) for each (may be NULL) after the map's lock is released. Returns the count. */
int gp_handle_remove_if(enum gp_handle_kind kind, int (*pred)(uint64_t h, void *obj, void *arg),
                        void *arg, void (*dispose)(void *obj));
/* The kind bits of a handle value (0 if it does not carry the tag). */
static inline int gp_handle_kind_of(uint64_t h)
{
    return (h & 0xffff000000000000ull) == GP_HANDLE_TAG ? (int)((h >> 40) & 0xff) : 0;
}

/* ---- VA map (vamap.c) ------------------------------------------------------------------- */
enum gp_range_kind {
    GP_RANGE_DEVICE = 1,     /* device allocation (cuMemAlloc etc.) */
    GP_RANGE_GLOBAL = 2,     /* module global reserved at the server's address */
    GP_RANGE_HOST_ALLOC = 3, /* cuMemHostAlloc / cuMemAllocHost: local memory */
    GP_RANGE_HOST_REG = 4,   /* cuMemHostRegister'ed local memory */
};
typedef struct gp_range {
    uint64_t base, size;
    enum gp_range_kind kind;
    uint64_t ctx;         /* context handle it belongs to */
    unsigned flags;       /* kind-specific (host alloc flags...) */
    uint64_t buffer_id;   /* unique per range, for CU_POINTER_ATTRIBUTE_BUFFER_ID */
    uint64_t mapped_size; /* device: bytes the server mapped (granularity-rounded); else 0 */
} gp_range;
/* Range flags for device kinds (gp_range.flags). */
#define GP_RANGE_F_ASYNC 0x1u /* from cuMemAllocAsync / cuMemAllocFromPoolAsync */
#define GP_RANGE_F_IPC 0x400u /* cuIpcOpenMemHandle's mapping: cuIpcCloseMemHandle ends it */
/* 0, or -1 if it overlaps (or size is 0). buffer_id 0 gets a fresh unique id. */
int gp_vamap_add(const gp_range *r);
int gp_vamap_remove(uint64_t base, gp_range *out); /* 0 and the removed range, or -1 */
int gp_vamap_find(uint64_t addr, gp_range *out);   /* range containing addr: 0, else -1 */
/* 1 if [addr, addr+len) lies inside one device or global range. */
int gp_vamap_device_span(uint64_t addr, uint64_t len);
/* 1 if [addr, addr+len) lies inside one host range (cuMemHostAlloc'd or registered memory,
 * whose device alias is its host address: mapped host memory). */
int gp_vamap_host_span(uint64_t addr, uint64_t len);
/* The client's reserved window for device memory (0, 0 before it is reserved). */
uint64_t gp_vamap_window_base(void);
uint64_t gp_vamap_window_size(void);
/* 1 if addr lies inside the reserved window. */
int gp_vamap_in_window(uint64_t addr);
/* Module global at an address the server's driver chose: reserves its pages PROT_NONE on the
 * client when they are outside the window (best effort, so that no host allocation can ever
 * land there) and records a GP_RANGE_GLOBAL range. Idempotent for the same (base, size).
 * Returns 0, or -1 if it overlaps a different range. */
int gp_vamap_add_global(uint64_t base, uint64_t size, uint64_t ctx);
/* A lease spread over servers: another part's copy of a global at the same address and size is
 * a "twin" of the one in the map (gp_vamap_add_global keeps it aside). gp_vamap_remove_global:
 * forget context ctx's copy of the global at base (a twin takes the map's place): 0, or -1.
 * gp_vamap_global_of: the copy (the map's or a twin) of the global containing addr whose
 * context `wanted` accepts: 0, else -1. gp_conn_find_range (conn_route.c): gp_vamap_find for
 * the calling thread, which gets its own part's copy of such a global when there is one. */
int gp_vamap_remove_global(uint64_t base, uint64_t ctx);
int gp_vamap_global_of(uint64_t addr, int (*wanted)(uint64_t ctx), gp_range *out);
int gp_conn_find_range(uint64_t addr, gp_range *out);
/* Forget every device/global range of context ctx (context destroyed or reset); returns how
 * many. Host ranges stay: the program may still touch its own memory. */
int gp_vamap_remove_ctx(uint64_t ctx);

/* ---- device and contexts (state.c) ------------------------------------------------------ */
typedef struct gp_device_snapshot {
    char name[256];
    CUuuid uuid;
    uint64_t total_mem;
    uint64_t memory_quota; /* device 0: the hello reply's memory_quota (issue 32), 0 = none */
    int driver_version;
    int pci_domain, pci_bus, pci_device;
    int attributes[512]; /* index = CUdevice_attribute */
    int attribute_count;
    uint64_t limits[64];
    int limit_count;
    int stream_priority_least, stream_priority_greatest;
    uint64_t granularity;
    int simulated;
    int proto_minor; /* a part's first device: its worker's protocol minor (hello reply) */
} gp_device_snapshot;
int gp_device_count(void);                        /* 0 before a successful connect */
const gp_device_snapshot *gp_device(int ordinal); /* NULL if out of range */
/* The snapshot of the current context's device (device 0's without a context; NULL before a
 * connect): launch limits, occupancy and pitch alignment follow the device a call runs on. */
const gp_device_snapshot *gp_device_current(void);

#define GP_PRIMARY_CTX_ID (GP_HANDLE_TAG | ((uint64_t)GP_H_CTX << 40) | 1)
/* Device k's primary context (issue 37): k in bits 32-37 (worker.h WK_PRIMARY_CTX_OF). */
#define GP_MAX_DEVICES 64 /* worker_session.devices: array:i32:64 */
#define GP_PRIMARY_CTX_OF(k) (GP_PRIMARY_CTX_ID | ((uint64_t)(k) << 32))

/* The calling thread's current context handle (0 if none). */
uint64_t gp_ctx_current(void);
/* call_entry.c: CUDA_SUCCESS if initialised and a context is current (also makes sure the
 * worker uses it);
 * CUDA_ERROR_NOT_INITIALIZED / CUDA_ERROR_INVALID_CONTEXT / the loss error otherwise. Every
 * call that works in "the current context" starts with it. */
CUresult gp_ctx_enter(void);
/* Check that ctx (a CUcontext from the program) is live; returns its handle or 0. */
uint64_t gp_ctx_check(CUcontext ctx);

/* A stream from the program: 0, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD or a live stream
 * handle. Returns 0 and sets *wire, or -1 if invalid (caller returns INVALID_HANDLE). */
int gp_stream_wire(CUstream s, uint64_t *wire);

/* In a _ptsz / _ptds entry point a NULL stream means the per-thread default stream. */
static inline CUstream gp_ptsz(CUstream s)
{
    return s ? s : CU_STREAM_PER_THREAD;
}

#endif /* GP_SHIM_H */
