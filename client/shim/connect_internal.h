/*
 * connect_internal.h: what the units of the shim's connect step (gp_connect, shim_core.h) share,
 * and no one else. Four units, one job each:
 *   connect.c           the session: configuration, VA window, connecting, retries across a
 *                       restart or a redirect, and the one error line when nothing works
 *   connect_select.c    server selection: every server asked `info` at once, candidates ordered
 *   connect_hello.c     the hello exchange on a connected socket: TLS hand-over, queue notices,
 *                       an older or newer server's reply
 *   connect_redirect.c  whether and how to follow a fleet's redirect (GP_EREDIRECT)
 *   connect_parts.c     a lease spread over several servers (issue 37, item 3): the parts a
 *                       fleet names checked, each part's trust settings and window slice, and
 *                       the parts' snapshots stored once all are connected (connect.c connects)
 */
#ifndef GP_CONNECT_INTERNAL_H
#define GP_CONNECT_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "client_config.h"
#include "gp_protocol.h"
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
    ATTEMPT_UNTRUSTED, /* refused by the trust rules before anything secret was sent: msg is
                        * the whole line (what, and the command that fixes it) */
    ATTEMPT_PARTS      /* a fleet's GP_EREDIRECT naming the parts of a spread lease: hc->plan
                        * holds them, checked (and, from try_server, their settings) */
};

/* A fleet sends a client on to the server that holds a GPU for it (GP_EREDIRECT); more than
 * this many hops in one connect means the servers disagree: give up rather than loop. */
#define MAX_REDIRECTS 4

/* One part of a spread lease as the fleet named it (redirect_parts), checked. */
typedef struct gp_part_target {
    char server[256];                     /* "host:port" */
    char fingerprint[GP_FINGERPRINT_CAP]; /* its pin as the fleet knows it, "" if none */
    int gpus, first_device;
} gp_part_target;

/* The parts of a spread lease (ATTEMPT_PARTS), in device order. */
typedef struct gp_spread_plan {
    uint64_t group; /* spread_group: what each part's hello names */
    int nparts;     /* 2..GP_MAX_GPUS */
    gp_part_target part[GP_MAX_GPUS];
    gp_server_config *hop; /* nparts settings to say each part's hello with (the trust rules of
                            * a redirect: gp_connect_resolve_parts), NULL before; malloc'd */
} gp_spread_plan;

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
    unsigned features;    /* ATTEMPT_OK: GP_HELLO_LZ4 / GP_HELLO_KEEPALIVE, as both sides agreed */
    gp_spread_plan *plan; /* where a reply's parts go (ATTEMPT_PARTS); NULL: this connect asks
                           * for no spread lease */
    /* A part's hello (parts > 0): which part of which group, its GPUs, its window slice. */
    uint64_t spread_group;
    int part, parts, part_gpus;
    uint64_t part_va_base, part_va_size;
    /* ATTEMPT_OK of a part's hello: its reply (malloc'd; stored in state.c once every part is
     * connected, so a part that fails leaves no snapshot behind) and its session. */
    uint8_t *part_reply;
    size_t part_reply_len;
    uint64_t session_id;
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

/* ---- connect_parts.c ------------------------------------------------------------------------ */
/* The parts of a GP_EREDIRECT reply r (redirect_parts not empty) checked into plan: 2 to
 * GP_MAX_GPUS parts, a spread_group, each of at least one GPU, their first devices 0, n0,
 * n0+n1... in order, hc->cfg->gpus in all, addresses that parse, and over TLS valid pins.
 * ATTEMPT_PARTS, or ATTEMPT_UNTRUSTED with msg the whole line naming what is wrong (nothing
 * was sent to any part). */
int gp_connect_parse_parts(const hello_ctx *hc, const gp_hello_reply *r, gp_spread_plan *plan,
                           char *msg, size_t mcap);
/* Each part's settings (plan->hop) by the trust rules of a one-server redirect from `from`,
 * every part decided before any is connected. ATTEMPT_OK, or the refusal's kind with msg
 * naming the part: nothing is sent to any part then. */
int gp_connect_resolve_parts(hello_ctx *hc, const gp_server_config *from, gp_spread_plan *plan,
                             char *msg, size_t mcap);
/* Part k's slice of the window [base, base + size) for n parts: 0 with *slice_base and
 * *slice_size set, or -1 (the window is too small for n slices of 2 MiB). */
int gp_connect_slice(uint64_t base, uint64_t size, int n, int k, uint64_t *slice_base,
                     uint64_t *slice_size);
/* Every part's reply (hc of each part, in order) stored as the device snapshot (state.c). */
void gp_connect_store_part(int first_device, int ndevices, const uint8_t *reply, size_t len);
void gp_spread_plan_free(gp_spread_plan *plan);

/* ---- state.c: the one function of it only the connect step calls ---------------------------- */
/* A part's hello reply: the snapshot of its devices first_device..first_device+ndevices-1
 * (part 0's starts the snapshot as gp_state_set_snapshot does). */
void gp_state_set_part_snapshot(int first_device, int ndevices, const gp_hello_reply *r);

#endif /* GP_CONNECT_INTERNAL_H */
