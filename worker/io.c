/*
 * io.c: the client socket.
 *
 * Input goes through one buffer (1 MiB, grown only for a frame that does not fit) so that a
 * client's batch of small frames costs one read() for many frames. Replies accumulate in an
 * output buffer that is written out when the input runs dry (just before we would block waiting
 * for the client, who may be waiting for those replies) or when it grows large. Bulk data is
 * copied straight between the socket and its destination.
 */
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "worker.h"

#define BULK_LOWAT (1 << 20) /* bytes a big upload's reads wait for (SO_RCVLOWAT) */
/* ...but never longer than this: the kernel may hold fewer back (a window smaller than the mark
 * early in a connection), and a wait for bytes that cannot come would hang the copy. */
#define LOWAT_WAIT_MS 5

int wk_io_init(struct worker *w, int fd, int sigfd)
{
    w->fd = fd;
    w->sigfd = sigfd;
    w->in = malloc(WK_INBUF_SIZE);
    w->out = malloc(WK_FLUSH_AT);
    if (!w->in || !w->out)
        return -1;
    w->in_cap = WK_INBUF_SIZE;
    w->out_cap = WK_FLUSH_AT;
    return 0;
}

void wk_io_free(struct worker *w)
{
    free(w->in);
    free(w->out);
    w->in = w->out = NULL;
}

static void lost(struct worker *w, const char *what, int err)
{
    if (!w->dead)
        wk_warn("client connection lost (%s: %s)", what, strerror(err));
    wk_end_session(w, WK_END_CLIENT_LOST, "client connection lost (%s: %s)", what, strerror(err));
    w->dead = 1;
}

/* SIGTERM/SIGINT arrived (the daemon stops us, or it died: PR_SET_PDEATHSIG): tell the client,
 * stop serving. */
static void on_signal(struct worker *w)
{
    struct signalfd_siginfo si;
    ssize_t n = read(w->sigfd, &si, sizeof si);
    int sig = n == (ssize_t)sizeof si ? (int)si.ssi_signo : 0;
    wk_detach_end_parked(w);
    wk_log("%s: ending the session", sig ? strsignal(sig) : "signal");
    wk_end_session(w, WK_END_SHUTDOWN, "%s: the server is shutting down",
                   sig ? strsignal(sig) : "signal");
    if (!w->in_write) { /* else the client is not reading anyway */
        wk_send_notice(w, CUDA_ERROR_DEVICE_UNAVAILABLE, 0,
                       "the gpupool server is shutting down; this session has ended");
        (void)wk_io_flush(w); /* best effort: the client may be gone */
    }
    w->dead = 1;
}

static int io_wait_loop(struct worker *w, short events);

/* Blocks until the client socket is ready for `events`, watching the signalfd and the control
 * socket too (whichever exist), and sending stats when they are due. 0 when the client socket is
 * ready (or hung up / in error: the next read or write tells which); -1 when the session must
 * stop (a termination signal, END, the daemon gone, poll failed). */
static int io_wait(struct worker *w, short events)
{
    /* Waiting for the client's next frame with nothing half done: the one moment a detach may be
     * agreed (detach.c). */
    w->ctl.waiting = (events & POLLIN) && !w->in_write && !w->in_call && w->out_len == 0 &&
                     w->in_end == w->in_pos && w->ctl.in_session;
    if (w->ctl.waiting)
        w->ctl.idle_since_ns = wk_now_ns();
    int rc = io_wait_loop(w, events);
    w->ctl.waiting = 0;
    return rc;
}

static int io_wait_loop(struct worker *w, short events)
{
    for (;;) {
        /* The set is rebuilt each round: the control socket comes and goes (adopt.c). Parked
         * (detach.c), the client socket is only watched for its next frame, never read, and not
         * at all once that frame has asked for a GPU. */
        struct pollfd p[4] = {{.fd = w->fd, .events = events}};
        if (w->ctl.parked) {
            p[0].events = POLLIN;
            if (w->ctl.want_sent)
                p[0].fd = -1;
        }
        nfds_t n = 1;
        int si = -1, ci = -1, li = -1;
        if (w->sigfd >= 0) {
            si = (int)n;
            p[n++] = (struct pollfd){.fd = w->sigfd, .events = POLLIN};
        }
        if (w->ctl.fd >= 0) {
            ci = (int)n;
            p[n++] = (struct pollfd){.fd = w->ctl.fd, .events = POLLIN};
        }
        if (w->ctl.listen_fd >= 0) {
            li = (int)n;
            p[n++] = (struct pollfd){.fd = w->ctl.listen_fd, .events = POLLIN};
        }
        if (wk_adopt_check_grace(w) != 0)
            return -1;
        int timeout = w->ctl.fd >= 0 ? wk_ctl_stats_tick(w) : -1;
        int grace = wk_adopt_wait_ms(w);
        if (grace >= 0 && (timeout < 0 || grace < timeout))
            timeout = grace;
        if (w->lowat && (timeout < 0 || timeout > LOWAT_WAIT_MS))
            timeout = LOWAT_WAIT_MS;
        int r = poll(p, n, timeout);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            lost(w, "poll", errno);
            return -1;
        }
        if (r == 0 && w->lowat)
            return 0; /* take what has come (the read does not wait) */
        if (r == 0)
            continue; /* stats are due, or the grace is over: the next round sees to it */
        if (si >= 0 && (p[si].revents & POLLIN)) {
            on_signal(w);
            return -1;
        }
        if (ci >= 0 && p[ci].revents && wk_ctl_handle(w) != 0)
            return -1;
        if (li >= 0 && (p[li].revents & POLLIN))
            (void)wk_adopt_accept(w);
        if (p[0].revents && w->ctl.parked) {
            if (wk_detach_client_ready(w) != 0)
                return -1;
            continue;
        }
        if (p[0].revents)
            return 0;
    }
}

int wk_io_check(struct worker *w)
{
    (void)wk_ctl_stats_tick(w);
    if (wk_adopt_check_grace(w) != 0)
        return -1;
    struct pollfd p[3] = {{.fd = w->ctl.fd, .events = POLLIN},
                          {.fd = w->sigfd, .events = POLLIN},
                          {.fd = w->ctl.listen_fd, .events = POLLIN}}; /* fd -1: skipped */
    int r;
    do {
        r = poll(p, 3, 0);
    } while (r < 0 && errno == EINTR);
    if (r <= 0)
        return 0; /* nothing (or poll failed: the next wait will tell) */
    if (p[1].revents & POLLIN) {
        on_signal(w);
        return -1;
    }
    if (p[2].revents & POLLIN)
        (void)wk_adopt_accept(w);
    return p[0].revents ? wk_ctl_handle(w) : 0;
}

/* The fd may arrive non-blocking (the daemon's asyncio sockets are); we clear that at start, but
 * if it comes back anyway, wait for readiness instead of spinning. */
static int wait_fd(struct worker *w, short events)
{
    if (w->sigfd >= 0 || w->ctl.fd >= 0 || w->ctl.listen_fd >= 0)
        return io_wait(w, events);
    struct pollfd p = {.fd = w->fd, .events = events};
    for (;;) {
        int r = poll(&p, 1, w->lowat ? LOWAT_WAIT_MS : -1);
        if (r >= 0)
            return 0;
        if (errno != EINTR) {
            lost(w, "poll", errno);
            return -1;
        }
    }
}

int wk_io_wait_client(struct worker *w, short events)
{
    return wait_fd(w, events);
}

/* TLS (w->ssl): write_all and read_some through the session (tls.c). */
static int tls_write_all(struct worker *w, const uint8_t *p, size_t n)
{
    char err[200];
    while (n > 0 && !w->dead) {
        short ev;
        ssize_t r = wk_tls_io(w, (void *)p, n, 1, &ev, err, sizeof err);
        if (r > 0) {
            p += r;
            n -= (size_t)r;
        } else if (ev) {
            w->in_write = 1; /* as below: the output buffer is being written */
            int wr = wait_fd(w, ev);
            w->in_write = 0;
            if (wr != 0)
                return -1;
        } else {
            if (!w->dead)
                wk_warn("TLS write: %s", err);
            lost(w, "TLS write", EPIPE);
            return -1;
        }
    }
    /* The records gathered in the write buffer (tls.c) go out now: nothing waits there. */
    while (!w->dead) {
        short ev;
        if (wk_tls_flush(w, &ev, err, sizeof err) == 0)
            return 0;
        if (!ev) {
            wk_warn("TLS write: %s", err);
            lost(w, "TLS write", EPIPE);
            return -1;
        }
        w->in_write = 1;
        int wr = wait_fd(w, ev);
        w->in_write = 0;
        if (wr != 0)
            return -1;
    }
    return -1;
}

static ssize_t tls_read_some(struct worker *w, void *dst, size_t n)
{
    char err[200];
    for (;;) {
        if (w->dead)
            return -1;
        short ev;
        ssize_t r = wk_tls_io(w, dst, n, 0, &ev, err, sizeof err);
        if (r >= 0)
            return r;
        if (!ev) {
            if (!w->dead)
                wk_warn("TLS read: %s", err);
            lost(w, "TLS read", EPROTO);
            return -1;
        }
        /* Replies go out before we block, never after (as read_some does). */
        if (w->out_len > 0) {
            if (wk_io_flush(w) != 0)
                return -1;
            continue;
        }
        if (wait_fd(w, ev) != 0)
            return -1;
    }
}

static int write_all(struct worker *w, const uint8_t *p, size_t n)
{
    if (w->ssl)
        return tls_write_all(w, p, n);
    while (n > 0 && !w->dead) {
        /* MSG_NOSIGNAL: a vanished client is an error return, not a SIGPIPE. In control mode a
         * write that would block waits in io_wait instead, so that END, the daemon's departure
         * and stats are still seen while a client does not read its replies. */
        int watch = w->ctl.fd >= 0 || w->ctl.listen_fd >= 0;
        ssize_t r = send(w->fd, p, n, MSG_NOSIGNAL | (watch ? MSG_DONTWAIT : 0));
        if (r < 0 && errno == ENOTSOCK)
            r = write(w->fd, p, n);
        if (r > 0) {
            p += r;
            n -= (size_t)r;
        } else if (r < 0 && errno == EINTR) {
            continue;
        } else if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            /* p may point into the output buffer: what runs during the wait must not touch it
             * (in_write tells END and signal handling to skip the client's notice). */
            w->in_write = 1;
            int wr = wait_fd(w, POLLOUT);
            w->in_write = 0;
            if (wr != 0)
                return -1;
        } else {
            lost(w, "write", r < 0 ? errno : EPIPE);
            return -1;
        }
    }
    return w->dead ? -1 : 0;
}

int wk_io_flush(struct worker *w)
{
    if (w->out_len == 0)
        return w->dead ? -1 : 0;
    int r = write_all(w, w->out, w->out_len);
    w->out_len = 0;
    return r;
}

int wk_io_write_direct(struct worker *w, const void *p, size_t n)
{
    if (wk_io_flush(w) != 0)
        return -1;
    return write_all(w, p, n);
}

uint8_t *wk_io_reserve(struct worker *w, size_t n)
{
    if (w->out_cap - w->out_len < n) {
        size_t cap = w->out_cap;
        while (cap - w->out_len < n)
            cap *= 2;
        uint8_t *o = realloc(w->out, cap);
        if (!o) {
            wk_error("out of memory for a %zu-byte reply; closing the session", n);
            wk_end_session(w, WK_END_WORKER_ERROR,
                           "the server ran out of memory for a %zu-byte reply", n);
            return NULL;
        }
        w->out = o;
        w->out_cap = cap;
    }
    uint8_t *p = w->out + w->out_len;
    w->out_len += n;
    return p;
}

void wk_io_unreserve(struct worker *w, size_t n)
{
    w->out_len = n > w->out_len ? 0 : w->out_len - n;
}

/* Up to n bytes into dst: > 0 bytes read, 0 end of stream, -1 error. Pending replies are written
 * out before we block, never after: the client may be waiting for them before it sends more. */
static ssize_t read_some(struct worker *w, void *dst, size_t n)
{
    if (n > SSIZE_MAX)
        n = SSIZE_MAX;
    if (w->ssl)
        return tls_read_some(w, dst, n);
    for (;;) {
        if (w->dead)
            return -1;
        ssize_t r;
        if (w->out_len > 0) {
            r = recv(w->fd, dst, n, MSG_DONTWAIT);
            if (r >= 0)
                return r;
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK && errno != ENOTSOCK) {
                lost(w, "read", errno);
                return -1;
            }
            if (wk_io_flush(w) != 0)
                return -1;
        }
        /* Between reads we watch the signalfd, the control socket and the adoption socket too
         * (when there are). */
        if ((w->sigfd >= 0 || w->ctl.fd >= 0 || w->ctl.listen_fd >= 0) && io_wait(w, POLLIN) != 0)
            return -1;
        /* Under a low-water mark, a read must not wait for it (see LOWAT_WAIT_MS). */
        r = w->lowat ? recv(w->fd, dst, n, MSG_DONTWAIT) : read(w->fd, dst, n);
        if (r >= 0)
            return r;
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            if (wait_fd(w, POLLIN) != 0)
                return -1;
            continue;
        }
        lost(w, "read", errno);
        return -1;
    }
}

/* Makes at least `need` bytes available at in_pos. 1 ok, 0 clean end of stream (nothing
 * buffered), -1 error or end of stream in the middle of a frame. */
static int fill(struct worker *w, size_t need)
{
    while (w->in_end - w->in_pos < need) {
        if (w->in_cap - w->in_pos < need) {
            size_t have = w->in_end - w->in_pos;
            if (need > w->in_cap) {
                uint8_t *n = realloc(w->in, need);
                if (!n) {
                    wk_error("out of memory for a %zu-byte frame; closing the session", need);
                    wk_end_session(w, WK_END_WORKER_ERROR,
                                   "the server ran out of memory for a %zu-byte frame", need);
                    return -1;
                }
                w->in = n;
                w->in_cap = need;
            }
            memmove(w->in, w->in + w->in_pos, have);
            w->in_pos = 0;
            w->in_end = have;
        }
        ssize_t r = read_some(w, w->in + w->in_end, w->in_cap - w->in_end);
        if (r < 0)
            return -1;
        if (r == 0) {
            if (w->in_end == w->in_pos)
                return 0;
            wk_warn("client closed the connection in the middle of a frame");
            wk_end_session(w, WK_END_CLIENT_LOST,
                           "the client closed the connection in the middle of a frame");
            return -1;
        }
        w->in_end += (size_t)r;
    }
    return 1;
}

int wk_io_next_frame(struct worker *w, gp_frame_header *h, const uint8_t **body)
{
    /* Between frames, give back the memory of an oversized frame. */
    if (w->in_cap > WK_INBUF_SIZE && w->in_end - w->in_pos <= WK_INBUF_SIZE) {
        size_t have = w->in_end - w->in_pos;
        memmove(w->in, w->in + w->in_pos, have);
        w->in_pos = 0;
        w->in_end = have;
        uint8_t *n = realloc(w->in, WK_INBUF_SIZE);
        if (n) {
            w->in = n;
            w->in_cap = WK_INBUF_SIZE;
        }
    }
    int r = fill(w, GP_PROTO_HEADER_SIZE);
    if (r <= 0)
        return r;
    gp_header_decode(w->in + w->in_pos, h);
    if (h->len > GP_PROTO_MAX_BODY) {
        wk_protocol_error(w, h->op, "frame body of %u bytes exceeds the limit of %u", h->len,
                          GP_PROTO_MAX_BODY);
        return -1;
    }
    if (!gp_op_known(h->op)) {
        wk_protocol_error(w, h->op, "unknown message op %u", h->op);
        return -1;
    }
    r = fill(w, GP_PROTO_HEADER_SIZE + (size_t)h->len);
    if (r <= 0) {
        if (r == 0) { /* end of stream right after a header */
            wk_warn("client closed the connection in the middle of a frame");
            wk_end_session(w, WK_END_CLIENT_LOST,
                           "the client closed the connection in the middle of a frame");
        }
        return -1;
    }
    *body = w->in + w->in_pos + GP_PROTO_HEADER_SIZE;
    w->in_pos += GP_PROTO_HEADER_SIZE + (size_t)h->len;
    return 1;
}

size_t wk_io_buffered(const struct worker *w)
{
    return w->in_end - w->in_pos;
}

const uint8_t *wk_io_buffered_ptr(const struct worker *w)
{
    return w->in + w->in_pos;
}

void wk_io_consume(struct worker *w, size_t n)
{
    if (n > w->in_end - w->in_pos)
        n = w->in_end - w->in_pos;
    w->in_pos += n;
}

static void clear_lowat(struct worker *w)
{
    int one = 1;
    if (w->lowat && setsockopt(w->fd, SOL_SOCKET, SO_RCVLOWAT, &one, sizeof one) != 0)
        wk_warn("SO_RCVLOWAT: %s", strerror(errno));
    w->lowat = 0;
}

int wk_io_read_bulk(struct worker *w, void *dst, uint64_t n)
{
    uint8_t *d = dst;
    size_t have = wk_io_buffered(w);
    if (have > n)
        have = (size_t)n;
    if (have > 0) {
        if (d) {
            memcpy(d, w->in + w->in_pos, have);
            d += have;
        }
        w->in_pos += have;
        n -= have;
    }
    /* Bulk beyond the buffer goes straight to its destination. Discarded bytes (a failed call
     * must still consume its data to keep the stream in sync) go to a scratch area. */
    uint8_t scratch[64 << 10];
    /* A big upload: wake up for a good piece of it at a time, not for every segment (each
     * wake-up costs a poll, a read and a context switch; SO_RCVLOWAT makes poll wait for that
     * much). Back to 1 byte after, for the frames. */
    if (d && n >= BULK_LOWAT * 4 && !w->ssl) {
        int v = BULK_LOWAT;
        w->lowat = setsockopt(w->fd, SOL_SOCKET, SO_RCVLOWAT, &v, sizeof v) == 0;
    }
    while (n > 0) {
        size_t want = n > SIZE_MAX ? SIZE_MAX : (size_t)n;
        if (!d && want > sizeof scratch)
            want = sizeof scratch;
        ssize_t r = read_some(w, d ? (void *)d : (void *)scratch, want);
        if (r <= 0) {
            clear_lowat(w);
            if (r == 0) {
                wk_warn("client closed the connection in the middle of bulk data");
                wk_end_session(w, WK_END_CLIENT_LOST,
                               "the client closed the connection in the middle of bulk data");
            }
            return -1;
        }
        if (d)
            d += r;
        n -= (uint64_t)r;
        if (w->lowat && n < BULK_LOWAT) /* the tail: whatever comes */
            clear_lowat(w);
    }
    clear_lowat(w);
    return 0;
}
