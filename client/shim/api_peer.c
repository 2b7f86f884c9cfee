/*
 * api_peer.c: server-to-server copies of a spread lease (issue 37, item 3; docs/multi-gpu.md,
 * "Across servers"; the worker's side is worker/h_peer.c). A peer copy between devices of two
 * parts goes from the source part's worker straight to the destination part's worker, over a
 * link the two servers' gpupoolds open between them; this process only orders it.
 *
 * - One link per ordered pair of parts (source -> destination), made at the pair's first copy and
 *   kept for the session: a random link_id and a random AES-256-GCM key (getrandom), given inside
 *   this process's own sessions to the two workers only (peer_link GP_PEER_RECV to the
 *   destination, GP_PEER_SEND to the source, both in flight at once: each worker waits for its
 *   gpupoold's half of the connection, so one alone would wait for the other until it timed out).
 *   The key is cleared from our memory once both requests were sent.
 * - A copy: peer_recv to the destination, peer_send to the source, both in flight, each worker in
 *   the primary context of its address's device (the caller passes them, as copy_across picks
 *   them); the result is the destination's code if nonzero, else the source's, with the words of
 *   the side whose code it is. Synchronous: the caller waited for the stream's earlier work, and
 *   we wait for the legacy stream of both contexts first (the workers copy on a non-blocking
 *   stream of their own, which would not wait for the program's blocking streams there, as the
 *   copy through this process does).
 * - A part takes part in one peer operation at a time (part_lock, the two parts' locks taken in
 *   index order): a worker handles its frames in order and a copy holds it, so copies of pairs
 *   that share a part in a cycle (A->B with B->A, or A->B, B->C, C->A) issued by several threads
 *   could otherwise leave every worker of the cycle sending while none reads. Pairs with no part
 *   in common copy at once.
 * - Links only between parts whose connections both run inside TLS: the key must never cross in
 *   clear.
 * - Two requests in flight at once need two waiting threads here (gp_request waits for its own
 *   reply, with the worker's words, which a detached request would drop): the destination's
 *   request goes from a short-lived helper thread while this thread sends the source's.
 * - Failure (spread_copy, client_config.h): "client" never links; "auto" (the default) copies
 *   through this process when a link cannot be made (one line per pair, with the servers' words;
 *   the pair tries again after RETRY_AFTER_S, doubled at each wait in a row, up to 16 min) or when a copy over a link fails (that copy; the next copy makes a new link, and after
 *   LINK_TRIES links in a row failed the pair waits RETRY_AFTER_S before the next try); "server"
 *   fails the copy with CUDA_ERROR_NOT_SUPPORTED (or the copy's own error) and a line at every
 *   failing copy. A failure that is not the link's (no thread, no memory, a gpupoold busy with
 *   other links) costs no try: the next copy tries again. Every failure closes the link on both
 *   ends. A part whose worker is older than protocol 1.9 never links.
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/types.h>
#include <time.h>

#include "client_config.h"
#include "generated/gp_cuda_tables.h"
#include "shim.h"
#include "shim_core.h"

enum {
    LINK_NONE, /* none now: the next copy makes one */
    LINK_UP,   /* both workers hold it */
    LINK_WAIT  /* until retry_at, copies of this pair go through this process (or fail: "server") */
};

/* Links in a row that fail (set-up, or a copy over them) before the pair waits; a set-up that
 * fails for a reason of the link's (servers that cannot reach each other, a refusal) waits at
 * once, as the next try would most likely fail the same way, costing its time again. */
#define LINK_TRIES 2
/* The first wait; each wait after another (no copy went over a link between them) is twice the
 * one before, up to RETRY_AFTER_S << RETRY_DOUBLINGS (16 min): servers that cannot reach each
 * other cost a try (up to the receiving server's accept wait, about 12 s) ever more rarely,
 * while a passing failure (a restart of one of them) still heals within a minute or two. */
#define RETRY_AFTER_S 30
#define RETRY_DOUBLINGS 5

typedef struct peer_pair {
    int state;
    int tries;         /* failed links in a row (reset by a copy that went over one) */
    int pauses;        /* waits in a row (reset by a copy that went over a link) */
    int said;          /* auto: the pair's line was written (once at info, then debug) */
    uint64_t id;       /* the link's id while LINK_UP */
    uint64_t retry_at; /* LINK_WAIT: CLOCK_MONOTONIC ns of the next try */
    char *why;         /* LINK_WAIT: why (malloc'd; NULL if there was no memory for it) */
} peer_pair;

/* [source part][destination part], each guarded by both parts' part_lock. */
static peer_pair pairs[GP_MAX_DEVICES][GP_MAX_DEVICES];
static pthread_mutex_t part_lock[GP_MAX_DEVICES];
static pthread_once_t part_lock_once = PTHREAD_ONCE_INIT;
static atomic_ullong next_copy_id;

static void part_lock_init(void)
{
    for (int i = 0; i < GP_MAX_DEVICES; i++)
        pthread_mutex_init(&part_lock[i], NULL); /* default attributes: cannot fail on Linux */
}

/* Both parts, lower index first: one order for every thread, so no two wait for each other. */
static void lock_parts(int a, int b)
{
    pthread_once(&part_lock_once, part_lock_init);
    pthread_mutex_lock(&part_lock[a < b ? a : b]);
    pthread_mutex_lock(&part_lock[a < b ? b : a]);
}

static void unlock_parts(int a, int b)
{
    pthread_mutex_unlock(&part_lock[a < b ? b : a]);
    pthread_mutex_unlock(&part_lock[a < b ? a : b]);
}

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t); /* cannot fail for CLOCK_MONOTONIC */
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* One request to one part, with its answer: the reply's code (the call's CUresult) and words,
 * or the transport's error (lost connection) / the worker's non-zero result. */
typedef struct peer_call {
    int part;
    uint64_t ctx; /* the context its worker runs it in; 0: as it is */
    uint8_t *frame;
    size_t len;
    int32_t code;
    int lost; /* the connection to this part is gone */
    char error[1024];
} peer_call;

static void call_run(peer_call *c)
{
    uint64_t own = gp_conn_wire_ctx();
    if (c->ctx)
        gp_conn_use_ctx(c->ctx);
    gp_conn_route(c->part);
    gp_reply rep;
    CUresult r = gp_request(c->frame, c->len, NULL, 0, NULL, 0, &rep);
    gp_conn_route(-1);
    gp_conn_use_ctx(own);
    c->error[0] = 0;
    c->lost = r == GP_LOST_CONNECTION_ERROR;
    if (r != CUDA_SUCCESS) {
        const char *name = gp_result_name((int)r) ? gp_result_name((int)r) : gp_cuda_error_name(r);
        c->code = gp_cu_result(r); /* a protocol code is no CUresult for the program */
        snprintf(c->error, sizeof c->error, "its worker answered %s (%d)", name ? name : "error",
                 (int)r);
        return;
    }
    /* peer_link, peer_send and peer_recv replies are alike: result, code, error. */
    gp_peer_link_reply d;
    if (gp_peer_link_reply_decode(rep.body, rep.len, &d) != 0) {
        c->code = CUDA_ERROR_UNKNOWN;
        snprintf(c->error, sizeof c->error, "its worker's reply was malformed");
    } else {
        c->code = d.code;
        snprintf(c->error, sizeof c->error, "%.*s", (int)d.error_len, d.error);
    }
    gp_reply_free(&rep);
}

static void *call_thread(void *arg)
{
    call_run(arg);
    return NULL;
}

/* first and second in flight at once, first from a helper thread (nothing orders the two
 * requests: each worker waits for its gpupoold's half of the work, so either may come first).
 * The helper writes into the caller's stack: the caller is not cancelled while it runs, and it
 * starts with every signal blocked, so none of the program's handlers runs on it. 0 with both
 * answered; else pthread_create's error number, and nothing was sent. */
static int call_both(peer_call *first, peer_call *second)
{
    int cancel_state;
    (void)pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &cancel_state); /* valid argument */
    sigset_t all, old;
    sigfillset(&all);
    int rc = pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_t t;
    if (rc == 0) {
        rc = pthread_create(&t, NULL, call_thread, first);
        int rs = pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (rs != 0) /* a valid mask of our own: cannot happen */
            gp_log_error("restoring the thread's signal mask failed (error %d)", rs);
    }
    if (rc == 0) {
        call_run(second);
        int rj = pthread_join(t, NULL);
        if (rj != 0) { /* cannot happen for a joinable thread of ours; never read `first` then */
            gp_log_error("waiting for a peer copy's helper thread failed (error %d)", rj);
            first->code = CUDA_ERROR_UNKNOWN;
            snprintf(first->error, sizeof first->error, "its helper thread was lost");
        }
    }
    (void)pthread_setcancelstate(cancel_state, NULL);
    return rc;
}

/* Closes link id on both parts (not answered; harmless when an end already closed it or never
 * opened it, and a lost part closes its links with its session). */
static void unlink_both(uint64_t id, int ps, int pd)
{
    gp_peer_unlink m = {.link_id = id};
    GP_FRAME(buf, len, gp_peer_unlink, &m);
    if (!buf)
        return;
    int ends[2] = {ps, pd};
    for (int i = 0; i < 2; i++) {
        gp_conn_route(ends[i]);
        (void)gp_post(buf, len, NULL, 0);
        gp_conn_route(-1);
    }
    GP_FRAME_FREE(buf);
}

/* The words of the side whose code a failed pair of calls returns (the destination's if it
 * failed, as copies do), or of the source first when source_first (link set-up: the source
 * reaches out to the other server, its words name the cause). */
static const char *words_of(const peer_call *dst, const peer_call *src, int source_first)
{
    const peer_call *first = source_first ? src : dst, *second = source_first ? dst : src;
    const peer_call *c = first->code != 0 ? first : second;
    if (c->error[0])
        return c->error;
    if (c != first && first->error[0])
        return first->error;
    return "no reason given";
}

/* A failure that is not the link's: the next copy may well succeed (no memory, a gpupoold busy
 * with other links: peer_links.py's "busy making"). */
static int passing(const peer_call *c)
{
    return c->code == CUDA_ERROR_OUT_OF_MEMORY || strstr(c->error, "is busy making") != NULL;
}

/* How a try went. */
typedef enum {
    TRY_OK,
    TRY_NOT_SENT, /* nothing went out (no thread, no memory): the link, if any, is as it was */
    TRY_PASSING,  /* failed for a reason that is not the link's */
    TRY_FAILED,   /* failed: the link's failure, or the copy's own error */
    TRY_LOST      /* the connection to a part is gone */
} try_result;

/* Sends a pair of frames (d's to pd, s's to ps) and sorts the answers; on a failure, r and why. */
static try_result run_pair(int pd, uint64_t dctx, uint8_t *rbuf, size_t rlen, int ps, uint64_t sctx,
                           uint8_t *sbuf, size_t slen, int source_first, CUresult *r, char *why,
                           size_t cap)
{
    if (!rbuf || !sbuf) {
        *r = CUDA_ERROR_OUT_OF_MEMORY;
        snprintf(why, cap, "this process is out of memory");
        return TRY_NOT_SENT;
    }
    peer_call d = {.part = pd, .ctx = dctx, .frame = rbuf, .len = rlen};
    peer_call s = {.part = ps, .ctx = sctx, .frame = sbuf, .len = slen};
    int rc = call_both(&d, &s);
    if (rc != 0) {
        *r = CUDA_ERROR_OUT_OF_MEMORY;
        snprintf(why, cap, "this process could not start a thread (%s)", strerror(rc));
        return TRY_NOT_SENT;
    }
    if (d.lost || s.lost) {
        *r = GP_LOST_CONNECTION_ERROR;
        snprintf(why, cap, "the connection to a server of the lease was lost");
        return TRY_LOST;
    }
    if (d.code == 0 && s.code == 0) {
        *r = CUDA_SUCCESS;
        return TRY_OK;
    }
    *r = source_first ? (s.code != 0 ? s.code : d.code) : (d.code != 0 ? d.code : s.code);
    snprintf(why, cap, "%s", words_of(&d, &s, source_first));
    return (d.code == 0 || passing(&d)) && (s.code == 0 || passing(&s)) ? TRY_PASSING : TRY_FAILED;
}

/* Makes the link of pair (ps -> pd); L up on TRY_OK, else why filled. */
static try_result link_up(peer_pair *L, int ps, int pd, char *why, size_t cap)
{
    uint8_t key[GP_PEER_KEY_SIZE];
    uint64_t id = 0;
    if (getrandom(key, sizeof key, 0) != (ssize_t)sizeof key ||
        getrandom(&id, sizeof id, 0) != (ssize_t)sizeof id) {
        snprintf(why, cap, "this process could not draw a random key (%s)", strerror(errno));
        explicit_bzero(key, sizeof key);
        return TRY_NOT_SENT;
    }
    id = id ? id : 1;
    gp_peer_link recv = {.link_id = id, .role = GP_PEER_RECV, .peer_part = (uint32_t)ps};
    gp_peer_link send = {.link_id = id, .role = GP_PEER_SEND, .peer_part = (uint32_t)pd};
    memcpy(recv.key, key, sizeof key);
    memcpy(send.key, key, sizeof key);
    explicit_bzero(key, sizeof key);
    GP_FRAME(rbuf, rlen, gp_peer_link, &recv);
    GP_FRAME(sbuf, slen, gp_peer_link, &send);
    explicit_bzero(recv.key, sizeof recv.key);
    explicit_bzero(send.key, sizeof send.key);
    CUresult r;
    try_result t = run_pair(pd, 0, rbuf, rlen, ps, 0, sbuf, slen, 1, &r, why, cap);
    if (t == TRY_OK) {
        L->state = LINK_UP;
        L->id = id;
    } else if (t != TRY_NOT_SENT) {
        unlink_both(id, ps, pd); /* one end may be up */
    }
    /* The frames held the key. */
    if (rbuf)
        explicit_bzero(rbuf, rlen);
    if (sbuf)
        explicit_bzero(sbuf, slen);
    GP_FRAME_FREE(rbuf);
    GP_FRAME_FREE(sbuf);
    return t;
}

/* One copy over pair L's link: TRY_OK, or the copy's error in *r with why filled. */
static try_result copy_over(const peer_pair *L, uint64_t dst, int pd, uint64_t dctx, uint64_t src,
                            int ps, uint64_t sctx, size_t n, CUresult *r, char *why, size_t cap)
{
    uint64_t copy_id = atomic_fetch_add(&next_copy_id, 1) + 1;
    gp_peer_recv rm = {.link_id = L->id, .copy_id = copy_id, .dst = dst, .size = n};
    gp_peer_send sm = {.link_id = L->id, .copy_id = copy_id, .src = src, .size = n};
    GP_FRAME(rbuf, rlen, gp_peer_recv, &rm);
    GP_FRAME(sbuf, slen, gp_peer_send, &sm);
    try_result t = run_pair(pd, dctx, rbuf, rlen, ps, sctx, sbuf, slen, 0, r, why, cap);
    GP_FRAME_FREE(rbuf);
    GP_FRAME_FREE(sbuf);
    return t;
}

/* Waits on part p's worker for the legacy stream of context ctx (the blocking streams there). */
static CUresult legacy_done(int p, uint64_t ctx)
{
    uint64_t own = gp_conn_wire_ctx();
    gp_conn_use_ctx(ctx);
    gp_conn_route(p);
    CUresult r = gp_stream_wait_wire(0);
    gp_conn_route(-1);
    gp_conn_use_ctx(own);
    return r;
}

/* A part's worker speaks protocol 1.9 (peer links) or later. */
static int part_links(int p)
{
    const gp_device_snapshot *d = gp_device(gp_conn_part_first_device(p));
    return d && d->proto_minor >= 9;
}

/* Pair L stops trying for RETRY_AFTER_S, doubled for each wait in a row before (at most
 * RETRY_DOUBLINGS times), keeping why for the lines meanwhile. */
static void pause_pair(peer_pair *L, const char *why)
{
    int doublings = L->pauses < RETRY_DOUBLINGS ? L->pauses : RETRY_DOUBLINGS;
    L->state = LINK_WAIT;
    L->tries = 0;
    L->pauses++;
    L->retry_at = now_ns() + ((uint64_t)RETRY_AFTER_S << doublings) * 1000000000u;
    free(L->why);
    L->why = strdup(why);
}

/* The pair's line: "server" says it at every failing copy; "auto" once per pair (then at debug
 * level) when it lasts (a pair waiting to try again, or plain TCP), with when server to server
 * is tried again, else (the next copy tries again) at debug level. */
static void say_not_direct(peer_pair *L, int ps, int pd, const char *why, int server_mode,
                           CUresult code, int lasting)
{
    const char *name = gp_cuda_error_name(code);
    char again[64] = "";
    if (L->state == LINK_WAIT) {
        uint64_t now = now_ns();
        snprintf(
            again, sizeof again, " (server to server is tried again in %llu s)",
            (unsigned long long)((L->retry_at > now ? L->retry_at - now : 0) / 1000000000u + 1));
    }
    if (server_mode) {
        gp_log_error("a copy from server %s to server %s cannot go server to server: %s%s. It "
                     "fails (%s, %d) as spread_copy = server (GPUPOOL_SPREAD_COPY) asks; set it "
                     "to auto to copy through this client instead",
                     gp_conn_part_server(ps), gp_conn_part_server(pd), why, again,
                     name ? name : "error", (int)code);
    } else if (lasting && !L->said) {
        L->said = 1;
        gp_log_info("copies from server %s to server %s go through this client: %s%s",
                    gp_conn_part_server(ps), gp_conn_part_server(pd), why, again);
    } else {
        gp_log_debug("a copy from server %s to server %s goes through this client: %s%s",
                     gp_conn_part_server(ps), gp_conn_part_server(pd), why,
                     lasting ? again : " (the next copy tries server to server again)");
    }
}

/* The direct path for one copy, under both parts' locks. *over = 1: the copy went over a link
 * (or the program's earlier work failed, or a part was lost): its result is returned. *over = 0:
 * not copied; why filled and the code "server" fails it with. */
static CUresult direct_locked(peer_pair *L, uint64_t dst, int pd, uint64_t dctx, uint64_t src,
                              int ps, uint64_t sctx, size_t n, int *over, char *why, size_t cap)
{
    *over = 0;
    if (L->state == LINK_WAIT) {
        if (now_ns() < L->retry_at) {
            snprintf(why, cap, "%s", L->why ? L->why : "a link between them failed");
            return CUDA_ERROR_NOT_SUPPORTED;
        }
        L->state = LINK_NONE;
        free(L->why);
        L->why = NULL;
    }
    CUresult r;
    if (L->state == LINK_NONE) {
        try_result t = link_up(L, ps, pd, why, cap);
        if (t == TRY_LOST) {
            *over = 1;
            return GP_LOST_CONNECTION_ERROR;
        }
        if (t == TRY_FAILED)
            pause_pair(L, why);
        if (t != TRY_OK)
            return CUDA_ERROR_NOT_SUPPORTED;
    }
    /* The copy sees the program's earlier work on both devices (below the workers' own
     * non-blocking streams); a long kernel then ends before the link's silence clock runs. */
    r = legacy_done(ps, sctx);
    if (r == CUDA_SUCCESS)
        r = legacy_done(pd, dctx);
    if (r != CUDA_SUCCESS) { /* earlier work's error, or a lost part: the link is untouched */
        *over = 1;
        return r;
    }
    try_result t = copy_over(L, dst, pd, dctx, src, ps, sctx, n, &r, why, cap);
    if (t == TRY_OK) {
        L->tries = 0;
        L->pauses = 0;
        *over = 1;
        return CUDA_SUCCESS;
    }
    if (t == TRY_NOT_SENT)
        return r; /* the link stays up */
    /* The link is dead on both ends (the workers close it on any failure): make sure. */
    unlink_both(L->id, ps, pd);
    L->state = LINK_NONE;
    if (t == TRY_LOST) {
        *over = 1;
        return r;
    }
    if (t == TRY_FAILED && ++L->tries >= LINK_TRIES)
        pause_pair(L, why);
    return r;
}

CUresult gp_spread_copy_direct(uint64_t dst, int pd, uint64_t dctx, uint64_t src, int ps,
                               uint64_t sctx, size_t n, int *through_client)
{
    *through_client = 1;
    int mode = gp_state_spread_copy();
    if (mode == GP_SPREAD_COPY_CLIENT || ps < 0 || pd < 0 || ps >= GP_MAX_DEVICES ||
        pd >= GP_MAX_DEVICES || ps == pd || !part_links(ps) || !part_links(pd))
        return CUDA_SUCCESS;
    int server_mode = mode == GP_SPREAD_COPY_SERVER;
    char why[1100]; /* a worker's words (up to 1023 bytes) or ours */
    int over = 0;
    CUresult r = CUDA_ERROR_NOT_SUPPORTED;
    lock_parts(ps, pd);
    peer_pair *L = &pairs[ps][pd];
    int plain = !gp_conn_part_tls(ps) ? ps : !gp_conn_part_tls(pd) ? pd : -1;
    if (plain >= 0)
        snprintf(why, sizeof why,
                 "the connection to server %s is plain TCP (a link's key travels only inside TLS)",
                 gp_conn_part_server(plain));
    else
        r = direct_locked(L, dst, pd, dctx, src, ps, sctx, n, &over, why, sizeof why);
    if (!over)
        say_not_direct(L, ps, pd, why, server_mode, r, plain >= 0 || L->state == LINK_WAIT);
    unlock_parts(ps, pd);
    if (over || server_mode) {
        *through_client = 0;
        return r;
    }
    return CUDA_SUCCESS; /* auto: this copy through this process; the source is untouched */
}
