/*
 * connect_internal.h: what the units of the shim's connect step (gp_connect, shim_core.h) share,
 * and no one else. Four units, one job each:
 *   connect.c           the session: configuration, VA window, connecting, retries across a
 *                       restart or a redirect, and the one error line when nothing works
 *   connect_select.c    server selection: every server asked `info` at once, candidates ordered
 *   connect_hello.c     the hello exchange on a connected socket: TLS hand-over, queue notices,
 *                       an older or newer server's reply
 *   connect_redirect.c  whether and how to follow a fleet's redirect (GP_EREDIRECT)
 */
#ifndef GP_CONNECT_INTERNAL_H
#define GP_CONNECT_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "client_config.h"
#include "net.h"

/* ATTEMPT_RESTARTING: the server said it is stopping or restarting (GP_ESHUTDOWN), or closed
 * the connection after it had accepted the hello (it went away while we waited): try again. */
enum {
    ATTEMPT_OK,
    ATTEMPT_CONNECT,
    ATTEMPT_REFUSED,
    ATTEMPT_VAWINDOW,
    ATTEMPT_TLS,
    ATTEMPT_RESTARTING,
    ATTEMPT_REDIRECT,
    ATTEMPT_UNTRUSTED /* refused by the trust rules before anything secret was sent: msg is
                       * the whole line (what, and the command that fixes it) */
};

/* A fleet sends a client on to the server that holds a GPU for it (GP_EREDIRECT); more than
 * this many hops in one connect means the servers disagree: give up rather than loop. */
#define MAX_REDIRECTS 4

/* One connect: who we are, what we ask for, and the server being tried. */
typedef struct hello_ctx {
    char host[256], user[256], program[1024];
    const gp_client_config *cfg; /* requirements, timeouts */
    const gp_server_config *srv; /* the server being tried: token, TLS, compression */
    double timeout_s;
    const char *desc;       /* the server being tried ("host:port"), for messages */
    const char *token_hint; /* what to check when the token is refused */
    int64_t
        restart_until;  /* mono_ms deadline of the retries across a server restart; 0: none yet */
    int64_t busy_since; /* mono_ms of the first TLS handshake the server closed; 0: none */
    int busy_tries;     /* how many it closed since */
    char redirect_fp[GP_FINGERPRINT_CAP]; /* ATTEMPT_REDIRECT: the target's pin, "" if none */
    unsigned features; /* ATTEMPT_OK: GP_HELLO_LZ4 / GP_HELLO_KEEPALIVE, as both sides agreed */
} hello_ctx;

/* ATTEMPT_FATAL: the one error line was printed already (no window at all). */
enum {
    ATTEMPT_FATAL = 100
};

/* CLOCK_MONOTONIC in ms. */
static inline int64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- connect_hello.c ------------------------------------------------------------------------ */
/* The host, user and program of this process, for the hello. */
void gp_connect_identity(hello_ctx *hc);
/* Hello on a connected socket (inside TLS when l->tls), and its answer. ATTEMPT_OK (the
 * snapshot stored, hc->features set), else the kind of failure with the reason in msg
 * (ATTEMPT_REDIRECT: msg is the address, hc->redirect_fp its pin). */
int gp_connect_hello(gp_link *l, hello_ctx *hc, uint64_t va_base, uint64_t va_size, char *msg,
                     size_t mcap);

/* ---- connect_select.c ----------------------------------------------------------------------- */
/* Probe every server with info (all at once) and put the candidates, best first, in order[].
 * Returns how many; the others are in failures (with their warning lines printed). */
int gp_connect_select(const gp_client_config *cfg, int *order, char *failures, size_t fcap,
                      int *nfail);
/* Append "desc: why" to the failures list. */
void gp_connect_add_failure(char *failures, size_t cap, int *nfail, const char *desc,
                            const char *why);

/* ---- connect_redirect.c --------------------------------------------------------------------- */
/* A GP_EREDIRECT from `from` to `where` (hc->redirect_fp: the pin it gave): into hop, the
 * settings to say the same hello there with (from may be hop itself). ATTEMPT_OK, or
 * ATTEMPT_UNTRUSTED / ATTEMPT_REFUSED / ATTEMPT_CONNECT with msg: nothing is sent to a target
 * refused. */
int gp_connect_follow_redirect(const hello_ctx *hc, const gp_server_config *from, const char *where,
                               gp_server_config *hop, char *msg, size_t mcap);

#endif /* GP_CONNECT_INTERNAL_H */
