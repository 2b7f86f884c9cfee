/*
 * connect_select.c: which server to try first when several are configured (connect.c; a single
 * server is used as it is, without a probe). Every server is asked `info` at once, each within
 * probe_timeout (0: 2 s); the first, in list order, with a free matching GPU wins, then those
 * with a matching GPU but none free, shortest queue first. A server whose probe fails is skipped
 * with one warning line; one without a matching GPU is skipped (debug line). Servers of protocol
 * 1.0 do not know info: when none answered it and some speak 1.0, those get a hello in list
 * order, as without selection.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "connect_internal.h"
#include "info_client.h"
#include "shim.h"
#include "shim_core.h"

typedef struct probe {
    const gp_client_config *cfg;
    const gp_server_config *srv;
    gp_info_result res;
    int rc;         /* gp_info_fetch's */
    char err[1024]; /* why it failed */
    pthread_t thread;
    int threaded;
} probe;

/* probe_timeout is a hard limit for each probe; 0 means GP_INFO_DEFAULT_TIMEOUT (2 s), never
 * forever (gp_info_fetch). */
static void *probe_main(void *arg)
{
    probe *p = arg;
    p->rc = gp_info_fetch(p->cfg, p->srv, p->cfg->probe_timeout, &p->res, p->err, sizeof p->err);
    return NULL;
}

/* "GPU 1, model 'H100', at least 40000000000 bytes" or "any GPU": for messages. */
static void describe_requirements(const gp_client_config *cfg, char *out, size_t cap)
{
    out[0] = 0;
    size_t n = 0;
    if (*cfg->gpu)
        n += (size_t)snprintf(out + n, cap - n, "GPU %s", cfg->gpu);
    if (*cfg->model && n < cap)
        n += (size_t)snprintf(out + n, cap - n, "%smodel '%s'", n ? ", " : "", cfg->model);
    if (cfg->min_memory && n < cap)
        snprintf(out + n, cap - n, "%sat least %llu bytes", n ? ", " : "",
                 (unsigned long long)cfg->min_memory);
    if (!*out)
        snprintf(out, cap, "any GPU");
}

/* Append "desc: why" to the failures list. */
void gp_connect_add_failure(char *failures, size_t cap, int *nfail, const char *desc,
                            const char *why)
{
    size_t n = strlen(failures);
    if (n < cap)
        snprintf(failures + n, cap - n, "%s%s: %s", *nfail ? "; " : "", desc, why);
    (*nfail)++;
}

/* Probe every server with info (all at once) and put the candidates, best first, in order[].
 * Returns how many; the others are in failures (with their warning lines printed). */
int gp_connect_select(const gp_client_config *cfg, int *order, char *failures, size_t fcap,
                      int *nfail)
{
    int n = cfg->nservers;
    probe *p = calloc((size_t)n, sizeof *p);
    if (!p) { /* no memory for the probes: try them in list order, as without selection */
        for (int i = 0; i < n; i++)
            order[i] = i;
        return n;
    }
    for (int i = 0; i < n; i++) {
        p[i].cfg = cfg;
        p[i].srv = &cfg->servers[i];
        p[i].threaded = pthread_create(&p[i].thread, NULL, probe_main, &p[i]) == 0;
    }
    for (int i = 0; i < n; i++) {
        if (!p[i].threaded) {
            probe_main(&p[i]); /* no thread to spare: this one in turn */
        } else if (pthread_join(p[i].thread, NULL) != 0) { /* cannot happen: joinable, ours */
            gp_info_free(&p[i].res);
            p[i].rc = -1;
            snprintf(p[i].err, sizeof p[i].err, "its probe thread was lost");
        }
    }
    char req[600];
    describe_requirements(cfg, req, sizeof req);
    /* No server answered info, and some said they speak protocol 1.0 (they know hello, not
     * info): this client still works with them, by hello in list order, as without selection. */
    int answered = 0, old_servers = 0;
    for (int i = 0; i < n; i++) {
        answered += p[i].rc == 0;
        old_servers += p[i].rc == GP_INFO_OLD_SERVER;
    }
    int fallback = !answered && old_servers > 0;
    if (fallback)
        gp_log_debug("no server answered info and %d speak%s protocol 1.0: trying %s with hello "
                     "in list order, without selection",
                     old_servers, old_servers == 1 ? "s" : "", old_servers == 1 ? "it" : "them");
    int nfree = 0, nwait = 0, wait_idx[GP_MAX_SERVERS];
    for (int i = 0; i < n; i++) {
        char desc[600], why[1200];
        gp_server_desc(&cfg->servers[i], desc, sizeof desc);
        const gp_info_result *r = &p[i].res;
        if (fallback && p[i].rc == GP_INFO_OLD_SERVER) {
            gp_log_debug("server %s: %s; it gets a hello", desc, p[i].err);
            order[nfree++] = i; /* list order */
            continue;
        }
        if (p[i].rc != 0) {
            snprintf(why, sizeof why, "%s", p[i].err);
        } else if (r->result != 0) {
            const char *code = gp_result_name(r->result);
            if (r->result == GP_EVERSION)
                snprintf(why, sizeof why, "server speaks protocol %u.%u, this client %u.%u%s%s",
                         r->major, r->minor, GP_PROTO_MAJOR, GP_PROTO_MINOR,
                         *r->message ? ": " : "", r->message);
            else
                snprintf(why, sizeof why, "%s%s",
                         *r->message ? r->message
                         : code      ? code
                                     : "refused",
                         r->result == GP_EAUTH
                             ? " (check its token: GPUPOOL_TOKEN or the configuration file)"
                             : "");
        } else {
            gp_log_debug("probe %s (%s): %u GPUs, %u matching (%s), %u free, queue %u", desc,
                         r->server, r->gpus, r->matching, req, r->free_matching, r->queue);
            if (r->matching == 0) {
                snprintf(why, sizeof why, "none of its %u GPUs meets the requirements (%s)",
                         r->gpus, req);
                gp_log_debug("server %s skipped: %s", desc, why);
                gp_connect_add_failure(failures, fcap, nfail, desc, why);
            } else if (r->free_matching > 0) {
                order[nfree++] = i;
            } else {
                wait_idx[nwait++] = i;
            }
            continue;
        }
        gp_log_info("server %s skipped: %s", desc, why);
        gp_connect_add_failure(failures, fcap, nfail, desc, why);
    }
    /* Then those with a matching GPU but none free: shortest queue first, ties in list order
     * (insertion sort: stable, and at most GP_MAX_SERVERS entries). */
    for (int a = 1; a < nwait; a++) {
        int v = wait_idx[a], b = a - 1;
        while (b >= 0 && p[wait_idx[b]].res.queue > p[v].res.queue) {
            wait_idx[b + 1] = wait_idx[b];
            b--;
        }
        wait_idx[b + 1] = v;
    }
    for (int a = 0; a < nwait; a++)
        order[nfree + a] = wait_idx[a];
    int count = nfree + nwait;
    if (count > 0 && gp_log_debug_enabled()) {
        char desc[600];
        gp_server_desc(&cfg->servers[order[0]], desc, sizeof desc);
        gp_log_debug("chose server %s (%s; %d candidate%s)", desc,
                     fallback ? "protocol 1.0, first in list order"
                     : nfree  ? "a matching GPU is free"
                              : "shortest queue",
                     count, count == 1 ? "" : "s");
    }
    for (int i = 0; i < n; i++)
        gp_info_free(&p[i].res);
    free(p);
    return count;
}
