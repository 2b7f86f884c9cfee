/*
 * conn_write.c: the stream to the worker. Frames are gathered in a batch (gp_write_append) and
 * written, with up to two more buffers after them (a frame and its bulk, written from the
 * caller's memory without a copy), by gp_write_flush: through the TLS session, or with
 * sendmsg() in pieces of at most SEND_CHUNK bytes. The locking, the flusher and what a failure
 * means for the connection are conn.c's.
 */
#include <errno.h>
#include <stdio.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include "compress.h"
#include "conn_state.h"
#include "shim.h"
#include "shim_core.h"

/* The most one sendmsg() is given. A call with all of a 256 MiB copy owns the socket until the
 * kernel has taken the last byte: the ACKs that arrive meanwhile wait in the socket's backlog
 * and the sender processes them itself in bursts, the window opening late. 1 MiB a call leaves
 * them to the softirq as they come: 256 MiB uploads 0.28-0.33 -> 0.20-0.22 client CPU s/GiB and
 * 0.71-0.81x -> 1.19-1.28x of raw TCP on loopback (docs/benchmarks.md, "Uploads"); 256 KiB and
 * 4 MiB measured between the two. */
#ifndef SEND_CHUNK
#define SEND_CHUNK (1u << 20)
#endif

/* TLS: every iovec through the session (a record or more each). */
static int write_tls(gp_writer *wr, const struct iovec *iov, int n, char *why, size_t cap)
{
    for (int i = 0; i < n; i++) {
        if (atomic_load(wr->dead))
            return GP_WRITE_STOPPED;
        if (iov[i].iov_len && gp_tls_write(wr->tls, iov[i].iov_base, iov[i].iov_len, why, cap) != 0)
            return GP_WRITE_FAILED;
        gp_ka_note_tx(wr->ka);
    }
    return GP_WRITE_OK;
}

/* Write every iovec completely. */
static int write_iov(gp_writer *wr, struct iovec *iov, int n, char *why, size_t cap)
{
    if (wr->tls)
        return write_tls(wr, iov, n, why, cap);
    while (n > 0 && iov[0].iov_len == 0)
        iov++, n--;
    while (n > 0) {
        if (atomic_load(wr->dead))
            return GP_WRITE_STOPPED;
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
        ssize_t w = sendmsg(wr->sock, &mh, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return GP_WRITE_TIMED_OUT; /* only with a send timeout: at exit, or keepalives' */
            snprintf(why, cap, "%s", strerror(errno));
            return GP_WRITE_FAILED;
        }
        gp_ka_note_tx(wr->ka);
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
    return GP_WRITE_OK;
}

int gp_write_flush(gp_writer *wr, const void *a, size_t alen, const void *b, size_t blen, char *why,
                   size_t cap)
{
    struct iovec iov[3] = {{wr->batch, wr->len}, {(void *)a, alen}, {(void *)b, blen}};
    int rc = write_iov(wr, iov, 3, why, cap);
    wr->len = 0;
    return rc;
}

int gp_write_append(gp_writer *wr, const void *p, size_t n)
{
    if (n == 0)
        return 0;
    if (wr->len + n > wr->cap) {
        size_t ncap = wr->cap ? wr->cap : 64 * 1024;
        while (ncap < wr->len + n)
            ncap *= 2;
        uint8_t *nb = realloc(wr->batch, ncap);
        if (!nb)
            return -1;
        wr->batch = nb;
        wr->cap = ncap;
    }
    memcpy(wr->batch + wr->len, p, n);
    wr->len += n;
    return 0;
}

int gp_write_lz4(gp_writer *wr, const void *src, uint64_t n, uint8_t *enc, char *why, size_t cap)
{
    const uint8_t *s = src;
    gp_cz_enc st = {0};
    for (uint64_t off = 0; off < n;) {
        size_t piece = n - off < GP_WRITE_CZ_PIECE ? (size_t)(n - off) : GP_WRITE_CZ_PIECE;
        size_t len = gp_cz_encode(&st, s + off, piece, enc);
        int rc = gp_write_flush(wr, NULL, 0, enc, len, why, cap);
        if (rc != GP_WRITE_OK)
            return rc;
        off += piece;
    }
    return GP_WRITE_OK;
}
