/*
 * control.c: the control channel between gpupoold and a pre-started worker (control mode,
 * worker/README.md "Control channel").
 *
 * One SOCK_SEQPACKET socket: message boundaries come for free, a descriptor (the client socket)
 * travels with SESSION, and the daemon's exit shows up as end of stream. Daemon -> worker
 * messages are small binary records (SESSION, END); worker -> daemon messages are one JSON
 * object each, which the Python side reads without a schema compiler.
 *
 * Stats are reported from the paths where the worker waits anyway (io_wait) and every 1024
 * frames, so the hot path pays nothing but the counter increments themselves.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "worker.h"

#define STATS_INTERVAL_NS 1000000000ull /* at most one stats event per second */
#define END_MAGIC "GPWE"
#define END_HEADER 8 /* "GPWE", i32 code */

uint64_t wk_now_ns(void)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0)
        return 0; /* cannot fail for CLOCK_MONOTONIC; 0 only delays a stats event */
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void wk_jb_printf(struct jbuf *j, const char *fmt, ...)
{
    if (j->overflow)
        return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(j->b + j->n, sizeof j->b - j->n, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof j->b - j->n) {
        j->overflow = 1;
        return;
    }
    j->n += (size_t)n;
}

void wk_jb_str(struct jbuf *j, const char *s)
{
    wk_jb_printf(j, "\"");
    for (const unsigned char *p = (const unsigned char *)s; *p && !j->overflow; p++) {
        unsigned char c = *p;
        if (c == '"' || c == '\\')
            wk_jb_printf(j, "\\%c", c);
        else if (c == '\n')
            wk_jb_printf(j, "\\n");
        else if (c < 0x20 || c == 0x7f)
            wk_jb_printf(j, "\\u%04x", c);
        else
            wk_jb_printf(j, "%c", c); /* UTF-8 passes through; the daemon decodes with replace */
    }
    wk_jb_printf(j, "\"");
}

int wk_ctl_send(struct worker *w, const struct jbuf *j, int best_effort)
{
    if (w->ctl.fd < 0 || w->ctl.gone)
        return -1;
    if (j->overflow) {
        wk_log("a control event did not fit in %d bytes; not sent", WK_CTL_MAX);
        return -1;
    }
    for (;;) {
        ssize_t r = send(w->ctl.fd, j->b, j->n, MSG_NOSIGNAL | (best_effort ? MSG_DONTWAIT : 0));
        if (r == (ssize_t)j->n)
            return 0;
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return -1; /* the daemon is not reading: a stats event can wait for the next */
        /* EPIPE/ECONNRESET: the daemon is gone; the poll on the socket will say so too. */
        if (r < 0 && errno != EPIPE && errno != ECONNRESET)
            wk_log("sending a control event: %s", strerror(errno));
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
                    wk_log("close: %s", strerror(errno));
            }
        }
    }
    if (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC))
        *truncated = 1;
    return n;
}

void wk_ctl_counters_json(struct worker *w, struct jbuf *j)
{
    const uint64_t *c = w->stats.calls;
    double dur = w->ctl.started_ns ? (double)(wk_now_ns() - w->ctl.started_ns) / 1e9 : 0.0;
    wk_jb_printf(j,
                 "\"calls\":{\"launch\":%llu,\"copy\":%llu,\"alloc\":%llu,\"sync\":%llu,"
                 "\"other\":%llu},\"bytes_h2d\":%llu,\"bytes_d2h\":%llu,\"module_bytes\":%llu,"
                 "\"duration_s\":%.3f,\"mem_used\":%llu,\"busy_ns\":%llu",
                 (unsigned long long)c[WK_CALL_LAUNCH], (unsigned long long)c[WK_CALL_COPY],
                 (unsigned long long)c[WK_CALL_ALLOC], (unsigned long long)c[WK_CALL_SYNC],
                 (unsigned long long)c[WK_CALL_OTHER], (unsigned long long)w->stats.h2d_bytes,
                 (unsigned long long)w->stats.d2h_bytes,
                 (unsigned long long)w->stats.module_bytes_received, dur,
                 (unsigned long long)w->stats.mem_used, (unsigned long long)w->stats.busy_ns);
    /* At most 431 bytes (20-digit numbers): the longest end event (511 detail bytes escaped to 6
     * each, every number at 20 digits) stays under 3,950 of WK_CTL_MAX's 4,096 bytes. */
    wk_jb_printf(j, ",\"latency\":{\"counts\":[");
    for (int i = 0; i < WK_LAT_BUCKETS; i++)
        wk_jb_printf(j, i ? ",%llu" : "%llu", (unsigned long long)w->stats.lat_counts[i]);
    wk_jb_printf(j, "],\"sum_ns\":%llu}", (unsigned long long)w->stats.lat_sum_ns);
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
    struct jbuf j = {.n = 0};
    wk_jb_printf(&j, "{\"event\":\"stats\",\"session\":%llu,",
                 (unsigned long long)w->ctl.session_id);
    wk_ctl_counters_json(w, &j);
    wk_jb_printf(&j, "}");
    /* Best effort: a daemon that does not read gets the next one a second later. */
    (void)wk_ctl_send(w, &j, 1);
    w->ctl.sent = w->stats;
    w->ctl.stats_ns = now;
    return -1;
}

/* The daemon is gone (end of stream or an error on the control socket). A session that can be
 * adopted goes on (adopt.c); otherwise nobody will account for it any more, so it ends now and
 * the client is told why, best effort. 0: carry on (orphaned); -1: the session ends. */
static int daemon_gone(struct worker *w)
{
    if (wk_adopt_orphan(w) == 0)
        return 0;
    wk_log("the control socket was closed: gpupoold is gone; ending");
    w->ctl.gone = 1;
    wk_end_session(w, WK_END_SHUTDOWN, "gpupoold closed the control socket");
    wk_close_client(w, CUDA_ERROR_DEVICE_UNAVAILABLE,
                    "the gpupool server stopped; this session has ended");
    return -1;
}

int wk_ctl_handle(struct worker *w)
{
    uint8_t buf[WK_CTL_MAX + 1];
    int fd, truncated;
    ssize_t n = wk_ctl_recv(w, buf, WK_CTL_MAX, &fd, &truncated);
    if (fd >= 0) {
        wk_log("closing a descriptor sent on the control socket during a session");
        if (close(fd) != 0)
            wk_log("close: %s", strerror(errno));
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
        return 0; /* spurious wake-up */
    if (n <= 0) {
        if (n < 0)
            wk_log("reading the control socket: %s", strerror(errno));
        return daemon_gone(w);
    }
    if ((size_t)n < END_HEADER || memcmp(buf, END_MAGIC, 4) != 0) {
        wk_log("ignoring an unexpected control message of %zd bytes during a session", n);
        return 0;
    }
    int32_t code = (int32_t)gp_rd_u32(buf + 4);
    buf[n] = '\0'; /* the text runs to the end of the message (cut at WK_CTL_MAX) */
    const char *text = (const char *)buf + END_HEADER;
    if (!*text)
        text = "the gpupool server ended this session";
    wk_log("the server ended the session (%d): %s", code, text);
    wk_end_session(w, WK_END_SERVER_ENDED, "%s", text);
    wk_close_client(w, code, text);
    return -1;
}

void wk_ctl_send_end(struct worker *w)
{
    struct jbuf j = {.n = 0};
    wk_jb_printf(&j, "{\"event\":\"end\",\"session\":");
    if (w->ctl.in_session)
        wk_jb_printf(&j, "%llu", (unsigned long long)w->ctl.session_id);
    else
        wk_jb_printf(&j, "null");
    wk_jb_printf(&j, ",\"reason\":\"%s\",\"detail\":", wk_end_reason_name(w->end_reason));
    wk_jb_str(&j, w->end_reason == WK_END_NONE ? "the connection ended" : w->end_detail);
    wk_jb_printf(&j, ",");
    wk_ctl_counters_json(w, &j);
    wk_jb_printf(&j, "}");
    /* An adoptable session writes its end down first: if the daemon goes before it records
     * this event (or there is none: orphaned), the next one reads the file. */
    int adoptable = w->ctl.in_session && w->ctl.listen_fd >= 0;
    if (adoptable)
        wk_adopt_write_end(w, &j, w->ctl.fd < 0);
    (void)wk_ctl_send(w, &j, 0);
}
