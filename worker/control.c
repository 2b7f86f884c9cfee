/*
 * control.c: the control channel between gpupoold and a pre-started worker (control mode,
 * worker/README.md "Control channel").
 *
 * One SOCK_SEQPACKET socket: message boundaries come for free, a descriptor (the client socket)
 * travels with worker_session, and the daemon's exit shows up as end of stream. Every message
 * either way is a frame of protocol/gpupool.toml ("control"), encoded and decoded by the
 * generated code, as gpupoold's side is (gpupoold/workers/supervisor.py).
 *
 * Stats are reported from the paths where the worker waits anyway (a timer of the reactor,
 * registered by control_session.c) and every 1024 frames, so the hot path pays nothing but the
 * counter increments themselves. This file is the channel: sending, receiving, the counters;
 * what the daemon's messages do during a session is control_session.c's.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "worker.h"

#define STATS_INTERVAL_NS 1000000000ull /* at most one stats event per second */

int wk_ctl_send(struct worker *w, size_t n, int best_effort)
{
    if (w->ctl.fd < 0 || w->ctl.gone)
        return -1;
    if (n == 0) {
        wk_warn("a control message did not fit in %d bytes; not sent", WK_CTL_MAX);
        return -1;
    }
    for (;;) {
        ssize_t r = send(w->ctl.fd, w->ctl.out, n, MSG_NOSIGNAL | (best_effort ? MSG_DONTWAIT : 0));
        if (r == (ssize_t)n)
            return 0;
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return -1; /* the daemon is not reading: a stats event can wait for the next */
        /* EPIPE/ECONNRESET: the daemon is gone; the poll on the socket will say so too. */
        if (r < 0 && errno != EPIPE && errno != ECONNRESET)
            wk_warn("sending a control event: %s", strerror(errno));
        return -1;
    }
}

ssize_t wk_ctl_recv(struct worker *w, void *buf, size_t cap, int *fd, int *truncated)
{
    /* Room for a few descriptors: a confused sender's extras are received and closed rather
     * than leaked into this process. */
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(4 * sizeof(int))];
    } cm;
    struct iovec iov = {.iov_base = buf, .iov_len = cap};
    struct msghdr msg = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cm.buf, .msg_controllen = sizeof cm.buf};
    *fd = -1;
    *truncated = 0;
    ssize_t n;
    do {
        n = recvmsg(w->ctl.fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    } while (n < 0 && errno == EINTR);
    if (n < 0)
        return -1;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < count; i++) {
            int got;
            memcpy(&got, CMSG_DATA(c) + i * sizeof(int), sizeof got);
            if (*fd < 0) {
                *fd = got;
            } else {
                wk_log("closing an extra descriptor sent on the control socket");
                if (close(got) != 0)
                    wk_warn("close: %s", strerror(errno));
            }
        }
    }
    if (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC))
        *truncated = 1;
    return n;
}

void wk_ctl_counters(struct worker *w, gp_worker_counters *c, uint8_t lat[8 * WK_LAT_BUCKETS])
{
    const uint64_t *calls = w->stats.calls;
    memset(c, 0, sizeof *c);
    c->calls_launch = calls[WK_CALL_LAUNCH];
    c->calls_copy = calls[WK_CALL_COPY];
    c->calls_alloc = calls[WK_CALL_ALLOC];
    c->calls_sync = calls[WK_CALL_SYNC];
    c->calls_other = calls[WK_CALL_OTHER];
    c->bytes_h2d = w->stats.h2d_bytes;
    c->bytes_d2h = w->stats.d2h_bytes;
    c->module_bytes = w->stats.module_bytes_received;
    c->duration_s = w->ctl.started_ns ? (double)(wk_now_ns() - w->ctl.started_ns) / 1e9 : 0.0;
    c->mem_used = w->stats.mem_used;
    c->busy_ns = w->stats.busy_ns;
    for (int i = 0; i < WK_LAT_BUCKETS; i++)
        gp_wr_u64(lat + 8 * i, w->stats.lat_counts[i]);
    c->latency_counts = lat;
    c->latency_counts_count = WK_LAT_BUCKETS;
    c->latency_sum_ns = w->stats.lat_sum_ns;
}

const uint8_t *wk_ctl_decode(const uint8_t *msg, size_t n, unsigned op)
{
    if (n < GP_PROTO_HEADER_SIZE)
        return NULL;
    gp_frame_header h;
    gp_header_decode(msg, &h);
    if (h.op != op || (h.flags & GP_FLAG_REPLY) || h.len != n - GP_PROTO_HEADER_SIZE)
        return NULL;
    return msg + GP_PROTO_HEADER_SIZE;
}

void wk_uuid_text(const struct worker *w, char out[64])
{
    const uint8_t *u = w->snap.uuid;
    snprintf(out, 64, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13],
             u[14], u[15]);
}

/* Whether the counters a stats event reports differ from the last one sent (a change of mem_used,
 * busy_ns or the latency counts makes one due too: the daemon's live values come from them). */
static int counters_changed(const struct wk_counters *a, const struct wk_counters *b)
{
    return memcmp(a->calls, b->calls, sizeof a->calls) != 0 ||
           memcmp(a->lat_counts, b->lat_counts, sizeof a->lat_counts) != 0 ||
           a->h2d_bytes != b->h2d_bytes || a->d2h_bytes != b->d2h_bytes ||
           a->module_bytes_received != b->module_bytes_received || a->mem_used != b->mem_used ||
           a->busy_ns != b->busy_ns;
}

int wk_ctl_stats_tick(struct worker *w)
{
    if (!w->ctl.in_session || w->ctl.gone || !counters_changed(&w->stats, &w->ctl.sent))
        return -1;
    uint64_t now = wk_now_ns();
    uint64_t due = w->ctl.stats_ns + STATS_INTERVAL_NS;
    if (now < due)
        return (int)((due - now + 999999) / 1000000);
    gp_worker_stats m = {.session_id = w->ctl.session_id};
    uint8_t lat[8 * WK_LAT_BUCKETS];
    wk_ctl_counters(w, &m.counters, lat);
    /* Best effort: a daemon that does not read gets the next one a second later. */
    (void)wk_ctl_send(w, WK_CTL_ENCODE(w, worker_stats, &m), 1);
    w->ctl.sent = w->stats;
    w->ctl.stats_ns = now;
    return -1;
}
