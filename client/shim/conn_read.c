/*
 * conn_read.c: the stream from the worker, read exactly: frame headers and bodies through a
 * buffer, large bulk straight into the caller's memory, LZ4 blocks inflated into place. It
 * knows nothing of waiters or the reader role (conn.c); when a read has waited a keepalive
 * slice for nothing it asks its owner what to do (gp_reader.quiet). A reply's body is the
 * caller's to free, with gp_reply_free.
 */
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "compress.h"
#include "conn_state.h"
#include "shim.h"
#include "shim_core.h"

/* A big download wakes the reader for a good piece of it at a time, not for every segment: each
 * wake-up is a recv and a context switch (SO_RCVLOWAT makes poll wait for that much; 1 byte
 * again for the tail and the frames). Never longer than LOWAT_WAIT_MS, then the recv takes what
 * has come without waiting: the kernel may hold fewer back (a window smaller than the mark early
 * in a connection), and a wait for bytes that cannot come would hang the copy. The worker does
 * the same for uploads. */
#define BULK_LOWAT (1 << 20)
#define LOWAT_WAIT_MS 5

static void set_lowat(int sock, int bytes)
{
    if (setsockopt(sock, SOL_SOCKET, SO_RCVLOWAT, &bytes, sizeof bytes) != 0)
        gp_log_debug("SO_RCVLOWAT %d: %s", bytes, strerror(errno));
}

static int read_loop(gp_reader *rs, uint8_t *d, uint64_t n, int *lowat, const char **why)
{
    while (n > 0) {
        if (*lowat && n < BULK_LOWAT) {
            set_lowat(rs->sock, 1);
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
        int slice = gp_ka_on(rs->ka) ? GP_KA_SLICE_MS : -1;
        if (d && n >= GP_READ_BUF_SIZE / 4) {
            /* large bulk: straight into the destination, no intermediate copy */
            size_t want = n > (1u << 30) ? (1u << 30) : (size_t)n;
            if (*lowat) {
                struct pollfd p = {.fd = rs->sock, .events = POLLIN};
                if (poll(&p, 1, LOWAT_WAIT_MS) < 0 && errno != EINTR) {
                    *why = strerror(errno);
                    return -1;
                }
                got = recv(rs->sock, d, want, MSG_DONTWAIT);
                if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
                    if (slice >= 0 && rs->quiet(rs->owner, why) != 0)
                        return -1;
                    continue;
                }
            } else {
                got = rs->tls
                          ? gp_tls_read(rs->tls, d, want, slice, rs->tls_err, sizeof rs->tls_err)
                          : recv(rs->sock, d, want, 0);
            }
            if (got > 0) {
                gp_ka_note_rx(rs->ka);
                d += got;
                n -= (uint64_t)got;
                continue;
            }
        } else {
            got = rs->tls ? gp_tls_read(rs->tls, rs->buf, GP_READ_BUF_SIZE, slice, rs->tls_err,
                                        sizeof rs->tls_err)
                          : recv(rs->sock, rs->buf, GP_READ_BUF_SIZE, 0);
            if (got > 0) {
                gp_ka_note_rx(rs->ka);
                rs->pos = 0;
                rs->len = (size_t)got;
                continue;
            }
        }
        if (got < 0 && errno == EINTR && !rs->tls)
            continue;
        if (got < 0 && slice >= 0 &&
            (errno == EAGAIN || errno == EWOULDBLOCK || errno == ETIMEDOUT)) {
            if (rs->quiet(rs->owner, why) != 0)
                return -1;
            continue;
        }
        *why = got == 0  ? "connection closed by the server"
               : rs->tls ? rs->tls_err
                         : strerror(errno);
        return -1;
    }
    return 0;
}

/* Read exactly n bytes into dst (NULL: discard). 0, or -1 with *why set. */
int gp_read_exact(gp_reader *rs, void *dst, uint64_t n, const char **why)
{
    uint8_t *d = dst;
    int lowat = 0;
    if (d && !rs->tls && n >= 4 * (uint64_t)BULK_LOWAT) {
        set_lowat(rs->sock, BULK_LOWAT);
        lowat = 1;
    }
    int rc = read_loop(rs, d, n, &lowat, why);
    if (lowat)
        set_lowat(rs->sock, 1);
    return rc;
}

/* The bulk of a reply: n raw bytes into dst (NULL: discard), as LZ4 blocks when cz. A corrupt
 * block breaks the stream. 0, or -1 with *why set. */
int gp_read_bulk(gp_reader *r, uint8_t *dst, uint64_t n, int cz, const char **why)
{
    if (!cz)
        return gp_read_exact(r, dst, n, why);
    for (uint64_t done = 0; done < n;) {
        uint8_t hdr[GP_CZ_HDR];
        uint32_t raw, stored;
        if (gp_read_exact(r, hdr, sizeof hdr, why) != 0)
            return -1;
        if (gp_cz_header(hdr, n - done, &raw, &stored, why) != 0)
            return -1;
        if (stored == raw || !dst) {
            if (gp_read_exact(r, dst ? dst + done : NULL, stored, why) != 0)
                return -1;
        } else {
            if (!r->cz_in && !(r->cz_in = malloc(GP_LZ4_BLOCK))) {
                *why = "out of memory for a compressed copy";
                return -1;
            }
            if (gp_read_exact(r, r->cz_in, stored, why) != 0)
                return -1;
            if (gp_cz_inflate(r->cz_in, stored, dst + done, raw, why) != 0)
                return -1;
        }
        done += raw;
    }
    return 0;
}

void gp_reply_free(gp_reply *reply)
{
    if (!reply)
        return;
    free(reply->body);
    reply->body = NULL;
    reply->len = 0;
}
