/*
 * conn_state.h: one connection to a gpupool worker, as a value (issue 37, spread step 3).
 * conn.c, conn_route.c, conn_life.c, conn_read.c, conn_write.c and keepalive.c share it; the rest
 * of the shim never sees it (it calls the functions of shim.h / shim_core.h, which act on the
 * process's connection).
 *
 * Why a struct: a lease spread over several servers (docs/multi-gpu.md, "Across servers") needs
 * one connection per part, each with its own socket, send side, waiters, reader role, receiver
 * thread and keepalive clock. Everything of one connection lives in a gp_conn, and conn.c's
 * functions take the connection they act on: one gp_conn for a lease of one server, one per
 * part of a spread lease (conn.c, "routing"); what stays process-wide whatever the number of
 * connections (cuInit once, the pending error, the request-id counter) is said where it lives.
 */
#ifndef GP_CONN_STATE_H
#define GP_CONN_STATE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "gp_tls.h"

/* ---- keepalive.c: the clock of a silent server -------------------------------------------- */
#define GP_KA_SLICE_MS 1000 /* with keepalives on, reads wake this often to look at the silence */
/* One connection's clock: each server promises keepalives or not (its hello reply). */
typedef struct gp_ka {
    atomic_int on;       /* the server promised keepalives and the timeout is on */
    uint64_t timeout_ns; /* set before on */
    atomic_uint_fast64_t last_rx_ns, last_tx_ns, last_ping_ns;
    char why[300]; /* gp_ka_silence's reason, for the loss line */
} gp_ka;
/* Once connected: with `promised` (the hello's GP_HELLO_KEEPALIVE) and GPUPOOL_SERVER_TIMEOUT
 * not 0, put read slices and the send timeout on socket s (and TLS session t) and start the
 * clock; otherwise keepalives stay off. */
void gp_ka_arm(gp_ka *ka, int s, gp_tls *t, int promised);
int gp_ka_on(const gp_ka *ka);           /* 1 while the clock runs */
double gp_ka_timeout_s(const gp_ka *ka); /* GPUPOOL_SERVER_TIMEOUT as armed, seconds */
void gp_ka_note_rx(gp_ka *ka);           /* bytes came in */
void gp_ka_note_tx(gp_ka *ka);           /* bytes went out */
/* The time of the last bytes out, and putting it back: a keepalive ping that the kernel
 * buffers proves nothing about the server and must not count as progress. */
uint64_t gp_ka_last_tx(gp_ka *ka);
void gp_ka_restore_tx(gp_ka *ka, uint64_t ns);
/* A read slice passed in silence: 1 when a ping is due (a third of the timeout quiet, none sent
 * for as long), -1 with *why (ka->why) once nothing came in and nothing went out for the whole
 * timeout, else 0. */
int gp_ka_silence(gp_ka *ka, const char **why);

/* ---- conn_read.c: the stream from the worker ----------------------------------------------- */
#define GP_READ_BUF_SIZE (256u * 1024)
typedef struct gp_reader {
    int sock;
    gp_tls *tls;       /* NULL: plaintext */
    gp_ka *ka;         /* the connection's clock: bytes in count as life */
    uint8_t *buf;      /* GP_READ_BUF_SIZE bytes (its owner allocates them) */
    size_t pos, len;   /* what of buf is read and not yet taken */
    uint8_t *cz_in;    /* one LZ4 block's stored bytes (GP_LZ4_BLOCK), allocated on first use */
    char tls_err[300]; /* the last TLS error */
    /* With keepalives on (gp_ka_on), a read slice passed in silence: 0 to read on, -1 (with
     * *why) to give up. owner: the connection that reads (what quiet acts on). */
    int (*quiet)(void *owner, const char **why);
    void *owner;
} gp_reader;
/* Exactly n bytes into dst (NULL: discard them). 0, or -1 with *why set. */
int gp_read_exact(gp_reader *r, void *dst, uint64_t n, const char **why);
/* A reply's bulk: n raw bytes into dst (NULL: discard), as LZ4 blocks when cz. 0, or -1. */
int gp_read_bulk(gp_reader *r, uint8_t *dst, uint64_t n, int cz, const char **why);
/* 1 if bytes already received wait in the buffer or in the TLS session (poll cannot see the
 * latter). */
static inline int gp_read_buffered(const gp_reader *r)
{
    return r->pos < r->len || (r->tls && gp_tls_pending(r->tls));
}

/* ---- conn_write.c: the stream to the worker ------------------------------------------------- */
typedef struct gp_writer {
    int sock;
    gp_tls *tls;            /* NULL: plaintext */
    gp_ka *ka;              /* the connection's clock: bytes out count as life */
    const atomic_int *dead; /* once set, nothing more is written */
    uint8_t *batch;         /* frames appended and not yet written */
    size_t len, cap;
} gp_writer;
enum {
    GP_WRITE_OK = 0,
    GP_WRITE_STOPPED = -1,   /* *dead was set: nothing more was written */
    GP_WRITE_FAILED = -2,    /* why filled */
    GP_WRITE_TIMED_OUT = -3, /* the send timeout passed with nothing taken */
};
/* Add n bytes to the batch: 0, or -1 (out of memory; the batch is as it was). */
int gp_write_append(gp_writer *w, const void *p, size_t n);
/* Write the batch, then a (alen bytes) and b (blen), completely; the batch is empty after,
 * whatever the outcome. GP_WRITE_*. */
int gp_write_flush(gp_writer *w, const void *a, size_t alen, const void *b, size_t blen, char *why,
                   size_t cap);

/* n bytes from src as LZ4 blocks (compress.h), encoded and written piece by piece through enc
 * (gp_cz_bound(GP_WRITE_CZ_PIECE) bytes). GP_WRITE_*. */
#define GP_WRITE_CZ_PIECE ((size_t)8 << 20) /* raw bytes encoded and written at a time */
int gp_write_lz4(gp_writer *w, const void *src, uint64_t n, uint8_t *enc, char *why, size_t cap);

/* ---- conn.c: one connection ------------------------------------------------------------------ */
enum { /* gp_conn.state */
    ST_NONE,
    ST_READY,
    ST_FAILED,
    ST_FORKED,
    ST_CLOSED
};

/* A request awaiting its reply (in its connection's waiter list, under wait_lock). */
typedef struct gp_waiter {
    uint64_t req;
    int detached;
    void *dst;
    uint64_t cap;
    int done;
    int32_t result;
    uint8_t *body;
    size_t len;
    uint64_t bulk_len;
    int want_role; /* waits on cv for its reply or for the reader role */
    pthread_cond_t cv;
    struct gp_waiter *next;
    struct gp_waiter *next_want; /* in the want list while want_role */
} gp_waiter;

/* The reader role (gp_conn.reader, under wait_lock). One thread at a time reads the socket: the
 * receiver thread, or a caller of gp_request waiting for its reply (the leader), which reads and
 * dispatches every frame itself until its own reply has come, so the common round trip needs
 * no thread hand-off. The receiver waits in poll() without the role, takes it only while no
 * caller holds it, and parks on role_cv while a caller does. A leader drains what it buffered
 * before it gives the role back. */
enum {
    RD_NONE,
    RD_RECEIVER,
    RD_CALLER
};

/* Everything of one connection to a worker; the locks say which fields they guard (conn.c's
 * head comment says how they are used). */
typedef struct gp_conn {
    atomic_int state; /* ST_* */
    atomic_int dead;
    int sock;
    gp_tls *tls;           /* the TLS session with the worker, or NULL (plaintext) */
    char server_desc[300]; /* "host:port" of the server in use */
    /* The part of the lease this connection serves (docs/multi-gpu.md, "Across servers"): the
     * program's devices first_device .. first_device + ndevices - 1, its device pointers in
     * [va_base, va_base + va_size). One part: 0, every device, the whole window. Set before the
     * connection is ready, then read-only. */
    int first_device, ndevices;
    uint64_t va_base, va_size;

    /* ---- send side (send_lock) ---- */
    pthread_mutex_t send_lock;
    pthread_cond_t flush_cv; /* CLOCK_MONOTONIC; the flusher waits on it */
    /* The stream to the worker (conn_write.c): the batch of frames not yet written, and the
     * socket and TLS session once connected. */
    gp_writer ws;
    uint64_t first_append_ns, last_append_ns;
    uint64_t last_ctx_sent; /* UINT64_MAX: unknown */

    /* ---- waiters and the reader role (wait_lock) ---- */
    pthread_mutex_t wait_lock;
    gp_waiter *wait_head, *wait_tail;
    int reader;            /* RD_* */
    int recv_parked;       /* the receiver waits on role_cv */
    uint64_t reader_gen;   /* counts the times a caller took the role */
    uint64_t linger_until; /* the receiver stays off the socket until then (conn.c, LINGER_NS) */
    int detached_count;    /* detached waiters in the list */
    /* Waiters blocked on their cv for the reader role, oldest first: a list of their own,
     * because the waiter list may hold thousands of detached copies, and scanning it at every
     * release of the role made 16384 small asynchronous downloads quadratic (0.15 GB/s instead
     * of 3). */
    gp_waiter *want_head, *want_tail;
    pthread_cond_t role_cv; /* CLOCK_MONOTONIC */
    /* The receiver thread, joinable: at exit over TLS it is joined (stop_receiver) so that no
     * thread of ours is inside OpenSSL, or running its thread-exit clean-up, while OpenSSL's own
     * exit handler frees the same state. Set once, when connecting (under init_lock). */
    pthread_t receiver_thread;
    int receiver_started;
    /* The stream in (conn_read.c): its buffer, and the socket and TLS session once connected;
     * only the reader touches it. */
    gp_reader rs;
    atomic_int lz4_on; /* LZ4-compressed copies negotiated (connect.c) */

    gp_ka ka; /* keepalive.c: this server's silence clock */
} gp_conn;

/* ---- conn.c, conn_route.c, conn_life.c: the process's connections, split by job ------------- */
/* conn_route.c: the parts table (it calls nothing of conn.c or conn_life.c). */
extern gp_conn gp_conn_process;       /* part 0's connection: the only one for one server */
extern gp_conn *gp_conn_part[];       /* part k's connection, for k < gp_conn_part_count */
extern atomic_int gp_conn_part_count; /* published once every part is connected */
/* The thread's variables are declared local to the library (hidden, local-dynamic TLS) so that
 * conn.c reaches them per frame as cheaply as when they were static there (one TLS lookup). */
#define GP_CONN_SHARED __attribute__((visibility("hidden"), tls_model("local-dynamic")))
extern GP_CONN_SHARED __thread uint64_t
    gp_conn_tl_wire_ctx; /* the calling thread's context (gp_conn_use_ctx) */
extern GP_CONN_SHARED __thread int
    gp_conn_tl_ctx_part;             /* its part, as gp_conn_route_spread last found it */
gp_conn *gp_conn_route_spread(void); /* conn_route's way for a lease of several parts */

/* The number of parts. Acquire: a thread that sees the parts sees their connections set up
 * (free on x86). */
static inline int conn_nparts(void)
{
    return atomic_load_explicit(&gp_conn_part_count, memory_order_acquire);
}

/* The connection of the calling thread's next frame. One part: gp_conn_process, one load and a
 * predicted branch (the hot path stays as it was: inline, per frame). */
static inline gp_conn *conn_route(void)
{
    if (__builtin_expect(conn_nparts() == 1, 1))
        return &gp_conn_process;
    return gp_conn_route_spread();
}

/* conn.c: what conn_life.c starts, stops and ends a connection with. */
extern atomic_int gp_conn_initialized; /* cuInit succeeded (set by conn_life.c's gp_conn_init) */
int gp_conn_kill(gp_conn *c); /* mark c dead, wake its waiters, no message; 1 if this call did it */
/* Write c's batch and then a and b; caller holds send_lock. 0, or -1 (c failed, with its line). */
int gp_conn_flush_locked(gp_conn *c, const void *a, size_t alen, const void *b, size_t blen);
int gp_conn_silence_check(void *owner, const char **why); /* gp_reader.quiet of a connection */
void *gp_conn_receiver_main(void *arg); /* the receiver thread of connection arg */
void *gp_conn_flusher_main(void *arg);  /* the flusher thread of connection arg */

#endif /* GP_CONN_STATE_H */
