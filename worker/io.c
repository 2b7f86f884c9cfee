/*
 * io.c: the client socket.
 *
 * Input goes through one buffer (1 MiB, grown only for a frame that does not fit) so that a
 * client's batch of small frames costs one read() for many frames. Replies accumulate in an
 * output buffer that is written out when the input runs dry (just before we would block waiting
 * for the client, who may be waiting for those replies) or when it grows large. Bulk data is
 * copied straight between the socket and its destination. The notices that tell the client why
 * a call failed or its session ended are written here too. Every wait goes to reactor.c, which
 * watches the daemon and the signals meanwhile.
 */
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "worker.h"

/* Bytes a big upload's reads wait for (SO_RCVLOWAT); a wait under it is bounded (reactor.c). */
#define BULK_LOWAT (1 << 20)

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
            int wr = wk_wait_client(w, ev);
            w->in_write = 0;
            if (wr != 0)
                return -1;
        } else {
            if (!w->dead)
                wk_warn("TLS write: %s", err);
            wk_client_lost(w, "TLS write", EPIPE);
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
            wk_client_lost(w, "TLS write", EPIPE);
            return -1;
        }
        w->in_write = 1;
        int wr = wk_wait_client(w, ev);
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
            wk_client_lost(w, "TLS read", EPROTO);
            return -1;
        }
        /* Replies go out before we block, never after (as read_some does). */
        if (w->out_len > 0) {
            if (wk_io_flush(w) != 0)
                return -1;
            continue;
        }
        if (wk_wait_client(w, ev) != 0)
            return -1;
    }
}

static int write_all(struct worker *w, const uint8_t *p, size_t n)
{
    if (w->ssl)
        return tls_write_all(w, p, n);
    while (n > 0 && !w->dead) {
        /* MSG_NOSIGNAL: a vanished client is an error return, not a SIGPIPE. In control mode a
         * write that would block waits in reactor.c instead, so that END, the daemon's departure
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
            int wr = wk_wait_client(w, POLLOUT);
            w->in_write = 0;
            if (wr != 0)
                return -1;
        } else {
            wk_client_lost(w, "write", r < 0 ? errno : EPIPE);
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
                wk_client_lost(w, "read", errno);
                return -1;
            }
            if (wk_io_flush(w) != 0)
                return -1;
        }
        /* Between reads we watch the signalfd, the control socket and the adoption socket too
         * (when there are). */
        if (wk_reactor_watching(&w->reactor) && wk_wait_client(w, POLLIN) != 0)
            return -1;
        /* Under a low-water mark, a read must not wait for it (see LOWAT_WAIT_MS). */
        r = w->lowat ? recv(w->fd, dst, n, MSG_DONTWAIT) : read(w->fd, dst, n);
        if (r >= 0)
            return r;
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            if (wk_wait_client(w, POLLIN) != 0)
                return -1;
            continue;
        }
        wk_client_lost(w, "read", errno);
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

/* ---- notices ---------------------------------------------------------------------------- */

void wk_send_notice(struct worker *w, int32_t code, uint16_t op, const char *text)
{
    gp_notice n = {0};
    n.code = code;
    n.op = op;
    n.text = text;
    size_t len = strlen(text);
    n.text_len = (uint32_t)(len > 4095 ? 4095 : len);
    size_t size = 16 + gp_notice_size(&n);
    uint8_t *p = wk_io_reserve(w, size);
    if (p)
        gp_notice_frame(p, 0, &n);
}

void wk_close_client(struct worker *w, int32_t code, const char *text)
{
    if (!w->dead && w->fd >= 0) {
        if (!w->in_write) { /* in_write: the output buffer is being written, and not read */
            wk_send_notice(w, code, 0, text);
            (void)wk_io_flush(w); /* best effort: the client may be gone */
        }
        /* The client sees the end now, not after our teardown. */
        if (shutdown(w->fd, SHUT_RDWR) != 0 && errno != ENOTSOCK && errno != ENOTCONN)
            wk_log("shutdown of the client socket failed: %s", strerror(errno));
    }
    w->dead = 1;
}

void wk_protocol_error(struct worker *w, uint16_t op, const char *fmt, ...)
{
    char text[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    if (n < 0)
        text[0] = '\0';
    wk_log("protocol error, closing the connection: %s", text);
    wk_end_session(w, WK_END_PROTOCOL_ERROR, "%s", text);
    wk_send_notice(w, GP_EPROTO, op, text);
    /* Shut the socket at once: the client sees the end now, not after our teardown. */
    if (wk_io_flush(w) == 0 && shutdown(w->fd, SHUT_RDWR) != 0 && errno != ENOTSOCK)
        wk_log("shutdown of the client socket failed: %s", strerror(errno));
    w->closing = 1;
}
