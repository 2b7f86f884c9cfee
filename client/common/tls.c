/*
 * tls.c: TLS on the connection to gpupool (tls = true / GPUPOOL_TLS=1, or a tls://host:port
 * server address; docs/protocol.md, "TLS"). Shared by libcuda.so.1 and libnvidia-ml.so.1: no
 * shim state here.
 *
 * OpenSSL 3 is loaded at run time (dlopen "libssl.so.3" and "libcrypto.so.3") the first time a
 * TLS connection is made, so that libcuda.so.1 has no link-time dependency on OpenSSL and a
 * client machine without it runs plaintext sessions as before. The constants below are the
 * values of OpenSSL 3's public headers (a stable ABI); we do not need its headers to build.
 *
 * Record I/O goes through our own BIO over the socket: send() with MSG_NOSIGNAL (a vanished
 * server is an error, never SIGPIPE) and MSG_DONTWAIT/recv(MSG_DONTWAIT), so the socket itself
 * stays blocking for the plaintext code and the TLS code waits in poll() between attempts.
 * On the worker's session (the data path) the BIO gathers records in a 256 KiB buffer and sends
 * them together: OpenSSL hands over one 16 KiB record per write, and a send() per record cost
 * more CPU than the encryption (65,536 calls per GiB; docs/benchmarks.md, "TLS"). Every public
 * call below empties that buffer before it returns, so nothing waits in it for a reply.
 * Without read-ahead OpenSSL reads exactly one record at a time: it never takes bytes past the
 * close_notify of the daemon's session, which belong to the worker's session.
 *
 * One session may be used by two threads (conn.c: a sender under send_lock and the reader);
 * an SSL object must never be entered by two threads at once, so every SSL call holds the
 * session's lock, which is never held while waiting in poll().
 *
 * Each server may have its own CA bundle and client certificate (client_config.h): one SSL_CTX
 * per distinct (tls_ca, tls_cert, tls_key, pinned without a CA), made on first use and kept for
 * the process's life.
 *
 * Trust (docs/protocol.md "Trust"), like ssh: a server is trusted by its pinned identity
 * (tls_fingerprint / GPUPOOL_TLS_FINGERPRINT: the SHA-256 of its certificate's public key, the
 * DER SubjectPublicKeyInfo, in unpadded base64), by a CA (tls_ca: the chain and the host name
 * are checked), or by both (both required). A pin alone needs no chain: the server's certificate
 * is self-signed. Every session on a connection (gpupoold's and the worker's after the hand-over)
 * is checked after its handshake, before a byte of ours goes into it. A TLS server with neither
 * is refused before anything is sent (gp_tls_trusted), with the command that fixes it.
 */
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "gp_log.h"
#include "gp_tls.h"

/* OpenSSL 3 constants (include/openssl/ssl.h, bio.h, x509_vfy.h). */
#define O_SSL_ERROR_SSL 1
#define O_SSL_ERROR_WANT_READ 2
#define O_SSL_ERROR_WANT_WRITE 3
#define O_SSL_ERROR_SYSCALL 5
#define O_SSL_ERROR_ZERO_RETURN 6
#define O_TLS1_2_VERSION 0x0303
#define O_SSL_CTRL_MODE 33
#define O_SSL_CTRL_SET_TLSEXT_HOSTNAME 55
#define O_SSL_CTRL_SET_MIN_PROTO_VERSION 123
#define O_SSL_MODE_PARTIAL_AND_MOVING 0x3 /* ENABLE_PARTIAL_WRITE | ACCEPT_MOVING_WRITE_BUFFER */
#define O_SSL_OP_IGNORE_UNEXPECTED_EOF (1ull << 7)
#define O_SSL_VERIFY_NONE 0
#define O_SSL_VERIFY_PEER 1
#define O_SSL_FILETYPE_PEM 1
#define O_X509_V_OK 0
#define O_BIO_TYPE_SOURCE_SINK 0x0400
#define O_BIO_FLAGS_READ 0x01
#define O_BIO_FLAGS_WRITE 0x02
#define O_BIO_FLAGS_RWS 0x07
#define O_BIO_FLAGS_SHOULD_RETRY 0x08
#define O_BIO_CTRL_FLUSH 11
#define O_OPENSSL_INIT_NO_ATEXIT 0x00080000ull /* crypto.h, OpenSSL 3 */

static struct {
    int (*OPENSSL_init_ssl)(uint64_t, const void *);
    const void *(*TLS_client_method)(void);
    void *(*SSL_CTX_new)(const void *);
    void (*SSL_CTX_free)(void *);
    long (*SSL_CTX_ctrl)(void *, int, long, void *);
    uint64_t (*SSL_CTX_set_options)(void *, uint64_t);
    int (*SSL_CTX_set_default_verify_paths)(void *);
    int (*SSL_CTX_load_verify_locations)(void *, const char *, const char *);
    int (*SSL_CTX_use_certificate_chain_file)(void *, const char *);
    int (*SSL_CTX_use_PrivateKey_file)(void *, const char *, int);
    int (*SSL_CTX_check_private_key)(const void *);
    void (*SSL_CTX_set_verify)(void *, int, void *);
    void *(*SSL_new)(void *);
    void (*SSL_free)(void *);
    void (*SSL_set_bio)(void *, void *, void *);
    int (*SSL_set1_host)(void *, const char *);
    void (*SSL_set_read_ahead)(void *, int);
    void (*SSL_set_default_read_buffer_len)(void *, size_t);
    long (*SSL_ctrl)(void *, int, long, void *);
    int (*SSL_connect)(void *);
    int (*SSL_read)(void *, void *, int);
    int (*SSL_write)(void *, const void *, int);
    int (*SSL_shutdown)(void *);
    int (*SSL_get_error)(const void *, int);
    int (*SSL_has_pending)(const void *);
    long (*SSL_get_verify_result)(const void *);
    const char *(*X509_verify_cert_error_string)(long);
    unsigned long (*ERR_get_error)(void);
    void (*ERR_error_string_n)(unsigned long, char *, size_t);
    void (*ERR_clear_error)(void);
    int (*BIO_get_new_index)(void);
    void *(*BIO_meth_new)(int, const char *);
    int (*BIO_meth_set_write)(void *, int (*)(void *, const char *, int));
    int (*BIO_meth_set_read)(void *, int (*)(void *, char *, int));
    int (*BIO_meth_set_ctrl)(void *, long (*)(void *, int, long, void *));
    void *(*BIO_new)(const void *);
    void (*BIO_set_data)(void *, void *);
    void *(*BIO_get_data)(void *);
    void *(*SSL_get_wbio)(const void *);
    void (*BIO_set_init)(void *, int);
    void (*BIO_set_flags)(void *, int);
    void (*BIO_clear_flags)(void *, int);
    void *(*SSL_get1_peer_certificate)(const void *);
    void (*X509_free)(void *);
    void *(*X509_get_X509_PUBKEY)(const void *);
    int (*i2d_X509_PUBKEY)(const void *, unsigned char **);
    void *(*d2i_X509)(void **, const unsigned char **, long);
    int (*EVP_Digest)(const void *, size_t, unsigned char *, unsigned int *, const void *, void *);
    const void *(*EVP_sha256)(void);
    int (*EVP_EncodeBlock)(unsigned char *, const unsigned char *, int);
} O;

/* Loaded once; the contexts are made on first use (probes run in parallel threads). */
static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER;
static int loaded;     /* O, bio_meth ready; guarded by load_lock */
static void *bio_meth; /* our socket BIO method */

/* The SSL_CTX for one set of files; a list guarded by load_lock, never shortened. */
typedef struct tls_context {
    struct tls_context *next;
    void *ctx;
    char ca[4096], cert[4096], key[4096];
    int pin_only; /* a pin and no CA: no chain to check (self-signed) */
} tls_context;
static tls_context *contexts;

#define WBUF_CAP (256 * 1024)

struct gp_tls {
    void *ssl;
    int fd;
    int send_timeout_ms; /* -1: wait as long as it takes; guarded by lock */
    pthread_mutex_t lock;
    /* Records not yet sent (bio_write gathers them once `gather` is set): wbuf[woff..wlen).
     * Guarded by lock, as every SSL call is. */
    int gather;
    uint8_t *wbuf;
    size_t woff, wlen;
};

/* ------------------------------------------------------------------ loading OpenSSL == */

static int load_symbols(void *ssl, void *crypto, char *err, size_t cap)
{
    struct {
        void **slot;
        void *lib;
        const char *name;
    } t[] = {
#define S(n) {(void **)&O.n, ssl, #n}
#define C(n)                                                                                       \
    {                                                                                              \
        (void **)&O.n, crypto, #n                                                                  \
    }
        S(OPENSSL_init_ssl),
        S(TLS_client_method),
        S(SSL_CTX_new),
        S(SSL_CTX_free),
        S(SSL_CTX_ctrl),
        S(SSL_CTX_set_options),
        S(SSL_CTX_set_default_verify_paths),
        S(SSL_CTX_load_verify_locations),
        S(SSL_CTX_use_certificate_chain_file),
        S(SSL_CTX_use_PrivateKey_file),
        S(SSL_CTX_check_private_key),
        S(SSL_CTX_set_verify),
        S(SSL_new),
        S(SSL_free),
        S(SSL_set_bio),
        S(SSL_set1_host),
        S(SSL_set_read_ahead),
        S(SSL_set_default_read_buffer_len),
        S(SSL_ctrl),
        S(SSL_connect),
        S(SSL_read),
        S(SSL_write),
        S(SSL_shutdown),
        S(SSL_get_error),
        S(SSL_has_pending),
        S(SSL_get_verify_result),
        C(X509_verify_cert_error_string),
        C(ERR_get_error),
        C(ERR_error_string_n),
        C(ERR_clear_error),
        C(BIO_get_new_index),
        C(BIO_meth_new),
        C(BIO_meth_set_write),
        C(BIO_meth_set_read),
        C(BIO_meth_set_ctrl),
        C(BIO_new),
        C(BIO_set_data),
        C(BIO_get_data),
        S(SSL_get_wbio),
        C(BIO_set_init),
        C(BIO_set_flags),
        C(BIO_clear_flags),
        S(SSL_get1_peer_certificate),
        C(X509_free),
        C(X509_get_X509_PUBKEY),
        C(i2d_X509_PUBKEY),
        C(d2i_X509),
        C(EVP_Digest),
        C(EVP_sha256),
        C(EVP_EncodeBlock),
#undef S
#undef C
    };
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        *t[i].slot = dlsym(t[i].lib, t[i].name);
        if (!*t[i].slot) {
            snprintf(err, cap, "TLS needs OpenSSL 3, but %s lacks %s; install libssl3",
                     t[i].lib == ssl ? "libssl.so.3" : "libcrypto.so.3", t[i].name);
            return -1;
        }
    }
    return 0;
}

/* The oldest error OpenSSL queued in this thread, as text (or `dflt`). */
static void ssl_error_text(char *out, size_t cap, const char *dflt)
{
    unsigned long e = O.ERR_get_error(), last = e;
    while (last) { /* keep the first, drop the rest of the queue */
        last = O.ERR_get_error();
    }
    if (!e) {
        snprintf(out, cap, "%s", dflt);
        return;
    }
    char buf[256];
    O.ERR_error_string_n(e, buf, sizeof buf);
    /* "error:0A000086:SSL routines::certificate verify failed": the part after the last ':' */
    const char *r = strrchr(buf, ':');
    snprintf(out, cap, "%s", r && r[1] ? r + 1 : buf);
}

/* One non-blocking send; EAGAIN marks the BIO for a retry. */
static ssize_t send_some(void *b, int fd, const void *p, size_t n)
{
    ssize_t w;
    do
        w = send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    while (w < 0 && errno == EINTR);
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
        O.BIO_set_flags(b, O_BIO_FLAGS_WRITE | O_BIO_FLAGS_SHOULD_RETRY);
    return w;
}

/* Sends what wbuf holds, without waiting: 0 when it is empty, -1 (errno; EAGAIN with the BIO
 * marked for a retry) when the socket takes no more. */
static int wbuf_send(gp_tls *s, void *b)
{
    while (s->woff < s->wlen) {
        ssize_t w = send_some(b, s->fd, s->wbuf + s->woff, s->wlen - s->woff);
        if (w < 0)
            return -1;
        s->woff += (size_t)w;
    }
    s->woff = s->wlen = 0;
    return 0;
}

static int bio_write(void *b, const char *p, int n)
{
    gp_tls *s = O.BIO_get_data(b);
    O.BIO_clear_flags(b, O_BIO_FLAGS_RWS | O_BIO_FLAGS_SHOULD_RETRY);
    if (!s->gather)
        return (int)send_some(b, s->fd, p, (size_t)n);
    if (s->wlen + (size_t)n > WBUF_CAP && wbuf_send(s, b) != 0)
        return -1; /* OpenSSL offers the same record again */
    if ((size_t)n >= WBUF_CAP)
        return (int)send_some(b, s->fd, p, (size_t)n);
    memcpy(s->wbuf + s->wlen, p, (size_t)n);
    s->wlen += (size_t)n;
    return n;
}

static int bio_read(void *b, char *p, int n)
{
    int fd = ((gp_tls *)O.BIO_get_data(b))->fd;
    O.BIO_clear_flags(b, O_BIO_FLAGS_RWS | O_BIO_FLAGS_SHOULD_RETRY);
    ssize_t r;
    do
        r = recv(fd, p, (size_t)n, MSG_DONTWAIT);
    while (r < 0 && errno == EINTR);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
        O.BIO_set_flags(b, O_BIO_FLAGS_READ | O_BIO_FLAGS_SHOULD_RETRY);
    return (int)r;
}

static long bio_ctrl(void *b, int cmd, long num, void *ptr)
{
    (void)num, (void)ptr;
    if (cmd != O_BIO_CTRL_FLUSH)
        return 0;
    gp_tls *s = O.BIO_get_data(b);
    O.BIO_clear_flags(b, O_BIO_FLAGS_RWS | O_BIO_FLAGS_SHOULD_RETRY);
    return wbuf_send(s, b) == 0;
}

/* A pin and no CA: the identity is the pin, there is no chain to check. */
static int pin_only(const gp_server_config *srv)
{
    return *srv->tls_fingerprint && !*srv->tls_ca;
}

/* A new SSL_CTX for srv's files, or NULL with err filled. Called under load_lock. */
static void *make_context(const gp_server_config *srv, char *err, size_t cap)
{
    void *c = O.SSL_CTX_new(O.TLS_client_method());
    if (!c) {
        ssl_error_text(err, cap, "SSL_CTX_new failed");
        return NULL;
    }
    O.SSL_CTX_ctrl(c, O_SSL_CTRL_SET_MIN_PROTO_VERSION, O_TLS1_2_VERSION, NULL);
    O.SSL_CTX_ctrl(c, O_SSL_CTRL_MODE, O_SSL_MODE_PARTIAL_AND_MOVING, NULL);
    /* End of stream without close_notify reads as end of stream: frames carry their lengths,
     * so a cut stream is detected by the frame layer, and conn.c says "connection closed". */
    O.SSL_CTX_set_options(c, O_SSL_OP_IGNORE_UNEXPECTED_EOF);
    const char *ca = srv->tls_ca, *cert = srv->tls_cert, *key = srv->tls_key;
    if (pin_only(srv)) {
        /* Verified after the handshake, by the pin (check_pin): no CA to ask. */
        O.SSL_CTX_set_verify(c, O_SSL_VERIFY_NONE, NULL);
    } else if (O.SSL_CTX_set_verify(c, O_SSL_VERIFY_PEER, NULL), *ca) {
        if (O.SSL_CTX_load_verify_locations(c, ca, NULL) != 1) {
            char why[200];
            ssl_error_text(why, sizeof why, "unreadable");
            snprintf(err, cap,
                     "cannot use the CA file %s (GPUPOOL_TLS_CA / tls_ca) (%s): it "
                     "must be a PEM file of CA certificates",
                     ca, access(ca, R_OK) ? strerror(errno) : why);
            goto fail;
        }
    } else if (O.SSL_CTX_set_default_verify_paths(c) != 1) {
        ssl_error_text(err, cap, "cannot load the system's trusted CA certificates");
        goto fail;
    }
    int have_cert = *cert != 0, have_key = *key != 0;
    if (have_cert != have_key) {
        snprintf(err, cap, "%s is set but %s is not: a client certificate needs both",
                 have_cert ? "GPUPOOL_TLS_CERT (tls_cert)" : "GPUPOOL_TLS_KEY (tls_key)",
                 have_cert ? "GPUPOOL_TLS_KEY (tls_key)" : "GPUPOOL_TLS_CERT (tls_cert)");
        goto fail;
    }
    if (have_cert) {
        char why[200];
        if (O.SSL_CTX_use_certificate_chain_file(c, cert) != 1) {
            ssl_error_text(why, sizeof why, "unreadable");
            snprintf(err, cap,
                     "cannot use the client certificate %s (GPUPOOL_TLS_CERT / "
                     "tls_cert) (%s): it must be a PEM certificate chain",
                     cert, access(cert, R_OK) ? strerror(errno) : why);
            goto fail;
        }
        if (O.SSL_CTX_use_PrivateKey_file(c, key, O_SSL_FILETYPE_PEM) != 1 ||
            O.SSL_CTX_check_private_key(c) != 1) {
            ssl_error_text(why, sizeof why, "unreadable");
            snprintf(err, cap,
                     "cannot use the client key %s (GPUPOOL_TLS_KEY / tls_key) (%s): "
                     "it must be the unencrypted PEM key of the client certificate %s",
                     key, access(key, R_OK) ? strerror(errno) : why, cert);
            goto fail;
        }
    }
    return c;
fail:
    O.SSL_CTX_free(c);
    return NULL;
}

/* dlopen OpenSSL and make the BIO method, once. Called under load_lock. 0, or -1. */
static int load_openssl(char *err, size_t cap)
{
    if (loaded)
        return 0;
    static void *ssl_lib, *crypto_lib; /* guarded by load_lock */
    /* libcrypto first: libssl needs it, and we take symbols from both. */
    if (!crypto_lib)
        crypto_lib = dlopen("libcrypto.so.3", RTLD_NOW | RTLD_LOCAL);
    if (crypto_lib && !ssl_lib)
        ssl_lib = dlopen("libssl.so.3", RTLD_NOW | RTLD_LOCAL);
    if (!crypto_lib || !ssl_lib) {
        snprintf(err, cap, "TLS needs OpenSSL 3 (libssl.so.3): install libssl3 (%s)", dlerror());
        return -1;
    }
    if (load_symbols(ssl_lib, crypto_lib, err, cap) != 0) {
        memset(&O, 0, sizeof O);
        return -1;
    }
    /* No cleanup of OpenSSL's globals at exit: the shim's threads may still be in a session
     * then (conn.c stops its receiver, but a program's own threads may be in a call), and the
     * process is going anyway. Ignored when the program's own OpenSSL was initialised first. */
    O.OPENSSL_init_ssl(O_OPENSSL_INIT_NO_ATEXIT, NULL);
    O.ERR_clear_error();
    bio_meth = O.BIO_meth_new(O.BIO_get_new_index() | O_BIO_TYPE_SOURCE_SINK, "gpupool socket");
    if (!bio_meth || O.BIO_meth_set_write(bio_meth, bio_write) != 1 ||
        O.BIO_meth_set_read(bio_meth, bio_read) != 1 ||
        O.BIO_meth_set_ctrl(bio_meth, bio_ctrl) != 1) {
        snprintf(err, cap, "OpenSSL: cannot create a BIO method");
        bio_meth = NULL; /* a half-made method is small: not worth the symbol to free it */
        return -1;
    }
    loaded = 1;
    return 0;
}

/* The context for srv's files (made on first use), or NULL with err filled. */
static void *context_for(const gp_server_config *srv, char *err, size_t cap)
{
    void *c = NULL;
    pthread_mutex_lock(&load_lock);
    if (load_openssl(err, cap) == 0) {
        for (tls_context *t = contexts; t && !c; t = t->next)
            if (!strcmp(t->ca, srv->tls_ca) && !strcmp(t->cert, srv->tls_cert) &&
                !strcmp(t->key, srv->tls_key) && t->pin_only == pin_only(srv))
                c = t->ctx;
        if (!c) {
            tls_context *t = calloc(1, sizeof *t);
            if (!t) {
                snprintf(err, cap, "out of memory");
            } else if (!(t->ctx = make_context(srv, err, cap))) {
                free(t);
            } else {
                snprintf(t->ca, sizeof t->ca, "%s", srv->tls_ca);
                snprintf(t->cert, sizeof t->cert, "%s", srv->tls_cert);
                snprintf(t->key, sizeof t->key, "%s", srv->tls_key);
                t->pin_only = pin_only(srv);
                t->next = contexts;
                contexts = t;
                c = t->ctx;
            }
        }
    }
    pthread_mutex_unlock(&load_lock);
    return c;
}

int gp_tls_trusted(const gp_server_config *srv, char *err, size_t cap)
{
    if (!srv->tls || *srv->tls_fingerprint || *srv->tls_ca)
        return 0;
    char desc[600];
    gp_server_desc(srv, desc, sizeof desc);
    snprintf(err, cap,
             "no pinned identity for %s: nothing was sent; run `gpupool login %s` (or set "
             "GPUPOOL_TLS_FINGERPRINT to what `gpupoold fingerprint` prints on the server)",
             desc, desc);
    return -1;
}

int gp_tls_setup(const gp_server_config *srv, char *err, size_t cap)
{
    if (gp_tls_trusted(srv, err, cap) != 0)
        return -1;
    return context_for(srv, err, cap) ? 0 : -1;
}

/* ------------------------------------------------------------------ identity == */

/* "SHA256:" + unpadded base64 of the SHA-256 of the DER SubjectPublicKeyInfo of certificate x.
 * 0, or -1 with err. OpenSSL loaded. */
static int fingerprint_of_x509(void *x, char *out, size_t cap, char *err, size_t errcap)
{
    void *pub = O.X509_get_X509_PUBKEY(x);
    int n = pub ? O.i2d_X509_PUBKEY(pub, NULL) : -1;
    if (n <= 0 || n > 1 << 20) {
        snprintf(err, errcap, "TLS: the server's certificate has no readable public key");
        return -1;
    }
    unsigned char *der = malloc((size_t)n), *p = der;
    if (!der) {
        snprintf(err, errcap, "out of memory");
        return -1;
    }
    unsigned char md[32], b64[48];
    unsigned int mdlen = 0;
    int ok = O.i2d_X509_PUBKEY(pub, &p) == n &&
             O.EVP_Digest(der, (size_t)n, md, &mdlen, O.EVP_sha256(), NULL) == 1 && mdlen == 32;
    free(der);
    if (!ok || O.EVP_EncodeBlock(b64, md, 32) != 44 || cap < GP_FINGERPRINT_CAP) {
        snprintf(err, errcap, "TLS: cannot compute the fingerprint of the server's key");
        return -1;
    }
    snprintf(out, cap, "SHA256:%.43s", (const char *)b64); /* the 44th is the '=' padding */
    return 0;
}

int gp_tls_fingerprint_of_cert(const unsigned char *der, size_t len, char *out, size_t cap,
                               char *err, size_t errcap)
{
    pthread_mutex_lock(&load_lock);
    int rc = load_openssl(err, errcap);
    pthread_mutex_unlock(&load_lock);
    if (rc != 0)
        return -1;
    const unsigned char *p = der;
    void *x = len <= 1 << 20 ? O.d2i_X509(NULL, &p, (long)len) : NULL;
    if (!x) {
        O.ERR_clear_error();
        snprintf(err, errcap, "not a DER certificate");
        return -1;
    }
    rc = fingerprint_of_x509(x, out, cap, err, errcap);
    O.X509_free(x);
    return rc;
}

int gp_tls_pin_matches(const char *seen, const char *expected, const char *desc, char *err,
                       size_t cap)
{
    /* Constant time over the pin's length: nothing to learn from how soon it differs. */
    size_t n = strlen(expected);
    unsigned diff = strlen(seen) != n;
    for (size_t i = 0; i < n && seen[i]; i++)
        diff |= (unsigned char)(seen[i] ^ expected[i]);
    if (!diff)
        return 0;
    snprintf(err, cap,
             "WARNING: THE IDENTITY OF SERVER %s HAS CHANGED: it presents %s, but the pinned "
             "one is %s (tls_fingerprint / GPUPOOL_TLS_FINGERPRINT); either its key was "
             "replaced (reinstalled, rotated) or someone is in the middle of this connection, "
             "so nothing was sent; ask its operator what `gpupoold fingerprint` prints on the "
             "server, and only if it is %s, pin it again with `gpupool login %s --fingerprint "
             "%s`",
             desc, seen, expected, seen, desc, seen);
    return -1;
}

/* After the handshake of s with srv: the peer's key against srv's pin (none: 0). 0, or -1. */
static int check_pin(gp_tls *s, const gp_server_config *srv, char *err, size_t cap)
{
    if (!*srv->tls_fingerprint)
        return 0;
    void *x = O.SSL_get1_peer_certificate(s->ssl);
    if (!x) {
        snprintf(err, cap,
                 "TLS: the server sent no certificate, so its pinned identity cannot "
                 "be checked: nothing was sent");
        return -1;
    }
    char seen[GP_FINGERPRINT_CAP], desc[600];
    int rc = fingerprint_of_x509(x, seen, sizeof seen, err, cap);
    O.X509_free(x);
    if (rc != 0)
        return -1;
    gp_server_desc(srv, desc, sizeof desc);
    return gp_tls_pin_matches(seen, srv->tls_fingerprint, desc, err, cap);
}

/* ------------------------------------------------------------------ one session == */

/* Monotonic milliseconds. */
static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* The end of a wait of timeout_ms from now (-1: none). */
static int64_t until_ms(int timeout_ms)
{
    return timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
}

/* Wait for events on fd until `until` (until_ms; -1: forever): 0, or -1 with errno (ETIMEDOUT).
 * Every poll gets only the time left, so a call that waits several times (a handshake, a record
 * that arrives in pieces) still ends by `until`. */
static int wait_fd(int fd, short events, int64_t until)
{
    struct pollfd p = {.fd = fd, .events = events};
    for (;;) {
        int timeout_ms = -1;
        if (until >= 0) {
            int64_t left = until - now_ms();
            timeout_ms = left <= 0 ? 0 : left > INT_MAX ? INT_MAX : (int)left;
        }
        int r = poll(&p, 1, timeout_ms);
        if (r > 0)
            return 0;
        if (r == 0) {
            errno = ETIMEDOUT;
            return -1;
        }
        if (errno != EINTR)
            return -1;
    }
}

static int is_ip_literal(const char *host)
{
    return strspn(host, "0123456789.") == strlen(host) || strchr(host, ':') != NULL;
}

/* Why a handshake failed, for the one-line error: certificate problems get what to do. 1 when
 * the server closed the connection without a word (no alert, no certificate problem), else 0. */
static int handshake_error(gp_tls *s, const gp_server_config *srv, int e, char *err, size_t cap)
{
    char desc[600];
    gp_server_desc(srv, desc, sizeof desc);
    long v = O.SSL_get_verify_result(s->ssl);
    if (v != O_X509_V_OK) {
        snprintf(err, cap,
                 "TLS: the server's certificate was not accepted (%s); set "
                 "GPUPOOL_TLS_CA (or tls_ca in the configuration file) to the CA certificate "
                 "that signed it (PEM) and connect with the host name the certificate names",
                 O.X509_verify_cert_error_string(v));
        O.ERR_clear_error();
        return 0;
    }
    char why[200];
    ssl_error_text(why, sizeof why,
                   e == O_SSL_ERROR_SYSCALL || e == O_SSL_ERROR_ZERO_RETURN
                       ? "the server closed the connection"
                       : "handshake failed");
    if (strstr(why, "wrong version number") || strstr(why, "packet length too long") ||
        strstr(why, "record layer failure"))
        snprintf(err, cap,
                 "TLS handshake failed (%s): the server does not speak TLS on this port (a "
                 "gpupoold with tls = \"off\", or older than TLS by default); ask its operator "
                 "to turn TLS on, or, on a network you trust, use it in plain TCP: `gpupool "
                 "login %s --plain` (tls = false for this server, GPUPOOL_TLS=0)",
                 why, desc);
    else if (strstr(why, "certificate required") || strstr(why, "handshake failure") ||
             strstr(why, "closed the connection"))
        snprintf(err, cap,
                 "TLS handshake failed (%s); if the server requires a client "
                 "certificate, set GPUPOOL_TLS_CERT and GPUPOOL_TLS_KEY to one its tls_client_ca "
                 "signed",
                 why);
    else
        snprintf(err, cap, "TLS handshake failed (%s)", why);
    return !strcmp(why, "the server closed the connection") || strstr(why, "unexpected eof");
}

gp_tls *gp_tls_connect(const gp_server_config *srv, int fd, int read_ahead, int timeout_ms,
                       char *err, size_t cap)
{
    const char *host = srv->host;
    int64_t until = until_ms(timeout_ms); /* the whole handshake */
    if (gp_tls_trusted(srv, err, cap) != 0)
        return NULL;
    void *ctx = context_for(srv, err, cap);
    if (!ctx)
        return NULL;
    gp_tls *s = calloc(1, sizeof *s);
    if (!s) {
        snprintf(err, cap, "out of memory");
        return NULL;
    }
    s->fd = fd;
    s->send_timeout_ms = -1;
    pthread_mutex_init(&s->lock, NULL);
    O.ERR_clear_error();
    void *bio = O.BIO_new(bio_meth);
    s->ssl = bio ? O.SSL_new(ctx) : NULL;
    if (!s->ssl) {
        ssl_error_text(err, cap, "cannot create a TLS session");
        free(s);
        return NULL;
    }
    O.BIO_set_data(bio, s);
    O.BIO_set_init(bio, 1);
    O.SSL_set_bio(s->ssl, bio, bio); /* one reference, owned by the SSL object */
    if (read_ahead) {
        /* Several records per recv(): fewer system calls for bulk data. Only for the worker's
         * session, the last on the socket: the daemon's must not read past its close_notify. */
        O.SSL_set_read_ahead(s->ssl, 1);
        O.SSL_set_default_read_buffer_len(s->ssl, 256 * 1024);
    }
    if ((!pin_only(srv) && O.SSL_set1_host(s->ssl, host) != 1) ||
        (!is_ip_literal(host) &&
         O.SSL_ctrl(s->ssl, O_SSL_CTRL_SET_TLSEXT_HOSTNAME, 0, (void *)host) != 1)) {
        snprintf(err, cap, "TLS: cannot use the host name %s", host);
        gp_tls_free(s);
        return NULL;
    }
    for (;;) {
        int r = O.SSL_connect(s->ssl);
        if (r == 1)
            break;
        int e = O.SSL_get_error(s->ssl, r);
        if (e == O_SSL_ERROR_WANT_READ || e == O_SSL_ERROR_WANT_WRITE) {
            if (wait_fd(fd, e == O_SSL_ERROR_WANT_READ ? POLLIN : POLLOUT, until) == 0)
                continue;
            snprintf(err, cap, "TLS handshake: %s",
                     errno == ETIMEDOUT ? "no answer (does the server speak TLS on this port?)"
                                        : strerror(errno));
            gp_tls_free(s);
            return NULL;
        }
        int closed = handshake_error(s, srv, e, err, cap);
        gp_tls_free(s);
        errno = closed ? ECONNRESET : EPROTO;
        return NULL;
    }
    if (check_pin(s, srv, err, cap) != 0) {
        gp_tls_free(s);
        return NULL;
    }
    /* The worker's session carries bulk data: gather its records (see the top). The daemon's
     * stays record by record, its last bytes being the close_notify before the hand-over. */
    if (read_ahead) {
        s->wbuf = malloc(WBUF_CAP);
        s->gather = s->wbuf != NULL;
    }
    return s;
}

/* Sends every gathered record, waiting for the socket as needed (until: until_ms; -1: as long
 * as it takes). 0, or -1 with errno (ETIMEDOUT). */
static int flush_gathered(gp_tls *s, int64_t until)
{
    for (;;) {
        pthread_mutex_lock(&s->lock);
        int r = s->wlen ? wbuf_send(s, O.SSL_get_wbio(s->ssl)) : 0;
        int saved = errno;
        pthread_mutex_unlock(&s->lock);
        if (r == 0)
            return 0;
        if (saved != EAGAIN && saved != EWOULDBLOCK) {
            errno = saved;
            return -1;
        }
        if (wait_fd(s->fd, POLLOUT, until) != 0)
            return -1;
    }
}

void gp_tls_free(gp_tls *s)
{
    if (!s)
        return;
    free(s->wbuf);
    if (s->ssl)
        O.SSL_free(s->ssl);
    pthread_mutex_destroy(&s->lock);
    free(s);
}

/* > 0 bytes, 0 end of stream (close_notify or TCP end), -1 error (err filled; errno ETIMEDOUT
 * when timeout_ms passed without data). */
ssize_t gp_tls_read(gp_tls *s, void *buf, size_t n, int timeout_ms, char *err, size_t cap)
{
    int len = n > INT_MAX ? INT_MAX : (int)n;
    int64_t until = until_ms(timeout_ms); /* the whole call */
    for (;;) {
        pthread_mutex_lock(&s->lock);
        O.ERR_clear_error();
        int r = O.SSL_read(s->ssl, buf, len);
        int e = r > 0 ? 0 : O.SSL_get_error(s->ssl, r);
        int saved = errno;
        if (e == O_SSL_ERROR_SSL)
            ssl_error_text(err, cap, "TLS error");
        size_t gathered = s->wlen; /* an answer OpenSSL wrote (a key update) */
        pthread_mutex_unlock(&s->lock);
        if (gathered && flush_gathered(s, until) != 0) {
            snprintf(err, cap, "%s", strerror(errno));
            return -1;
        }
        if (r > 0)
            return r;
        if (e == O_SSL_ERROR_ZERO_RETURN)
            return 0;
        if (e == O_SSL_ERROR_WANT_READ || e == O_SSL_ERROR_WANT_WRITE) {
            if (wait_fd(s->fd, e == O_SSL_ERROR_WANT_READ ? POLLIN : POLLOUT, until) != 0) {
                snprintf(err, cap, "%s", strerror(errno));
                return -1;
            }
            continue;
        }
        if (e == O_SSL_ERROR_SYSCALL) {
            if (saved == 0)
                return 0;
            snprintf(err, cap, "%s", strerror(saved));
            errno = saved;
        } else if (e != O_SSL_ERROR_SSL) {
            snprintf(err, cap, "TLS error %d", e);
        }
        if (e != O_SSL_ERROR_SYSCALL)
            errno = EPROTO;
        return -1;
    }
}

int gp_tls_write(gp_tls *s, const void *p, size_t n, char *err, size_t cap)
{
    const uint8_t *b = p;
    while (n > 0) {
        int len = n > (1u << 30) ? (1 << 30) : (int)n;
        pthread_mutex_lock(&s->lock);
        O.ERR_clear_error();
        int r = O.SSL_write(s->ssl, b, len);
        int e = r > 0 ? 0 : O.SSL_get_error(s->ssl, r);
        int saved = errno, timeout_ms = s->send_timeout_ms;
        if (e == O_SSL_ERROR_SSL)
            ssl_error_text(err, cap, "TLS error");
        pthread_mutex_unlock(&s->lock);
        if (r > 0) {
            b += r;
            n -= (size_t)r;
            continue;
        }
        if (e == O_SSL_ERROR_WANT_READ || e == O_SSL_ERROR_WANT_WRITE) {
            if (wait_fd(s->fd, e == O_SSL_ERROR_WANT_READ ? POLLIN : POLLOUT,
                        until_ms(timeout_ms)) != 0) {
                snprintf(err, cap, "%s", errno == ETIMEDOUT ? "send timed out" : strerror(errno));
                return -1;
            }
            continue;
        }
        if (e == O_SSL_ERROR_SYSCALL)
            snprintf(err, cap, "%s", saved ? strerror(saved) : "connection closed");
        else if (e != O_SSL_ERROR_SSL)
            snprintf(err, cap, "TLS error %d", e);
        return -1;
    }
    pthread_mutex_lock(&s->lock);
    int timeout_ms = s->send_timeout_ms;
    pthread_mutex_unlock(&s->lock);
    if (flush_gathered(s, until_ms(timeout_ms)) != 0) {
        snprintf(err, cap, "%s", errno == ETIMEDOUT ? "send timed out" : strerror(errno));
        return -1;
    }
    return 0;
}

int gp_tls_pending(gp_tls *s)
{
    pthread_mutex_lock(&s->lock);
    int p = O.SSL_has_pending(s->ssl);
    pthread_mutex_unlock(&s->lock);
    return p;
}

void gp_tls_set_send_timeout(gp_tls *s, int timeout_ms)
{
    pthread_mutex_lock(&s->lock);
    s->send_timeout_ms = timeout_ms;
    pthread_mutex_unlock(&s->lock);
}

/* Both close_notify alerts: ours out, the peer's in, with no application data in between (the
 * daemon's session ends this way before the worker's begins on the same socket). 0, or -1. */
int gp_tls_close(gp_tls *s, int timeout_ms, char *err, size_t cap)
{
    int64_t until = until_ms(timeout_ms); /* both alerts */
    if (flush_gathered(s, until) != 0) {
        snprintf(err, cap, "closing the server's TLS session: %s", strerror(errno));
        return -1;
    }
    pthread_mutex_lock(&s->lock);
    s->gather = 0; /* the alerts go out as they are made */
    pthread_mutex_unlock(&s->lock);
    for (int zeros = 0;;) {
        O.ERR_clear_error();
        int r = O.SSL_shutdown(s->ssl);
        if (r == 1)
            return 0;
        int e = r == 0 ? O_SSL_ERROR_WANT_READ : O.SSL_get_error(s->ssl, r);
        if (r == 0 && zeros++ == 0)
            continue; /* ours is sent: the next call reads theirs */
        if (e == O_SSL_ERROR_WANT_READ || e == O_SSL_ERROR_WANT_WRITE) {
            if (wait_fd(s->fd, e == O_SSL_ERROR_WANT_READ ? POLLIN : POLLOUT, until) == 0)
                continue;
            snprintf(err, cap, "closing the server's TLS session: %s", strerror(errno));
            return -1;
        }
        char why[200];
        ssl_error_text(why, sizeof why, "the server closed the connection");
        snprintf(err, cap, "closing the server's TLS session: %s", why);
        return -1;
    }
}
