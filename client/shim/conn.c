/*
 * conn.c: the one TCP connection of this process to its gpupool worker.
 *
 *  - gp_conn_ensure: connect once (GPUPOOL_SERVER, a comma-separated list tried in order),
 *    reserve the VA window first, send hello, store the device snapshot; any failure prints one
 *    line saying what happened and what to do, and cuInit answers CUDA_ERROR_NO_DEVICE.
 *  - Sending: fire-and-forget frames are appended to a batch under send_lock; the batch goes
 *    out before any request that waits, when it passes 256 KiB, and from the flusher thread
 *    ~50 us after the last append, so a program that never synchronises still progresses.
 *    Bulk data above 64 KiB is written straight from the caller's buffer (no copy).
 *  - Receiving: one thread reads frames. A reply completes the waiter with its request id
 *    (reply bulk is read directly into the waiter's buffer); replies of detached requests
 *    (async device-to-host copies) land in the program's buffer; notices are printed once per
 *    distinct text and become the pending error.
 *  - Loss: the first failure marks the connection dead, wakes every waiter with
 *    GP_LOST_CONNECTION_ERROR and prints one line. Sends use MSG_NOSIGNAL (never SIGPIPE).
 *  - fork: the child drops the connection without sending anything (CUDA calls there return
 *    CUDA_ERROR_NOT_INITIALIZED); exit: flush and goodbye, bounded by short timeouts.
 * Lock order: send_lock before wait_lock; the receiver never takes send_lock.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <pwd.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "shim.h"
#include "shim_core.h"

#define BATCH_LIMIT (256u * 1024)   /* flush the batch once it is this large */
#define DIRECT_BULK (64u * 1024)    /* bulk above this is written from the caller's buffer */
#define FLUSH_DELAY_NS 50000ull     /* flusher: this long after the last append... */
#define FLUSH_MAX_DELAY_NS 500000ull /* ...but never later than this after the first one */
#define RBUF_SIZE (256u * 1024)

#define DEFAULT_PORT "7070" /* gpupoold's default remoting listener (docs/configuration.md) */
#define DEFAULT_VA_BASE 0x200000000000ull
#define DEFAULT_VA_SIZE (1ull << 40)
#define VA_STEP 0x40000000000ull /* 4 TiB between candidate bases */
#define VA_TRIES 8

enum { ST_NONE, ST_READY, ST_FAILED, ST_FORKED, ST_CLOSED };

static atomic_int state = ST_NONE;
static atomic_int dead;
/* cuInit succeeded (cuDriverGetVersion may connect earlier, but the other calls still answer
 * CUDA_ERROR_NOT_INITIALIZED until cuInit, as the driver does). */
static atomic_int initialized;
static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;
static CUresult init_result = CUDA_ERROR_NOT_INITIALIZED; /* guarded by init_lock */

static int sock = -1;
static char server_desc[300];

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
    pthread_cond_t cv;
    struct waiter *next;
} waiter;
static pthread_mutex_t wait_lock = PTHREAD_MUTEX_INITIALIZER;
static waiter *wait_head, *wait_tail;

/* ---- pending error and notices ---- */
static atomic_int pending_error;
static pthread_mutex_t notice_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t notice_seen[512];
static size_t notice_count;

static uint64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int is_sticky(int code) { return (code >= 700 && code <= 719) || code == 999; }

/* ======================================================================== pending errors == */

CUresult gp_cu_result(int32_t r) { return r >= 100000 || r < 0 ? CUDA_ERROR_UNKNOWN : r; }

static void record_pending(int32_t code) {
    if (code == 0) return;
    int expected = 0;
    atomic_compare_exchange_strong(&pending_error, &expected, (int)gp_cu_result(code));
}

CUresult gp_take_pending_error(void) {
    int v = atomic_load(&pending_error);
    if (v == 0 || is_sticky(v)) return v;
    atomic_compare_exchange_strong(&pending_error, &v, 0);
    return v;
}

/* ============================================================================== state == */

CUresult gp_check_init(void) {
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

int gp_conn_attempted(void) { return atomic_load(&state) != ST_NONE; }

CUresult gp_conn_init(void) {
    CUresult r = gp_conn_ensure();
    if (r == CUDA_SUCCESS) {
        atomic_store(&initialized, 1);
        r = gp_check_init();
    }
    return r;
}
const char *gp_conn_server(void) { return server_desc; }

/* ========================================================================== loss == */

static void conn_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void conn_fail(const char *fmt, ...) {
    int expected = 0;
    if (!atomic_compare_exchange_strong(&dead, &expected, 1)) return;
    if (sock >= 0) shutdown(sock, SHUT_RDWR); /* unblocks a sender stuck in sendmsg */
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
    pthread_mutex_unlock(&wait_lock);
    /* Without send_lock: a sender that fails calls this while holding it. A missed wake-up only
     * leaves the idle flusher asleep, which is harmless. */
    pthread_cond_broadcast(&flush_cv);
}

/* ====================================================================== sending == */

/* Write every iovec completely. Caller holds send_lock. 0, or -1 (connection failed). */
static int write_iov_locked(struct iovec *iov, int n) {
    while (n > 0 && iov[0].iov_len == 0) iov++, n--;
    while (n > 0) {
        if (atomic_load(&dead)) return -1;
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)(n > 64 ? 64 : n)};
        ssize_t w = sendmsg(sock, &mh, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                /* only with a send timeout (at exit): give up */
                conn_fail("send timed out");
                return -1;
            }
            conn_fail("%s", strerror(errno));
            return -1;
        }
        size_t left = (size_t)w;
        while (n > 0 && left >= iov[0].iov_len) {
            left -= iov[0].iov_len;
            iov++, n--;
        }
        if (n > 0) {
            iov[0].iov_base = (uint8_t *)iov[0].iov_base + left;
            iov[0].iov_len -= left;
        }
        while (n > 0 && iov[0].iov_len == 0) iov++, n--;
    }
    return 0;
}

/* Write the batch followed by up to two extra buffers. Caller holds send_lock. */
static int flush_locked(const void *a, size_t alen, const void *b, size_t blen) {
    struct iovec iov[3] = {{batch, batch_len}, {(void *)a, alen}, {(void *)b, blen}};
    int rc = write_iov_locked(iov, 3);
    batch_len = 0;
    return rc;
}

static int batch_append_locked(const void *p, size_t n) {
    if (n == 0) return 0;
    if (batch_len + n > batch_cap) {
        size_t ncap = batch_cap ? batch_cap : 64 * 1024;
        while (ncap < batch_len + n) ncap *= 2;
        uint8_t *nb = realloc(batch, ncap);
        if (!nb) return -1;
        batch = nb;
        batch_cap = ncap;
    }
    memcpy(batch + batch_len, p, n);
    batch_len += n;
    return 0;
}

/* Before a frame of the calling thread: switch the worker's context if this thread's differs
 * from the last one sent. Caller holds send_lock. */
static int apply_ctx_locked(void) {
    uint64_t want = tl_wire_ctx;
    if (want == 0 || want == last_ctx_sent) return 0;
    gp_ctx_set_current m = {.ctx = want};
    uint8_t f[16 + 8];
    size_t n = gp_ctx_set_current_frame(f, atomic_fetch_add(&next_req, 1), &m);
    if (batch_append_locked(f, n) != 0) return -1;
    last_ctx_sent = want;
    return 0;
}

void gp_conn_use_ctx(uint64_t ctx_id) { tl_wire_ctx = ctx_id; }

void gp_conn_forget_ctx(void) {
    pthread_mutex_lock(&send_lock);
    last_ctx_sent = UINT64_MAX;
    pthread_mutex_unlock(&send_lock);
}

/* A frame was appended: make sure the flusher will send it soon. Caller holds send_lock. */
static void kick_flusher_locked(size_t len_before) {
    uint64_t now = mono_ns();
    last_append_ns = now;
    if (len_before == 0) {
        first_append_ns = now;
        pthread_cond_signal(&flush_cv);
    }
}

/* Queue header+body (+ bulk) of a fire-and-forget frame. Caller holds send_lock. */
static CUresult post_locked(uint8_t *frame, size_t frame_len, const void *bulk,
                            uint64_t bulk_len) {
    if (atomic_load(&dead)) return GP_LOST_CONNECTION_ERROR;
    size_t before = batch_len;
    if (apply_ctx_locked() != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    if (bulk_len > DIRECT_BULK) {
        if (flush_locked(frame, frame_len, bulk, bulk_len) != 0) return GP_LOST_CONNECTION_ERROR;
        return CUDA_SUCCESS;
    }
    if (batch_append_locked(frame, frame_len) != 0 || batch_append_locked(bulk, bulk_len) != 0) {
        batch_len = before;          /* never leave half a frame behind... */
        last_ctx_sent = UINT64_MAX;  /* ...nor believe a dropped context switch went out */
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (batch_len >= BATCH_LIMIT) {
        if (flush_locked(NULL, 0, NULL, 0) != 0) return GP_LOST_CONNECTION_ERROR;
    } else {
        kick_flusher_locked(before);
    }
    return CUDA_SUCCESS;
}

CUresult gp_post(uint8_t *frame, size_t frame_len, const void *bulk, uint64_t bulk_len) {
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!frame || frame_len < 16) return CUDA_ERROR_INVALID_VALUE;
    if (bulk_len && !bulk) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&send_lock);
    gp_wr_u64(frame + 8, atomic_fetch_add(&next_req, 1));
    r = post_locked(frame, frame_len, bulk, bulk_len);
    pthread_mutex_unlock(&send_lock);
    return r;
}

/* Link a waiter in (unless the connection is dead). 0, or -1 if dead. */
static int waiter_add(waiter *w) {
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
    pthread_mutex_unlock(&wait_lock);
    return 0;
}

/* Unlink the waiter with this request id and return it (NULL if none). Caller holds wait_lock. */
static waiter *waiter_take_locked(uint64_t req) {
    waiter *prev = NULL;
    for (waiter *w = wait_head; w; prev = w, w = w->next) {
        if (w->req != req) continue;
        if (prev)
            prev->next = w->next;
        else
            wait_head = w->next;
        if (wait_tail == w) wait_tail = prev;
        w->next = NULL;
        return w;
    }
    return NULL;
}

void gp_reply_free(gp_reply *reply) {
    if (!reply) return;
    free(reply->body);
    reply->body = NULL;
    reply->len = 0;
}

CUresult gp_request(uint8_t *frame, size_t frame_len, const void *bulk, uint64_t bulk_len,
                    void *bulk_dst, uint64_t bulk_cap, gp_reply *reply) {
    gp_reply dummy;
    if (!reply) reply = &dummy;
    memset(reply, 0, sizeof *reply);
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS) return reply->result = r;
    if (!frame || frame_len < 16 || (bulk_len && !bulk)) return CUDA_ERROR_INVALID_VALUE;

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
            while (!mine && !w.done) pthread_cond_wait(&w.cv, &wait_lock);
            pthread_mutex_unlock(&wait_lock);
            pthread_cond_destroy(&w.cv);
            free(w.body);
            return reply->result = CUDA_ERROR_OUT_OF_MEMORY;
        }
        flush_locked(frame, frame_len, bulk, bulk_len); /* on failure conn_fail wakes us */
    }
    pthread_mutex_unlock(&send_lock);

    pthread_mutex_lock(&wait_lock);
    while (!w.done) pthread_cond_wait(&w.cv, &wait_lock);
    pthread_mutex_unlock(&wait_lock);
    pthread_cond_destroy(&w.cv);

    reply->result = w.result;
    reply->body = w.body;
    reply->len = w.len;
    reply->bulk_len = w.bulk_len;
    if (w.result != 0) gp_reply_free(reply);
    return w.result;
}

CUresult gp_request_detached(uint8_t *frame, size_t frame_len, void *bulk_dst,
                             uint64_t bulk_cap) {
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!frame || frame_len < 16) return CUDA_ERROR_INVALID_VALUE;
    waiter *w = calloc(1, sizeof *w);
    if (!w) return CUDA_ERROR_OUT_OF_MEMORY;
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

static void *flusher_main(void *arg) {
    (void)arg;
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0); /* wake close to the 50 us deadline */
    pthread_mutex_lock(&send_lock);
    for (;;) {
        while (!atomic_load(&dead) && batch_len == 0) pthread_cond_wait(&flush_cv, &send_lock);
        if (atomic_load(&dead)) break;
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

typedef struct rstate {
    uint8_t *buf;
    size_t pos, len;
} rstate;

/* Read exactly n bytes into dst (NULL: discard). 0, or -1 with *why set. */
static int rd_exact(rstate *rs, void *dst, uint64_t n, const char **why) {
    uint8_t *d = dst;
    while (n > 0) {
        if (rs->pos < rs->len) {
            size_t k = rs->len - rs->pos;
            if (k > n) k = (size_t)n;
            if (d) {
                memcpy(d, rs->buf + rs->pos, k);
                d += k;
            }
            rs->pos += k;
            n -= k;
            continue;
        }
        ssize_t got;
        if (d && n >= RBUF_SIZE / 4) {
            /* large bulk: straight into the destination, no intermediate copy */
            got = recv(sock, d, n > (1u << 30) ? (1u << 30) : (size_t)n, 0);
            if (got > 0) {
                d += got;
                n -= (uint64_t)got;
                continue;
            }
        } else {
            got = recv(sock, rs->buf, RBUF_SIZE, 0);
            if (got > 0) {
                rs->pos = 0;
                rs->len = (size_t)got;
                continue;
            }
        }
        if (got < 0 && errno == EINTR) continue;
        *why = got == 0 ? "connection closed by the server" : strerror(errno);
        return -1;
    }
    return 0;
}

static void handle_notice(const uint8_t *body, size_t len) {
    gp_notice m;
    if (gp_notice_decode(body, len, &m) != 0) return;
    /* FNV-1a of the text: print each distinct text once */
    uint64_t h = 1469598103934665603ull;
    for (uint32_t i = 0; i < m.text_len; i++) h = (h ^ (uint8_t)m.text[i]) * 1099511628211ull;
    int show = 1;
    pthread_mutex_lock(&notice_lock);
    for (size_t i = 0; i < notice_count; i++)
        if (notice_seen[i] == h) show = 0;
    if (show && notice_count < sizeof notice_seen / sizeof notice_seen[0])
        notice_seen[notice_count++] = h;
    pthread_mutex_unlock(&notice_lock);
    if (show && m.text_len) gp_log_error("%.*s", (int)m.text_len, m.text);
    record_pending(m.code);
}

/* Deliver one reply. 0, or -1 if the stream broke (*why set). */
static int handle_reply(rstate *rs, const gp_frame_header *hd, uint8_t *body, const char **why) {
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

    pthread_mutex_lock(&wait_lock);
    waiter *w = waiter_take_locked(hd->req);
    pthread_mutex_unlock(&wait_lock);

    int rc = 0;
    if (!w) {
        gp_log_debug("reply to unknown request %llu (op %s) ignored", (unsigned long long)hd->req,
                     gp_op_name(hd->op));
        rc = rd_exact(rs, NULL, bulk, why);
        free(body);
        return rc;
    }
    if (bulk > w->cap) {
        gp_log_error("server sent %llu bytes for a %llu-byte copy (op %s); dropped",
                     (unsigned long long)bulk, (unsigned long long)w->cap, gp_op_name(hd->op));
        rc = rd_exact(rs, NULL, bulk, why);
        if (result == 0) result = CUDA_ERROR_UNKNOWN;
        bulk = 0;
    } else if (bulk) {
        rc = rd_exact(rs, w->dst, bulk, why);
    }
    if (rc != 0) result = GP_LOST_CONNECTION_ERROR;

    if (w->detached) {
        if (result != 0 && rc == 0) record_pending(result);
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

static void *receiver_main(void *arg) {
    (void)arg;
    rstate rs = {.buf = malloc(RBUF_SIZE)};
    const char *why = "out of memory";
    if (!rs.buf) goto fail;
    for (;;) {
        uint8_t h[16];
        if (rd_exact(&rs, h, 16, &why) != 0) goto fail;
        gp_frame_header hd;
        gp_header_decode(h, &hd);
        if (hd.len > GP_PROTO_MAX_BODY) {
            why = "malformed frame from the server (body too long)";
            goto fail;
        }
        uint8_t *body = malloc(hd.len ? hd.len : 1);
        if (!body) {
            why = "out of memory";
            goto fail;
        }
        if (rd_exact(&rs, body, hd.len, &why) != 0) {
            free(body);
            goto fail;
        }
        if (hd.flags & GP_FLAG_REPLY) {
            if (handle_reply(&rs, &hd, body, &why) != 0) goto fail;
        } else if (hd.op == GP_OP_NOTICE) {
            handle_notice(body, hd.len);
            free(body);
        } else {
            free(body);
            why = "unexpected frame from the server";
            goto fail;
        }
    }
fail:
    conn_fail("%s", why); /* silent after goodbye: the server closing is the expected end */
    free(rs.buf);
    return NULL;
}

/* ================================================================ connecting == */

/* Copy src (n bytes) into dst as valid UTF-8 of at most cap-1 bytes (invalid bytes become '?',
 * truncation never splits a character); returns the length. */
static size_t utf8_clean(char *dst, size_t cap, const char *src, size_t n) {
    size_t o = 0;
    const unsigned char *s = (const unsigned char *)src;
    for (size_t i = 0; i < n;) {
        unsigned c = s[i];
        size_t k = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        int ok = k > 0 && i + k <= n && c != 0xC0 && c != 0xC1 && c <= 0xF4;
        for (size_t j = 1; ok && j < k; j++) ok = (s[i + j] & 0xC0) == 0x80;
        if (ok && k > 2) { /* no overlong forms, surrogates or code points past U+10FFFF */
            unsigned c1 = s[i + 1];
            if ((c == 0xE0 && c1 < 0xA0) || (c == 0xED && c1 > 0x9F) || (c == 0xF0 && c1 < 0x90) ||
                (c == 0xF4 && c1 > 0x8F))
                ok = 0;
        }
        if (!ok) k = 1;
        if (o + (ok ? k : 1) >= cap) break;
        if (ok) {
            memcpy(dst + o, s + i, k);
            o += k;
        } else {
            dst[o++] = '?';
        }
        i += k;
    }
    dst[o] = 0;
    return o;
}

/* "prog arg1 arg2" from /proc/self/cmdline, argv[0] reduced to its basename. */
static size_t program_string(char *out, size_t cap) {
    char raw[8192];
    size_t n = 0;
    FILE *f = fopen("/proc/self/cmdline", "rb");
    if (f) {
        n = fread(raw, 1, sizeof raw - 1, f);
        fclose(f);
    }
    if (n == 0) return utf8_clean(out, cap, "?", 1);
    raw[n] = 0;
    const char *argv0 = raw, *slash = strrchr(argv0, '/');
    const char *start = slash ? slash + 1 : argv0;
    size_t len = strlen(start);
    char joined[8192];
    memcpy(joined, start, len);
    size_t j = len;
    for (size_t i = strlen(raw); i < n; i++) joined[j++] = raw[i] ? raw[i] : ' ';
    while (j > 0 && joined[j - 1] == ' ') j--;
    return utf8_clean(out, cap, joined, j);
}

static uint64_t env_u64(const char *name, uint64_t dflt) {
    const char *v = getenv(name);
    if (!v || !*v) return dflt;
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 0);
    if (errno || end == v) {
        gp_log_error("ignoring %s=%s (not a number)", name, v);
        return dflt;
    }
    switch (*end) {
    case 'k': case 'K': x <<= 10; end++; break;
    case 'm': case 'M': x <<= 20; end++; break;
    case 'g': case 'G': x <<= 30; end++; break;
    case 't': case 'T': x <<= 40; end++; break;
    default: break;
    }
    if (*end) {
        gp_log_error("ignoring %s=%s (not a number)", name, v);
        return dflt;
    }
    return x;
}

/* Split "host:port" / "[v6]:port"; a bare host name (no colon at all) means gpupoold's default
 * port. 0, or -1. */
static int split_hostport(const char *s, char *host, size_t hcap, char *port, size_t pcap) {
    const char *colon;
    if (!strchr(s, ':') && s[0] != '[') {
        if (strlen(s) >= hcap || !*s) return -1;
        strcpy(host, s);
        snprintf(port, pcap, "%s", DEFAULT_PORT);
        return 0;
    }
    if (s[0] == '[') {
        const char *close = strchr(s, ']');
        if (!close || close[1] != ':') return -1;
        if ((size_t)(close - s - 1) >= hcap) return -1;
        memcpy(host, s + 1, (size_t)(close - s - 1));
        host[close - s - 1] = 0;
        colon = close + 1;
    } else {
        colon = strrchr(s, ':');
        if (!colon || (size_t)(colon - s) >= hcap) return -1;
        memcpy(host, s, (size_t)(colon - s));
        host[colon - s] = 0;
    }
    if (!colon[1] || strlen(colon + 1) >= pcap) return -1;
    strcpy(port, colon + 1);
    return host[0] ? 0 : -1;
}

static void set_keepalive(int fd) {
    int one = 1, idle = 10, intvl = 5, cnt = 3;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
    /* No TCP_USER_TIMEOUT: a worker busy in a long synchronous call legitimately lets its
     * receive window fill up, and that must not end the session. */
}

/* Connect with a timeout. The fd, or -1 with err filled. */
static int tcp_connect(const char *host, const char *port, double timeout_s, char *err,
                       size_t ecap) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    int g = getaddrinfo(host, port, &hints, &res);
    if (g != 0) {
        snprintf(err, ecap, "%s", g == EAI_SYSTEM ? strerror(errno) : gai_strerror(g));
        return -1;
    }
    int fd = -1;
    snprintf(err, ecap, "no address");
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) {
            snprintf(err, ecap, "%s", strerror(errno));
            continue;
        }
        int fl = fcntl(fd, F_GETFL);
        fcntl(fd, F_SETFL, fl | O_NONBLOCK);
        int rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
        if (rc != 0 && errno == EINPROGRESS) {
            struct pollfd p = {.fd = fd, .events = POLLOUT};
            int ms = timeout_s <= 0 ? -1 : (int)(timeout_s * 1000);
            int pr;
            do pr = poll(&p, 1, ms);
            while (pr < 0 && errno == EINTR);
            if (pr == 0) {
                errno = ETIMEDOUT;
                rc = -1;
            } else {
                int soerr = 0;
                socklen_t sl = sizeof soerr;
                getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
                errno = soerr;
                rc = soerr ? -1 : 0;
            }
        }
        if (rc == 0) {
            fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
            set_keepalive(fd);
            break;
        }
        snprintf(err, ecap, "%s", errno == ETIMEDOUT ? "timed out" : strerror(errno));
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    return fd;
}

static int write_all_fd(int fd, const uint8_t *p, size_t n) {
    while (n > 0) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Read exactly n bytes; waits at most timeout_ms per chunk (-1: forever). 0 or -1. */
static int read_all_fd(int fd, uint8_t *p, size_t n, int timeout_ms) {
    while (n > 0) {
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        int pr = poll(&pf, 1, timeout_ms);
        if (pr < 0 && errno == EINTR) continue;
        if (pr == 0) {
            errno = ETIMEDOUT;
            return -1;
        }
        if (pr < 0) return -1;
        ssize_t r = recv(fd, p, n, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r == 0) errno = ECONNRESET;
        if (r <= 0) return -1;
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

enum { ATTEMPT_OK, ATTEMPT_CONNECT, ATTEMPT_REFUSED, ATTEMPT_VAWINDOW };

typedef struct hello_ctx {
    char host[256], user[256], program[1024], devreq[256];
    const char *token;
    size_t token_len;
    double timeout_s;
} hello_ctx;

/* Hello on a connected socket. Fills msg with the reason when not ATTEMPT_OK. */
static int say_hello(int fd, const hello_ctx *hc, uint64_t va_base, uint64_t va_size,
                     char *msg, size_t mcap) {
    gp_hello h = {
        .magic = GP_PROTO_MAGIC, .major = GP_PROTO_MAJOR, .minor = GP_PROTO_MINOR,
        .pid = (uint32_t)getpid(), .flags = 0,
        .host = hc->host, .host_len = (uint32_t)strlen(hc->host),
        .user = hc->user, .user_len = (uint32_t)strlen(hc->user),
        .program = hc->program, .program_len = (uint32_t)strlen(hc->program),
        .token = hc->token, .token_len = (uint32_t)hc->token_len,
        .device_request = hc->devreq, .device_request_len = (uint32_t)strlen(hc->devreq),
        .va_base = va_base, .va_size = va_size,
    };
    size_t n = 16 + gp_hello_size(&h);
    uint8_t *f = malloc(n);
    if (!f) {
        snprintf(msg, mcap, "out of memory");
        return ATTEMPT_CONNECT;
    }
    uint64_t req = atomic_fetch_add(&next_req, 1);
    gp_hello_frame(f, req, &h);
    int ok = write_all_fd(fd, f, n) == 0;
    free(f);
    if (!ok) {
        snprintf(msg, mcap, "sending hello: %s", strerror(errno));
        return ATTEMPT_CONNECT;
    }

    int waited_note = 0;
    for (;;) {
        uint8_t hb[16];
        /* The server may queue us until a GPU is free: wait, saying so once. */
        int rc = read_all_fd(fd, hb, 1, 5000);
        if (rc != 0 && errno == ETIMEDOUT) {
            if (!waited_note++)
                gp_log_info("waiting for server %s to answer (it may be waiting for a free GPU)",
                            server_desc);
            continue;
        }
        if (rc != 0 || read_all_fd(fd, hb + 1, 15, 30000) != 0) {
            snprintf(msg, mcap, "no answer to hello: %s",
                     errno == ECONNRESET ? "connection closed" : strerror(errno));
            return ATTEMPT_CONNECT;
        }
        gp_frame_header hd;
        gp_header_decode(hb, &hd);
        if (hd.len > GP_PROTO_MAX_BODY) {
            snprintf(msg, mcap, "it does not answer like a gpupool server; is the port right?");
            return ATTEMPT_CONNECT;
        }
        uint8_t *body = malloc(hd.len ? hd.len : 1);
        if (!body || read_all_fd(fd, body, hd.len, 30000) != 0) {
            free(body);
            snprintf(msg, mcap, "no answer to hello: %s", strerror(errno));
            return ATTEMPT_CONNECT;
        }
        if (!(hd.flags & GP_FLAG_REPLY) && hd.op == GP_OP_NOTICE) {
            handle_notice(body, hd.len);
            free(body);
            continue;
        }
        if (!(hd.flags & GP_FLAG_REPLY) || hd.op != GP_OP_HELLO || hd.len < 4) {
            free(body);
            snprintf(msg, mcap, "it does not answer like a gpupool server; is the port right?");
            return ATTEMPT_CONNECT;
        }
        gp_hello_reply r;
        int decoded = gp_hello_reply_decode(body, hd.len, &r) == 0;
        int32_t result = (int32_t)gp_rd_u32(body);
        if (result == GP_EVAWINDOW) {
            free(body);
            snprintf(msg, mcap, "the server could not reserve the address window");
            return ATTEMPT_VAWINDOW;
        }
        if (result != 0) {
            const char *what = decoded && r.message_len ? r.message : NULL;
            int wl = decoded ? (int)r.message_len : 0;
            const char *code = gp_result_name(result);
            if (what)
                snprintf(msg, mcap, "%.*s", wl, what);
            else
                snprintf(msg, mcap, "%s", code ? code : "refused");
            if (result == GP_EAUTH)
                snprintf(msg + strlen(msg), mcap - strlen(msg),
                         " (check GPUPOOL_TOKEN)");
            free(body);
            return ATTEMPT_REFUSED;
        }
        if (!decoded) {
            free(body);
            snprintf(msg, mcap, "malformed hello reply (client and server versions differ?)");
            return ATTEMPT_REFUSED;
        }
        if (r.major != GP_PROTO_MAJOR) {
            snprintf(msg, mcap, "server speaks protocol %u.%u, this client %u.%u", r.major,
                     r.minor, GP_PROTO_MAJOR, GP_PROTO_MINOR);
            free(body);
            return ATTEMPT_REFUSED;
        }
        if (r.va_size && (r.va_base != va_base || r.va_size != va_size))
            gp_log_debug("server reports window 0x%llx+0x%llx, ours is 0x%llx+0x%llx",
                         (unsigned long long)r.va_base, (unsigned long long)r.va_size,
                         (unsigned long long)va_base, (unsigned long long)va_size);
        gp_state_set_snapshot(&r);
        gp_log_debug("connected to %s (%.*s%s, session %llu, device \"%.*s\", driver %d, "
                     "window 0x%llx+0x%llx)",
                     server_desc, (int)r.server_len, r.server, r.simulated ? ", simulated" : "",
                     (unsigned long long)r.session_id, (int)r.name_len, r.name,
                     r.driver_version, (unsigned long long)va_base, (unsigned long long)va_size);
        free(body);
        return ATTEMPT_OK;
    }
}

static void fill_identity(hello_ctx *hc) {
    char buf[512];
    if (gethostname(buf, sizeof buf) != 0) strcpy(buf, "?");
    buf[sizeof buf - 1] = 0;
    utf8_clean(hc->host, sizeof hc->host, buf, strlen(buf));
    struct passwd pw, *res = NULL;
    char pwbuf[4096];
    const char *user = NULL;
    if (getpwuid_r(geteuid(), &pw, pwbuf, sizeof pwbuf, &res) == 0 && res) user = res->pw_name;
    if (!user) user = getenv("USER");
    if (!user) {
        snprintf(buf, sizeof buf, "uid%u", (unsigned)geteuid());
        user = buf;
    }
    utf8_clean(hc->user, sizeof hc->user, user, strlen(user));
    program_string(hc->program, sizeof hc->program);
    const char *dev = getenv("GPUPOOL_DEVICE");
    utf8_clean(hc->devreq, sizeof hc->devreq, dev ? dev : "", dev ? strlen(dev) : 0);
}

static void atfork_child(void);
static void at_exit(void);

static int start_thread(void *(*fn)(void *), const char *name) {
    pthread_t t;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* the program's signals stay on its threads */
    int rc = pthread_create(&t, NULL, fn, NULL);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) return -1;
    pthread_setname_np(t, name);
    pthread_detach(t);
    return 0;
}

static CUresult do_connect(void) {
    const char *list = getenv("GPUPOOL_SERVER");
    if (!list || !*list) {
        gp_log_error("GPUPOOL_SERVER is not set: no GPU server to run CUDA on. Set "
                     "GPUPOOL_SERVER=host:port (and GPUPOOL_TOKEN if the server needs one), or "
                     "start the program with `gpupool run`.");
        return CUDA_ERROR_NO_DEVICE;
    }
    hello_ctx hc = {0};
    const char *tok = getenv("GPUPOOL_TOKEN");
    hc.token = tok ? tok : "";
    hc.token_len = strlen(hc.token);
    if (hc.token_len > 4096) {
        gp_log_error("GPUPOOL_TOKEN is longer than 4096 bytes; is it the right value?");
        return CUDA_ERROR_NO_DEVICE;
    }
    fill_identity(&hc);
    const char *to = getenv("GPUPOOL_CONNECT_TIMEOUT");
    hc.timeout_s = to && *to ? atof(to) : 10.0;

    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t va_base = env_u64("GPUPOOL_VA_BASE", DEFAULT_VA_BASE) & ~(page - 1);
    uint64_t va_size = (env_u64("GPUPOOL_VA_SIZE", DEFAULT_VA_SIZE) + page - 1) & ~(page - 1);
    if (va_size == 0) va_size = DEFAULT_VA_SIZE;
    uint64_t step = va_size > VA_STEP ? (va_size + VA_STEP - 1) / VA_STEP * VA_STEP : VA_STEP;

    char *servers = strdup(list);
    if (!servers) return CUDA_ERROR_NO_DEVICE;
    char failures[2048] = "";
    int nfail = 0, last_kind = ATTEMPT_CONNECT;
    char last_msg[1024] = "";
    int base_index = 0;
    CUresult result = CUDA_ERROR_NO_DEVICE;

    char *save = NULL;
    for (char *entry = strtok_r(servers, ",", &save); entry; entry = strtok_r(NULL, ",", &save)) {
        while (*entry == ' ' || *entry == '\t') entry++;
        size_t el = strlen(entry);
        while (el > 0 && (entry[el - 1] == ' ' || entry[el - 1] == '\t')) entry[--el] = 0;
        if (!*entry) continue;
        snprintf(server_desc, sizeof server_desc, "%s", entry);
        char host[256], port[32];
        if (split_hostport(entry, host, sizeof host, port, sizeof port) != 0) {
            snprintf(last_msg, sizeof last_msg, "not of the form host:port");
            last_kind = ATTEMPT_REFUSED;
            goto failed;
        }
        if (!strchr(entry, ':')) snprintf(server_desc, sizeof server_desc, "%s:%s", host, port);
        for (;;) {
            /* The window first: device pointers must never alias our memory. */
            while (gp_vamap_window_size() == 0 && base_index < VA_TRIES) {
                uint64_t b = va_base + (uint64_t)base_index * step;
                if (gp_vamap_reserve_window(b, va_size) == 0) break;
                gp_log_debug("cannot reserve the address window at 0x%llx: %s",
                             (unsigned long long)b, strerror(errno));
                base_index++;
            }
            if (gp_vamap_window_size() == 0) {
                gp_log_error("cannot reserve %llu bytes of address space for device memory "
                             "(tried %d bases from 0x%llx); set GPUPOOL_VA_BASE / "
                             "GPUPOOL_VA_SIZE to a free range",
                             (unsigned long long)va_size, VA_TRIES, (unsigned long long)va_base);
                free(servers);
                return CUDA_ERROR_NO_DEVICE;
            }
            int fd = tcp_connect(host, port, hc.timeout_s, last_msg, sizeof last_msg);
            if (fd < 0) {
                last_kind = ATTEMPT_CONNECT;
                goto failed;
            }
            int k = say_hello(fd, &hc, gp_vamap_window_base(), gp_vamap_window_size(), last_msg,
                              sizeof last_msg);
            if (k == ATTEMPT_OK) {
                sock = fd;
                free(servers);
                return CUDA_SUCCESS;
            }
            close(fd);
            last_kind = k;
            if (k == ATTEMPT_VAWINDOW && base_index + 1 < VA_TRIES) {
                gp_log_debug("server %s cannot use window 0x%llx; trying the next base", entry,
                             (unsigned long long)gp_vamap_window_base());
                gp_vamap_release_window();
                base_index++;
                continue;
            }
            goto failed;
        }
    failed:
        nfail++;
        snprintf(failures + strlen(failures), sizeof failures - strlen(failures), "%s%s: %s",
                 nfail > 1 ? "; " : "", entry, last_msg);
    }
    free(servers);
    if (nfail == 0) {
        gp_log_error("GPUPOOL_SERVER is empty: set GPUPOOL_SERVER=host:port.");
    } else if (nfail > 1) {
        gp_log_error("cannot use any gpupool server (%s). Are they running? Check "
                     "GPUPOOL_SERVER and GPUPOOL_TOKEN.",
                     failures);
    } else if (last_kind == ATTEMPT_CONNECT) {
        gp_log_error("cannot connect to gpupool server %s (%s). Is gpupoold running there? Set "
                     "GPUPOOL_SERVER=host:port.",
                     server_desc, last_msg);
    } else if (last_kind == ATTEMPT_VAWINDOW) {
        gp_log_error("server %s could not reserve the client's device address window (%s); "
                     "set GPUPOOL_VA_BASE to another free range.",
                     server_desc, last_msg);
    } else {
        gp_log_error("server %s refused the session: %s", server_desc, last_msg);
    }
    gp_vamap_release_window();
    return result;
}

static void init_once_handlers(void) {
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&flush_cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_atfork(NULL, NULL, atfork_child);
}

/* The connection's own status (gp_check_init without the cuInit requirement). */
static CUresult conn_status(void) {
    int s = atomic_load_explicit(&state, memory_order_acquire);
    if (s == ST_READY) return atomic_load(&dead) ? GP_LOST_CONNECTION_ERROR : CUDA_SUCCESS;
    if (s == ST_CLOSED) return CUDA_ERROR_DEINITIALIZED;
    if (s == ST_FORKED) return CUDA_ERROR_NOT_INITIALIZED;
    return CUDA_ERROR_NO_DEVICE;
}

CUresult gp_conn_ensure(void) {
    int s = atomic_load_explicit(&state, memory_order_acquire);
    if (s == ST_READY || s == ST_CLOSED) return conn_status();
    if (s == ST_FAILED) return CUDA_ERROR_NO_DEVICE;
    if (s == ST_FORKED) return CUDA_ERROR_NOT_INITIALIZED;

    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, init_once_handlers);

    pthread_mutex_lock(&init_lock);
    s = atomic_load(&state);
    if (s == ST_NONE) {
        init_result = do_connect();
        if (init_result == CUDA_SUCCESS) {
            last_ctx_sent = UINT64_MAX;
            if (start_thread(receiver_main, "gpupool-recv") != 0 ||
                start_thread(flusher_main, "gpupool-flush") != 0) {
                gp_log_error("cannot start the connection threads: %s", strerror(errno));
                close(sock);
                sock = -1;
                init_result = CUDA_ERROR_NO_DEVICE;
            }
        }
        if (init_result == CUDA_SUCCESS) {
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

static void atfork_child(void) {
    /* Only this thread survives; the connection belongs to the parent. Send nothing, and close
     * our copy of the socket so the parent's session ends when the parent does. */
    int s = atomic_load(&state);
    if (s == ST_NONE || s == ST_FAILED) return; /* the child may connect on its own */
    if (sock >= 0) close(sock);
    sock = -1;
    atomic_store(&dead, 1);
    atomic_store(&state, ST_FORKED);
    gp_log_debug("fork(): CUDA is not available in the child process (it was initialised in "
                 "the parent)");
}

static void at_exit(void) {
    if (atomic_load(&state) != ST_READY || atomic_load(&dead)) return;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 200000000L;
    if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
    if (pthread_mutex_timedlock(&send_lock, &ts) != 0) return; /* a sender is stuck: just go */
    atomic_store(&state, ST_CLOSED);
    struct timeval tv = {.tv_sec = 1};
    setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    gp_goodbye m = {0};
    uint8_t f[16 + 1];
    size_t n = gp_goodbye_frame(f, atomic_fetch_add(&next_req, 1), &m);
    if (!atomic_load(&dead)) flush_locked(f, n, NULL, 0);
    pthread_mutex_unlock(&send_lock);
}
