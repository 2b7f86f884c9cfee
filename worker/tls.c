/*
 * tls.c: the worker's end of the data path's TLS (docs/protocol.md, "TLS").
 *
 * gpupoold terminates the client's first TLS session (the hello, the queue) and closes it
 * cleanly before it hands the plain socket over; SESSION then carries the TLS flag and this
 * worker runs a second handshake on that socket (SSL_accept) before its hello reply. From then
 * on io.c sends and receives through the SSL object (tls_read/tls_write below). The context is
 * made at start (--tls-cert, --tls-key, --tls-client-ca), before `ready`, so that a bad file is
 * a set-up failure the operator sees at once, not a refused client.
 *
 * The socket is non-blocking while TLS runs: OpenSSL answers WANT_READ/WANT_WRITE and the worker
 * waits in its usual poll (reactor.c, which also watches the control socket and the signalfd). Read-ahead is on:
 * fewer system calls per record for bulk data; SSL_read answers WANT_READ only when no complete
 * record is buffered, so waiting in poll() then is right.
 *
 * The private key is not in the context: the worker reads it once at start into w->tls_key, lends
 * it to its one session's SSL object for the handshake, and drops both references as soon as the
 * handshake is over (wk_tls_drop_key), before the first frame is read. OpenSSL clears a key's
 * numbers when it frees them, and every other buffer of OpenSSL's is cleared as it is freed
 * (wk_tls_clear_on_free): the copies the PEM and DER decoders made of the key included. A tenant who finds a bug in the frame parsers finds no key in
 * memory, and the file is out of reach too (sandbox.c). docs/architecture.md, "The worker's TLS
 * key", says why this and not a hand-over of traffic keys.
 *
 * After the handshake a 256 KiB buffering BIO sits between the session and the socket: OpenSSL
 * writes one 16 KiB record at a time, and a send() per record cost more CPU than encrypting it
 * (docs/benchmarks.md, "TLS"). io.c empties it (wk_tls_flush) at the end of every write.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <poll.h>
#include <openssl/ssl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "worker.h"

/* OpenSSL's allocations, with their size kept in front so that each is cleared as it is freed:
 * OpenSSL clears a key's numbers itself, but not every buffer a key passed through on its way in
 * (the DER its decoder reads the PEM into, for one), nor the handshake's. MAX_ALIGN keeps the
 * pointers OpenSSL gets as aligned as malloc's. */
#define MAX_ALIGN 16

static void *clear_malloc(size_t n, const char *file, int line)
{
    (void)file, (void)line;
    if (n > SIZE_MAX - MAX_ALIGN)
        return NULL;
    unsigned char *p = malloc(n + MAX_ALIGN);
    if (!p)
        return NULL;
    memcpy(p, &n, sizeof n);
    return p + MAX_ALIGN;
}

static void clear_free(void *q, const char *file, int line)
{
    (void)file, (void)line;
    if (!q)
        return;
    unsigned char *p = (unsigned char *)q - MAX_ALIGN;
    size_t n;
    memcpy(&n, p, sizeof n);
    explicit_bzero(q, n);
    free(p);
}

static void *clear_realloc(void *q, size_t n, const char *file, int line)
{
    if (!q)
        return clear_malloc(n, file, line);
    if (n == 0) {
        clear_free(q, file, line);
        return NULL;
    }
    size_t old;
    memcpy(&old, (unsigned char *)q - MAX_ALIGN, sizeof old);
    void *r = clear_malloc(n, file, line);
    if (!r)
        return NULL;
    memcpy(r, q, old < n ? old : n);
    clear_free(q, file, line);
    return r;
}

int wk_tls_clear_on_free(void)
{
    return CRYPTO_set_mem_functions(clear_malloc, clear_realloc, clear_free) == 1 ? 0 : -1;
}

/* The oldest queued OpenSSL error as text ("certificate verify failed"), or dflt. */
static void err_text(char *out, size_t cap, const char *dflt)
{
    unsigned long e = ERR_get_error();
    ERR_clear_error();
    if (!e) {
        snprintf(out, cap, "%s", dflt);
        return;
    }
    const char *r = ERR_reason_error_string(e);
    snprintf(out, cap, "%s", r ? r : dflt);
}

/* Refuses to prompt for a passphrase: gpupoold checked already that the key has none. */
static int no_passphrase(char *buf, int size, int rwflag, void *u)
{
    (void)buf, (void)size, (void)rwflag, (void)u;
    return -1;
}

/* The PEM private key at path, read by us (not through stdio, whose buffer would keep a copy of
 * the file after fclose) into a buffer cleared before it is freed. NULL with why. */
static EVP_PKEY *read_key(const char *path, char *why, size_t cap)
{
    enum {
        MAX_KEY_FILE = 64 << 10
    };
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY);
    if (fd < 0) {
        snprintf(why, cap, "%s", strerror(errno));
        return NULL;
    }
    unsigned char *buf = OPENSSL_malloc(MAX_KEY_FILE);
    size_t n = 0;
    ssize_t r = 0;
    while (buf && n < MAX_KEY_FILE && (r = read(fd, buf + n, MAX_KEY_FILE - n)) != 0) {
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            break;
        n += (size_t)r;
    }
    int read_errno = errno;
    if (close(fd) != 0)
        wk_warn("close %s: %s", path, strerror(errno));
    EVP_PKEY *key = NULL;
    if (!buf)
        snprintf(why, cap, "out of memory");
    else if (r < 0)
        snprintf(why, cap, "%s", strerror(read_errno));
    else if (n == MAX_KEY_FILE)
        snprintf(why, cap, "longer than %d KiB: not a PEM key", MAX_KEY_FILE >> 10);
    else {
        BIO *mem = BIO_new_mem_buf(buf, (int)n);
        key = mem ? PEM_read_bio_PrivateKey(mem, NULL, no_passphrase, NULL) : NULL;
        BIO_free(mem);
        if (!key)
            err_text(why, cap, "no PEM private key in it");
    }
    if (buf)
        OPENSSL_clear_free(buf, MAX_KEY_FILE);
    return key;
}

int wk_tls_setup(struct worker *w, const struct wk_options *o, char *err, size_t cap)
{
    SSL_CTX *ctx = SSL_CTX_new(TLS_server_method());
    if (!ctx) {
        err_text(err, cap, "cannot create a TLS context");
        return -1;
    }
    char why[200];
    if (SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION) != 1)
        goto ssl_fail;
    SSL_CTX_set_mode(ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    /* A client that vanishes without close_notify is "client lost", as with plain TCP. */
    SSL_CTX_set_options(ctx, SSL_OP_IGNORE_UNEXPECTED_EOF);
    /* The key is gone after the handshake (wk_tls_drop_key): no second one on TLS 1.2. */
    SSL_CTX_set_options(ctx, SSL_OP_NO_RENEGOTIATION);
    SSL_CTX_set_read_ahead(ctx, 1);
    SSL_CTX_set_default_read_buffer_len(ctx, WK_TLS_BUFFER);
    /* One session per connection: no tickets to store or send. */
    if (SSL_CTX_set_num_tickets(ctx, 0) != 1)
        goto ssl_fail;
    if (SSL_CTX_use_certificate_chain_file(ctx, o->tls_cert) != 1) {
        err_text(why, sizeof why, "unreadable");
        snprintf(err, cap, "cannot use the TLS certificate %s (setting 'tls_cert'): %s",
                 o->tls_cert, why);
        goto fail;
    }
    EVP_PKEY *key = read_key(o->tls_key, why, sizeof why);
    X509 *cert = SSL_CTX_get0_certificate(ctx);
    if (!key || !cert || X509_check_private_key(cert, key) != 1) {
        if (key)
            err_text(why, sizeof why, "it is not the key of the certificate");
        snprintf(err, cap, "cannot use the TLS key %s (setting 'tls_key') with %s: %s", o->tls_key,
                 o->tls_cert, why);
        EVP_PKEY_free(key);
        goto fail;
    }
    w->tls_key = key;
    if (o->tls_client_ca) {
        STACK_OF(X509_NAME) *names = SSL_load_client_CA_file(o->tls_client_ca);
        if (SSL_CTX_load_verify_locations(ctx, o->tls_client_ca, NULL) != 1 || !names) {
            err_text(why, sizeof why, "no CA certificate in it");
            snprintf(err, cap, "cannot use %s (setting 'tls_client_ca'): %s", o->tls_client_ca,
                     why);
            if (names)
                sk_X509_NAME_pop_free(names, X509_NAME_free);
            goto fail;
        }
        SSL_CTX_set_client_CA_list(ctx, names); /* takes ownership */
        SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, NULL);
    }
    w->tls_ctx = ctx;
    return 0;
ssl_fail:
    err_text(err, cap, "cannot configure the TLS context");
fail:
    SSL_CTX_free(ctx);
    return -1;
}

void wk_tls_drop_key(struct worker *w)
{
    if (w->ssl)
        SSL_certs_clear(w->ssl); /* the session's reference to the key */
    EVP_PKEY_free(w->tls_key);   /* the last one: OpenSSL clears the numbers as it frees them */
    w->tls_key = NULL;
}

void wk_tls_free(struct worker *w)
{
    wk_tls_drop_key(w);
    if (w->ssl) {
        SSL_free(w->ssl);
        w->ssl = NULL;
    }
    if (w->tls_ctx) {
        SSL_CTX_free(w->tls_ctx);
        w->tls_ctx = NULL;
    }
}

/* Puts a buffering BIO in front of the socket's for writing (see the top). The socket BIO stays
 * the session's read BIO; the chain holds a reference of its own, freed with the chain. */
static int gather_writes(struct worker *w, char *err, size_t cap)
{
    BIO *sock = SSL_get_wbio(w->ssl);
    BIO *buf = BIO_new(BIO_f_buffer());
    if (!sock || !buf || BIO_set_write_buffer_size(buf, WK_TLS_BUFFER) != 1 ||
        BIO_up_ref(sock) != 1) {
        BIO_free(buf);
        err_text(err, cap, "cannot set up the TLS write buffer");
        return -1;
    }
    BIO_push(buf, sock);
    SSL_set0_wbio(w->ssl, buf); /* drops the session's old reference to sock */
    return 0;
}

int wk_tls_flush(struct worker *w, short *wait_events, char *err, size_t cap)
{
    *wait_events = 0;
    BIO *b = SSL_get_wbio(w->ssl);
    if (!b || BIO_wpending(b) == 0)
        return 0;
    ERR_clear_error();
    if (BIO_flush(b) == 1)
        return 0;
    if (BIO_should_retry(b)) {
        *wait_events = POLLOUT;
        return -1;
    }
    snprintf(err, cap, "%s", errno ? strerror(errno) : "connection closed");
    return -1;
}

static int handshake(struct worker *w, char *err, size_t cap);

int wk_tls_accept(struct worker *w, char *err, size_t cap)
{
    if (!w->tls_ctx) {
        snprintf(err, cap,
                 "SESSION asks for TLS but this worker was started without "
                 "--tls-cert/--tls-key; gpupoold and gpupool-worker do not match");
        return -1;
    }
    int fl = fcntl(w->fd, F_GETFL);
    if (fl < 0 || fcntl(w->fd, F_SETFL, fl | O_NONBLOCK) != 0) {
        snprintf(err, cap, "cannot make the client socket non-blocking: %s", strerror(errno));
        return -1;
    }
    w->ssl = SSL_new(w->tls_ctx);
    if (!w->ssl || SSL_set_fd(w->ssl, w->fd) != 1 || !w->tls_key ||
        SSL_use_PrivateKey(w->ssl, w->tls_key) != 1) {
        err_text(err, cap, "cannot create a TLS session");
        wk_tls_drop_key(w);
        return -1;
    }
    int rc = handshake(w, err, cap);
    wk_tls_drop_key(w); /* before the first frame, whatever the handshake's outcome */
    return rc == 0 ? gather_writes(w, err, cap) : -1;
}

/* SSL_accept until it is done. 0, or -1 with err. */
static int handshake(struct worker *w, char *err, size_t cap)
{
    for (;;) {
        ERR_clear_error();
        int r = SSL_accept(w->ssl);
        if (r == 1)
            return 0;
        int e = SSL_get_error(w->ssl, r);
        if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) {
            if (wk_wait_client(w, e == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT) != 0) {
                snprintf(err, cap, "the session ended during the TLS handshake");
                return -1;
            }
            continue;
        }
        char why[200];
        err_text(why, sizeof why,
                 e == SSL_ERROR_SYSCALL || e == SSL_ERROR_ZERO_RETURN
                     ? "the client closed the connection"
                     : "handshake failed");
        snprintf(err, cap, "TLS handshake with the client failed: %s", why);
        return -1;
    }
}

ssize_t wk_tls_io(struct worker *w, void *buf, size_t n, int writing, short *wait_events, char *err,
                  size_t cap)
{
    int len = n > INT_MAX ? INT_MAX : (int)n;
    ERR_clear_error();
    int r = writing ? SSL_write(w->ssl, buf, len) : SSL_read(w->ssl, buf, len);
    *wait_events = 0;
    if (r > 0)
        return r;
    int e = SSL_get_error(w->ssl, r);
    if (e == SSL_ERROR_ZERO_RETURN)
        return 0;
    if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) {
        *wait_events = e == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT;
        return -1;
    }
    if (e == SSL_ERROR_SYSCALL && !writing && errno == 0)
        return 0;
    if (e == SSL_ERROR_SYSCALL)
        snprintf(err, cap, "%s", errno ? strerror(errno) : "connection closed");
    else
        err_text(err, cap, "TLS error");
    return -1;
}
