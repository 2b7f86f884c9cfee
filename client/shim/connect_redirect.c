/*
 * connect_redirect.c: following a fleet's redirect (GP_EREDIRECT: the server that holds a GPU
 * for this client is another one). Followed only where this client can trust the target: over
 * a verified TLS connection with the target's pin in the reply (equal to the client's own pin
 * for that address if it has one), or over plain TCP only to one of the client's own servers.
 * connect.c says the same hello there.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "connect_internal.h"
#include "gp_tls.h"
#include "shim.h"

/* The client's own entry for the server at host:port, or NULL. */
static const gp_server_config *configured(const gp_client_config *cfg, const gp_server_config *t)
{
    for (int i = 0; i < cfg->nservers; i++)
        if (!strcasecmp(cfg->servers[i].host, t->host) && !strcmp(cfg->servers[i].port, t->port))
            return &cfg->servers[i];
    return NULL;
}

/* A GP_EREDIRECT from `from` to `where` (hc->redirect_fp: the pin it gave): into hop, the
 * settings to say the same hello there with. Followed only where this client can trust the
 * target: over a verified TLS connection (gp_tls_connect checked the pin or CA of `from`)
 * with the target's pin in the reply, which must also equal the client's own pin for that
 * address if it has one; over plain TCP (tls = false), only to one of the client's own
 * servers, with that entry's settings. ATTEMPT_OK, or ATTEMPT_UNTRUSTED / ATTEMPT_REFUSED
 * with msg: nothing is sent to a target refused. */
static int redirect_into(const hello_ctx *hc, const gp_server_config *from, const char *where,
                         gp_server_config *hop, char *msg, size_t mcap);
int gp_connect_follow_redirect(const hello_ctx *hc, const gp_server_config *from, const char *where,
                               gp_server_config *hop, char *msg, size_t mcap)
{
    /* from may be hop itself (a second redirect): decide from a copy of it. */
    gp_server_config *prev = malloc(sizeof *prev);
    if (!prev) {
        snprintf(msg, mcap, "out of memory");
        return ATTEMPT_CONNECT;
    }
    memcpy(prev, from, sizeof *prev);
    int k = redirect_into(hc, prev, where, hop, msg, mcap);
    free(prev);
    return k;
}

static int redirect_into(const hello_ctx *hc, const gp_server_config *from, const char *where,
                         gp_server_config *hop, char *msg, size_t mcap)
{
    memset(hop, 0, sizeof *hop);
    if (gp_parse_server_address(where, hop) != 0) {
        snprintf(msg, mcap, "it sent this client to '%s', which is not an address", where);
        return ATTEMPT_REFUSED;
    }
    char to[300]; /* host (255) and port */
    gp_server_desc(hop, to, sizeof to);
    const gp_server_config *own = configured(hc->cfg, hop);
    if (!from->tls) {
        if (!own) {
            snprintf(msg, mcap,
                     "server %s (plain TCP) sent this client on to %s, which is not one of its "
                     "configured servers: not followed, nothing was sent there; over plain TCP "
                     "a redirect is followed only among the servers of GPUPOOL_SERVER or the "
                     "configuration file (add it there, or pin the fleet's servers: `gpupool "
                     "login %s`)",
                     hc->desc, to, hc->desc);
            return ATTEMPT_UNTRUSTED;
        }
        memcpy(hop, own, sizeof *hop);
        return gp_tls_trusted(hop, msg, mcap) == 0 ? ATTEMPT_OK : ATTEMPT_UNTRUSTED;
    }
    const char *fp = hc->redirect_fp;
    if (!gp_fingerprint_valid(fp, strlen(fp))) {
        snprintf(msg, mcap,
                 "server %s sent this client on to %s without %s fingerprint: not followed, "
                 "nothing was sent there; its servers need gpupoold with protocol 1.4 (they "
                 "tell clients each other's pins), or pin it yourself (`gpupool login %s`)",
                 hc->desc, to, *fp ? "a valid" : "that server's", to);
        return ATTEMPT_UNTRUSTED;
    }
    if (own && *own->tls_fingerprint &&
        gp_tls_pin_matches(fp, own->tls_fingerprint, to, msg, mcap) != 0)
        return ATTEMPT_UNTRUSTED; /* the fleet's pin for it is not ours */
    if (own) {
        memcpy(hop, own, sizeof *hop);
    } else {
        memcpy(hop, from, sizeof *hop); /* its token and client certificate */
        hop->tls_ca[0] = 0;             /* trusted by the pin it came with */
        hop->tls_prefix = 0;
        if (gp_parse_server_address(where, hop) != 0) { /* cannot fail: parsed above */
            snprintf(msg, mcap, "it sent this client to '%s', which is not an address", where);
            return ATTEMPT_REFUSED;
        }
    }
    hop->tls = 1;
    snprintf(hop->tls_fingerprint, sizeof hop->tls_fingerprint, "%s", fp);
    return ATTEMPT_OK;
}
