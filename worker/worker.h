/*
 * worker.h: the state of one gpupool-worker process and the interfaces between its files.
 *
 * The worker is single-threaded on purpose: it serves exactly one client connection, frames are
 * executed in the order they arrive (the client relies on that for stream order), and the driver
 * calls it makes are the only concurrency it needs. All state lives in one `struct worker` that is
 * passed to every function; there is no global mutable state, so no locks.
 *
 * Files:
 *   main.c      arguments, the hello on stdin (--fd mode), exit codes, what the waits watch
 *   prestart.c  control mode (--control-fd): set up before any client, take a session, report
 *   control.c   the control channel: frames in and out, the counters, periodic stats
 *   control_session.c  what the daemon says during a session (worker_end, its departure, idle
 *               detach), worker_ended
 *   control_wait.c  a handler waits for gpupoold's answer to its request (IPC, peer links)
 *   session.c   driver and device setup, the VA window, the hello reply, teardown
 *   devices.c   the lease's other devices (issue 37): their primary contexts, peers, access
 *   loop.c      the frame loop: header checks, decode, dispatch (the generated table)
 *   io.c        the socket: 1 MiB input buffer, bulk input, output buffer and flushing, notices
 *   reactor.c   the waits: the client socket, and what the files below registered meanwhile
 *   signals.c   SIGTERM/SIGINT as a signalfd the waits watch
 *   errors.c    error names, deferred (pending) errors
 *   end.c       why the session ends (the first reason), a lost client connection
 *   objects.c   client ids -> driver handles (idmap.c), lookups and bulk cleanup
 *   quota.c     the tenant's memory quota on a shared GPU, zeroing before memory is freed
 *   h_session.c ping, stats, goodbye, notice, info: session messages, not CUDA calls
 *   h_ctx.c     contexts, limits, primary context reset
 *   h_device.c  the snapshot of a lease's other devices (device_props)
 *   h_memory.c  allocations in the VA window (vm.c), frees, memory info, device-side copies and
 *               memsets
 *   h_copy.c    host<->device copies through pinned staging buffers
 *   compress.c  LZ4-compressed copies (blocks; the codec is common/compress.c)
 *   h_stream.c  streams
 *   h_event.c   events
 *   h_module.c  module/library loading, functions, globals (image cache: modcache.c)
 *   h_launch.c  function attributes, occupancy, launches
 *   h_graph.c   stream capture and CUDA graphs
 *   h_vmm.c     the client's virtual memory management calls (reserve, create, map, access)
 *   h_peer.c    server-to-server links of a spread lease: peer_link/send/recv/unlink (issue 37)
 *   peer_link.c a link's records: AES-256-GCM seal/open, reads and writes with a timeout
 *               (peer_link.h, not in worker.h)
 *   h_export.c  export tables: a table's slot count, the tools-module table's slot 7
 *   adopt.c     a session outlives its daemon (the adoption socket)
 *   detach.c    idle detach: parked, detached, attached again
 *   heartbeat.c the keepalive thread (notices to the client during a long call)
 *   tls.c       the data path's TLS session
 *   sandbox.c   what a set-up worker may still do (not dumpable, Landlock)
 *   generated/  from protocol/gpupool.toml (make gen): the handler prototypes and dispatch table
 *               (wk_calls.h), the driver entry points (wk_driver_funcs.h)
 * Base files, whose headers include nothing of the worker (worker.h includes all but sock.h):
 *   clock.c     wk_now_ns, the monotonic clock
 *   log.c       log lines on stderr (wk_log, wk_warn, wk_error)
 *   sock.c      the client socket's options (main.c and prestart.c; sock.h, not in worker.h)
 *   fileio.c    files written whole or not at all
 *
 * h_<group>.c holds the handlers of the messages the spec puts in that group, the same groups
 * as the client's api_<group>.c.
 */
#ifndef GP_WORKER_H
#define GP_WORKER_H

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/types.h>

#include "clock.h"
#include "driver.h"
#include "fileio.h"
#include "generated/wk_calls.h"
#include "gp_cuda.h"
#include "gp_protocol.h"
#include "idmap.h"
#include "log.h"
#include "modcache.h"
#include "quota.h"
#include "reactor.h"
#include "utf8.h"
#include "vm.h"

/* The client's primary context id: 0x6750000000000000 | GP_H_CTX << 40 | 1 (client/shim/shim.h).
 * The spec's ctx_set_current doc calls the primary "ctx 1", so the bare 1 is accepted too. */
#define WK_PRIMARY_CTX_ID (0x6750000000000000ull | (1ull << 40) | 1ull)

/* Device k's primary context (issue 37): the primary id with k in bits 32-37, so device 0's is
 * WK_PRIMARY_CTX_ID (client/shim/shim.h GP_PRIMARY_CTX_OF says the same). */
#define WK_MAX_DEVICES 64 /* worker_session.devices: array:i32:64 */
#define WK_PRIMARY_CTX_OF(k) (WK_PRIMARY_CTX_ID | ((uint64_t)(k) << 32))

#define WK_INBUF_SIZE ((size_t)1 << 20)  /* input buffer: many batched frames per read() */
#define WK_FLUSH_AT ((size_t)256 << 10)  /* flush the output buffer when it grows past this */
#define WK_CHUNK ((size_t)8 << 20)       /* staging buffer size for large copies */
#define WK_SMALL_COPY ((size_t)64 << 10) /* copies up to this size skip the staging buffers */
#define WK_MAX_IMAGE ((uint64_t)1 << 30) /* largest module image we accept */
#define WK_MAX_NOTICES 32                /* notices per interval between synchronisations */

/* A client-named object. One layout for every kind keeps cleanup code generic. */
struct wk_obj {
    void *h; /* CUcontext, CUstream, CUevent, CUmodule/CUlibrary, CUfunction/CUkernel */
    uint64_t
        owner;     /* context id (streams, events, modules, allocations) or module id (functions) */
    uint32_t kind; /* modules: 0 module, 1 library; functions: 0 function, 1 kernel;
                    * allocations: 0 own, WK_ALLOC_IMPORTED (another worker's, h_ipc.c) */
    uint64_t size; /* allocations: mapped bytes */
    CUmemGenericAllocationHandle mem; /* allocations: the physical memory handle */
    char name[];                      /* functions: kernel name (for messages) */
};

#define WK_ALLOC_IMPORTED 1u /* wk_obj.kind of an allocation mapped by cuIpcOpenMemHandle */

/* Two staging buffers for large copies (h_copy.c). */
struct staging {
    void *buf[2];
    int pinned;      /* buf from cuMemHostAlloc (else malloc: copies are then synchronous) */
    CUevent ev[2];   /* ev[i] completes when the copy using buf[i] is done */
    int busy[2];     /* ev[i] was recorded and not yet waited for */
    uint64_t ev_ctx; /* context the events belong to (events are per context); 0 = none */
};

/* LZ4-compressed copies (compress.c, docs/protocol.md "Compressed copies"). */
struct wk_lz4 {
    uint32_t features; /* the hello reply's features (GP_HELLO_LZ4 when on; GP_HELLO_KEEPALIVE,
                        * which session.c adds, when the keepalive thread runs) */
    int on;            /* negotiated in the hello: large copies carry their bulk as blocks */
    uint8_t *scratch;  /* one block's stored bytes (in) or encoded block (out); NULL until used */
    /* Bytes of copy data (raw) and what carried them on the wire, every copy counted. */
    uint64_t h2d_raw, h2d_wire, d2h_raw, d2h_wire;
};

/* Classes of client calls for the daemon's accounting (control channel `calls`). */
enum wk_call_class {
    WK_CALL_NONE = -1,
    WK_CALL_LAUNCH,
    WK_CALL_COPY,
    WK_CALL_ALLOC,
    WK_CALL_SYNC,
    WK_CALL_OTHER,
    WK_CALL_CLASSES
};

/* The latency histogram's bucket upper bounds in ns (inclusive), the last bucket being +Inf:
 * 50us 100us 250us 500us 1ms 2.5ms 5ms 10ms 25ms 50ms 100ms 250ms 500ms 1s 2.5s 5s 10s +Inf.
 * gpupoold/workers/supervisor.py LATENCY_BUCKETS holds the same bounds in seconds (tests compare them). */
#define WK_LAT_BUCKETS 18
#define WK_LAT_BOUNDS_NS                                                                           \
    {                                                                                              \
        50000ull, 100000ull, 250000ull, 500000ull, 1000000ull, 2500000ull, 5000000ull,             \
            10000000ull, 25000000ull, 50000000ull, 100000000ull, 250000000ull, 500000000ull,       \
            1000000000ull, 2500000000ull, 5000000000ull, 10000000000ull                            \
    }

/* Plain increments on the hot path; control.c reads them when it reports. */
struct wk_counters {
    uint64_t frames, module_bytes_received, modules_loaded, module_cache_hits;
    uint64_t h2d_bytes, d2h_bytes, launches;
    uint64_t calls[WK_CALL_CLASSES];
    uint64_t mem_used; /* bytes of device memory the session's allocations hold now (a level) */
    uint64_t busy_ns;  /* simulated device: ns spent inside launches, copies and memsets; 0 on
                        * real GPUs (their utilisation comes from NVML) */
    /* Call latency (loop.c): every counted call, timed from dispatch (its body read) to its reply
     * queued, in the bucket of the first bound in WK_LAT_BOUNDS_NS it does not exceed (the last
     * bucket: above all of them); not cumulative across buckets. */
    uint64_t lat_counts[WK_LAT_BUCKETS];
    uint64_t lat_sum_ns;
    /* The same timings per op id (the client's profile asks for them: op_times). */
    uint64_t op_calls[256];
    uint64_t op_ns[256];
};

/* Why a session ended (the control channel's `end` event). The first reason set wins. */
enum wk_end_reason {
    WK_END_NONE,
    WK_END_CLIENT_EXIT,    /* goodbye received */
    WK_END_CLIENT_LOST,    /* end of stream or a connection error without goodbye */
    WK_END_PROTOCOL_ERROR, /* the client broke the protocol */
    WK_END_SERVER_ENDED,   /* the daemon sent END */
    WK_END_SHUTDOWN,       /* SIGTERM/SIGINT */
    WK_END_WORKER_ERROR,   /* a failure on our side (out of memory) */
    WK_END_DAEMON_LOST,    /* orphaned, and no gpupoold adopted us within the grace (adopt.c) */
};

/* What the hello reply says about the device, read once when the device is set up. */
struct wk_snapshot {
    char name[256];
    uint8_t uuid[16];
    uint64_t total_mem;
    int32_t driver_version;
    uint8_t attrs[4 * CU_DEVICE_ATTRIBUTE_MAX]; /* attrs[i]: attribute i, little-endian i32 */
    uint8_t limits[8 * CU_LIMIT_MAX];
    int prio_least, prio_greatest;
};

/* The control channel (control mode only; control.c). */
struct wk_control {
    int fd;         /* the SOCK_SEQPACKET control socket, or -1 (--fd mode, or gone) */
    int gone;       /* the daemon closed it: exit without another message */
    int in_session; /* a session is being served: stats are due */
    uint64_t session_id;
    uint64_t started_ns;     /* CLOCK_MONOTONIC at the start of the session */
    uint64_t stats_ns;       /* when the last stats event went out */
    struct wk_counters sent; /* the counters as the last stats event reported them */
    /* Adoption (adopt.c): the session outlives its daemon. */
    const char *adopt_dir; /* --adopt-dir, or NULL (the session ends with its daemon) */
    uint64_t grace_ns;     /* --orphan-grace: longest time with no daemon; 0 = end with it */
    int listen_fd;         /* <adopt_dir>/lease-<session>.sock during a session, or -1 */
    uint64_t orphan_since; /* CLOCK_MONOTONIC when the daemon went; 0 while one follows us */
    /* What the client asked for (its hello): a new daemon rebuilds the lease's view from it. */
    char req_gpu[128], req_model[256];
    uint64_t req_min_memory;
    /* The hello's flags: worker_adopted passes GP_HELLO_KEEP_GPU on (GP_ADOPTED_KEEP_GPU). */
    uint32_t req_flags;
    uint8_t out[4096]; /* the control message being sent (WK_CTL_ENCODE), WK_CTL_MAX bytes */
    /* Idle detach (detach.c). */
    int waiting;            /* in wk_wait_client for the next frame, nothing half done */
    uint64_t idle_since_ns; /* CLOCK_MONOTONIC when that wait began */
    int parked;             /* said worker_detach_ok: reads no client frame until attached */
    int want_sent;          /* parked and worker_wants_gpu sent: the client has a frame */
    int detached;           /* parked and checkpointed (worker_detached) */
    int no_driver;          /* parked (or ended while parked): the driver may hold this process
                             * locked or checkpointed, so no driver call, even at the end */
    uint64_t detaches;      /* times this session was detached */
    int ipc_shared; /* the session exported or opened memory through CUDA IPC (h_ipc.c): another
                     * process maps it, so it never detaches (its GPU memory cannot move) */
};

/* The keepalive thread (heartbeat.c): the only state two threads share, hence the atomics and
 * the lock (the rest of struct worker is the main thread's alone). */
struct wk_heartbeat {
    pthread_t thread;
    int running;                 /* main thread only: the thread was started */
    pthread_mutex_t lock;        /* held while a notice is being written */
    atomic_int busy;             /* the main thread is inside a WK_LONG call */
    atomic_uint_least64_t calls; /* WK_LONG calls entered: the same value seen for a while
                                         * with `busy` set means one call has lasted that long */
    atomic_int sending;          /* the heartbeat thread is about to write, or writes */
    atomic_int stop;
    pthread_mutex_t wake_lock; /* with `wake`: wk_hb_stop wakes the thread at once */
    pthread_cond_t wake;
};

#define PATH_MAX_ADOPT 4096

struct worker {
    /* connection (io.c) */
    int fd;
    int closing;  /* leave the loop: goodbye, client gone, or a protocol violation */
    int dead;     /* the connection failed: nothing more is read or written */
    int sigfd;    /* signalfd for SIGTERM/SIGINT (the daemon stops us with SIGTERM), or -1 */
    int in_write; /* waiting in the middle of writing the output buffer: leave it alone */
    int in_call;  /* a frame is being served (loop.c): a wait inside it is no idle moment */
    int lowat;    /* a big upload is read with SO_RCVLOWAT set (io.c): waits are bounded */
    uint8_t *in;
    size_t in_cap, in_pos, in_end;
    uint8_t *out;
    size_t out_len, out_cap;

    /* driver and device (session.c) */
    struct gp_driver drv;
    int ordinal;
    CUdevice dev;
    CUcontext primary;
    /* The lease's devices (devices.c; issue 37): [0] is the worker's own (dev, primary); the
     * others come from worker_session.devices (--devices in --fd mode), in the program's order. */
    int ndev;
    CUdevice devs[WK_MAX_DEVICES];
    CUcontext prims[WK_MAX_DEVICES]; /* their retained primary contexts ([0]: see primary) */
    uint8_t peer[WK_MAX_DEVICES][WK_MAX_DEVICES]; /* cuDeviceCanAccessPeer(i, j) */
    int primary_retains; /* how many cuDevicePrimaryCtxRetain calls to balance at exit */
    uint64_t cur_ctx;    /* client id of the context current on this thread (0: none) */
    uint64_t gran;       /* allocation granularity */

    /* VA window (h_memory.c) */
    uint64_t va_base, va_size;
    int va_reserved;
    struct vm vm;

    /* client ids -> objects (objects.c) */
    struct idmap ctxs, streams, events, modules, funcs, allocs;
    struct idmap graphs, graph_execs; /* h_graph.c: CUgraph / CUgraphExec by client id */
    /* h_vmm.c: the client's VMM objects: physical handles by client id, reservations and
     * mappings by address (wk_obj.size; mappings: wk_obj.mem = client handle id) */
    struct idmap vmm_handles, vmm_resvs, vmm_maps;
    struct wk_quota quota; /* quota.c: the tenant's memory quota (issue 32) */

    /* deferred errors (errors.c) */
    CUresult pending;
    unsigned notices;

    struct staging st;
    struct wk_lz4 cz;
    struct modcache mc;
    void *params_buf; /* 8-byte aligned copy of launch arguments */
    size_t params_cap;
    struct wk_counters stats;
    int simulated;
    uint64_t busy_t0; /* DRV_BUSY: when the timed call started */

    struct wk_snapshot snap;
    int device_ready; /* wk_device_open succeeded: snap, gran, primary are valid */
    struct wk_control ctl;
    struct wk_heartbeat hb;
    enum wk_end_reason end_reason;
    char end_detail[512];
    int32_t refused_code; /* the last hello refusal (control mode reports it) */
    char refused_text[512];

    /* TLS (tls.c): the context from --tls-cert/--tls-key (NULL: none), and the session on fd
     * (NULL: plain TCP; io.c then makes exactly the system calls it always made) */
    struct ssl_ctx_st *tls_ctx;
    struct ssl_st *ssl;
    /* The private key of --tls-key, held here and not in tls_ctx so that it is freed (and its
     * bytes cleared) once the session's handshake is done: NULL from then on (tls.c). */
    struct evp_pkey_st *tls_key;

    /* what the waits watch besides the client socket, registered at start (reactor.c) */
    struct wk_reactor reactor;

    /* h_peer.c: the server-to-server links of a spread lease (issue 37), NULL until the first */
    struct wk_peer_links *peer_links;
    /* how many of its links are open, kept by h_peer.c: detach.c logs it when parking (a field
     * rather than a call, so that detach.c names nothing of h_peer.c's, which waits on the
     * control channel: test_layout's rule against circles between C files) */
    int peer_links_open;
};

/* Device time of a launch/copy/memset on the simulated device, whose work is done when the call
 * returns, into stats.busy_ns: rc = DRV_BUSY(w, cuLaunchKernel, ...) instead of DRV(...). The
 * comma operator orders the clock reads around the call. No clock read on real GPUs. */
static inline uint64_t busy_start(const struct worker *w)
{
    return w->simulated ? wk_now_ns() : 0;
}

static inline CUresult busy_end(struct worker *w, CUresult rc)
{
    if (w->simulated) {
        uint64_t t1 = wk_now_ns();
        if (t1 > w->busy_t0)
            w->stats.busy_ns += t1 - w->busy_t0;
    }
    return rc;
}

#define DRV_BUSY(w_, fn_, ...)                                                                     \
    ((w_)->busy_t0 = busy_start(w_), busy_end((w_), DRV(w_, fn_, __VA_ARGS__)))

/* ---- heartbeat.c ------------------------------------------------------------------------ */
/* Start / stop the keepalive thread of a session whose client asked for it. 0, or -1 (logged:
 * the session runs without keepalives). */
int wk_hb_start(struct worker *w);
void wk_hb_stop(struct worker *w);
/* Waits until a notice the heartbeat thread is writing is complete. */
void wk_hb_wait_writer(struct worker *w);

/* Cheap on purpose (launches on the simulated device go through it): a relaxed counter and a
 * release store on the way in; on the way out one sequentially consistent store and a load,
 * which with the heartbeat thread's own pair guarantee that only one of them uses the socket. */
static inline void hb_enter(struct worker *w)
{
    if (w->hb.running) {
        atomic_store_explicit(&w->hb.calls,
                              atomic_load_explicit(&w->hb.calls, memory_order_relaxed) + 1,
                              memory_order_relaxed);
        atomic_store_explicit(&w->hb.busy, 1, memory_order_release);
    }
}

static inline CUresult hb_leave(struct worker *w, CUresult rc)
{
    if (w->hb.running) {
        atomic_store(&w->hb.busy, 0);
        if (atomic_load(&w->hb.sending))
            wk_hb_wait_writer(w); /* the socket is ours again once its notice is out */
    }
    return rc;
}

/* A driver call that may take long: a synchronise, a JIT, a launch (the simulated device runs
 * the kernel inside it; a real driver blocks when its launch queue is full). The client gets
 * keepalive notices meanwhile. Only where no reply is half written:
 * `rc = WK_LONG(w, DRV(w, ...))`. */
#define WK_LONG(w_, call_) (hb_enter(w_), hb_leave((w_), (call_)))

/* ---- errors.c (and io.c: the notices; end.c: the end of a session) ------------------------ */
/* (Log lines: log.h; the clock: clock.h; the client socket's options: sock.h.) */
/* "CUDA_ERROR_INVALID_VALUE" etc. (driver's name when it has one). Valid until the next call. */
const char *wk_err_name(struct worker *w, CUresult rc);
void wk_send_notice(struct worker *w, int32_t code, uint16_t op, const char *text); /* io.c */
/* A fire-and-forget call failed: keep rc as the pending error (the first wins) and tell the
 * client why in a notice: "<what> failed: <ERROR NAME> (<sim detail>)". */
void wk_defer_error(struct worker *w, uint16_t op, CUresult rc, const char *what_fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* The result of a synchronising call: the pending error instead of success (cleared unless it is
 * sticky), else rc itself. */
CUresult wk_sync_result(struct worker *w, CUresult rc);
/* io.c: the session ends on our side: tell the client (a notice with code and text, unless a
 * write to it is in progress), shut the connection so that it sees the end at once, mark it
 * dead. */
void wk_close_client(struct worker *w, int32_t code, const char *text);
/* io.c: the client broke the protocol: notice (GP_EPROTO) with the reason, flush, stop the loop. */
void wk_protocol_error(struct worker *w, uint16_t op, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
int wk_err_is_sticky(CUresult rc);
/* end.c: records why the session ends (the first reason wins) and stops the loop. */
void wk_end_session(struct worker *w, enum wk_end_reason reason, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
const char *wk_end_reason_name(enum wk_end_reason reason);
/* end.c: the client connection failed (`what`: the system call, err: its errno): warned once,
 * the session ends as "client lost", nothing more is read or written. */
void wk_client_lost(struct worker *w, const char *what, int err);

/* ---- compress.c ------------------------------------------------------------------------ */
/* The hello: whether the client asked for LZ4 (hello flags) and we can: sets w->cz.on; the
 * reply's features. */
uint32_t wk_cz_negotiate(struct worker *w, uint32_t hello_flags);
/* Whether a copy of n bytes travels as blocks in this session. */
int wk_cz_copy(const struct worker *w, uint64_t n);
/* Reads blocks holding n raw bytes of a host-to-device copy into dst (NULL: check and drop).
 * 0, or -1 (connection gone, or a corrupt block: protocol error sent, session ends). */
int wk_cz_read(struct worker *w, void *dst, size_t n);
/* Writes n raw bytes of a device-to-host reply as blocks; *raw_run: the copy's adaptive state
 * (0 at its start). 0, or -1 (connection gone). */
int wk_cz_write(struct worker *w, const void *src, size_t n, int *raw_run);
/* At the end of the session: the byte counts in the log; frees the scratch buffer. */
void wk_cz_end(struct worker *w);

/* ---- io.c ------------------------------------------------------------------------------- */
/* sigfd: the signalfd (signals.c; -1: none), kept in w->sigfd for the waits to watch. fd may be
 * -1 until a session brings the client. */
int wk_io_init(struct worker *w, int fd, int sigfd);
void wk_io_free(struct worker *w);
/* Next frame: 1 with *h and *body (valid until the next io call that reads), 0 on a clean end of
 * stream, -1 if the loop must stop (error, protocol violation: notice sent). */
int wk_io_next_frame(struct worker *w, gp_frame_header *h, const uint8_t **body);
/* Bytes of input already buffered after the current frame (bulk data may start there). */
size_t wk_io_buffered(const struct worker *w);
const uint8_t *wk_io_buffered_ptr(const struct worker *w);
void wk_io_consume(struct worker *w, size_t n);
/* Reads exactly n bulk bytes into dst (NULL: discard). 0, or -1 (connection gone). */
int wk_io_read_bulk(struct worker *w, void *dst, uint64_t n);
/* n bytes at the end of the output buffer, or NULL (out of memory: closing is set). */
uint8_t *wk_io_reserve(struct worker *w, size_t n);
void wk_io_unreserve(struct worker *w, size_t n);
/* Writes the output buffer out. 0, or -1 (connection gone: closing is set). */
int wk_io_flush(struct worker *w);
/* Flushes, then writes n bytes from p straight to the socket (bulk replies). */
int wk_io_write_direct(struct worker *w, const void *p, size_t n);

/* Encode reply `type_` (e.g. gp_ping_reply) for request req_ into the output buffer. */
#define WK_REPLY(w_, req_, type_, msgp_)                                                           \
    do {                                                                                           \
        uint8_t *p_ = wk_io_reserve((w_), 16 + type_##_size(msgp_));                               \
        if (p_)                                                                                    \
            type_##_frame(p_, (req_), (msgp_));                                                    \
    } while (0)

/* ---- objects.c -------------------------------------------------------------------------- */
struct wk_obj *wk_obj_new(uint64_t owner, void *h, const char *name, size_t name_len);
/* Puts obj under id; frees obj and returns CUDA_ERROR_INVALID_VALUE (id in use or 0) or
 * CUDA_ERROR_OUT_OF_MEMORY on failure. */
CUresult wk_obj_bind(struct idmap *m, uint64_t id, struct wk_obj *obj);
/* Client stream id -> CUstream (0, 1 and 2 pass through). CUDA_ERROR_INVALID_HANDLE if unknown. */
CUresult wk_stream_get(struct worker *w, uint64_t id, CUstream *out);
CUresult wk_event_get(struct worker *w, uint64_t id, CUevent *out);
/* Canonical context id (the primary's aliases fold to WK_PRIMARY_CTX_ID) and its handle. */
uint64_t wk_ctx_canon(uint64_t id);
CUcontext wk_ctx_handle(struct worker *w, uint64_t id); /* NULL if unknown */
/* k if id is device k's primary context id (k >= 1, k < ndev; issue 37), else 0. */
int wk_primary_index(const struct worker *w, uint64_t id);
/* Calls destroy (may be NULL) on, then removes and frees, every object of map whose owner is
 * `owner` (0: all) and, if kind_mask is not 0, whose (1 << kind) is in kind_mask. */
void wk_obj_purge(struct worker *w, struct idmap *m, uint64_t owner, unsigned kind_mask,
                  void (*destroy)(struct worker *, uint64_t id, struct wk_obj *));
/* Every destroy function used by cleanup paths. */
void wk_obj_destroy_stream(struct worker *w, uint64_t id, struct wk_obj *o);
void wk_obj_destroy_event(struct worker *w, uint64_t id, struct wk_obj *o);
void wk_obj_destroy_module(struct worker *w, uint64_t id, struct wk_obj *o); /* + its functions */

/* ---- devices.c: the lease's other devices (issue 37) ------------------------------------ */
struct wk_options;
/* Opens devices 1.. of o->devices (cuDeviceGet, a retained primary context each) and reads which
 * can access which. 0, or -1 with *code and err saying what went wrong. */
int wk_devices_open(struct worker *w, const struct wk_options *o, int32_t *code, char *err,
                    size_t errlen);
/* Releases the primary contexts of devices 1.. (the end of the session). */
void wk_devices_close(struct worker *w);
/* The lease device (0..ndev-1) a context id belongs to; 0 for none or an unknown id. */
int wk_ctx_device(struct worker *w, uint64_t ctx);
/* The device of the current context. */
int wk_cur_device(struct worker *w);
/* The access descriptors for memory on lease device `dev`: that device and every device that
 * can access it as a peer (read-write). Fills out[WK_MAX_DEVICES]; returns how many. */
size_t wk_access_descs(const struct worker *w, int dev, CUmemAccessDesc *out);
/* Reads the snapshot of a device (the current context's limits and priority range). */
void wk_snapshot_take(struct worker *w, CUdevice dev, struct wk_snapshot *s);

/* ---- session.c -------------------------------------------------------------------------- */
#define WK_MAX_SANDBOX_RW 8
struct wk_options {
    int fd;         /* --fd, or -1 */
    int control_fd; /* --control-fd, or -1 */
    const char *driver;
    int ordinal;
    int ndevices;                /* worker_session.devices / --devices: 0 = --device only */
    int devices[WK_MAX_DEVICES]; /* server ordinals; [0] is --device */
    const char *cache_dir;
    uint64_t session_id;
    uint64_t hello_req;
    int simulated;
    const char *tls_cert, *tls_key, *tls_client_ca; /* --tls-*, or NULL (control mode only) */
    const char *adopt_dir;    /* --adopt-dir, or NULL (control mode only; adopt.c) */
    uint64_t orphan_grace_ms; /* --orphan-grace, in ms (0: the session ends with its daemon) */
    int no_sandbox;           /* --no-sandbox: no Landlock domain (sandbox.c) */
    int n_sandbox_rw;         /* --sandbox-rw DIR, repeated: more folders it writes (sandbox.c) */
    const char *sandbox_rw[WK_MAX_SANDBOX_RW];
    int n_sandbox_ro; /* --sandbox-ro PATH, repeated: more files it reads (sandbox.c) */
    const char *sandbox_ro[WK_MAX_SANDBOX_RW];
    uint64_t memory_quota; /* worker_session's memory_quota, --memory-quota (0: none; quota.c) */
};
/* Loads the driver, cuInit, cuDeviceGet, retains the primary context and makes it current, reads
 * the granularity and takes the device snapshot: everything that does not depend on a hello.
 * 0, or -1 with *code (a CUresult or GP_E*) and a message saying what to do in err. */
int wk_device_open(struct worker *w, const char *driver, int ordinal, int32_t *code, char *err,
                   size_t errlen);
/* The session part: checks the hello, reserves the VA window, sends the hello reply. The device
 * is opened first if it is not yet (--fd mode). 0 if the session runs, -1 if it was refused
 * (the reply says why; refused_code/refused_text too). */
int wk_session_start(struct worker *w, const struct wk_options *o, const gp_hello *hello);
/* Releases everything (allocations, streams, events, modules, contexts, the window). */
void wk_session_end(struct worker *w);
/* gp_hello_decode that skips the fields a newer minor version appended and reads the ones an
 * older minor version lacks as 0 (its strings may then point into a static copy of `body`:
 * one hello per process). 0 or the decoder's error. */
int wk_hello_decode(const uint8_t *body, size_t len, gp_hello *h);
/* Sends a hello reply carrying only an error (used before the driver is up, too). */
void wk_hello_refuse(struct worker *w, uint64_t req, int32_t result, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* ---- loop.c ----------------------------------------------------------------------------- */
void wk_worker_loop(struct worker *w);

/* ---- control.c -------------------------------------------------------------------------- */
#define WK_CTL_MAX 4096 /* the longest control message either way, except worker_session */

/* Control messages are frames of protocol/gpupool.toml ("control"; the version both sides speak
 * is GP_WORKER_CONTROL_VERSION). WK_CTL_ENCODE encodes message msg_ (a gp_<kind_> *) into
 * w->ctl.out: its length, or 0 when it would not fit (every text field is bounded well under
 * WK_CTL_MAX, so only a bug gets 0). */
#define WK_CTL_ENCODE(w_, kind_, msg_)                                                             \
    (gp_##kind_##_size(msg_) + GP_PROTO_HEADER_SIZE <= sizeof(w_)->ctl.out                         \
         ? gp_##kind_##_frame((w_)->ctl.out, 0, (msg_))                                            \
         : 0)
/* Points a message's text field at buf (a char array), holding src as valid UTF-8 of at most
 * sizeof buf - 1 bytes (the field's limit in the spec). */
#define WK_SET_TEXT(field_, buf_, src_)                                                            \
    ((field_##_len) = (uint32_t)gp_utf8_clean((buf_), sizeof(buf_), (src_), strlen(src_)),         \
     (field_) = (buf_))
/* Sends the n bytes WK_CTL_ENCODE put in w->ctl.out; blocking unless `best_effort` (then dropped
 * when the socket is full). 0, or -1 (not sent: the daemon is gone, or n is 0). */
int wk_ctl_send(struct worker *w, size_t n, int best_effort);
/* Receives one control message into buf: its length, 0 at end of stream (the daemon is gone),
 * -1 on error (errno). *fd gets the descriptor passed with it, or -1 (extra ones are closed);
 * *truncated is set when the message did not fit in cap bytes. */
ssize_t wk_ctl_recv(struct worker *w, void *buf, size_t cap, int *fd, int *truncated);
/* Called whenever the worker may wait, and every 1024 frames: sends `stats` when one is due (a
 * second since the last, and a counter changed). Returns the milliseconds to wait at most before
 * the next one is due, or -1 (nothing pending). */
int wk_ctl_stats_tick(struct worker *w);
/* control_session.c: registers the control socket (worker_end, the daemon's departure, idle
 * detach's messages) and the stats interval with the waits. 0, or -1 (table full). */
int wk_ctl_watch(struct worker *w);
/* ---- detach.c (idle detach) --------------------------------------------------------------- */
/* A control message of idle detach (op: worker_detach_ask, worker_detached, worker_attached;
 * body of n bytes): 0 carry on, -1 the loop must stop. */
int wk_detach_control(struct worker *w, unsigned op, const uint8_t *body, size_t n);
/* Registers the hold on the client socket while parked: the waits then watch it for the next
 * frame only, which asks gpupoold for a GPU, or the client's end (client lost). */
void wk_detach_watch(struct worker *w);
/* The session ends while parked (a signal, worker_end, the client or the daemon gone): stop
 * the keepalive notices and unpark, so that the last notice to the client can be written; the
 * exit then makes no driver call (no_driver stays set). */
void wk_detach_end_parked(struct worker *w);
/* The daemon went away while parked and the session cannot go on orphaned (not detached yet:
 * a checkpoint was under way; or not adoptable): the client is told and the session ends. */
void wk_detach_daemon_gone(struct worker *w);
/* Being adopted (adopt.c) while detached: before worker_adopted, worker_detach_ok again (the new
 * daemon learns the session has no GPU and how much memory it saved) ... */
void wk_detach_restate(struct worker *w);
/* ... and after it, worker_wants_gpu when the client called while no daemon followed us. */
void wk_detach_adopted(struct worker *w);

/* control_session.c: worker_ended with the counters; an adoptable session writes it to its end
 * record first (wk_adopt_write_end), for a daemon that goes before it records it. */
void wk_ctl_send_end(struct worker *w);
/* A control message (n bytes of buf, received during a session) other than an answer that a
 * handler waits for (h_ipc.c): worker_end, idle detach. 0: carry on; -1: the session stops. */
int wk_ctl_on_message(struct worker *w, const uint8_t *buf, ssize_t n, int truncated);
/* The counters of worker_stats, worker_ended and worker_adopted; lat holds the latency counts
 * (little-endian) that c->latency_counts points at. */
void wk_ctl_counters(struct worker *w, gp_worker_counters *c, uint8_t lat[8 * WK_LAT_BUCKETS]);
/* The body of control message msg (n bytes, as received) when it is one whole frame of `op`,
 * else NULL. */
const uint8_t *wk_ctl_decode(const uint8_t *msg, size_t n, unsigned op);
/* control_wait.c: waits up to timeout_ms for gpupoold's control message `op` (the answer to the
 * handler's request) into buf; other messages that come first are handled as during any wait.
 * Its fd (or -1) in *fd. The message's length, or -1 with err set (gpupoold gone, the session
 * ends, or no answer in time: *timed_out set). */
ssize_t wk_ctl_wait_answer(struct worker *w, unsigned op, uint8_t *buf, size_t cap, int *fd,
                           int timeout_ms, int *timed_out, char *err, size_t errlen);
/* The device's UUID as NVML writes it ("GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"). */
void wk_uuid_text(const struct worker *w, char out[64]);

/* ---- adopt.c ---------------------------------------------------------------------------- */
/* At the start of a session (with --adopt-dir and a grace > 0): listen on the adoption socket
 * and stop asking for SIGTERM at the daemon's death. 0, or -1 (logged: the session then ends
 * with its daemon). */
int wk_adopt_listen(struct worker *w);
/* Stop listening and remove the socket file (the session is over). */
void wk_adopt_close(struct worker *w);
/* The control socket closed during a session: go on without a daemon if we can be adopted.
 * 0: orphaned, carry on; -1: cannot be adopted, the session ends. */
int wk_adopt_orphan(struct worker *w);
/* Registers the adoption socket (accept, check, take worker_adopt, send worker_adopted) and
 * the orphan's grace (over: the session ends, the client is told) with the waits. 0, or -1. */
int wk_adopt_watch(struct worker *w);
/* Writes the encoded worker_ended frame (n bytes of w->ctl.out) to <adopt_dir>/lease-<session>.end
 * (atomically; fsynced and logged when `alone`: no daemon follows the session) for whichever
 * daemon records the lease's end. */
void wk_adopt_write_end(struct worker *w, size_t n, int alone);

/* ---- sandbox.c -------------------------------------------------------------------------- */
/* Not dumpable, no core files, no_new_privs. 0, or -1 (each failure is logged). */
int wk_harden_process(void);
/* The kernel's Landlock ABI version, 0 without Landlock. */
int wk_sandbox_abi(void);
/* The Landlock domain of a set-up worker. 0 applied, 1 no Landlock here (warned once), -1 with
 * err (a rule could not be made: the worker must not serve). */
int wk_sandbox_apply(const struct wk_options *o, char *err, size_t cap);

/* Defined only in build/tests/gpupool-worker-compromise (tests/c/worker/worker_compromise.c),
 * which plays a worker a tenant has taken over: called once the session has started. The shipped
 * worker has no definition, so the weak reference is NULL and nothing is called. */
extern void wk_test_compromise(struct worker *w, const struct wk_options *o) __attribute__((weak));

/* ---- tls.c ------------------------------------------------------------------------------ */
/* The server context from o->tls_* into w->tls_ctx. 0, or -1 with err saying what to fix. */
int wk_tls_setup(struct worker *w, const struct wk_options *o, char *err, size_t cap);
/* SSL_accept on w->fd (made non-blocking). 0, or -1 with err. */
int wk_tls_accept(struct worker *w, char *err, size_t cap);
/* One SSL_read/SSL_write: > 0 bytes, 0 end of stream (reads), -1 with *wait_events set (wait
 * for POLLIN/POLLOUT, then retry) or 0 (an error, err says which). */
ssize_t wk_tls_io(struct worker *w, void *buf, size_t n, int writing, short *wait_events, char *err,
                  size_t cap);
/* Sends what the session's write buffer holds: 0 when empty, -1 with *wait_events POLLOUT (wait,
 * then call again) or 0 (an error, err says which). */
int wk_tls_flush(struct worker *w, short *wait_events, char *err, size_t cap);
/* Makes OpenSSL clear every buffer it frees (tls.c says why). Before any OpenSSL call: 0, or -1
 * when OpenSSL allocated already. */
int wk_tls_clear_on_free(void);
/* Frees the private key (the session's reference and ours): after the handshake, or at once for
 * a session without TLS. Idempotent. */
void wk_tls_drop_key(struct worker *w);
void wk_tls_free(struct worker *w);
/* The TLS read-ahead buffer and the write buffer in front of the socket, in bytes. */
#define WK_TLS_BUFFER (256 * 1024)

/* ---- reactor.c: the waits (the registry is reactor.h) --------------------------------------- */
/* Waits until the client socket is ready for `events`, watching what is registered meanwhile and
 * calling its callbacks (a parked session's client socket goes to its holder). 0 ready (or hung
 * up / in error: the next read or write tells), -1 the session must stop. */
int wk_wait_client(struct worker *w, short events);
/* Control mode, now and then from the frame loop (a busy client may never let the worker wait):
 * the timers (stats if due), and a look without waiting at what is registered. 0: carry on;
 * -1: the session must stop. */
int wk_io_check(struct worker *w);

/* ---- signals.c -------------------------------------------------------------------------- */
/* Blocks SIGTERM and SIGINT and returns a signalfd for them, or -1 (warned: they then end the
 * worker at once). */
int wk_signals_open(void);
/* Registers the signalfd with the waits: a signal ends the session, the client told. 0, or -1. */
int wk_signals_watch(struct worker *w);

/* ---- prestart.c ------------------------------------------------------------------------- */
/* The whole life of a control-mode worker; returns the exit status. */
int wk_prestart_main(struct worker *w, const struct wk_options *o, uint64_t t0_ns);

/* ---- handlers (h_*.c): one per request message --------------------------------------- */
/* Their prototypes (WK_HANDLER) and the dispatch table are generated from the messages of
 * protocol/gpupool.toml that carry a call_class: generated/wk_calls.h, included above. */
/* h_vmm.c: unmaps and releases everything the client made with the VMM calls (session end). */
void wk_vmm_release_all(struct worker *w);
/* h_graph.c: destroys every graph exec and graph of the session (before its contexts go). */
void wk_graph_release_all(struct worker *w);
/* h_peer.c: closes every server-to-server link (their keys cleared) and frees the table. */
void wk_peer_close_all(struct worker *w);
/* h_peer.c: destroys the stream of peer copies of context ctx_id (of every context: all), before
 * the context goes (h_ctx.c calls it where a context is torn down or a primary reset; the
 * session's end closes them with the links). */
void wk_peer_ctx_gone(struct worker *w, uint64_t ctx_id, int all);
/* h_copy.c: the largest copy that can name a valid device range (h_peer.c checks peer copies). */
uint64_t wk_copy_limit(const struct worker *w);

/* ---- helpers of the handlers used by cleanup ------------------------------------------- */
/* Destroys a client-created context (o, already removed from the map) with everything of it;
 * falls back to the primary if it was current. Returns cuCtxDestroy's result. */
CUresult wk_ctx_teardown(struct worker *w, uint64_t id, struct wk_obj *o);
/* Unmaps and releases one allocation and returns its range (errors are logged). */
void wk_obj_destroy_alloc(struct worker *w, uint64_t id, struct wk_obj *o);
/* Reserve / release the client's VA window. 0, or the CUresult (or -1: other address). */
CUresult wk_va_reserve(struct worker *w);
void wk_va_release(struct worker *w);
/* A function (CUfunction, kind 0) or a kernel (CUkernel, kind 1) by its client id, or NULL
 * (h_func.c, h_launch.c). */
static inline struct wk_obj *wk_func_get(struct worker *w, uint64_t id)
{
    return wk_idmap_get(&w->funcs, id);
}
/* The raw CUlaunchAttribute array from the wire, copied to aligned memory (*out may be NULL when
 * there are none; free it) (h_launch.c, for launches and occupancy queries). */
CUresult wk_launch_attrs_copy(const uint8_t *blob, uint32_t len, CUlaunchAttribute **out,
                              unsigned *count);
/* Waits for and frees the staging buffers and their events (before a context goes away). */
void wk_staging_release(struct worker *w);
/* Forgets the staging events if they belong to context id (it is about to be destroyed). */
void wk_staging_drop_events(struct worker *w, uint64_t ctx_id);
/* The staging buffers for other copies (h_peer.c): st.buf[0..1] of WK_CHUNK bytes ready, with
 * events in the current context when possible: 0, or -1 (out of memory). wk_staging_mark after
 * queueing a copy that uses buf[i] on stream s; wk_staging_wait before reusing buf[i] (the
 * error of the copy that used it). */
int wk_staging_ready(struct worker *w);
CUresult wk_staging_mark(struct worker *w, int i, CUstream s);
CUresult wk_staging_wait(struct worker *w, int i);

#endif /* GP_WORKER_H */
