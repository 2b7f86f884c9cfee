/*
 * connect_parts.c: a lease spread over several servers of a fleet (issue 37, item 3; `spread =
 * true`, docs/multi-gpu.md "Across servers"). A fleet that has no one server with the GPUs a
 * spread client asks for answers its hello with GP_EREDIRECT and redirect_parts: for each part
 * its server, that server's pin, its GPU count and the program's ordinal of its first device.
 * This unit checks those parts (a hostile or broken server must not send the client anywhere it
 * would not go for a one-server redirect, nor make it number its devices wrongly), decides each
 * part's settings by the trust rules of a one-server redirect (connect_redirect.c), cuts the
 * client's address window into one slice per part, and stores the parts' snapshots once every
 * part is connected. connect.c connects the parts, in order.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "connect_internal.h"
#include "shim.h"
#include "shim_core.h"

#define SLICE_ALIGN (2ull << 20) /* 2 MiB: the granularity of device allocations */

/* What is wrong with the parts of r, into why (empty: nothing); plan filled as far as read. */
static int check_parts(const hello_ctx *hc, const gp_hello_reply *r, gp_spread_plan *plan,
                       char *why, size_t wcap)
{
    uint32_t n = r->redirect_parts.count;
    why[0] = 0;
    if (r->spread_group == 0) {
        snprintf(why, wcap, "it named %u parts without a spread group", n);
        return 0;
    }
    if (n < 2 || n > GP_MAX_GPUS) {
        snprintf(why, wcap, "it named %u part%s; a spread lease has 2 to %d", n, n == 1 ? "" : "s",
                 GP_MAX_GPUS);
        return 0;
    }
    gp_server_config *check = malloc(sizeof *check);
    if (!check)
        return -1;
    gp_record_span span = r->redirect_parts;
    int64_t sum = 0;
    for (uint32_t i = 0; i < n && !*why; i++) {
        gp_redirect_part p;
        gp_part_target *t = &plan->part[i];
        if (gp_redirect_part_next(&span, &p) != 0) {
            snprintf(why, wcap, "its part %u is malformed", i);
            break;
        }
        /* The generated decoder bounds server to 255 and fingerprint to 63 bytes. */
        memcpy(t->server, p.server, p.server_len);
        t->server[p.server_len] = 0;
        memcpy(t->fingerprint, p.fingerprint, p.fingerprint_len);
        t->fingerprint[p.fingerprint_len] = 0;
        memset(check, 0, sizeof *check);
        if (p.gpus < 1 || p.gpus > GP_MAX_GPUS)
            snprintf(why, wcap, "it gave part %u (%s) %u GPUs", i, t->server, p.gpus);
        else if ((int64_t)p.first_device != sum)
            snprintf(why, wcap,
                     "it numbered the devices out of order: part %u (%s) starts at device %u, "
                     "not %lld",
                     i, t->server, p.first_device, (long long)sum);
        else if (strlen(t->server) != p.server_len ||
                 gp_parse_server_address(t->server, check) != 0 || check->tls_prefix)
            snprintf(why, wcap, "it gave part %u the address '%.*s', which is not one (host:port)",
                     i, (int)p.server_len, p.server);
        else if (hc->srv->tls && !gp_fingerprint_valid(t->fingerprint, p.fingerprint_len))
            snprintf(why, wcap,
                     "it gave part %u (%s) %s fingerprint: over TLS every part needs its "
                     "server's pin",
                     i, t->server, p.fingerprint_len ? "an invalid" : "no");
        t->gpus = (int)p.gpus;
        t->first_device = (int)p.first_device;
        sum += p.gpus;
    }
    free(check);
    if (!*why && sum != hc->cfg->gpus)
        snprintf(why, wcap, "its parts hold %lld GPUs; this process asked for %d", (long long)sum,
                 hc->cfg->gpus);
    return 0;
}

int gp_connect_parse_parts(const hello_ctx *hc, const gp_hello_reply *r, gp_spread_plan *plan,
                           char *msg, size_t mcap)
{
    memset(plan, 0, sizeof *plan);
    char why[768];
    if (check_parts(hc, r, plan, why, sizeof why) != 0) {
        snprintf(msg, mcap, "out of memory");
        return ATTEMPT_CONNECT;
    }
    if (*why) {
        /* The whole line: nothing was sent anywhere, and the fault is the fleet's. */
        snprintf(msg, mcap,
                 "server %s offered a lease spread over several servers that this client "
                 "refuses: %s. Nothing was sent to any part; its gpupoold may be broken or "
                 "newer than this client: tell its operator, or set GPUPOOL_SPREAD=0",
                 hc->desc, why);
        return ATTEMPT_UNTRUSTED;
    }
    plan->group = r->spread_group;
    plan->nparts = (int)r->redirect_parts.count;
    return ATTEMPT_PARTS;
}

int gp_connect_resolve_parts(hello_ctx *hc, const gp_server_config *from, gp_spread_plan *plan,
                             char *msg, size_t mcap)
{
    free(plan->hop);
    plan->hop = calloc((size_t)plan->nparts, sizeof *plan->hop);
    if (!plan->hop) {
        snprintf(msg, mcap, "out of memory");
        return ATTEMPT_CONNECT;
    }
    for (int i = 0; i < plan->nparts; i++) {
        /* Each part is a redirect to its server with its pin: the same rules, decided for all
         * parts before any is connected, so that a refused one means nothing went anywhere. */
        snprintf(hc->redirect_fp, sizeof hc->redirect_fp, "%s", plan->part[i].fingerprint);
        char why[1024];
        int k = gp_connect_follow_redirect(hc, from, plan->part[i].server, &plan->hop[i], why,
                                           sizeof why);
        if (k != ATTEMPT_OK) {
            snprintf(msg, mcap, "part %d of %d of a spread lease (%d GPU%s at %s): %s", i + 1,
                     plan->nparts, plan->part[i].gpus, plan->part[i].gpus == 1 ? "" : "s",
                     plan->part[i].server, why);
            return k;
        }
    }
    return ATTEMPT_OK;
}

/* Slices, not one window per part: every part's server maps device memory at the addresses the
 * client gives it, and device pointers of different servers must never overlap, so that a
 * pointer alone names its device (cuPointerGetAttribute, vamap.c) and never aliases another
 * part's. Equal slices, in part order, each a multiple of 2 MiB from a 2 MiB boundary. */
int gp_connect_slice(uint64_t base, uint64_t size, int n, int k, uint64_t *slice_base,
                     uint64_t *slice_size)
{
    if (n < 1 || k < 0 || k >= n)
        return -1;
    uint64_t first = (base + SLICE_ALIGN - 1) & ~(SLICE_ALIGN - 1);
    if (first < base || first - base >= size)
        return -1;
    uint64_t each = (size - (first - base)) / (uint64_t)n & ~(SLICE_ALIGN - 1);
    if (each == 0)
        return -1;
    *slice_base = first + (uint64_t)k * each;
    *slice_size = each;
    return 0;
}

void gp_connect_store_part(int first_device, int ndevices, const uint8_t *reply, size_t len)
{
    gp_hello_reply r;
    int rc = gp_hello_reply_decode(reply, len, &r);
    if (rc != 0 && rc != GP_PROTO_ETRAILING) /* checked when it came: cannot happen */
        return;
    gp_state_set_part_snapshot(first_device, ndevices, &r);
}

void gp_spread_plan_free(gp_spread_plan *plan)
{
    if (!plan)
        return;
    free(plan->hop);
    free(plan);
}
