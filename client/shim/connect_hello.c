/*
 * connect_hello.c: the hello exchange with a gpupool server on a connected socket (connect.c
 * connects and retries; connect_internal.h). Sends the hello (this process's identity, the
 * requirements, the VA window, the features it wants) and reads until the reply: queue and
 * keepalive notices are printed while the server keeps the hello unanswered (GP_INFO_QUEUED:
 * every GPU is taken); with TLS the hand-over from gpupoold's session to the worker's
 * (GP_INFO_HANDOFF, docs/protocol.md "TLS"); a TLS alert instead of an answer says why the
 * server refused us. An older server's shorter reply reads its missing fields as 0, a newer
 * server's longer one is read as far as this client knows it.
 */
#include <errno.h>
#include <pwd.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "compress.h"
#include "connect_internal.h"
#include "sha256.h"
#include "shim.h"
#include "shim_core.h"

/* "prog arg1 arg2" from /proc/self/cmdline, argv[0] reduced to its basename. */
static size_t program_string(char *out, size_t cap)
{
    char raw[8192];
    size_t n = 0;
    FILE *f = fopen("/proc/self/cmdline", "rb");
    if (f) {
        n = fread(raw, 1, sizeof raw - 1, f);
        fclose(f);
    }
    if (n == 0)
        return gp_utf8_clean(out, cap, "?", 1);
    raw[n] = 0;
    const char *argv0 = raw, *slash = strrchr(argv0, '/');
    const char *start = slash ? slash + 1 : argv0;
    size_t len = strlen(start);
    char joined[8192];
    memcpy(joined, start, len);
    size_t j = len;
    for (size_t i = strlen(raw); i < n; i++)
        joined[j++] = raw[i] ? raw[i] : ' ';
    while (j > 0 && joined[j - 1] == ' ')
        j--;
    return gp_utf8_clean(out, cap, joined, j);
}

/* A notice before the hello reply. No CUDA call has run on the server yet, so it is never the
 * deferred error of one: print it and record nothing. Every one is printed, bypassing
 * gp_pending_notice's table of texts already shown: queue updates are news each time, and a long
 * wait must not fill that table for the session. Its code, 0 if unreadable. */
static int early_notice(const uint8_t *body, size_t len)
{
    gp_notice m;
    if (gp_notice_decode(body, len, &m) != 0) {
        gp_log_debug("malformed notice before the hello reply ignored");
        return 0;
    }
    if (gp_code_is_info(m.code)) {
        if (m.text_len)
            gp_log_info("%.*s", (int)m.text_len, m.text);
        return m.code;
    }
    if (m.text_len)
        gp_log_error("%.*s", (int)m.text_len, m.text);
    return m.code;
}

/* GPUPOOL_SERVER_TIMEOUT in ms (conn.c reads it too); 0: none. */
static int64_t handshake_timeout_ms(void)
{
    return (int64_t)(gp_server_timeout_setting() * 1000);
}

static uint64_t handoff_binding(const uint8_t *body, size_t len)
{
    static const char label[] = "gpupool tls handoff";
    gp_sha256_ctx c;
    uint8_t d[GP_SHA256_DIGEST_SIZE];
    gp_sha256_init(&c);
    gp_sha256_update(&c, label, sizeof label); /* with its NUL */
    gp_sha256_update(&c, body, len);
    gp_sha256_final(&c, d);
    return gp_rd_u64(d);
}

/* GP_INFO_HANDOFF: gpupoold's TLS session ends (close_notify both ways) and the worker's
 * begins on the same socket, where we prove first that we are the client of that hello. 0, or
 * -1 with msg filled; -2 when the worker closed the connection without a word during its
 * handshake (its gpupoold went away during the hand-over, e.g. a restart: a clean-clone CI's
 * soak met it; try again, as for any server that took us in and went away). */
static int tls_handoff(gp_link *l, const hello_ctx *hc, uint64_t binding, char *msg, size_t mcap)
{
    int ms = gp_timeout_ms(hc->timeout_s);
    int rc = gp_tls_close(l->tls, ms, msg, mcap);
    gp_tls_free(l->tls);
    l->tls = NULL;
    if (rc != 0)
        return -1;
    l->tls = gp_tls_connect(hc->srv, l->fd, 1, ms, msg, mcap);
    if (!l->tls)
        return errno == ECONNRESET ? -2 : -1; /* (a refused certificate is an alert: EPROTO) */
    gp_ping p = {.token = binding};
    uint8_t f[16 + 8];
    size_t n = gp_ping_frame(f, gp_conn_new_req(), &p);
    if (gp_link_write(l, f, n) != 0) {
        snprintf(msg, mcap, "TLS hand-over: %s", gp_link_error(l, errno));
        return -1;
    }
    return 0;
}

/* A TLS alert instead of an answer: with TLS 1.3 the server checks our certificate after our
 * side of the handshake has finished, so a missing or refused one shows up here. */
static int tls_refusal(gp_link *l, char *msg, size_t mcap)
{
    const char *hint = "";
    if (strstr(l->err, "certificate required"))
        hint = "; it requires a client certificate that its tls_client_ca signed: set "
               "GPUPOOL_TLS_CERT and GPUPOOL_TLS_KEY (tls_cert, tls_key)";
    else if (strstr(l->err, "unknown ca") || strstr(l->err, "certificate"))
        hint = "; it did not accept the client certificate (GPUPOOL_TLS_CERT): use one that its "
               "tls_client_ca signed";
    snprintf(msg, mcap, "TLS: the server ended the connection (%s)%s", l->err, hint);
    return ATTEMPT_TLS;
}

/* GP_HELLO_LZ4 when the server's configuration (its own compression, else the top level's, or
 * GPUPOOL_COMPRESSION) asks for compressed copies and liblz4 loads. */
static uint32_t want_lz4(const gp_server_config *srv)
{
    if (srv->compression != GP_COMPRESSION_LZ4)
        return 0;
    if (gp_lz4_available())
        return GP_HELLO_LZ4;
    static atomic_int said;
    if (!atomic_exchange(&said, 1))
        gp_log_info("compression = lz4 is set but %s: copies stay uncompressed (install liblz4, "
                    "package liblz4-1)",
                    gp_lz4_why());
    return 0;
}

/* connect_timeout in the hello (protocol 1.5), in ms rounded up: a fleet holds a GPU for this
 * client's redirect no longer than the client waits for it. 0: no limit. */
static uint32_t timeout_ms(double seconds)
{
    if (!(seconds > 0))
        return 0;
    return seconds < UINT32_MAX / 1000.0 ? (uint32_t)(seconds * 1000 + 0.999) : UINT32_MAX;
}

/* GP_HELLO_SPREAD (protocol 1.8, issue 37): a lease of several GPUs may come in parts from
 * several servers of a fleet. Only where the caller can take parts (hc->plan); a part's own
 * hello says it too. */
static uint32_t spread_flag(const hello_ctx *hc)
{
    return hc->cfg->spread && hc->cfg->gpus > 1 && (hc->plan || hc->parts) ? GP_HELLO_SPREAD : 0;
}

/* A part's reply (hc->parts > 0): kept for connect.c to store once every part is connected.
 * ATTEMPT_OK (body is hc's now), or ATTEMPT_REFUSED with msg. */
static int keep_part_reply(hello_ctx *hc, const gp_hello_reply *r, uint8_t *body, size_t len,
                           char *msg, size_t mcap)
{
    uint32_t have = r->device_count ? r->device_count : 1;
    if (r->minor < 8) {
        snprintf(msg, mcap,
                 "it speaks protocol %u.%u, which knows no spread lease (its part needs 1.8)",
                 r->major, r->minor);
        return ATTEMPT_REFUSED;
    }
    if (have != (uint32_t)hc->part_gpus) {
        snprintf(msg, mcap, "it gave this part %u device%s, the fleet said %d", have,
                 have == 1 ? "" : "s", hc->part_gpus);
        return ATTEMPT_REFUSED;
    }
    free(hc->part_reply);
    hc->part_reply = body;
    hc->part_reply_len = len;
    return ATTEMPT_OK;
}

/* Hello on a connected socket (inside TLS when l->tls). Fills msg with the reason when not
 * ATTEMPT_OK. */
int gp_connect_hello(gp_link *l, hello_ctx *hc, uint64_t va_base, uint64_t va_size, char *msg,
                     size_t mcap)
{
    gp_hello h = {
        .magic = GP_PROTO_MAGIC,
        .major = GP_PROTO_MAJOR,
        .minor = GP_PROTO_MINOR,
        .pid = (uint32_t)getpid(),
        .flags = want_lz4(hc->srv) | GP_HELLO_KEEPALIVE |
                 (hc->cfg->keep_gpu ? GP_HELLO_KEEP_GPU : 0u) | spread_flag(hc),
        .host = hc->host,
        .host_len = (uint32_t)strlen(hc->host),
        .user = hc->user,
        .user_len = (uint32_t)strlen(hc->user),
        .program = hc->program,
        .program_len = (uint32_t)strlen(hc->program),
        .token = hc->srv->token,
        .token_len = (uint32_t)strlen(hc->srv->token),
        .gpu = hc->cfg->gpu,
        .gpu_len = (uint32_t)strlen(hc->cfg->gpu),
        .model = hc->cfg->model,
        .model_len = (uint32_t)strlen(hc->cfg->model),
        .min_memory = hc->cfg->min_memory,
        .va_base = va_base,
        .va_size = va_size,
        .connect_timeout_ms = timeout_ms(hc->cfg->connect_timeout),
        .gpus = (uint32_t)(hc->parts ? hc->part_gpus : hc->cfg->gpus),
        .memory = hc->cfg->memory,
        .spread_group = hc->parts ? hc->spread_group : 0,
        .part = hc->parts ? (uint32_t)hc->part : 0,
        .parts = (uint32_t)hc->parts,
    };
    size_t n = 16 + gp_hello_size(&h);
    uint8_t *f = malloc(n);
    if (!f) {
        snprintf(msg, mcap, "out of memory");
        return ATTEMPT_CONNECT;
    }
    uint64_t req = gp_conn_new_req();
    gp_hello_frame(f, req, &h);
    uint64_t binding = l->tls ? handoff_binding(f + 16, n - 16) : 0;
    int ok = gp_link_write(l, f, n) == 0;
    free(f);
    if (!ok && l->tls) {
        /* The server may have ended the session with an alert (a refused client certificate):
         * read it, it says more than the failed write. */
        int err = errno;
        uint8_t b;
        if (gp_link_read(l, &b, 1, 2000) != 0 && errno == EPROTO)
            return tls_refusal(l, msg, mcap);
        errno = err;
    }
    if (!ok) {
        snprintf(msg, mcap, "sending hello: %s", gp_link_error(l, errno));
        return ATTEMPT_CONNECT;
    }

    int waited_note = 0, queued = 0, keepalive = 0;
    int64_t limit_ms = handshake_timeout_ms(), heard = mono_ms();
    for (;;) {
        uint8_t hb[16];
        /* The server may queue us until a GPU is free: wait without limit. A server that says
         * nothing for 5 s (an older one, or one busy starting a worker) gets one line, unless it
         * already told us our place in the queue. One that sends keepalives (GP_INFO_WORKING,
         * every second while it queues or prepares us) and then falls silent for
         * GPUPOOL_SERVER_TIMEOUT is hung or stopped. */
        int rc = gp_link_read(l, hb, 1, keepalive ? 1000 : 5000);
        if (rc != 0 && errno == ETIMEDOUT) {
            if (keepalive && limit_ms > 0 && mono_ms() - heard >= limit_ms) {
                snprintf(msg, mcap,
                         "the server stopped answering while we waited for a GPU "
                         "(no keepalive for %lld s): it is hung or stopped "
                         "(GPUPOOL_SERVER_TIMEOUT)",
                         (long long)(limit_ms / 1000));
                return ATTEMPT_CONNECT;
            }
            if (!waited_note++ && !queued && !keepalive)
                gp_log_info("waiting for server %s to answer (it may be waiting for a free GPU)",
                            hc->desc);
            continue;
        }
        heard = mono_ms();
        if (rc != 0 || gp_link_read(l, hb + 1, 15, 30000) != 0) {
            if (errno == EPROTO && l->tls)
                return tls_refusal(l, msg, mcap);
            snprintf(msg, mcap, "no answer to hello: %s", gp_link_error(l, errno));
            /* It had taken us in (queued us, or kept us informed) and went away: a restart. */
            return queued || keepalive ? ATTEMPT_RESTARTING : ATTEMPT_CONNECT;
        }
        gp_frame_header hd;
        gp_header_decode(hb, &hd);
        if (hd.len > GP_PROTO_MAX_BODY) {
            snprintf(msg, mcap, "it does not answer like a gpupool server; is the port right?");
            return ATTEMPT_CONNECT;
        }
        uint8_t *body = malloc(hd.len ? hd.len : 1);
        if (!body || gp_link_read(l, body, hd.len, 30000) != 0) {
            free(body);
            snprintf(msg, mcap, "no answer to hello: %s", gp_link_error(l, errno));
            return ATTEMPT_CONNECT;
        }
        if (!(hd.flags & GP_FLAG_REPLY) && hd.op == GP_OP_NOTICE && l->tls && hd.len >= 4 &&
            (int32_t)gp_rd_u32(body) == GP_INFO_HANDOFF) {
            free(body);
            int hk = tls_handoff(l, hc, binding, msg, mcap);
            if (hk != 0)
                return hk == -2 ? ATTEMPT_RESTARTING : ATTEMPT_TLS;
            keepalive = 0; /* the worker's part: it answers the hello, gpupoold sends nothing */
            continue;
        }
        if (!(hd.flags & GP_FLAG_REPLY) && hd.op == GP_OP_NOTICE) {
            int code = early_notice(body, hd.len);
            queued |= code == GP_INFO_QUEUED;
            keepalive |= code == GP_INFO_WORKING;
            if (code == GP_INFO_QUEUED || code == GP_INFO_WORKING) {
                /* It took us in: a restart or a busy spell from here on is a new one, with its
                 * whole wait (and its line), not what is left of one met before we got here. */
                hc->restart_until = 0;
                hc->busy_since = 0;
                hc->busy_tries = 0;
            }
            free(body);
            heard = mono_ms();
            continue;
        }
        if (!(hd.flags & GP_FLAG_REPLY) || hd.op != GP_OP_HELLO || hd.len < 4) {
            free(body);
            snprintf(msg, mcap, "it does not answer like a gpupool server; is the port right?");
            return ATTEMPT_CONNECT;
        }
        gp_hello_reply r;
        int drc = gp_hello_reply_decode(body, hd.len, &r);
        /* An older server's reply ends before fields appended later, read as 0 {minor below,
         * bytes}: 1.3 before redirect_fingerprint (1.4), 1.6's 12 and 1.8's 12; 1.4/1.5 before
         * 1.6's and 1.8's; 1.6/1.7 before 1.8's (u64 spread_group, u32 count of no parts). */
        static const uint16_t below[] = {4, 6, 8}, pad[] = {28, 24, 12};
        for (size_t i = 0; i < 3 && drc != 0 && drc != GP_PROTO_ETRAILING; i++) {
            uint8_t *padded = realloc(body, (size_t)hd.len + pad[i]);
            if (!padded)
                break;
            body = padded;
            memset(body + hd.len, 0, pad[i]);
            if (gp_hello_reply_decode(body, hd.len + pad[i], &r) == 0 &&
                r.major == GP_PROTO_MAJOR && r.minor < below[i])
                drc = 0;
        }
        /* A newer server appends fields to its reply: the ones we know are enough. */
        int decoded = drc == 0 || (drc == GP_PROTO_ETRAILING && r.major == GP_PROTO_MAJOR &&
                                   r.minor > GP_PROTO_MINOR);
        int32_t result = (int32_t)gp_rd_u32(body);
        if (result == GP_EVAWINDOW) {
            free(body);
            snprintf(msg, mcap, "the server could not reserve the address window");
            return ATTEMPT_VAWINDOW;
        }
        if (result == GP_EREDIRECT && decoded && r.redirect_parts.count > 0) {
            /* A spread lease's parts: only for a client that asked (GP_HELLO_SPREAD). */
            gp_log_debug("server %s: %.*s", hc->desc, (int)r.message_len, r.message);
            int k;
            if (!(h.flags & GP_HELLO_SPREAD) || !hc->plan) {
                snprintf(msg, mcap,
                         "it offered a lease spread over %u servers, which this client did not "
                         "ask for (spread is off)",
                         r.redirect_parts.count);
                k = ATTEMPT_REFUSED;
            } else {
                k = gp_connect_parse_parts(hc, &r, hc->plan, msg, mcap);
            }
            free(body);
            return k;
        }
        if (result == GP_EREDIRECT && decoded && r.redirect_len > 0) {
            /* msg: the address to say the same hello to (the reason goes to the log);
             * hc->redirect_fp: its pin, as this (verified) server knows it */
            gp_log_debug("server %s: %.*s", hc->desc, (int)r.message_len, r.message);
            snprintf(msg, mcap, "%.*s", (int)r.redirect_len, r.redirect);
            hc->redirect_fp[0] = 0;
            if (r.redirect_fingerprint_len < sizeof hc->redirect_fp) {
                memcpy(hc->redirect_fp, r.redirect_fingerprint, r.redirect_fingerprint_len);
                hc->redirect_fp[r.redirect_fingerprint_len] = 0;
            }
            free(body);
            return ATTEMPT_REDIRECT;
        }
        if (result == GP_ESHUTDOWN) {
            snprintf(msg, mcap, "the server is stopping or restarting");
            free(body);
            return ATTEMPT_RESTARTING;
        }
        if (result != 0) {
            const char *what = decoded && r.message_len ? r.message : NULL;
            int wl = decoded ? (int)r.message_len : 0;
            const char *code = gp_result_name(result);
            if (what)
                snprintf(msg, mcap, "%.*s", wl, what);
            else
                snprintf(msg, mcap, "%s", code ? code : "refused");
            if (result == GP_EAUTH)
                snprintf(msg + strlen(msg), mcap - strlen(msg), " (check %s)", hc->token_hint);
            free(body);
            return ATTEMPT_REFUSED;
        }
        if (!decoded) {
            free(body);
            snprintf(msg, mcap, "malformed hello reply (client and server versions differ?)");
            return ATTEMPT_REFUSED;
        }
        if (r.major != GP_PROTO_MAJOR) {
            snprintf(msg, mcap, "server speaks protocol %u.%u, this client %u.%u", r.major, r.minor,
                     GP_PROTO_MAJOR, GP_PROTO_MINOR);
            free(body);
            return ATTEMPT_REFUSED;
        }
        if (r.va_size && (r.va_base != va_base || r.va_size != va_size))
            gp_log_debug("server reports window 0x%llx+0x%llx, ours is 0x%llx+0x%llx",
                         (unsigned long long)r.va_base, (unsigned long long)r.va_size,
                         (unsigned long long)va_base, (unsigned long long)va_size);
        hc->session_id = r.session_id;
        if (hc->parts) {
            int k = keep_part_reply(hc, &r, body, hd.len, msg, mcap);
            if (k != ATTEMPT_OK) {
                free(body);
                return k;
            }
            body = NULL; /* hc's now */
        } else {
            gp_state_set_snapshot(&r);
        }
        hc->features = (h.flags & r.features & GP_HELLO_LZ4) | (r.features & GP_HELLO_KEEPALIVE);
        if (h.flags & GP_HELLO_LZ4)
            gp_log_debug("lz4-compressed copies: %s",
                         r.features & GP_HELLO_LZ4 ? "on" : "not accepted by the server");
        gp_log_debug("connected to %s (%.*s%s, session %llu, device \"%.*s\", driver %d, "
                     "window 0x%llx+0x%llx)",
                     hc->desc, (int)r.server_len, r.server, r.simulated ? ", simulated" : "",
                     (unsigned long long)r.session_id, (int)r.name_len, r.name, r.driver_version,
                     (unsigned long long)va_base, (unsigned long long)va_size);
        free(body);
        return ATTEMPT_OK;
    }
}

void gp_connect_identity(hello_ctx *hc)
{
    char buf[512];
    if (gethostname(buf, sizeof buf) != 0)
        strcpy(buf, "?");
    buf[sizeof buf - 1] = 0;
    gp_utf8_clean(hc->host, sizeof hc->host, buf, strlen(buf));
    struct passwd pw, *res = NULL;
    char pwbuf[4096];
    const char *user = NULL;
    if (getpwuid_r(geteuid(), &pw, pwbuf, sizeof pwbuf, &res) == 0 && res)
        user = res->pw_name;
    if (!user)
        user = getenv("USER");
    if (!user) {
        snprintf(buf, sizeof buf, "uid%u", (unsigned)geteuid());
        user = buf;
    }
    gp_utf8_clean(hc->user, sizeof hc->user, user, strlen(user));
    program_string(hc->program, sizeof hc->program);
}
