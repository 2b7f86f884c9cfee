/*
 * peer_link.c: sealing, opening, writing and reading the records of a server-to-server link
 * (peer_link.h says the format). The socket is non-blocking and a whole record, read or written,
 * has ONE deadline (the caller's limit): a peer that dribbles a byte now and then cannot hold a
 * copy longer than that, as a silent one cannot. TCP_USER_TIMEOUT bounds what the kernel keeps
 * unacknowledged too. Writes never raise SIGPIPE (MSG_NOSIGNAL). Nothing here trusts the other
 * worker: a length over the limit, a record that does not decrypt under the link's key and
 * counter, or a short read fails.
 */
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <openssl/evp.h>

#include "clock.h"
#include "log.h"
#include "peer_link.h"

int wk_peer_end_open(struct wk_peer_end *e, int fd, int sealing, const uint8_t key[WK_PEER_KEY],
                     int timeout_ms, char *err, size_t errlen)
{
    e->fd = -1;
    e->sealing = sealing;
    e->count = 0;
    e->cipher = EVP_CIPHER_CTX_new();
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) {
        snprintf(err, errlen, "the link's socket: %s", strerror(errno));
        goto fail;
    }
    /* Data the other server's kernel stops acknowledging fails the connection after the link's
     * limit, not the kernel's default of about 15 minutes of retransmissions. Not a TCP socket
     * (the tests' socket pairs): nothing to bound. */
    unsigned int user_timeout = timeout_ms > 0 ? (unsigned int)timeout_ms : 0;
    if (setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout, sizeof user_timeout) != 0 &&
        errno != EOPNOTSUPP && errno != ENOPROTOOPT && errno != EINVAL)
        wk_warn("TCP_USER_TIMEOUT on a server-to-server link: %s", strerror(errno));
    if (!e->cipher) {
        snprintf(err, errlen, "out of memory for the link's cipher");
        goto fail;
    }
    int ok = sealing ? EVP_EncryptInit_ex(e->cipher, EVP_aes_256_gcm(), NULL, key, NULL)
                     : EVP_DecryptInit_ex(e->cipher, EVP_aes_256_gcm(), NULL, key, NULL);
    if (ok != 1) {
        snprintf(err, errlen, "OpenSSL could not set up AES-256-GCM for the link");
        goto fail;
    }
    e->fd = fd;
    return 0;
fail:
    EVP_CIPHER_CTX_free(e->cipher);
    e->cipher = NULL;
    if (close(fd) != 0)
        wk_warn("close: %s", strerror(errno));
    return -1;
}

void wk_peer_end_close(struct wk_peer_end *e)
{
    if (e->fd >= 0 && close(e->fd) != 0)
        wk_warn("closing a server-to-server link: %s", strerror(errno));
    e->fd = -1;
    EVP_CIPHER_CTX_free(e->cipher); /* clears the key schedule (EVP_CIPHER_CTX_reset) */
    e->cipher = NULL;
}

static void nonce(uint8_t iv[12], uint64_t count)
{
    memset(iv, 0, 4);
    for (int i = 0; i < 8; i++)
        iv[4 + i] = (uint8_t)(count >> (8 * i));
}

/* Waits for `events` on fd until deadline (wk_now_ns); 0 ready, -1 with err (the deadline
 * passed, or an error). limit_ms only names the limit in the words. */
static int wait_fd(int fd, short events, uint64_t deadline, int limit_ms, char *err, size_t errlen)
{
    for (;;) {
        uint64_t now = wk_now_ns();
        if (now >= deadline) {
            snprintf(err, errlen,
                     "the other server's worker %s a whole record in %d.%03d s (it stopped, or "
                     "goes too slowly): check the network between the two servers",
                     events == POLLIN ? "did not send" : "did not take", limit_ms / 1000,
                     limit_ms % 1000);
            return -1;
        }
        struct pollfd p = {.fd = fd, .events = events};
        int r = poll(&p, 1, (int)((deadline - now) / 1000000ull) + 1);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            snprintf(err, errlen, "waiting on the link: %s", strerror(errno));
            return -1;
        }
        if (r > 0)
            return 0; /* ready, or hung up / in error: the next call says which */
    }
}

/* The deadline of a record that starts now, limit_ms long. */
static uint64_t record_deadline(int limit_ms)
{
    return wk_now_ns() + (uint64_t)(limit_ms > 0 ? limit_ms : 0) * 1000000ull;
}

/* Writes (out 1) or reads (out 0) all n bytes at p by the deadline: 0, or -1 with err. */
static int move_all(int fd, int out, uint8_t *p, size_t n, uint64_t deadline, int limit_ms,
                    char *err, size_t errlen)
{
    while (n > 0) {
        ssize_t r = out ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);
        if (r > 0) {
            p += r;
            n -= (size_t)r;
            continue;
        }
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            if (wait_fd(fd, out ? POLLOUT : POLLIN, deadline, limit_ms, err, errlen) != 0)
                return -1;
            continue;
        }
        snprintf(err, errlen, "the other server's worker closed the link (%s)",
                 r < 0 ? strerror(errno)
                 : out ? "nothing written"
                       : "end of stream");
        return -1;
    }
    return 0;
}

int wk_peer_write(struct wk_peer_end *e, uint8_t kind, const void *head, size_t hn,
                  const void *data, size_t dn, uint8_t *rec, int timeout_ms, char *err,
                  size_t errlen)
{
    /* hn first: WK_PEER_RECORD_MAX - hn - 1 wraps for an hn of WK_PEER_RECORD_MAX or more */
    if (e->fd < 0 || !e->sealing || hn >= WK_PEER_RECORD_MAX || dn > WK_PEER_RECORD_MAX - hn - 1) {
        snprintf(err, errlen, "internal error: a record of 1 + %zu + %zu bytes cannot be sent", hn,
                 dn);
        return -1;
    }
    size_t len = 1 + hn + dn;
    for (int i = 0; i < 4; i++)
        rec[i] = (uint8_t)(len >> (8 * i));
    uint8_t iv[12];
    nonce(iv, e->count);
    uint8_t *out = rec + 4;
    int n = 0, ok = EVP_EncryptInit_ex(e->cipher, NULL, NULL, NULL, iv) == 1 &&
                    EVP_EncryptUpdate(e->cipher, NULL, &n, rec, 4) == 1 &&
                    EVP_EncryptUpdate(e->cipher, out, &n, &kind, 1) == 1;
    out += ok ? n : 0;
    if (ok && hn > 0) {
        ok = EVP_EncryptUpdate(e->cipher, out, &n, head, (int)hn) == 1;
        out += ok ? n : 0;
    }
    if (ok && dn > 0) {
        ok = EVP_EncryptUpdate(e->cipher, out, &n, data, (int)dn) == 1;
        out += ok ? n : 0;
    }
    ok = ok && EVP_EncryptFinal_ex(e->cipher, out, &n) == 1;
    out += ok ? n : 0;
    ok = ok && out == rec + 4 + len &&
         EVP_CIPHER_CTX_ctrl(e->cipher, EVP_CTRL_GCM_GET_TAG, WK_PEER_TAG, out) == 1;
    if (!ok) {
        snprintf(err, errlen, "OpenSSL could not encrypt a record of the link");
        return -1;
    }
    e->count++;
    return move_all(e->fd, 1, rec, 4 + len + WK_PEER_TAG, record_deadline(timeout_ms), timeout_ms,
                    err, errlen);
}

int wk_peer_read(struct wk_peer_end *e, uint8_t *rec, int timeout_ms, uint8_t **plain, size_t *n,
                 char *err, size_t errlen)
{
    if (e->fd < 0 || e->sealing) {
        snprintf(err, errlen, "internal error: this end of the link does not receive");
        return -1;
    }
    uint64_t deadline = record_deadline(timeout_ms); /* one for the whole record */
    if (move_all(e->fd, 0, rec, 4, deadline, timeout_ms, err, errlen) != 0)
        return -1;
    size_t len = (size_t)rec[0] | (size_t)rec[1] << 8 | (size_t)rec[2] << 16 | (size_t)rec[3] << 24;
    if (len == 0 || len > WK_PEER_RECORD_MAX) {
        snprintf(err, errlen,
                 "the link carried a record of %zu bytes (1 to %zu are valid): not the other "
                 "worker's, or the connection was tampered with",
                 len, (size_t)WK_PEER_RECORD_MAX);
        return -1;
    }
    if (move_all(e->fd, 0, rec + 4, len + WK_PEER_TAG, deadline, timeout_ms, err, errlen) != 0)
        return -1;
    uint8_t iv[12];
    nonce(iv, e->count);
    int m = 0, fin = 0;
    int ok =
        EVP_DecryptInit_ex(e->cipher, NULL, NULL, NULL, iv) == 1 &&
        EVP_DecryptUpdate(e->cipher, NULL, &m, rec, 4) == 1 &&
        EVP_DecryptUpdate(e->cipher, rec + 4, &m, rec + 4, (int)len) == 1 &&
        EVP_CIPHER_CTX_ctrl(e->cipher, EVP_CTRL_GCM_SET_TAG, WK_PEER_TAG, rec + 4 + len) == 1 &&
        EVP_DecryptFinal_ex(e->cipher, rec + 4 + m, &fin) == 1 && (size_t)(m + fin) == len;
    if (!ok) {
        snprintf(err, errlen,
                 "a record of the link did not decrypt: the two workers were given different "
                 "keys, or the data was altered on its way");
        return -1;
    }
    e->count++;
    *plain = rec + 4;
    *n = len;
    return 0;
}
