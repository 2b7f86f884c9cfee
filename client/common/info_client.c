/*
 * info_client.c: the `info` request (info_client.h; docs/protocol.md, message 6). One short
 * connection: TCP (TLS when the server's settings say so, with the same rules as a hello), the
 * info frame as the first frame, the reply, close. The whole exchange is bounded by the caller's
 * timeout. Self-contained: no shim state (the NVML shim links this file too).
 */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gp_log.h"
#include "gp_protocol.h"
#include "info_client.h"
#include "net.h"

/* The largest frames an answer to info may be: the info reply with every view array at its
 * spec limit is about 30 MiB (protocol/gpupool.toml: 1024 GPUs, 4096 leases, 4096 waiters, the
 * protocol 1.7 lists of shares and lease GPUs, every string at its longest), so 32 MiB; a notice (i32 code, u16 op, string:4095 text). A bigger
 * frame is refused before anything is allocated for it. */
#define INFO_REPLY_MAX_BODY (32u << 20)
#define NOTICE_MAX_BODY (4u + 2u + (4u + 4095u))

/* "Connection refused" -> "connection refused" (a system message inside our sentence). */
static void lower_first(char *s)
{
    if (isupper((unsigned char)s[0]) && (s[1] == 0 || islower((unsigned char)s[1])))
        s[0] = (char)tolower((unsigned char)s[0]);
}

static void timed_out(double timeout_s, char *err, size_t cap)
{
    snprintf(err, cap, "timed out after %g s", timeout_s);
}

/* Milliseconds left until deadline, at most cap_ms. */
static int left_capped_ms(double deadline, int cap_ms)
{
    int ms = gp_left_ms(deadline);
    return ms < 0 || ms > cap_ms ? cap_ms : ms;
}

/* The TLS alert a server sent instead of an answer (a refused client certificate), else why
 * the exchange failed. */
static void link_failure(gp_link *l, int e, const char *what, double timeout_s, char *err,
                         size_t cap)
{
    if (e == ETIMEDOUT) {
        timed_out(timeout_s, err, cap);
    } else if (e == EPROTO && l->tls) {
        const char *hint = "";
        if (strstr(l->err, "certificate required"))
            hint = "; it requires a client certificate that its tls_client_ca signed: set "
                   "tls_cert and tls_key (GPUPOOL_TLS_CERT, GPUPOOL_TLS_KEY)";
        else if (strstr(l->err, "unknown ca") || strstr(l->err, "certificate"))
            hint = "; it did not accept the client certificate (tls_cert, GPUPOOL_TLS_CERT): "
                   "use one that its tls_client_ca signed";
        snprintf(err, cap, "TLS: the server ended the connection (%s)%s", l->err, hint);
    } else {
        char why[320];
        snprintf(why, sizeof why, "%s", gp_link_error(l, e));
        lower_first(why);
        snprintf(err, cap, "%s: %s", what, why);
    }
}

/* Send the info frame and read the answer on a connected link. 0 (out filled) or -1. */
static int exchange(gp_link *l, const gp_client_config *cfg, const gp_server_config *srv,
                    double deadline, double timeout_s, gp_info_result *out, char *err, size_t cap)
{
    char host_raw[256], host[256];
    if (gethostname(host_raw, sizeof host_raw) != 0)
        snprintf(host_raw, sizeof host_raw, "?");
    host_raw[sizeof host_raw - 1] = 0;
    gp_utf8_clean(host, sizeof host, host_raw, strlen(host_raw));
    gp_info m = {
        .magic = GP_PROTO_MAGIC,
        .major = GP_PROTO_MAJOR,
        .minor = GP_PROTO_MINOR,
        .flags = 0,
        .token = srv->token,
        .token_len = (uint32_t)strlen(srv->token),
        .gpu = cfg->gpu,
        .gpu_len = (uint32_t)strlen(cfg->gpu),
        .model = cfg->model,
        .model_len = (uint32_t)strlen(cfg->model),
        .min_memory = cfg->min_memory,
        .host = host,
        .host_len = (uint32_t)strlen(host),
    };
    size_t n = 16 + gp_info_size(&m);
    uint8_t *f = malloc(n);
    if (!f) {
        snprintf(err, cap, "out of memory");
        return -1;
    }
    gp_info_frame(f, 1, &m);
    /* The frame (under 10 KiB) fits in the socket's send buffer: a plain write does not wait.
     * Through TLS, a write may have to read first: bounded by what is left as well. */
    if (l->tls)
        gp_tls_set_send_timeout(l->tls, left_capped_ms(deadline, 2000));
    int ok = gp_link_write(l, f, n) == 0;
    free(f);
    if (!ok) {
        int e = errno;
        uint8_t b;
        if (l->tls && gp_link_read(l, &b, 1, left_capped_ms(deadline, 2000)) != 0 &&
            errno == EPROTO)
            e = EPROTO;
        link_failure(l, e, "sending info", timeout_s, err, cap);
        return -1;
    }

    char notice[4096] = "";
    int notice_code = 0;
    for (;;) {
        uint8_t hb[16];
        if (gp_link_read_until(l, hb, sizeof hb, deadline) != 0) {
            int e = errno;
            if (e == ECONNRESET && notice_code) {
                if (strstr(notice, "must be hello")) {
                    snprintf(err, cap,
                             "server speaks protocol 1.0; this client needs %d.%d for "
                             "info: upgrade gpupoold",
                             GP_PROTO_MAJOR, GP_PROTO_MINOR);
                    return GP_INFO_OLD_SERVER;
                }
                snprintf(err, cap, "%s", notice);
                return -1;
            }
            link_failure(l, e, "no answer to info", timeout_s, err, cap);
            return -1;
        }
        gp_frame_header hd;
        gp_header_decode(hb, &hd);
        int is_notice = !(hd.flags & GP_FLAG_REPLY) && hd.op == GP_OP_NOTICE;
        int is_reply = (hd.flags & GP_FLAG_REPLY) && hd.op == GP_OP_INFO;
        if (!is_notice && !is_reply) {
            snprintf(err, cap,
                     "it does not answer like a gpupool server (protocol %d.%d); is "
                     "the port right?",
                     GP_PROTO_MAJOR, GP_PROTO_MINOR);
            return -1;
        }
        uint32_t max = is_notice ? NOTICE_MAX_BODY : INFO_REPLY_MAX_BODY;
        if (hd.len > max) {
            snprintf(err, cap,
                     "its answer to info is a %s of %u bytes, more than the %u it can "
                     "be: it does not answer like a gpupool server; is the port right?",
                     is_notice ? "notice" : "reply", hd.len, max);
            return -1;
        }
        uint8_t *body = malloc(hd.len + GP_INFO_APPENDED_MAX); /* (room for older replies) */
        if (!body) {
            snprintf(err, cap, "out of memory");
            return -1;
        }
        if (gp_link_read_until(l, body, hd.len, deadline) != 0) {
            int e = errno;
            free(body);
            link_failure(l, e, "no answer to info", timeout_s, err, cap);
            return -1;
        }
        if (!(hd.flags & GP_FLAG_REPLY) && hd.op == GP_OP_NOTICE) {
            gp_notice nm;
            if (gp_notice_decode(body, hd.len, &nm) == 0 && !gp_code_is_info(nm.code)) {
                notice_code = nm.code ? nm.code : -1;
                gp_utf8_clean(notice, sizeof notice, nm.text, nm.text_len);
            }
            free(body);
            continue;
        }
        gp_info_reply r;
        if (gp_info_reply_decode_any(body, hd.len, &r) != 0) {
            free(body);
            snprintf(err, cap,
                     "it does not answer like a gpupool server (protocol %d.%d); is "
                     "the port right?",
                     GP_PROTO_MAJOR, GP_PROTO_MINOR);
            return -1;
        }
        out->result = r.result;
        out->major = r.major;
        out->minor = r.minor;
        gp_utf8_clean(out->message, sizeof out->message, r.message, r.message_len);
        gp_utf8_clean(out->server, sizeof out->server, r.server, r.server_len);
        out->gpus = r.gpus;
        out->matching = r.matching;
        out->free_matching = r.free_matching;
        out->queue = r.queue;
        out->reply = r;
        out->body = body; /* the reply's strings and spans point into it */
        return 0;
    }
}

int gp_info_fetch(const gp_client_config *cfg, const gp_server_config *srv, double timeout_s,
                  gp_info_result *out, char *err, size_t errcap)
{
    memset(out, 0, sizeof *out);
    if (!(timeout_s > 0))
        timeout_s = GP_INFO_DEFAULT_TIMEOUT; /* a probe never waits forever */
    /* One deadline for everything: connect (each address only the time left), TLS handshake,
     * the request, every read of the answer. Name resolution has no timeout (getaddrinfo). */
    double deadline = gp_deadline(timeout_s);
    /* A server this client cannot trust (TLS with neither pin nor CA) is not even connected to:
     * the shim's hello does the same (connect.c), and the message names the fix. */
    if (gp_tls_trusted(srv, err, errcap) != 0)
        return -1;
    char why[600];
    int fd = gp_tcp_connect_until(srv->host, srv->port, deadline, why, sizeof why);
    if (fd < 0) {
        if (!strcmp(why, "timed out")) {
            timed_out(timeout_s, err, errcap);
        } else {
            lower_first(why);
            snprintf(err, errcap, "%s", why);
        }
        return -1;
    }
    gp_link l = {.fd = fd};
    int rc = -1;
    if (srv->tls) {
        if (gp_tls_setup(srv, err, errcap) == 0)
            l.tls = gp_tls_connect(srv, fd, 0, gp_left_ms(deadline), err, errcap);
        if (l.tls)
            rc = 0;
    } else {
        rc = 0;
    }
    if (rc == 0)
        rc = exchange(&l, cfg, srv, deadline, timeout_s, out, err, errcap);
    gp_tls_free(l.tls);
    close(fd);
    if (rc != 0)
        gp_info_free(out);
    return rc;
}

void gp_info_free(gp_info_result *r)
{
    if (!r)
        return;
    free(r->body);
    r->body = NULL;
    memset(&r->reply, 0, sizeof r->reply);
}
