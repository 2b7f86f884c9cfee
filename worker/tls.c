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
 * After the handshake a 256 KiB buffering BIO sits between the session and the socket: OpenSSL
 * writes one 16 KiB record at a time, and a send() per record cost more CPU than encrypting it
 * (docs/benchmarks.md, "TLS"). io.c empties it (wk_tls_flush) at the end of every write.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <openssl/err.h>
#include <poll.h>
#include <openssl/ssl.h>
#include <stdio.h>
#include <string.h>

#include "worker.h"

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
    if (SSL_CTX_use_PrivateKey_file(ctx, o->tls_key, SSL_FILETYPE_PEM) != 1 ||
        SSL_CTX_check_private_key(ctx) != 1) {
        err_text(why, sizeof why, "unreadable");
        snprintf(err, cap, "cannot use the TLS key %s (setting 'tls_key') with %s: %s", o->tls_key,
                 o->tls_cert, why);
        goto fail;
    }
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

void wk_tls_free(struct worker *w)
{
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
    if (!w->ssl || SSL_set_fd(w->ssl, w->fd) != 1) {
        err_text(err, cap, "cannot create a TLS session");
        return -1;
    }
    for (;;) {
        ERR_clear_error();
        int r = SSL_accept(w->ssl);
        if (r == 1)
            return gather_writes(w, err, cap);
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
