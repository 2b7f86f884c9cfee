/*
 * conn.c: the one TCP connection of this process to its gpupool worker.
 *
 *  - gp_conn_ensure: connect once per process (connect.c does the talking: VA window, hello,
 *    snapshot, the one-line error), pthread_once-like; then start the two threads below.
 *  - Sending: fire-and-forget frames are appended to a batch under send_lock; the batch goes
 *    out before any request that waits, when it passes 256 KiB, and from the flusher thread
 *    ~50 us after the last append, so a program that never synchronises still progresses.
 *    Bulk data above 64 KiB is written straight from the caller's buffer (no copy).
 *  - Receiving: one thread at a time reads frames (the reader role): a caller waiting for its
 *    reply reads them itself while nobody else does (no thread hand-off on a round trip), the
 *    receiver thread otherwise (see "the reader role"). A reply completes the waiter with its request id
 *    (reply bulk is read directly into the waiter's buffer); replies of detached requests
 *    (async device-to-host copies) land in the program's buffer; notices are printed once per
 *    distinct text and become the pending error (informational codes: printed, not recorded).
 *  - Loss: the first failure marks the connection dead, wakes every waiter with
 *    GP_LOST_CONNECTION_ERROR and prints one line. Sends use MSG_NOSIGNAL (never SIGPIPE).
 *  - fork: the child drops the connection without sending anything (CUDA calls there return
 *    CUDA_ERROR_NOT_INITIALIZED); exit: flush and goodbye, bounded by short timeouts.
 *  - Keepalive (when the server promised it, GP_HELLO_KEEPALIVE): a live server is never silent
 *    towards a waiting client for more than GP_KEEPALIVE_MS (its worker sends GP_INFO_WORKING
 *    notices during long calls). Reads wake every KEEPALIVE_SLICE_MS; whoever reads while a
 *    reply is awaited sends a ping when the connection has been quiet for a third of the
 *    timeout, and fails the connection when nothing came in and nothing went out for
 *    GPUPOOL_SERVER_TIMEOUT seconds (default 30): a stopped or hung server, or a cut network.
 * Lock order: send_lock before wait_lock; the receiver takes send_lock only with trylock (its
 * keepalive ping), never waiting for it.
 *  - TLS (tls != NULL; tls.c): the same flow, with the socket calls replaced by the session's
 *    (which locks itself per call, so a sender and the reader may use it at once). OpenSSL may
 *    hold received bytes that poll() cannot see: the reader drains them before giving the role
 *    back, and the receiver checks them before it polls. With tls == NULL (plaintext) the code
 *    below makes exactly the system calls it made before TLS existed.
 */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "compress.h"
#include "shim.h"
#include "shim_core.h"

#define BATCH_LIMIT (256u * 1024) /* flush the batch once it is this large */
#define DIRECT_BULK (64u * 1024)  /* bulk above this is written from the caller's buffer */
/* The most one sendmsg() is given. A call with all of a 256 MiB copy owns the socket until the
 * kernel has taken the last byte: the ACKs that arrive meanwhile wait in the socket's backlog
 * and the sender processes them itself in bursts, the window opening late. 1 MiB a call leaves
 * them to the softirq as they come: 256 MiB uploads 0.28-0.33 -> 0.20-0.22 client CPU s/GiB and
 * 0.71-0.81x -> 1.19-1.28x of raw TCP on loopback (docs/benchmarks.md, "Uploads"); 256 KiB and
 * 4 MiB measured between the two. */
#ifndef SEND_CHUNK
#define SEND_CHUNK (1u << 20)
#endif
#define FLUSH_DELAY_NS 50000ull      /* flusher: this long after the last append... */
#define FLUSH_MAX_DELAY_NS 500000ull /* ...but never later than this after the first one */
#define RBUF_SIZE (256u * 1024)

enum {
    ST_NONE,
    ST_READY,
    ST_FAILED,
    ST_FORKED,
    ST_CLOSED
};

static atomic_int state = ST_NONE;
static atomic_int dead;
/* cuInit succeeded (cuDriverGetVersion may connect earlier, but the other calls still answer
 * CUDA_ERROR_NOT_INITIALIZED until cuInit, as the driver does). */
static atomic_int initialized;
static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;
static CUresult init_result = CUDA_ERROR_NOT_INITIALIZED; /* guarded by init_lock */

static int sock = -1;
static gp_tls *tls;           /* the TLS session with the worker, or NULL (plaintext) */
static char tls_err[300];     /* the reader's last TLS error (only the reader writes it) */
static char server_desc[300]; /* "host:port" of the server in use */

/* ---- send side (send_lock) ---- */
static pthread_mutex_t send_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t flush_cv; /* CLOCK_MONOTONIC; the flusher waits on it */
static uint8_t *batch;
static size_t batch_len, batch_cap;
static uint64_t first_append_ns, last_append_ns;
static uint64_t last_ctx_sent; /* UINT64_MAX: unknown */
static atomic_uint_fast64_t next_req = 1;
static __thread uint64_t tl_wire_ctx;

/* ---- waiters (wait_lock) ---- */
typedef struct waiter {
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
    struct waiter *next;
    struct waiter *next_want; /* in the want list while want_role */
} waiter;
static pthread_mutex_t wait_lock = PTHREAD_MUTEX_INITIALIZER;
static waiter *wait_head, *wait_tail;

/* ---- the reader role (wait_lock) ----
 * One thread at a time reads the socket: the receiver thread, or a caller of gp_request
 * waiting for its reply (the leader), which reads and dispatches every frame itself until its
 * own reply has come, so the common round trip needs no thread hand-off. The receiver waits in
 * poll() without the role, takes it only while no caller holds it, and parks on role_cv while
 * a caller does. A leader drains what it buffered before it gives the role back. */
enum {
    RD_NONE,
    RD_RECEIVER,
    RD_CALLER
};
static int reader;          /* RD_* */
static int recv_parked;     /* the receiver waits on role_cv */
static uint64_t reader_gen; /* counts the times a caller took the role */
/* After a caller gives the role back, the receiver stays off the socket this long (unless
 * detached requests are outstanding), so back-to-back round trips do not wake it each time;
 * notices and loss that arrive meanwhile are seen at most this late. */
#define LINGER_NS 2000000ull
static uint64_t linger_until;
static int detached_count; /* detached waiters in the list */
/* Waiters blocked on their cv for the reader role, oldest first: a list of their own, because
 * the waiter list may hold thousands of detached copies, and scanning it at every release of the
 * role made 16384 small asynchronous downloads quadratic (0.15 GB/s instead of 3). */
static waiter *want_head, *want_tail;
static pthread_cond_t role_cv; /* CLOCK_MONOTONIC */
/* The receiver thread, joinable: at exit over TLS it is joined (stop_receiver) so that no thread
 * of ours is inside OpenSSL, or running its thread-exit clean-up, while OpenSSL's own exit
 * handler frees the same state. Set once by gp_conn_ensure under init_lock. */
static pthread_t receiver_thread;
static int receiver_started;
typedef struct rstate {
    uint8_t *buf;
    size_t pos, len;
} rstate;
static rstate rs;      /* the read buffer; only the reader touches it */
static uint8_t *cz_in; /* one LZ4 block's stored bytes (GP_LZ4_BLOCK); only the reader touches it */
static atomic_int lz4_on; /* LZ4-compressed copies negotiated (connect.c) */

/* ---- keepalive ---- */
#define KEEPALIVE_SLICE_MS 1000     /* reads wake this often to look at the silence */
#define KEEPALIVE_REQ UINT64_MAX    /* our pings' request id: their replies are dropped */
#define SERVER_TIMEOUT_DEFAULT 30.0 /* seconds; GPUPOOL_SERVER_TIMEOUT */
static atomic_int keepalive_on;     /* the server promised keepalives and the timeout is on */
static uint64_t server_timeout_ns;  /* set before keepalive_on */
static atomic_uint_fast64_t last_rx_ns, last_tx_ns, last_ping_ns;

/* ---- pending error and notices ---- */
static atomic_int pending_error;
static pthread_mutex_t notice_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t notice_seen[512];
static size_t notice_count;

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Bytes moved: the server is alive (a sender's progress counts as much as a reply). */
static void note_rx(void)
{
    if (atomic_load_explicit(&keepalive_on, memory_order_relaxed))
        atomic_store_explicit(&last_rx_ns, mono_ns(), memory_order_relaxed);
}
static void note_tx(void)
{
    if (atomic_load_explicit(&keepalive_on, memory_order_relaxed))
        atomic_store_explicit(&last_tx_ns, mono_ns(), memory_order_relaxed);
}

static int is_sticky(int code)
{
    return (code >= 700 && code <= 719) || code == 999;
}

/* ======================================================================== pending errors == */

CUresult gp_cu_result(int32_t r)
{
    return r >= 100000 || r < 0 ? CUDA_ERROR_UNKNOWN : r;
}

static void record_pending(int32_t code)
{
    if (code == 0)
        return;
    int expected = 0;
    atomic_compare_exchange_strong(&pending_error, &expected, (int)gp_cu_result(code));
}

CUresult gp_take_pending_error(void)
{
    int v = atomic_load(&pending_error);
    if (v == 0 || is_sticky(v))
        return v;
    atomic_compare_exchange_strong(&pending_error, &v, 0);
    return v;
}

/* ============================================================================== state == */

CUresult gp_check_init(void)
{
    switch (atomic_load_explicit(&state, memory_order_acquire)) {
    case ST_READY:
        if (!atomic_load_explicit(&initialized, memory_order_relaxed))
            return CUDA_ERROR_NOT_INITIALIZED;
        return atomic_load_explicit(&dead, memory_order_relaxed) ? GP_LOST_CONNECTION_ERROR
                                                                 : CUDA_SUCCESS;
    case ST_CLOSED:
        return CUDA_ERROR_DEINITIALIZED;
    default:
        return CUDA_ERROR_NOT_INITIALIZED;
    }
}

int gp_conn_attempted(void)
{
    return atomic_load(&state) != ST_NONE;
}

CUresult gp_conn_init(void)
{
    CUresult r = gp_conn_ensure();
    if (r == CUDA_SUCCESS) {
        atomic_store(&initialized, 1);
        r = gp_check_init();
    }
    return r;
}
const char *gp_conn_server(void)
{
    return server_desc;
}

uint64_t gp_conn_new_req(void)
{
    return atomic_fetch_add(&next_req, 1);
}

/* ========================================================================== loss == */

static void conn_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void conn_fail(const char *fmt, ...)
{
    int expected = 0;
    if (!atomic_compare_exchange_strong(&dead, &expected, 1))
        return;
    if (sock >= 0)
        shutdown(sock, SHUT_RDWR); /* unblocks a sender stuck in sendmsg */
    if (atomic_load(&state) == ST_READY) {
        char reason[512];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(reason, sizeof reason, fmt, ap);
        va_end(ap);
        gp_log_error("lost connection to server %s (%s); CUDA calls now fail with "
                     "CUDA_ERROR_DEVICE_UNAVAILABLE",
                     server_desc, reason);
    }
    pthread_mutex_lock(&wait_lock);
    waiter *w = wait_head;
    wait_head = wait_tail = NULL;
    detached_count = 0;
    while (w) {
        waiter *next = w->next;
        if (w->detached) {
            free(w);
        } else {
            w->result = GP_LOST_CONNECTION_ERROR;
            w->done = 1;
            pthread_cond_signal(&w->cv);
        }
        w = next;
    }
    pthread_cond_broadcast(&role_cv);
    pthread_mutex_unlock(&wait_lock);
    /* Without send_lock: a sender that fails calls this while holding it. A missed wake-up only
     * leaves the idle flusher asleep, which is harmless. */
    pthread_cond_broadcast(&flush_cv);
}

/* ====================================================================== sending == */

/* TLS: every iovec through the session (a record or more each). Caller holds send_lock. */
static int write_iov_tls_locked(const struct iovec *iov, int n)
{
    char err[300];
    for (int i = 0; i < n; i++) {
        if (atomic_load(&dead))
            return -1;
        if (iov[i].iov_len &&
            gp_tls_write(tls, iov[i].iov_base, iov[i].iov_len, err, sizeof err) != 0) {
            conn_fail("%s", err);
            return -1;
        }
        note_tx();
    }
    return 0;
}

/* Write every iovec completely. Caller holds send_lock. 0, or -1 (connection failed). */
static int write_iov_locked(struct iovec *iov, int n)
{
    if (tls)
        return write_iov_tls_locked(iov, n);
    while (n > 0 && iov[0].iov_len == 0)
        iov++, n--;
    while (n > 0) {
        if (atomic_load(&dead))
            return -1;
        /* At most SEND_CHUNK bytes a call (above); the loop below takes what was sent off iov. */
        struct iovec part[64];
        int np = 0;
        size_t total = 0;
        for (; np < n && np < 64 && total < SEND_CHUNK; np++) {
            part[np] = iov[np];
            if (part[np].iov_len > SEND_CHUNK - total)
                part[np].iov_len = SEND_CHUNK - total;
            total += part[np].iov_len;
        }
        struct msghdr mh = {.msg_iov = part, .msg_iovlen = (size_t)np};
        ssize_t w = sendmsg(sock, &mh, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                /* only with a send timeout (at exit, or the keepalive's): give up */
                if (atomic_load(&keepalive_on) && atomic_load(&state) == ST_READY)
                    conn_fail("the server took no data for %.0f s: it is hung or stopped, or "
                              "the network is cut (GPUPOOL_SERVER_TIMEOUT)",
                              (double)server_timeout_ns / 1e9);
                else
                    conn_fail("send timed out");
                return -1;
            }
            conn_fail("%s", strerror(errno));
            return -1;
        }
        note_tx();
        size_t left = (size_t)w;
        while (n > 0 && left >= iov[0].iov_len) {
            left -= iov[0].iov_len;
            iov++, n--;
        }
        if (n > 0) {
            iov[0].iov_base = (uint8_t *)iov[0].iov_base + left;
            iov[0].iov_len -= left;
        }
        while (n > 0 && iov[0].iov_len == 0)
            iov++, n--;
    }
    return 0;
}

/* Write the batch followed by up to two extra buffers. Caller holds send_lock. */
static int flush_locked(const void *a, size_t alen, const void *b, size_t blen)
{
    struct iovec iov[3] = {{batch, batch_len}, {(void *)a, alen}, {(void *)b, blen}};
    int rc = write_iov_locked(iov, 3);
    batch_len = 0;
    return rc;
}

static int batch_append_locked(const void *p, size_t n)
{
    if (n == 0)
        return 0;
    if (batch_len + n > batch_cap) {
        size_t ncap = batch_cap ? batch_cap : 64 * 1024;
        while (ncap < batch_len + n)
            ncap *= 2;
        uint8_t *nb = realloc(batch, ncap);
        if (!nb)
            return -1;
        batch = nb;
        batch_cap = ncap;
    }
    memcpy(batch + batch_len, p, n);
    batch_len += n;
    return 0;
}

/* Before a frame of the calling thread: switch the worker's context if this thread's differs
 * from the last one sent. Caller holds send_lock. */
static int apply_ctx_locked(void)
{
    uint64_t want = tl_wire_ctx;
    if (want == 0 || want == last_ctx_sent)
        return 0;
    gp_ctx_set_current m = {.ctx = want};
    uint8_t f[16 + 8];
    size_t n = gp_ctx_set_current_frame(f, atomic_fetch_add(&next_req, 1), &m);
    if (batch_append_locked(f, n) != 0)
        return -1;
    last_ctx_sent = want;
    return 0;
}

void gp_conn_use_ctx(uint64_t ctx_id)
{
    tl_wire_ctx = ctx_id;
}

void gp_conn_forget_ctx(void)
{
    pthread_mutex_lock(&send_lock);
    last_ctx_sent = UINT64_MAX;
    pthread_mutex_unlock(&send_lock);
}

/* A frame was appended: make sure the flusher will send it soon. Caller holds send_lock. */
static void kick_flusher_locked(size_t len_before)
{
    uint64_t now = mono_ns();
    last_append_ns = now;
    if (len_before == 0) {
        first_append_ns = now;
        pthread_cond_signal(&flush_cv);
    }
}

/* Queue header+body (+ bulk) of a fire-and-forget frame. Caller holds send_lock. */
static CUresult post_locked(uint8_t *frame, size_t frame_len, const void *bulk, uint64_t bulk_len)
{
    if (atomic_load(&dead))
        return GP_LOST_CONNECTION_ERROR;
    size_t before = batch_len;
    if (apply_ctx_locked() != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (bulk_len > DIRECT_BULK) {
        if (flush_locked(frame, frame_len, bulk, bulk_len) != 0)
            return GP_LOST_CONNECTION_ERROR;
        return CUDA_SUCCESS;
    }
    if (batch_append_locked(frame, frame_len) != 0 || batch_append_locked(bulk, bulk_len) != 0) {
        batch_len = before;         /* never leave half a frame behind... */
        last_ctx_sent = UINT64_MAX; /* ...nor believe a dropped context switch went out */
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (batch_len >= BATCH_LIMIT) {
        if (flush_locked(NULL, 0, NULL, 0) != 0)
            return GP_LOST_CONNECTION_ERROR;
    } else {
        kick_flusher_locked(before);
    }
    return CUDA_SUCCESS;
}

CUresult gp_post(uint8_t *frame, size_t frame_len, const void *bulk, uint64_t bulk_len)
{
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    if (!frame || frame_len < 16)
        return CUDA_ERROR_INVALID_VALUE;
    if (bulk_len && !bulk)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&send_lock);
    gp_wr_u64(frame + 8, atomic_fetch_add(&next_req, 1));
    r = post_locked(frame, frame_len, bulk, bulk_len);
    pthread_mutex_unlock(&send_lock);
    return r;
}

void gp_conn_set_lz4(int on)
{
    atomic_store(&lz4_on, on);
}

double gp_server_timeout_setting(void)
{
    const char *v = getenv("GPUPOOL_SERVER_TIMEOUT");
    if (!v || !*v)
        return SERVER_TIMEOUT_DEFAULT;
    char *end;
    double t = strtod(v, &end);
    if (*end || end == v || !(t == 0 || (t >= 3 && t <= 86400))) {
        static atomic_int said;
        if (!atomic_exchange(&said, 1))
            gp_log_error("GPUPOOL_SERVER_TIMEOUT=%s is not 0 or a number of seconds from 3 to "
                         "86400; using %.0f",
                         v, SERVER_TIMEOUT_DEFAULT);
        return SERVER_TIMEOUT_DEFAULT;
    }
    return t;
}

static int server_keepalive; /* the hello reply promised keepalives (connect.c says so) */
void gp_conn_set_keepalive(int on)
{
    server_keepalive = on;
}

/* Once connected: arm the timeout on socket s when the server sends keepalives, unless
 * GPUPOOL_SERVER_TIMEOUT=0. */
static void arm_keepalive(int s, gp_tls *t)
{
    double timeout = gp_server_timeout_setting();
    if (!server_keepalive || timeout <= 0) {
        atomic_store(&keepalive_on, 0);
        gp_log_debug("keepalive: off (%s)",
                     server_keepalive ? "GPUPOOL_SERVER_TIMEOUT=0" : "the server sends none");
        return;
    }
    server_timeout_ns = (uint64_t)(timeout * 1e9);
    uint64_t now = mono_ns();
    atomic_store(&last_rx_ns, now);
    atomic_store(&last_tx_ns, now);
    atomic_store(&last_ping_ns, now);
    /* Reads wake every slice; a write that moves nothing for the whole timeout fails. */
    struct timeval rt = {.tv_sec = KEEPALIVE_SLICE_MS / 1000,
                         .tv_usec = (KEEPALIVE_SLICE_MS % 1000) * 1000};
    struct timeval st = {.tv_sec = (time_t)timeout,
                         .tv_usec = (suseconds_t)((timeout - (double)(time_t)timeout) * 1e6)};
    if (setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &rt, sizeof rt) != 0 ||
        setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &st, sizeof st) != 0) {
        gp_log_debug("keepalive: setsockopt: %s; no server timeout", strerror(errno));
        return;
    }
    if (t)
        gp_tls_set_send_timeout(t, (int)(timeout * 1000));
    atomic_store(&keepalive_on, 1);
    gp_log_debug("keepalive: a server silent for %.0f s is given up (GPUPOOL_SERVER_TIMEOUT)",
                 timeout);
}
int gp_conn_lz4(void)
{
    return atomic_load(&lz4_on);
}

#define CZ_PIECE ((size_t)8 << 20) /* encoded and sent in pieces of this many raw bytes */

CUresult gp_post_lz4(uint8_t *frame, size_t frame_len, const void *src, uint64_t n)
{
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    if (!frame || frame_len < 16 || !src)
        return CUDA_ERROR_INVALID_VALUE;
    uint8_t *enc = malloc((size_t)gp_cz_bound(CZ_PIECE));
    if (!enc)
        return CUDA_ERROR_OUT_OF_MEMORY;
    const uint8_t *s = src;
    gp_cz_enc st = {0};
    pthread_mutex_lock(&send_lock);
    gp_wr_u64(frame + 8, atomic_fetch_add(&next_req, 1));
    if (atomic_load(&dead)) {
        r = GP_LOST_CONNECTION_ERROR;
    } else if (apply_ctx_locked() != 0) {
        r = CUDA_ERROR_OUT_OF_MEMORY;
    } else if (flush_locked(frame, frame_len, NULL, 0) != 0) {
        r = GP_LOST_CONNECTION_ERROR;
    } else {
        /* The frame is out: from here only a lost connection stops the data. */
        for (uint64_t off = 0; off < n;) {
            size_t piece = n - off < CZ_PIECE ? (size_t)(n - off) : CZ_PIECE;
            size_t len = gp_cz_encode(&st, s + off, piece, enc);
            if (flush_locked(NULL, 0, enc, len) != 0) {
                r = GP_LOST_CONNECTION_ERROR;
                break;
            }
            off += piece;
        }
    }
    pthread_mutex_unlock(&send_lock);
    free(enc);
    return r;
}

/* Link a waiter in (unless the connection is dead). 0, or -1 if dead. */
static int waiter_add(waiter *w)
{
    pthread_mutex_lock(&wait_lock);
    if (atomic_load(&dead)) {
        pthread_mutex_unlock(&wait_lock);
        return -1;
    }
    w->next = NULL;
    if (wait_tail)
        wait_tail->next = w;
    else
        wait_head = w;
    wait_tail = w;
    if (w->detached && detached_count++ == 0 && recv_parked)
        pthread_cond_signal(&role_cv); /* its reply needs the receiver */
    pthread_mutex_unlock(&wait_lock);
    return 0;
}

/* Unlink the waiter with this request id and return it (NULL if none). Caller holds wait_lock. */
static waiter *waiter_take_locked(uint64_t req)
{
    waiter *prev = NULL;
    for (waiter *w = wait_head; w; prev = w, w = w->next) {
        if (w->req != req)
            continue;
        if (prev)
            prev->next = w->next;
        else
            wait_head = w->next;
        if (wait_tail == w)
            wait_tail = prev;
        w->next = NULL;
        if (w->detached)
            detached_count--;
        return w;
    }
    return NULL;
}

static void await_reply(waiter *w);

void gp_reply_free(gp_reply *reply)
{
    if (!reply)
        return;
    free(reply->body);
    reply->body = NULL;
    reply->len = 0;
}

CUresult gp_request(uint8_t *frame, size_t frame_len, const void *bulk, uint64_t bulk_len,
                    void *bulk_dst, uint64_t bulk_cap, gp_reply *reply)
{
    gp_reply dummy;
    if (!reply)
        reply = &dummy;
    memset(reply, 0, sizeof *reply);
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return reply->result = r;
    if (!frame || frame_len < 16 || (bulk_len && !bulk))
        return CUDA_ERROR_INVALID_VALUE;

    waiter w = {.dst = bulk_dst, .cap = bulk_dst ? bulk_cap : 0};
    pthread_cond_init(&w.cv, NULL);
    w.req = atomic_fetch_add(&next_req, 1);
    gp_wr_u64(frame + 8, w.req);
    if (waiter_add(&w) != 0) {
        pthread_cond_destroy(&w.cv);
        return reply->result = GP_LOST_CONNECTION_ERROR;
    }

    pthread_mutex_lock(&send_lock);
    if (!atomic_load(&dead)) {
        if (apply_ctx_locked() != 0) {
            /* cannot even queue the context switch: take the waiter back */
            pthread_mutex_unlock(&send_lock);
            pthread_mutex_lock(&wait_lock);
            int mine = waiter_take_locked(w.req) != NULL;
            while (!mine && !w.done)
                pthread_cond_wait(&w.cv, &wait_lock);
            pthread_mutex_unlock(&wait_lock);
            pthread_cond_destroy(&w.cv);
            free(w.body);
            return reply->result = CUDA_ERROR_OUT_OF_MEMORY;
        }
        flush_locked(frame, frame_len, bulk, bulk_len); /* on failure conn_fail wakes us */
    }
    pthread_mutex_unlock(&send_lock);

    await_reply(&w);
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
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    if (!frame || frame_len < 16)
        return CUDA_ERROR_INVALID_VALUE;
    waiter *w = calloc(1, sizeof *w);
    if (!w)
        return CUDA_ERROR_OUT_OF_MEMORY;
    w->detached = 1;
    w->dst = bulk_dst;
    w->cap = bulk_dst ? bulk_cap : 0;
    w->req = atomic_fetch_add(&next_req, 1);
    gp_wr_u64(frame + 8, w->req);
    uint64_t req = w->req;
    if (waiter_add(w) != 0) {
        free(w);
        return GP_LOST_CONNECTION_ERROR;
    }
    /* From here the receiver (or conn_fail) owns w. */
    pthread_mutex_lock(&send_lock);
    r = post_locked(frame, frame_len, NULL, 0);
    pthread_mutex_unlock(&send_lock);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) {
        pthread_mutex_lock(&wait_lock);
        waiter *mine = waiter_take_locked(req);
        pthread_mutex_unlock(&wait_lock);
        free(mine);
    }
    return r;
}

/* ===================================================================== the flusher == */

static void *flusher_main(void *arg)
{
    (void)arg;
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0); /* wake close to the 50 us deadline */
    pthread_mutex_lock(&send_lock);
    for (;;) {
        while (!atomic_load(&dead) && batch_len == 0)
            pthread_cond_wait(&flush_cv, &send_lock);
        if (atomic_load(&dead))
            break;
        uint64_t now = mono_ns();
        uint64_t deadline = last_append_ns + FLUSH_DELAY_NS;
        if (deadline > first_append_ns + FLUSH_MAX_DELAY_NS)
            deadline = first_append_ns + FLUSH_MAX_DELAY_NS;
        if (now < deadline) {
            struct timespec ts = {.tv_sec = (time_t)(deadline / 1000000000ull),
                                  .tv_nsec = (long)(deadline % 1000000000ull)};
            pthread_cond_timedwait(&flush_cv, &send_lock, &ts);
            continue;
        }
        flush_locked(NULL, 0, NULL, 0);
    }
    pthread_mutex_unlock(&send_lock);
    return NULL;
}

/* ==================================================================== the receiver == */

/* Our keepalive: a ping whose reply is dropped. Only if nobody is sending (a sender's progress
 * counts already, and the reader must never wait for send_lock). */
static void send_keepalive(void)
{
    if (pthread_mutex_trylock(&send_lock) != 0)
        return;
    gp_ping m = {.token = 0};
    uint8_t f[16 + 8];
    size_t n = gp_ping_frame(f, KEEPALIVE_REQ, &m);
    /* A ping the kernel buffers proves nothing about the server: it must not count as progress
     * (senders are held off by send_lock meanwhile). */
    uint64_t tx = atomic_load(&last_tx_ns);
    if (!atomic_load(&dead))
        flush_locked(f, n, NULL, 0);
    atomic_store(&last_tx_ns, tx);
    pthread_mutex_unlock(&send_lock);
}

/* The connection has been quiet for a read slice while a reply is awaited: ping the server
 * when it has been quiet for a third of the timeout; -1 (with *why) once nothing came in and
 * nothing went out for the whole timeout. */
static int silence_check(const char **why)
{
    static char text[300];
    uint64_t now = mono_ns(), rx = atomic_load(&last_rx_ns), tx = atomic_load(&last_tx_ns);
    uint64_t heard = rx > tx ? rx : tx;
    uint64_t quiet = now > heard ? now - heard : 0;
    if (quiet >= server_timeout_ns) {
        snprintf(text, sizeof text,
                 "the server has not answered for %.0f s, not even a keepalive: it is hung or "
                 "stopped, or the network is cut (GPUPOOL_SERVER_TIMEOUT=%.0f)",
                 (double)quiet / 1e9, (double)server_timeout_ns / 1e9);
        *why = text;
        return -1;
    }
    if (quiet >= server_timeout_ns / 3 &&
        now - atomic_load(&last_ping_ns) >= server_timeout_ns / 3) {
        atomic_store(&last_ping_ns, now);
        send_keepalive();
    }
    return 0;
}

/* Read exactly n bytes into dst (NULL: discard). 0, or -1 with *why set. */
/* A big download wakes the reader for a good piece of it at a time, not for every segment: each
 * wake-up is a recv and a context switch (SO_RCVLOWAT makes poll wait for that much; 1 byte
 * again for the tail and the frames). Never longer than LOWAT_WAIT_MS, then the recv takes what
 * has come without waiting: the kernel may hold fewer back (a window smaller than the mark early
 * in a connection), and a wait for bytes that cannot come would hang the copy. The worker does
 * the same for uploads. */
#define BULK_LOWAT (1 << 20)
#define LOWAT_WAIT_MS 5

static int rd_exact_loop(rstate *rs, uint8_t *d, uint64_t n, int *lowat, const char **why);

static void set_lowat(int bytes)
{
    if (setsockopt(sock, SOL_SOCKET, SO_RCVLOWAT, &bytes, sizeof bytes) != 0)
        gp_log_debug("SO_RCVLOWAT %d: %s", bytes, strerror(errno));
}

static int rd_exact(rstate *rs, void *dst, uint64_t n, const char **why)
{
    uint8_t *d = dst;
    int lowat = 0;
    if (d && !tls && n >= 4 * (uint64_t)BULK_LOWAT) {
        set_lowat(BULK_LOWAT);
        lowat = 1;
    }
    int rc = rd_exact_loop(rs, d, n, &lowat, why);
    if (lowat)
        set_lowat(1);
    return rc;
}

static int rd_exact_loop(rstate *rs, uint8_t *d, uint64_t n, int *lowat, const char **why)
{
    while (n > 0) {
        if (*lowat && n < BULK_LOWAT) {
            set_lowat(1);
            *lowat = 0;
        }
        if (rs->pos < rs->len) {
            size_t k = rs->len - rs->pos;
            if (k > n)
                k = (size_t)n;
            if (d) {
                memcpy(d, rs->buf + rs->pos, k);
                d += k;
            }
            rs->pos += k;
            n -= k;
            continue;
        }
        ssize_t got;
        /* With keepalives on, reads wake every slice (SO_RCVTIMEO; TLS: the read's timeout) */
        int slice =
            atomic_load_explicit(&keepalive_on, memory_order_relaxed) ? KEEPALIVE_SLICE_MS : -1;
        if (d && n >= RBUF_SIZE / 4) {
            /* large bulk: straight into the destination, no intermediate copy */
            size_t want = n > (1u << 30) ? (1u << 30) : (size_t)n;
            if (*lowat) {
                struct pollfd p = {.fd = sock, .events = POLLIN};
                if (poll(&p, 1, LOWAT_WAIT_MS) < 0 && errno != EINTR) {
                    *why = strerror(errno);
                    return -1;
                }
                got = recv(sock, d, want, MSG_DONTWAIT);
                if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
                    if (slice >= 0 && silence_check(why) != 0)
                        return -1;
                    continue;
                }
            } else {
                got = tls ? gp_tls_read(tls, d, want, slice, tls_err, sizeof tls_err)
                          : recv(sock, d, want, 0);
            }
            if (got > 0) {
                note_rx();
                d += got;
                n -= (uint64_t)got;
                continue;
            }
        } else {
            got = tls ? gp_tls_read(tls, rs->buf, RBUF_SIZE, slice, tls_err, sizeof tls_err)
                      : recv(sock, rs->buf, RBUF_SIZE, 0);
            if (got > 0) {
                note_rx();
                rs->pos = 0;
                rs->len = (size_t)got;
                continue;
            }
        }
        if (got < 0 && errno == EINTR && !tls)
            continue;
        if (got < 0 && slice >= 0 &&
            (errno == EAGAIN || errno == EWOULDBLOCK || errno == ETIMEDOUT)) {
            if (silence_check(why) != 0)
                return -1;
            continue;
        }
        *why = got == 0 ? "connection closed by the server" : tls ? tls_err : strerror(errno);
        return -1;
    }
    return 0;
}

/* The bulk of a reply: n raw bytes into dst (NULL: discard), as LZ4 blocks when cz. A corrupt
 * block breaks the stream. 0, or -1 with *why set. */
static int rd_bulk(rstate *r, uint8_t *dst, uint64_t n, int cz, const char **why)
{
    if (!cz)
        return rd_exact(r, dst, n, why);
    for (uint64_t done = 0; done < n;) {
        uint8_t hdr[GP_CZ_HDR];
        uint32_t raw, stored;
        if (rd_exact(r, hdr, sizeof hdr, why) != 0)
            return -1;
        if (gp_cz_header(hdr, n - done, &raw, &stored, why) != 0)
            return -1;
        if (stored == raw || !dst) {
            if (rd_exact(r, dst ? dst + done : NULL, stored, why) != 0)
                return -1;
        } else {
            if (!cz_in && !(cz_in = malloc(GP_LZ4_BLOCK))) {
                *why = "out of memory for a compressed copy";
                return -1;
            }
            if (rd_exact(r, cz_in, stored, why) != 0)
                return -1;
            if (gp_cz_inflate(cz_in, stored, dst + done, raw, why) != 0)
                return -1;
        }
        done += raw;
    }
    return 0;
}

void gp_conn_notice(const uint8_t *body, size_t len)
{
    gp_notice m;
    if (gp_notice_decode(body, len, &m) != 0)
        return;
    if (gp_code_is_info(m.code)) { /* status, not an error: every one is news */
        if (m.text_len)
            gp_log_info("%.*s", (int)m.text_len, m.text);
        return;
    }
    /* FNV-1a of the text: print each distinct text once. A full table only stops remembering:
     * texts it has no room for are still printed (show stays 1), never silenced. */
    uint64_t h = 1469598103934665603ull;
    for (uint32_t i = 0; i < m.text_len; i++)
        h = (h ^ (uint8_t)m.text[i]) * 1099511628211ull;
    int show = 1;
    pthread_mutex_lock(&notice_lock);
    for (size_t i = 0; i < notice_count; i++)
        if (notice_seen[i] == h)
            show = 0;
    if (show && notice_count < sizeof notice_seen / sizeof notice_seen[0])
        notice_seen[notice_count++] = h;
    pthread_mutex_unlock(&notice_lock);
    if (show && m.text_len)
        gp_log_error("%.*s", (int)m.text_len, m.text);
    record_pending(m.code);
}

/* Deliver one reply. 0, or -1 if the stream broke (*why set). */
static int handle_reply(rstate *rs, const gp_frame_header *hd, uint8_t *body, const char **why)
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
    int cz = hd->op == GP_OP_MEMCPY_DTOH && gp_conn_lz4() && gp_cz_applies(bulk);

    pthread_mutex_lock(&wait_lock);
    waiter *w = waiter_take_locked(hd->req);
    pthread_mutex_unlock(&wait_lock);

    int rc = 0;
    if (!w) {
        if (hd->req != KEEPALIVE_REQ)
            gp_log_debug("reply to unknown request %llu (op %s) ignored",
                         (unsigned long long)hd->req, gp_op_name(hd->op));
        rc = rd_bulk(rs, NULL, bulk, cz, why);
        free(body);
        return rc;
    }
    if (bulk > w->cap) {
        gp_log_error("server sent %llu bytes for a %llu-byte copy (op %s); dropped",
                     (unsigned long long)bulk, (unsigned long long)w->cap, gp_op_name(hd->op));
        rc = rd_bulk(rs, NULL, bulk, cz, why);
        if (result == 0)
            result = CUDA_ERROR_UNKNOWN;
        bulk = 0;
    } else if (bulk) {
        rc = rd_bulk(rs, w->dst, bulk, cz, why);
    }
    if (rc != 0)
        result = GP_LOST_CONNECTION_ERROR;

    if (w->detached) {
        if (result != 0 && rc == 0)
            record_pending(result);
        free(body);
        free(w);
        return rc;
    }
    pthread_mutex_lock(&wait_lock);
    w->result = result;
    w->body = body;
    w->len = hd->len;
    w->bulk_len = bulk;
    w->done = 1;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&wait_lock);
    return rc;
}

/* Read and dispatch one frame. Caller holds the reader role. 0, or -1 (*why set). */
static int read_frame(const char **why)
{
    uint8_t h[16];
    if (rd_exact(&rs, h, 16, why) != 0)
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
    if (rd_exact(&rs, body, hd.len, why) != 0) {
        free(body);
        return -1;
    }
    if (hd.flags & GP_FLAG_REPLY)
        return handle_reply(&rs, &hd, body, why);
    if (hd.op == GP_OP_NOTICE) {
        gp_conn_notice(body, hd.len);
        free(body);
        return 0;
    }
    free(body);
    *why = "unexpected frame from the server";
    return -1;
}

/* Give the reader role back and wake whoever may take it next: the parked receiver, and one
 * caller waiting for its reply. Caller holds wait_lock. */
static void release_role_locked(void)
{
    if (reader == RD_CALLER)
        linger_until = mono_ns() + LINGER_NS;
    reader = RD_NONE;
    if (recv_parked && (detached_count > 0 || rs.pos < rs.len || (tls && gp_tls_pending(tls))))
        pthread_cond_signal(&role_cv);
    if (want_head)
        pthread_cond_signal(&want_head->cv);
}

static void want_role_locked(waiter *w)
{
    w->want_role = 1;
    w->next_want = NULL;
    if (want_tail)
        want_tail->next_want = w;
    else
        want_head = w;
    want_tail = w;
}

static void unwant_role_locked(waiter *w)
{
    waiter *prev = NULL;
    for (waiter *o = want_head; o; prev = o, o = o->next_want) {
        if (o != w)
            continue;
        if (prev)
            prev->next_want = o->next_want;
        else
            want_head = o->next_want;
        if (want_tail == o)
            want_tail = prev;
        break;
    }
    w->want_role = 0;
    w->next_want = NULL;
}

/* Wait for w's reply, reading the socket ourselves whenever no other thread does. */
static void await_reply(waiter *w)
{
    pthread_mutex_lock(&wait_lock);
    while (!w->done) {
        if (reader != RD_NONE || atomic_load(&dead)) {
            /* another thread reads (it completes us, or hands us the role) or conn_fail did */
            want_role_locked(w);
            pthread_cond_wait(&w->cv, &wait_lock);
            unwant_role_locked(w);
            continue;
        }
        reader = RD_CALLER;
        reader_gen++;
        pthread_mutex_unlock(&wait_lock);
        for (;;) {
            const char *why = "connection lost";
            if (read_frame(&why) != 0) {
                conn_fail("%s", why); /* completes every waiter, w included */
                pthread_mutex_lock(&wait_lock);
                release_role_locked();
                break;
            }
            pthread_mutex_lock(&wait_lock);
            /* done: give the role back once nothing read is left in the buffer */
            if (w->done && rs.pos == rs.len && !(tls && gp_tls_pending(tls))) {
                release_role_locked();
                break;
            }
            pthread_mutex_unlock(&wait_lock);
        }
    }
    pthread_mutex_unlock(&wait_lock);
}

static void receive_until_lost(void);

static void *receiver_main(void *arg)
{
    (void)arg;
    receive_until_lost();
    return NULL;
}

static void receive_until_lost(void)
{
    const char *why = "connection lost";
    pthread_mutex_lock(&wait_lock);
    for (;;) {
        /* wait, without the role, until there is something to read and nobody reads it */
        int ready = 0;
        for (;;) {
            while (reader != RD_NONE && !atomic_load(&dead)) {
                /* Timed: a caller may hand the role back without signalling (nothing buffered,
                 * nothing detached). Re-checking every LINGER_NS bounds how late a notice or a
                 * dead server is seen while the program computes on the CPU. */
                uint64_t until = mono_ns() + LINGER_NS;
                struct timespec ts = {.tv_sec = (time_t)(until / 1000000000ull),
                                      .tv_nsec = (long)(until % 1000000000ull)};
                recv_parked = 1;
                pthread_cond_timedwait(&role_cv, &wait_lock, &ts);
                recv_parked = 0;
                ready = 0;
            }
            if (atomic_load(&dead)) {
                pthread_mutex_unlock(&wait_lock);
                return;
            }
            if (ready || rs.pos < rs.len || (tls && gp_tls_pending(tls)))
                break;
            if (detached_count == 0 && linger_until) {
                uint64_t now = mono_ns();
                if (now < linger_until) {
                    /* a caller read recently: stay off the socket for a while */
                    struct timespec ts = {.tv_sec = (time_t)(linger_until / 1000000000ull),
                                          .tv_nsec = (long)(linger_until % 1000000000ull)};
                    recv_parked = 1;
                    pthread_cond_timedwait(&role_cv, &wait_lock, &ts);
                    recv_parked = 0;
                    ready = 0;
                    continue;
                }
            }
            uint64_t gen = reader_gen;
            int ka = atomic_load(&keepalive_on);
            pthread_mutex_unlock(&wait_lock);
            struct pollfd p = {.fd = sock, .events = POLLIN};
            int n = poll(&p, 1, ka ? KEEPALIVE_SLICE_MS : -1);
            int err = errno;
            pthread_mutex_lock(&wait_lock);
            if (n < 0 && err != EINTR) {
                pthread_mutex_unlock(&wait_lock);
                why = strerror(err);
                goto fail;
            }
            /* Quiet while detached requests (async copies) are awaited: the same watch as a
             * caller's (an idle program with an idle server is not a silence) */
            if (n == 0 && ka && detached_count > 0 && reader == RD_NONE) {
                pthread_mutex_unlock(&wait_lock);
                int bad = silence_check(&why);
                pthread_mutex_lock(&wait_lock);
                if (bad) {
                    pthread_mutex_unlock(&wait_lock);
                    goto fail;
                }
            }
            /* stale if a caller has read in the meantime: poll again */
            ready = n > 0 && gen == reader_gen;
        }
        reader = RD_RECEIVER;
        pthread_mutex_unlock(&wait_lock);
        int rc = read_frame(&why);
        pthread_mutex_lock(&wait_lock);
        release_role_locked();
        if (rc != 0) {
            pthread_mutex_unlock(&wait_lock);
            goto fail;
        }
    }
fail:
    conn_fail("%s", why); /* silent after goodbye: the server closing is the expected end */
}

static void atfork_child(void);
static void at_exit(void);
static void stop_receiver(void);
static void say_goodbye(void);

/* Starts fn on a thread of ours; detached unless out is given (then the caller joins it). */
static int start_thread(void *(*fn)(void *), const char *name, pthread_t *out)
{
    pthread_t t;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* the program's signals stay on its threads */
    int rc = pthread_create(&t, NULL, fn, NULL);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0)
        return -1;
    pthread_setname_np(t, name);
    if (out)
        *out = t;
    else
        pthread_detach(t);
    return 0;
}

static void init_once_handlers(void)
{
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&flush_cv, &ca);
    pthread_cond_init(&role_cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_atfork(NULL, NULL, atfork_child);
}

/* The connection's own status (gp_check_init without the cuInit requirement). */
static CUresult conn_status(void)
{
    int s = atomic_load_explicit(&state, memory_order_acquire);
    if (s == ST_READY)
        return atomic_load(&dead) ? GP_LOST_CONNECTION_ERROR : CUDA_SUCCESS;
    if (s == ST_CLOSED)
        return CUDA_ERROR_DEINITIALIZED;
    if (s == ST_FORKED)
        return CUDA_ERROR_NOT_INITIALIZED;
    return CUDA_ERROR_NO_DEVICE;
}

CUresult gp_conn_ensure(void)
{
    int s = atomic_load_explicit(&state, memory_order_acquire);
    if (s == ST_READY || s == ST_CLOSED)
        return conn_status();
    if (s == ST_FAILED)
        return CUDA_ERROR_NO_DEVICE;
    if (s == ST_FORKED)
        return CUDA_ERROR_NOT_INITIALIZED;

    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, init_once_handlers);

    pthread_mutex_lock(&init_lock);
    s = atomic_load(&state);
    if (s == ST_NONE) {
        init_result = gp_connect(&sock, &tls, server_desc, sizeof server_desc);
        if (init_result == CUDA_SUCCESS && !rs.buf && !(rs.buf = malloc(RBUF_SIZE))) {
            gp_log_error("cannot allocate the receive buffer");
            gp_tls_free(tls);
            tls = NULL;
            close(sock);
            sock = -1;
            init_result = CUDA_ERROR_NO_DEVICE;
        }
        if (init_result == CUDA_SUCCESS) {
            last_ctx_sent = UINT64_MAX;
            if (start_thread(receiver_main, "gpupool-recv", &receiver_thread) == 0)
                receiver_started = 1;
            if (!receiver_started || start_thread(flusher_main, "gpupool-flush", NULL) != 0) {
                gp_log_error("cannot start the connection threads: %s", strerror(errno));
                stop_receiver(); /* out of the socket and the TLS state before they go */
                gp_tls_free(tls);
                tls = NULL;
                close(sock);
                sock = -1;
                init_result = CUDA_ERROR_NO_DEVICE;
            }
        }
        if (init_result == CUDA_SUCCESS) {
            arm_keepalive(sock, tls);
            atexit(at_exit);
            atomic_store_explicit(&state, ST_READY, memory_order_release);
        } else {
            atomic_store_explicit(&state, ST_FAILED, memory_order_release);
        }
    }
    CUresult r = conn_status();
    pthread_mutex_unlock(&init_lock);
    return r;
}

/* ============================================================== fork and exit == */

static void atfork_child(void)
{
    /* Only this thread survives; the connection belongs to the parent. Send nothing, and close
     * our copy of the socket so the parent's session ends when the parent does. */
    int s = atomic_load(&state);
    if (s == ST_NONE || s == ST_FAILED)
        return; /* the child may connect on its own */
    if (sock >= 0)
        close(sock);
    sock = -1;
    atomic_store(&dead, 1);
    atomic_store(&state, ST_FORKED);
    gp_log_debug("fork(): CUDA is not available in the child process (it was initialised in "
                 "the parent)");
}

static void at_exit(void)
{
    if (atomic_load(&state) != ST_READY)
        return; /* never connected, already closed, or a forked child (the thread is not ours) */
    if (!atomic_load(&dead))
        say_goodbye();
    if (tls)
        stop_receiver();
}

/* The goodbye frame, 1 s at most: the worker then ends the session at once instead of waiting
 * for the socket to close. */
static void say_goodbye(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 200000000L;
    if (ts.tv_nsec >= 1000000000L)
        ts.tv_sec++, ts.tv_nsec -= 1000000000L;
    if (pthread_mutex_timedlock(&send_lock, &ts) != 0)
        return; /* a sender is stuck: just go */
    atomic_store(&state, ST_CLOSED);
    struct timeval tv = {.tv_sec = 1};
    setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    if (tls)
        gp_tls_set_send_timeout(tls, 1000);
    gp_goodbye m = {0};
    uint8_t f[16 + 1];
    size_t n = gp_goodbye_frame(f, atomic_fetch_add(&next_req, 1), &m);
    if (!atomic_load(&dead))
        flush_locked(f, n, NULL, 0);
    pthread_mutex_unlock(&send_lock);
}

/* Over TLS, at exit (and when start-up fails half-way): the receiver thread must have ended
 * before OpenSSL's exit handler (registered before ours, so run after it) frees the library's
 * state. A receiver woken by the worker's close right after the goodbye was still in SSL_read,
 * or in OpenSSL's clean-up of its thread, while that handler ran: "double free" in
 * OPENSSL_cleanup after a program's last line (ASan, CI 2026-12-06; once in glibc in about three
 * full test runs before). Marked dead (nothing more is read or reported), its socket shut for
 * reading (a poll or read returns at once) and joined, 500 ms at most. */
static void stop_receiver(void)
{
    if (!receiver_started)
        return;
    receiver_started = 0;
    atomic_store(&dead, 1);
    if (sock >= 0)
        shutdown(sock, SHUT_RD);
    pthread_mutex_lock(&wait_lock);
    pthread_cond_broadcast(&role_cv);
    pthread_mutex_unlock(&wait_lock);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_nsec += 500000000L;
    if (until.tv_nsec >= 1000000000L)
        until.tv_sec++, until.tv_nsec -= 1000000000L;
    if (pthread_timedjoin_np(receiver_thread, NULL, &until) != 0)
        gp_log_debug("at exit: the receiver thread did not stop within 500 ms");
}
