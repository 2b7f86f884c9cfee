/*
 * gp_tls.h: TLS on a connection to gpupool (tls.c; docs/protocol.md "TLS"). OpenSSL 3 is loaded
 * at run time. One session may be used by two threads at once (each call locks it). Errors fill
 * err with the one-line reason. Shared by libcuda.so.1 and libnvidia-ml.so.1 (no shim state).
 */
#ifndef GP_TLS_H
#define GP_TLS_H

#include <stddef.h>
#include <sys/types.h>

#include "client_config.h"

typedef struct gp_tls gp_tls;
/* 0 when srv may be sent a token: plain TCP by its own choice (tls = false), or TLS with a pin
 * (tls_fingerprint) or a CA (tls_ca). Else -1 with the one line naming the fix (`gpupool
 * login`). gp_tls_setup and gp_tls_connect check it first. */
int gp_tls_trusted(const gp_server_config *srv, char *err, size_t cap);
/* The fingerprint ("SHA256:" + 43 base64 characters) of a DER certificate's public key into
 * out (cap >= GP_FINGERPRINT_CAP): what a pin holds. 0, or -1 with err (OpenSSL missing, not a
 * certificate). */
int gp_tls_fingerprint_of_cert(const unsigned char *der, size_t len, char *out, size_t cap,
                               char *err, size_t errcap);
/* 0 when seen equals the pin expected (constant time), else -1 with the "identity has changed"
 * message for server desc ("host:port") in err. */
int gp_tls_pin_matches(const char *seen, const char *expected, const char *desc, char *err,
                       size_t cap);
/* Load OpenSSL (once) and make the TLS context for srv's tls_ca / tls_cert / tls_key (once per
 * distinct set of files; contexts are kept for the process's life). 0, or -1 with err filled. */
int gp_tls_setup(const gp_server_config *srv, char *err, size_t cap);
/* A TLS session on connected socket fd with srv (certificate checked against srv->host when
 * srv has a CA, its public key against srv's pin when it has one; a mismatch fails before the
 * session is returned, so nothing of ours is written to an unverified peer), made
 * with srv's context (gp_tls_setup first). read_ahead: only for the last session on the socket.
 * timeout_ms bounds the whole handshake (-1: none). NULL with err filled on failure; errno
 * ECONNRESET when the server closed the connection during the handshake without a word (a busy
 * gpupoold past its handshake limits does that). */
gp_tls *gp_tls_connect(const gp_server_config *srv, int fd, int read_ahead, int timeout_ms,
                       char *err, size_t cap);
/* Up to n bytes: > 0, 0 at the end of the stream, -1 (errno ETIMEDOUT when timeout_ms, for the
 * whole call, passed; -1: no limit). */
ssize_t gp_tls_read(gp_tls *s, void *buf, size_t n, int timeout_ms, char *err, size_t cap);
int gp_tls_write(gp_tls *s, const void *p, size_t n, char *err, size_t cap);
int gp_tls_pending(gp_tls *s); /* bytes OpenSSL holds that poll() misses */
void gp_tls_set_send_timeout(gp_tls *s, int timeout_ms);
/* close_notify both ways, within timeout_ms in all (-1: no limit). */
int gp_tls_close(gp_tls *s, int timeout_ms, char *err, size_t cap);
void gp_tls_free(gp_tls *s);

#endif /* GP_TLS_H */
