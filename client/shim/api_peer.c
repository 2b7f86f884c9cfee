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
 *   them); the result is the destination's code if nonzero, else the source's. Synchronous: the
 *   caller waited for the stream's earlier work.
 * - One peer operation at a time in the process (peer_lock): two copies in opposite directions
 *   issued by two threads could otherwise reach the two workers in opposite orders, each worker
 *   then sending to the other while neither reads (each handles its frames in order).
 * - Two requests in flight at once need two waiting threads here (gp_request waits for its own
 *   reply, with the worker's words, which a detached request would drop): the destination's
 *   request goes from a short-lived helper thread while this thread sends the source's.
 * - Failure (spread_copy, client_config.h): "client" never links; "auto" (the default) copies
 *   through this process when a link cannot be made (one line per pair, with the worker's words)
 *   or when a copy over a link fails (that copy, then one new link at the next copy at most);
 *   "server" fails the copy with CUDA_ERROR_NOT_SUPPORTED (or the copy's own error) and the line.
 *   A part whose worker is older than protocol 1.9 never links.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <sys/types.h>

#include "client_config.h"
#include "generated/gp_cuda_tables.h"
#include "shim.h"
#include "shim_core.h"

enum {
    LINK_NONE,    /* none yet (or forgotten after a failed copy): the next copy makes one */
    LINK_UP,      /* both workers hold it */
    LINK_GIVEN_UP /* copies of this pair go through this process (or fail: "server") */
};

/* The links a pair of parts (source, destination) made at most: the first, and one more after a
 * copy over it failed. */
#define LINK_TRIES 2

typedef struct peer_pair {
    int state;
    int tries;   /* links made (or tried) for this pair */
    uint64_t id; /* the link's id while LINK_UP */
} peer_pair;

static pthread_mutex_t peer_lock = PTHREAD_MUTEX_INITIALIZER;
static peer_pair pairs[GP_MAX_DEVICES][GP_MAX_DEVICES]; /* [source part][destination part] */
static atomic_ullong next_copy_id;

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

/* first and second in flight at once (first from a helper thread, sent first as a rule). -1 when
 * no helper thread could be started (nothing was sent), else 0 with both answered. */
static int call_both(peer_call *first, peer_call *second)
{
    pthread_t t;
    if (pthread_create(&t, NULL, call_thread, first) != 0)
        return -1;
    call_run(second);
    int rc = pthread_join(t, NULL);
    if (rc != 0) { /* cannot happen for a joinable thread of ours; never read `first` then */
        gp_log_error("waiting for a peer copy's helper thread failed (error %d)", rc);
        first->code = CUDA_ERROR_UNKNOWN;
        snprintf(first->error, sizeof first->error, "its helper thread was lost");
    }
    return 0;
}

/* Closes link id on both parts (not answered; harmless when an end already closed it). */
static void unlink_both(uint64_t id, int ps, int pd)
{
    gp_peer_unlink m = {.link_id = id};
    GP_FRAME(buf, len, gp_peer_unlink, &m);
    if (!buf)
        return;
    int ends[2] = {ps, pd};
    for (int i = 0; i < 2; i++) {
        gp_conn_route(ends[i]);
        (void)gp_post(buf, len, NULL, 0); /* a lost part closes its links with its session */
        gp_conn_route(-1);
    }
    GP_FRAME_FREE(buf);
}

/* The words of a failed pair of calls: the source's when it failed (it reaches out to the other
 * server: its words name the cause), else the destination's. */
static const char *words_of(const peer_call *dst, const peer_call *src)
{
    if (src->code != 0 && src->error[0])
        return src->error;
    if (dst->error[0])
        return dst->error;
    return "no reason given";
}

/* Makes the link of pair (ps -> pd). CUDA_SUCCESS (L up), or the failure with why filled. */
static CUresult link_up(peer_pair *L, int ps, int pd, char *why, size_t cap)
{
    uint8_t key[GP_PEER_KEY_SIZE];
    uint64_t id = 0;
    if (getrandom(key, sizeof key, 0) != (ssize_t)sizeof key ||
        getrandom(&id, sizeof id, 0) != (ssize_t)sizeof id) {
        snprintf(why, cap, "this process could not draw a random key (%s)", strerror(errno));
        explicit_bzero(key, sizeof key);
        return CUDA_ERROR_NOT_SUPPORTED;
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
    CUresult r = CUDA_ERROR_OUT_OF_MEMORY;
    snprintf(why, cap, "out of memory");
    if (rbuf && sbuf) {
        peer_call d = {.part = pd, .frame = rbuf, .len = rlen};
        peer_call s = {.part = ps, .frame = sbuf, .len = slen};
        if (call_both(&d, &s) != 0) {
            snprintf(why, cap, "this process could not start a thread (%s)", strerror(errno));
        } else if (d.lost || s.lost) {
            r = GP_LOST_CONNECTION_ERROR;
            snprintf(why, cap, "the connection to a server of the lease was lost");
        } else if (d.code != 0 || s.code != 0) {
            r = d.code != 0 ? d.code : s.code;
            snprintf(why, cap, "%s", words_of(&d, &s));
            unlink_both(id, ps, pd); /* one end may be up */
        } else {
            r = CUDA_SUCCESS;
            L->state = LINK_UP;
            L->id = id;
        }
    }
    /* The frames held the key. */
    if (rbuf)
        explicit_bzero(rbuf, rlen);
    if (sbuf)
        explicit_bzero(sbuf, slen);
    GP_FRAME_FREE(rbuf);
    GP_FRAME_FREE(sbuf);
    return r;
}

/* One copy over pair L's link. CUDA_SUCCESS, or the copy's error with why filled. */
static CUresult copy_over(const peer_pair *L, uint64_t dst, int pd, uint64_t dctx, uint64_t src,
                          int ps, uint64_t sctx, size_t n, char *why, size_t cap)
{
    uint64_t copy_id = atomic_fetch_add(&next_copy_id, 1) + 1;
    gp_peer_recv rm = {.link_id = L->id, .copy_id = copy_id, .dst = dst, .size = n};
    gp_peer_send sm = {.link_id = L->id, .copy_id = copy_id, .src = src, .size = n};
    GP_FRAME(rbuf, rlen, gp_peer_recv, &rm);
    GP_FRAME(sbuf, slen, gp_peer_send, &sm);
    CUresult r = CUDA_ERROR_OUT_OF_MEMORY;
    snprintf(why, cap, "out of memory");
    if (rbuf && sbuf) {
        peer_call d = {.part = pd, .ctx = dctx, .frame = rbuf, .len = rlen};
        peer_call s = {.part = ps, .ctx = sctx, .frame = sbuf, .len = slen};
        if (call_both(&d, &s) != 0) {
            snprintf(why, cap, "this process could not start a thread (%s)", strerror(errno));
        } else if (d.lost || s.lost) {
            r = GP_LOST_CONNECTION_ERROR;
        } else if (d.code != 0 || s.code != 0) {
            r = d.code != 0 ? d.code : s.code;
            snprintf(why, cap, "%s", words_of(&d, &s));
        } else {
            r = CUDA_SUCCESS;
        }
    }
    GP_FRAME_FREE(rbuf);
    GP_FRAME_FREE(sbuf);
    return r;
}

/* A part's worker speaks protocol 1.9 (peer links) or later. */
static int part_links(int p)
{
    const gp_device_snapshot *d = gp_device(gp_conn_part_first_device(p));
    return d && d->proto_minor >= 9;
}

/* The one line of a pair that gives up on server-to-server copies. */
static void say_given_up(int ps, int pd, const char *why, int server_mode, CUresult code)
{
    const char *name = gp_cuda_error_name(code);
    if (server_mode)
        gp_log_error("copies from server %s to server %s cannot go server to server: %s. This "
                     "copy fails (%s, %d) as spread_copy = server (GPUPOOL_SPREAD_COPY) asks; set "
                     "it to auto to copy through this client instead",
                     gp_conn_part_server(ps), gp_conn_part_server(pd), why, name ? name : "error",
                     (int)code);
    else
        gp_log_info("copies from server %s to server %s go through this client: %s",
                    gp_conn_part_server(ps), gp_conn_part_server(pd), why);
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
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&peer_lock);
    peer_pair *L = &pairs[ps][pd];
    if (L->state == LINK_GIVEN_UP) {
        pthread_mutex_unlock(&peer_lock);
        if (!server_mode)
            return CUDA_SUCCESS;
        *through_client = 0;
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    if (L->state == LINK_NONE) {
        L->tries++;
        r = link_up(L, ps, pd, why, sizeof why);
        if (r == GP_LOST_CONNECTION_ERROR) {
            pthread_mutex_unlock(&peer_lock);
            *through_client = 0;
            return r;
        }
        if (r != CUDA_SUCCESS) {
            L->state = LINK_GIVEN_UP;
            say_given_up(ps, pd, why, server_mode, CUDA_ERROR_NOT_SUPPORTED);
            pthread_mutex_unlock(&peer_lock);
            *through_client = !server_mode;
            return server_mode ? CUDA_ERROR_NOT_SUPPORTED : CUDA_SUCCESS;
        }
    }
    r = copy_over(L, dst, pd, dctx, src, ps, sctx, n, why, sizeof why);
    if (r == CUDA_SUCCESS || r == GP_LOST_CONNECTION_ERROR) {
        pthread_mutex_unlock(&peer_lock);
        *through_client = 0;
        return r;
    }
    /* The link is dead on both ends (the workers close it on any failure). */
    unlink_both(L->id, ps, pd);
    L->state = L->tries < LINK_TRIES ? LINK_NONE : LINK_GIVEN_UP;
    if (L->state == LINK_GIVEN_UP) {
        say_given_up(ps, pd, why, server_mode, r);
    } else {
        gp_log_debug("a copy from server %s to server %s failed: %s; the next copy makes a new "
                     "link",
                     gp_conn_part_server(ps), gp_conn_part_server(pd), why);
    }
    int given_up = L->state == LINK_GIVEN_UP;
    pthread_mutex_unlock(&peer_lock);
    if (server_mode) {
        if (!given_up)
            gp_log_error("a copy from server %s to server %s failed: %s", gp_conn_part_server(ps),
                         gp_conn_part_server(pd), why);
        *through_client = 0;
        return r;
    }
    return CUDA_SUCCESS; /* auto: this copy through this process; the source is untouched */
}
