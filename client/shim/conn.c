/*
 * conn.c: the TCP connection of this process to its gpupool worker, as it carries the session:
 * sending, the flusher, the receiver and the reader role, loss. A connection's state is a
 * gp_conn (conn_state.h) and the functions here take the one they act on. A lease of one server
 * has one (gp_conn_process); a lease spread over servers has one per part (docs/multi-gpu.md,
 * "Across servers"), and the public functions (gp_post, gp_request...) send each frame to the
 * part of the calling thread's context, or to the part the thread routed it to (gp_conn_route:
 * frames that name a device, copies by address): conn_route.c holds the parts table and the
 * routing, conn_life.c starts the connections and ends them (fork, exit, goodbye).
 *
 *  - gp_conn_ensure (conn_life.c): connect once per process (connect.c does the talking: VA
 *    window, hello, snapshot, the one-line error), pthread_once-like; then start the two
 *    threads below.
 *  - Sending: fire-and-forget frames are appended to a batch under send_lock; the batch goes
 *    out before any request that waits, when it passes 256 KiB, and from the flusher thread
 *    ~50 us after the last append, so a program that never synchronises still progresses.
 *    Bulk data above 64 KiB is written straight from the caller's buffer (no copy). The bytes
 *    go out through conn_write.c.
 *  - Receiving: one thread at a time reads frames (the reader role): a caller waiting for its
 *    reply reads them itself while nobody else does (no thread hand-off on a round trip), the
 *    receiver thread otherwise (see "the reader role"). A reply completes the waiter with its
 *    request id (reply bulk is read directly into the waiter's buffer: conn_read.c); replies of
 *    detached requests (async device-to-host copies) land in the program's buffer; notices and
 *    failed detached requests become the pending error (pending.c).
 *  - Loss: the first failure marks the connection dead, prints one line, then wakes every
 *    waiter with GP_LOST_CONNECTION_ERROR (the line is out before any woken waiter can end the
 *    program). Sends use MSG_NOSIGNAL (never SIGPIPE).
 *  - fork (conn_life.c): the child drops the connection without sending anything (CUDA calls
 *    there return CUDA_ERROR_NOT_INITIALIZED); exit: flush and goodbye, bounded by short
 *    timeouts.
 *  - Keepalive (when the server promised it, GP_HELLO_KEEPALIVE; keepalive.c keeps the clock):
 *    reads wake every GP_KA_SLICE_MS; whoever reads while a reply is awaited pings a quiet
 *    server and fails the connection when it stays silent for GPUPOOL_SERVER_TIMEOUT seconds.
 * Lock order (a connection's own locks): send_lock before wait_lock; the receiver takes
 * send_lock only with trylock (its keepalive ping), never waiting for it.
 *  - TLS (tls != NULL; tls.c): the same flow, with the socket calls replaced by the session's
 *    (which locks itself per call, so a sender and the reader may use it at once). OpenSSL may
 *    hold received bytes that poll() cannot see: the reader drains them before giving the role
 *    back, and the receiver checks them before it polls. With tls == NULL (plaintext) the code
 *    below makes exactly the system calls it made before TLS existed.
 */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "compress.h"
#include "conn_state.h"
#include "shim.h"
#include "shim_core.h"

#define BATCH_LIMIT (256u * 1024)    /* flush the batch once it is this large */
#define DIRECT_BULK (64u * 1024)     /* bulk above this is written from the caller's buffer */
#define FLUSH_DELAY_NS 50000ull      /* flusher: this long after the last append... */
#define FLUSH_MAX_DELAY_NS 500000ull /* ...but never later than this after the first one */

/* cuInit succeeded (cuDriverGetVersion may connect earlier, but the other calls still answer
 * CUDA_ERROR_NOT_INITIALIZED until cuInit, as the driver does). Process-wide, whatever the
 * number of connections: cuInit is once per process, and so is the connecting it does (a lease
 * of several parts connects to all of them under conn_life.c's init_lock). Set by gp_conn_init
 * (conn_life.c), read here per call. */
atomic_int gp_conn_initialized;

/* After a caller gives the role back, the receiver stays off the socket this long (linger_until;
 * unless detached requests are outstanding), so back-to-back round trips do not wake it each
 * time; notices and loss that arrive meanwhile are seen at most this late. */
#define LINGER_NS 2000000ull

/* ---- keepalive (keepalive.c keeps the clock) ---- */
#define KEEPALIVE_REQ UINT64_MAX /* our pings' request id: their replies are dropped */

/* ============================================================================== state == */

/* The connection is ready for the program's calls (gp_check_init). */
static inline CUresult conn_check_init(gp_conn *c)
{
    switch (atomic_load_explicit(&c->state, memory_order_acquire)) {
    case ST_READY:
        if (!atomic_load_explicit(&gp_conn_initialized, memory_order_relaxed))
            return CUDA_ERROR_NOT_INITIALIZED;
        return atomic_load_explicit(&c->dead, memory_order_relaxed) ? GP_LOST_CONNECTION_ERROR
                                                                    : CUDA_SUCCESS;
    case ST_CLOSED:
        return CUDA_ERROR_DEINITIALIZED;
    default:
        return CUDA_ERROR_NOT_INITIALIZED;
    }
}

CUresult gp_check_init(void)
{
    return conn_check_init(&gp_conn_process);
}

int gp_conn_attempted(void)
{
    return atomic_load(&gp_conn_process.state) != ST_NONE;
}

const char *gp_conn_server(void)
{
    return gp_conn_process.server_desc;
}

/* ========================================================================== loss == */

static int conn_claim_dead(gp_conn *c);
static void conn_wake_all(gp_conn *c);
/* The first failure of c: marks it dead, says why (when it was ready), then wakes every waiter
 * with GP_LOST_CONNECTION_ERROR; the other parts of a spread lease are killed quietly. */
static void conn_fail(gp_conn *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void conn_fail(gp_conn *c, const char *fmt, ...)
{
    int ready = atomic_load(&c->state) == ST_READY;
    if (!conn_claim_dead(c))
        return;
    /* The line before anyone is woken: a program that exits on the error it is woken with must
     * not end before the line is written. */
    if (ready) {
        char reason[512];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(reason, sizeof reason, fmt, ap);
        va_end(ap);
        gp_log_error("lost connection to server %s (%s); CUDA calls now fail with "
                     "CUDA_ERROR_DEVICE_UNAVAILABLE",
                     c->server_desc, reason);
    }
    conn_wake_all(c);
    /* A spread lease is one job: the loss of any part loses the process's contexts on every
     * part (each part's server then ends and scrubs its part, as for a client that went away).
     * The line above names the server that went away; the other parts go quietly. */
    int n = ready ? conn_nparts() : 1;
    for (int k = 0; k < n; k++)
        if (gp_conn_part[k] != c)
            gp_conn_kill(gp_conn_part[k]);
}

int gp_conn_kill(gp_conn *c)
{
    if (!conn_claim_dead(c))
        return 0;
    conn_wake_all(c);
    return 1;
}

/* Marks c dead (1 if this call did it; 0 if it was already) and shuts its socket down. */
static int conn_claim_dead(gp_conn *c)
{
    int expected = 0;
    if (!atomic_compare_exchange_strong(&c->dead, &expected, 1))
        return 0;
    if (c->sock >= 0)
        shutdown(c->sock, SHUT_RDWR); /* unblocks a sender stuck in sendmsg */
    return 1;
}

/* Wakes every waiter of a dead c with the loss error (detached ones are dropped). */
static void conn_wake_all(gp_conn *c)
{
    pthread_mutex_lock(&c->wait_lock);
    gp_waiter *w = c->wait_head;
    c->wait_head = c->wait_tail = NULL;
    c->detached_count = 0;
    while (w) {
        gp_waiter *next = w->next;
        if (w->detached) {
            free(w);
        } else {
            w->result = GP_LOST_CONNECTION_ERROR;
            w->done = 1;
            pthread_cond_signal(&w->cv);
        }
        w = next;
    }
    pthread_cond_broadcast(&c->role_cv);
    pthread_mutex_unlock(&c->wait_lock);
    /* Without send_lock: a sender that fails calls this while holding it. A missed wake-up only
     * leaves the idle flusher asleep, which is harmless. */
    pthread_cond_broadcast(&c->flush_cv);
}

/* ====================================================================== sending == */

/* Write the batch followed by up to two extra buffers (gp_conn_flush_locked), or compressed data
 * (gp_post_lz4). Caller holds send_lock. 0, or -1 (the connection failed: conn_fail said why). */
static int write_failed(gp_conn *c, int rc, const char *why)
{
    if (rc == GP_WRITE_TIMED_OUT) {
        /* only with a send timeout (at exit, or the keepalive's): give up */
        if (gp_ka_on(&c->ka) && atomic_load(&c->state) == ST_READY)
            conn_fail(c,
                      "the server took no data for %.0f s: it is hung or stopped, or the network "
                      "is cut (GPUPOOL_SERVER_TIMEOUT)",
                      gp_ka_timeout_s(&c->ka));
        else
            conn_fail(c, "send timed out");
    } else if (rc == GP_WRITE_FAILED) {
        conn_fail(c, "%s", why);
    }
    return rc == GP_WRITE_OK ? 0 : -1;
}

int gp_conn_flush_locked(gp_conn *c, const void *a, size_t alen, const void *b, size_t blen)
{
    char why[300];
    return write_failed(c, gp_write_flush(&c->ws, a, alen, b, blen, why, sizeof why), why);
}

/* Before a frame of the calling thread: switch the worker's context if this thread's differs
 * from the last one sent. Caller holds send_lock. */
static int apply_ctx_locked(gp_conn *c)
{
    uint64_t want = gp_conn_tl_wire_ctx;
    if (want == 0 || want == c->last_ctx_sent)
        return 0;
    /* Spread: a context lives on its device's part only. A frame routed to another part (it
     * names its device, or a unified address there) leaves that worker's context as it was. */
    if (conn_nparts() > 1 && gp_conn_part[gp_conn_tl_ctx_part] != c)
        return 0;
    gp_ctx_set_current m = {.ctx = want};
    if (c->first_device > 0) { /* a later part's worker numbers its devices from 0 */
        int k = gp_primary_index(want);
        if (k >= 0)
            m.ctx = GP_PRIMARY_CTX_OF(k - c->first_device);
    }
    uint8_t f[16 + 8];
    size_t n = gp_ctx_set_current_frame(f, gp_conn_new_req(), &m);
    if (gp_write_append(&c->ws, f, n) != 0)
        return -1;
    c->last_ctx_sent = want;
    return 0;
}

void gp_conn_forget_ctx(void)
{
    int n = conn_nparts();
    for (int k = 0; k < n; k++) {
        gp_conn *c = gp_conn_part[k];
        pthread_mutex_lock(&c->send_lock);
        c->last_ctx_sent = UINT64_MAX;
        pthread_mutex_unlock(&c->send_lock);
    }
}

/* A frame was appended: make sure the flusher will send it soon. Caller holds send_lock. */
static void kick_flusher_locked(gp_conn *c, size_t len_before)
{
    uint64_t now = gp_mono_ns();
    c->last_append_ns = now;
    if (len_before == 0) {
        c->first_append_ns = now;
        pthread_cond_signal(&c->flush_cv);
    }
}

/* Queue header+body (+ bulk) of a fire-and-forget frame. Caller holds send_lock. */
static CUresult post_locked(gp_conn *c, uint8_t *frame, size_t frame_len, const void *bulk,
                            uint64_t bulk_len)
{
    if (atomic_load(&c->dead))
        return GP_LOST_CONNECTION_ERROR;
    size_t before = c->ws.len;
    if (apply_ctx_locked(c) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (bulk_len > DIRECT_BULK) {
        if (gp_conn_flush_locked(c, frame, frame_len, bulk, bulk_len) != 0)
            return GP_LOST_CONNECTION_ERROR;
        return CUDA_SUCCESS;
    }
    if (gp_write_append(&c->ws, frame, frame_len) != 0 ||
        gp_write_append(&c->ws, bulk, bulk_len) != 0) {
        c->ws.len = before;            /* never leave half a frame behind... */
        c->last_ctx_sent = UINT64_MAX; /* ...nor believe a dropped context switch went out */
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (c->ws.len >= BATCH_LIMIT) {
        if (gp_conn_flush_locked(c, NULL, 0, NULL, 0) != 0)
            return GP_LOST_CONNECTION_ERROR;
    } else {
        kick_flusher_locked(c, before);
    }
    return CUDA_SUCCESS;
}

CUresult gp_post(uint8_t *frame, size_t frame_len, const void *bulk, uint64_t bulk_len)
{
    gp_conn *c = conn_route();
    CUresult r = conn_check_init(c);
    if (r != CUDA_SUCCESS)
        return r;
    if (!frame || frame_len < 16)
        return CUDA_ERROR_INVALID_VALUE;
    if (bulk_len && !bulk)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&c->send_lock);
    gp_wr_u64(frame + 8, gp_conn_new_req());
    r = post_locked(c, frame, frame_len, bulk, bulk_len);
    pthread_mutex_unlock(&c->send_lock);
    return r;
}

int gp_conn_lz4(void)
{
    return atomic_load(&conn_route()->lz4_on);
}

CUresult gp_post_lz4(uint8_t *frame, size_t frame_len, const void *src, uint64_t n)
{
    gp_conn *c = conn_route();
    CUresult r = conn_check_init(c);
    if (r != CUDA_SUCCESS)
        return r;
    if (!frame || frame_len < 16 || !src)
        return CUDA_ERROR_INVALID_VALUE;
    uint8_t *enc = malloc((size_t)gp_cz_bound(GP_WRITE_CZ_PIECE));
    if (!enc)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&c->send_lock);
    gp_wr_u64(frame + 8, gp_conn_new_req());
    if (atomic_load(&c->dead)) {
        r = GP_LOST_CONNECTION_ERROR;
    } else if (apply_ctx_locked(c) != 0) {
        r = CUDA_ERROR_OUT_OF_MEMORY;
    } else if (gp_conn_flush_locked(c, frame, frame_len, NULL, 0) != 0) {
        r = GP_LOST_CONNECTION_ERROR;
    } else {
        /* The frame is out: from here only a lost connection stops the data. */
        char why[300];
        if (write_failed(c, gp_write_lz4(&c->ws, src, n, enc, why, sizeof why), why) != 0)
            r = GP_LOST_CONNECTION_ERROR;
    }
    pthread_mutex_unlock(&c->send_lock);
    free(enc);
    return r;
}

/* Link a waiter in (unless the connection is dead). 0, or -1 if dead. */
static int waiter_add(gp_conn *c, gp_waiter *w)
{
    pthread_mutex_lock(&c->wait_lock);
    if (atomic_load(&c->dead)) {
        pthread_mutex_unlock(&c->wait_lock);
        return -1;
    }
    w->next = NULL;
    if (c->wait_tail)
        c->wait_tail->next = w;
    else
        c->wait_head = w;
    c->wait_tail = w;
    if (w->detached && c->detached_count++ == 0 && c->recv_parked)
        pthread_cond_signal(&c->role_cv); /* its reply needs the receiver */
    pthread_mutex_unlock(&c->wait_lock);
    return 0;
}

/* Unlink the waiter with this request id and return it (NULL if none). Caller holds wait_lock. */
static gp_waiter *waiter_take_locked(gp_conn *c, uint64_t req)
{
    gp_waiter *prev = NULL;
    for (gp_waiter *w = c->wait_head; w; prev = w, w = w->next) {
        if (w->req != req)
            continue;
        if (prev)
            prev->next = w->next;
        else
            c->wait_head = w->next;
        if (c->wait_tail == w)
            c->wait_tail = prev;
        w->next = NULL;
        if (w->detached)
            c->detached_count--;
        return w;
    }
    return NULL;
}

static void await_reply(gp_conn *c, gp_waiter *w);

CUresult gp_request(uint8_t *frame, size_t frame_len, const void *bulk, uint64_t bulk_len,
                    void *bulk_dst, uint64_t bulk_cap, gp_reply *reply)
{
    gp_reply dummy;
    if (!reply)
        reply = &dummy;
    memset(reply, 0, sizeof *reply);
    gp_conn *c = conn_route();
    CUresult r = conn_check_init(c);
    if (r != CUDA_SUCCESS)
        return reply->result = r;
    if (!frame || frame_len < 16 || (bulk_len && !bulk))
        return CUDA_ERROR_INVALID_VALUE;

    gp_waiter w = {.dst = bulk_dst, .cap = bulk_dst ? bulk_cap : 0};
    pthread_cond_init(&w.cv, NULL);
    w.req = gp_conn_new_req();
    gp_wr_u64(frame + 8, w.req);
    if (waiter_add(c, &w) != 0) {
        pthread_cond_destroy(&w.cv);
        return reply->result = GP_LOST_CONNECTION_ERROR;
    }

    pthread_mutex_lock(&c->send_lock);
    if (!atomic_load(&c->dead)) {
        if (apply_ctx_locked(c) != 0) {
            /* cannot even queue the context switch: take the waiter back */
            pthread_mutex_unlock(&c->send_lock);
            pthread_mutex_lock(&c->wait_lock);
            int mine = waiter_take_locked(c, w.req) != NULL;
            while (!mine && !w.done)
                pthread_cond_wait(&w.cv, &c->wait_lock);
            pthread_mutex_unlock(&c->wait_lock);
            pthread_cond_destroy(&w.cv);
            free(w.body);
            return reply->result = CUDA_ERROR_OUT_OF_MEMORY;
        }
        gp_conn_flush_locked(c, frame, frame_len, bulk,
                             bulk_len); /* on failure conn_fail wakes us */
    }
    pthread_mutex_unlock(&c->send_lock);

    await_reply(c, &w);
    pthread_cond_destroy(&w.cv);

    reply->result = w.result;
    reply->body = w.body;
    reply->len = w.len;
    reply->bulk_len = w.bulk_len;
    if (w.result != 0)
        gp_reply_free(reply);
    return w.result;
}

CUresult gp_request_detached(uint8_t *frame, size_t frame_len, void *bulk_dst, uint64_t bulk_cap)
{
    gp_conn *c = conn_route();
    CUresult r = conn_check_init(c);
    if (r != CUDA_SUCCESS)
        return r;
    if (!frame || frame_len < 16)
        return CUDA_ERROR_INVALID_VALUE;
    gp_waiter *w = calloc(1, sizeof *w);
    if (!w)
        return CUDA_ERROR_OUT_OF_MEMORY;
    w->detached = 1;
    w->dst = bulk_dst;
    w->cap = bulk_dst ? bulk_cap : 0;
    w->req = gp_conn_new_req();
    gp_wr_u64(frame + 8, w->req);
    uint64_t req = w->req;
    if (waiter_add(c, w) != 0) {
        free(w);
        return GP_LOST_CONNECTION_ERROR;
    }
    /* From here the receiver (or conn_fail) owns w. */
    pthread_mutex_lock(&c->send_lock);
    r = post_locked(c, frame, frame_len, NULL, 0);
    pthread_mutex_unlock(&c->send_lock);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) {
        pthread_mutex_lock(&c->wait_lock);
        gp_waiter *mine = waiter_take_locked(c, req);
        pthread_mutex_unlock(&c->wait_lock);
        free(mine);
    }
    return r;
}

/* ===================================================================== the flusher == */

void *gp_conn_flusher_main(void *arg)
{
    gp_conn *c = arg;
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0); /* wake close to the 50 us deadline */
    pthread_mutex_lock(&c->send_lock);
    for (;;) {
        while (!atomic_load(&c->dead) && c->ws.len == 0)
            pthread_cond_wait(&c->flush_cv, &c->send_lock);
        if (atomic_load(&c->dead))
            break;
        uint64_t now = gp_mono_ns();
        uint64_t deadline = c->last_append_ns + FLUSH_DELAY_NS;
        if (deadline > c->first_append_ns + FLUSH_MAX_DELAY_NS)
            deadline = c->first_append_ns + FLUSH_MAX_DELAY_NS;
        if (now < deadline) {
            struct timespec ts = {.tv_sec = (time_t)(deadline / 1000000000ull),
                                  .tv_nsec = (long)(deadline % 1000000000ull)};
            pthread_cond_timedwait(&c->flush_cv, &c->send_lock, &ts);
            continue;
        }
        gp_conn_flush_locked(c, NULL, 0, NULL, 0);
    }
    pthread_mutex_unlock(&c->send_lock);
    return NULL;
}

/* ==================================================================== the receiver == */

/* Our keepalive: a ping whose reply is dropped. Only if nobody is sending (a sender's progress
 * counts already, and the reader must never wait for send_lock). */
static void send_keepalive(gp_conn *c)
{
    if (pthread_mutex_trylock(&c->send_lock) != 0)
        return;
    gp_ping m = {.token = 0};
    uint8_t f[16 + 8];
    size_t n = gp_ping_frame(f, KEEPALIVE_REQ, &m);
    /* A ping the kernel buffers proves nothing about the server: it must not count as progress
     * (senders are held off by send_lock meanwhile). */
    uint64_t tx = gp_ka_last_tx(&c->ka);
    if (!atomic_load(&c->dead))
        gp_conn_flush_locked(c, f, n, NULL, 0);
    gp_ka_restore_tx(&c->ka, tx);
    pthread_mutex_unlock(&c->send_lock);
}

/* The connection has been quiet for a read slice while a reply is awaited: ping the server
 * when keepalive.c says so; -1 (with *why) once the server counts as gone. */
int gp_conn_silence_check(void *owner, const char **why)
{
    gp_conn *c = owner;
    int k = gp_ka_silence(&c->ka, why);
    if (k > 0)
        send_keepalive(c);
    return k < 0 ? -1 : 0;
}

/* Deliver one reply. 0, or -1 if the stream broke (*why set). */
static int handle_reply(gp_conn *c, const gp_frame_header *hd, uint8_t *body, const char **why)
{
    if (hd->len < 4) {
        free(body);
        *why = "malformed reply from the server";
        return -1;
    }
    int32_t result = (int32_t)gp_rd_u32(body);
    uint64_t bulk = 0;
    if (hd->op == GP_OP_MEMCPY_DTOH && hd->len > 4) {
        gp_memcpy_dtoh_reply d;
        if (gp_memcpy_dtoh_reply_decode(body, hd->len, &d) != 0) {
            free(body);
            *why = "malformed reply from the server";
            return -1;
        }
        bulk = d.data_len;
    }
    int cz = hd->op == GP_OP_MEMCPY_DTOH && atomic_load(&c->lz4_on) && gp_cz_applies(bulk);

    pthread_mutex_lock(&c->wait_lock);
    gp_waiter *w = waiter_take_locked(c, hd->req);
    pthread_mutex_unlock(&c->wait_lock);

    int rc = 0;
    if (!w) {
        if (hd->req != KEEPALIVE_REQ)
            gp_log_debug("reply to unknown request %llu (op %s) ignored",
                         (unsigned long long)hd->req, gp_op_name(hd->op));
        rc = gp_read_bulk(&c->rs, NULL, bulk, cz, why);
        free(body);
        return rc;
    }
    if (bulk > w->cap) {
        gp_log_error("server sent %llu bytes for a %llu-byte copy (op %s); dropped",
                     (unsigned long long)bulk, (unsigned long long)w->cap, gp_op_name(hd->op));
        rc = gp_read_bulk(&c->rs, NULL, bulk, cz, why);
        if (result == 0)
            result = CUDA_ERROR_UNKNOWN;
        bulk = 0;
    } else if (bulk) {
        rc = gp_read_bulk(&c->rs, w->dst, bulk, cz, why);
    }
    if (rc != 0)
        result = GP_LOST_CONNECTION_ERROR;

    if (w->detached) {
        if (result != 0 && rc == 0)
            gp_pending_record(result);
        free(body);
        free(w);
        return rc;
    }
    pthread_mutex_lock(&c->wait_lock);
    w->result = result;
    w->body = body;
    w->len = hd->len;
    w->bulk_len = bulk;
    w->done = 1;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&c->wait_lock);
    return rc;
}

/* Read and dispatch one frame. Caller holds the reader role. 0, or -1 (*why set). */
static int read_frame(gp_conn *c, const char **why)
{
    uint8_t h[16];
    if (gp_read_exact(&c->rs, h, 16, why) != 0)
        return -1;
    gp_frame_header hd;
    gp_header_decode(h, &hd);
    if (hd.len > GP_PROTO_MAX_BODY) {
        *why = "malformed frame from the server (body too long)";
        return -1;
    }
    uint8_t *body = malloc(hd.len ? hd.len : 1);
    if (!body) {
        *why = "out of memory";
        return -1;
    }
    if (gp_read_exact(&c->rs, body, hd.len, why) != 0) {
        free(body);
        return -1;
    }
    if (hd.flags & GP_FLAG_REPLY)
        return handle_reply(c, &hd, body, why);
    if (hd.op == GP_OP_NOTICE) {
        gp_pending_notice(body, hd.len);
        free(body);
        return 0;
    }
    free(body);
    *why = "unexpected frame from the server";
    return -1;
}

/* Give the reader role back and wake whoever may take it next: the parked receiver, and one
 * caller waiting for its reply. Caller holds wait_lock. */
static void release_role_locked(gp_conn *c)
{
    if (c->reader == RD_CALLER)
        c->linger_until = gp_mono_ns() + LINGER_NS;
    c->reader = RD_NONE;
    if (c->recv_parked && (c->detached_count > 0 || gp_read_buffered(&c->rs)))
        pthread_cond_signal(&c->role_cv);
    if (c->want_head)
        pthread_cond_signal(&c->want_head->cv);
}

static void want_role_locked(gp_conn *c, gp_waiter *w)
{
    w->want_role = 1;
    w->next_want = NULL;
    if (c->want_tail)
        c->want_tail->next_want = w;
    else
        c->want_head = w;
    c->want_tail = w;
}

static void unwant_role_locked(gp_conn *c, gp_waiter *w)
{
    gp_waiter *prev = NULL;
    for (gp_waiter *o = c->want_head; o; prev = o, o = o->next_want) {
        if (o != w)
            continue;
        if (prev)
            prev->next_want = o->next_want;
        else
            c->want_head = o->next_want;
        if (c->want_tail == o)
            c->want_tail = prev;
        break;
    }
    w->want_role = 0;
    w->next_want = NULL;
}

/* Wait for w's reply, reading the socket ourselves whenever no other thread does. */
static void await_reply(gp_conn *c, gp_waiter *w)
{
    pthread_mutex_lock(&c->wait_lock);
    while (!w->done) {
        if (c->reader != RD_NONE || atomic_load(&c->dead)) {
            /* another thread reads (it completes us, or hands us the role) or conn_fail did */
            want_role_locked(c, w);
            pthread_cond_wait(&w->cv, &c->wait_lock);
            unwant_role_locked(c, w);
            continue;
        }
        c->reader = RD_CALLER;
        c->reader_gen++;
        pthread_mutex_unlock(&c->wait_lock);
        for (;;) {
            const char *why = "connection lost";
            if (read_frame(c, &why) != 0) {
                conn_fail(c, "%s", why); /* completes every waiter, w included */
                pthread_mutex_lock(&c->wait_lock);
                release_role_locked(c);
                break;
            }
            pthread_mutex_lock(&c->wait_lock);
            /* done: give the role back once nothing read is left in the buffer */
            if (w->done && !gp_read_buffered(&c->rs)) {
                release_role_locked(c);
                break;
            }
            pthread_mutex_unlock(&c->wait_lock);
        }
    }
    pthread_mutex_unlock(&c->wait_lock);
}

static void receive_until_lost(gp_conn *c);

void *gp_conn_receiver_main(void *arg)
{
    receive_until_lost(arg);
    return NULL;
}

/* The receiver waits on role_cv, without the role, until `until` (CLOCK_MONOTONIC ns) or a
 * signal. Caller holds wait_lock. */
static void park_receiver_locked(gp_conn *c, uint64_t until)
{
    struct timespec ts = {.tv_sec = (time_t)(until / 1000000000ull),
                          .tv_nsec = (long)(until % 1000000000ull)};
    c->recv_parked = 1;
    pthread_cond_timedwait(&c->role_cv, &c->wait_lock, &ts);
    c->recv_parked = 0;
}

static void receive_until_lost(gp_conn *c)
{
    const char *why = "connection lost";
    pthread_mutex_lock(&c->wait_lock);
    for (;;) {
        /* wait, without the role, until there is something to read and nobody reads it */
        int ready = 0;
        for (;;) {
            while (c->reader != RD_NONE && !atomic_load(&c->dead)) {
                /* Timed: a caller may hand the role back without signalling (nothing buffered,
                 * nothing detached). Re-checking every LINGER_NS bounds how late a notice or a
                 * dead server is seen while the program computes on the CPU. */
                park_receiver_locked(c, gp_mono_ns() + LINGER_NS);
                ready = 0;
            }
            if (atomic_load(&c->dead)) {
                pthread_mutex_unlock(&c->wait_lock);
                return;
            }
            if (ready || gp_read_buffered(&c->rs))
                break;
            if (c->detached_count == 0 && c->linger_until) {
                uint64_t now = gp_mono_ns();
                if (now < c->linger_until) {
                    park_receiver_locked(c, c->linger_until); /* a caller read recently: stay off */
                    ready = 0;
                    continue;
                }
            }
            uint64_t gen = c->reader_gen;
            int ka = gp_ka_on(&c->ka);
            pthread_mutex_unlock(&c->wait_lock);
            struct pollfd p = {.fd = c->sock, .events = POLLIN};
            int n = poll(&p, 1, ka ? GP_KA_SLICE_MS : -1);
            int err = errno;
            pthread_mutex_lock(&c->wait_lock);
            if (n < 0 && err != EINTR) {
                pthread_mutex_unlock(&c->wait_lock);
                why = strerror(err);
                goto fail;
            }
            /* Quiet while detached requests (async copies) are awaited: the same watch as a
             * caller's (an idle program with an idle server is not a silence) */
            if (n == 0 && ka && c->detached_count > 0 && c->reader == RD_NONE) {
                pthread_mutex_unlock(&c->wait_lock);
                int bad = gp_conn_silence_check(c, &why);
                pthread_mutex_lock(&c->wait_lock);
                if (bad) {
                    pthread_mutex_unlock(&c->wait_lock);
                    goto fail;
                }
            }
            /* stale if a caller has read in the meantime: poll again */
            ready = n > 0 && gen == c->reader_gen;
        }
        c->reader = RD_RECEIVER;
        pthread_mutex_unlock(&c->wait_lock);
        int rc = read_frame(c, &why);
        pthread_mutex_lock(&c->wait_lock);
        release_role_locked(c);
        if (rc != 0) {
            pthread_mutex_unlock(&c->wait_lock);
            goto fail;
        }
    }
fail:
    conn_fail(c, "%s", why); /* silent after goodbye: the server closing is the expected end */
}
