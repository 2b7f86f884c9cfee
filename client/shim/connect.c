/*
 * connect.c: starting a session with a gpupool server (conn.c runs it once cuInit asks).
 *
 * The servers, their tokens and TLS settings, the timeouts and the GPU requirements come from
 * the client configuration (client_config.c: the file, then GPUPOOL_SERVER, GPUPOOL_TOKEN,
 * GPUPOOL_TLS*, GPUPOOL_CONNECT_TIMEOUT, GPUPOOL_GPU...). Server selection: one server is used
 * as it is (no probe, no added latency); with several, each is asked `info` (probe_timeout
 * each, all at once) and the first, in list order, with a free matching GPU wins; else the one
 * with the shortest queue among those with a matching GPU. A server whose probe fails is skipped
 * with one warning line; one without a matching GPU is skipped (debug line). When a hello fails
 * the next candidate follows. A probe ends within probe_timeout whatever the server does (0: 2 s).
 * Servers of protocol 1.0 do not know info: when none answered it and some speak 1.0, those get
 * a hello in list order, as without selection (debug line).
 *
 * For the chosen server: reserve the VA window first (device pointers must never alias this
 * process's memory), connect with a timeout (connect_timeout, default 10 s; TCP_NODELAY;
 * keepalive with short probes), send hello and read the answer. A server that cannot use our
 * window answers GP_EVAWINDOW and we retry with the next base (0x200000000000,
 * 0x240000000000, ...). While every GPU is taken the server keeps the hello unanswered and sends
 * queue notices (GP_INFO_QUEUED): we print each one and wait, for as long as it takes. Whatever
 * fails is said in ONE line on stderr, with what to do about it, and cuInit then answers
 * CUDA_ERROR_NO_DEVICE.
 *
 * TLS (tls = true / GPUPOOL_TLS=1, or an address written tls://host:port; tls.c,
 * docs/protocol.md "TLS"): the
 * hello goes to gpupoold inside a first TLS session; when the lease starts gpupoold sends
 * GP_INFO_HANDOFF, both sides close that session (close_notify), and a second TLS session on the
 * same socket, with the worker, carries the hello reply and everything after it.
 */
#include <errno.h>
#include <pthread.h>
#include <pwd.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "client_config.h"
#include "compress.h"
#include "info_client.h"
#include "net.h"
#include "sha256.h"
#include "shim.h"
#include "shim_core.h"

#define DEFAULT_VA_BASE 0x200000000000ull
#define DEFAULT_VA_SIZE (1ull << 40)
#define VA_STEP 0x40000000000ull /* 4 TiB between candidate bases */
#define VA_TRIES 8

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

static uint64_t env_u64(const char *name, uint64_t dflt)
{
    const char *v = getenv(name);
    if (!v || !*v)
        return dflt;
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 0);
    if (errno || end == v) {
        gp_log_error("ignoring %s=%s (not a number)", name, v);
        return dflt;
    }
    switch (*end) {
    case 'k':
    case 'K':
        x <<= 10;
        end++;
        break;
    case 'm':
    case 'M':
        x <<= 20;
        end++;
        break;
    case 'g':
    case 'G':
        x <<= 30;
        end++;
        break;
    case 't':
    case 'T':
        x <<= 40;
        end++;
        break;
    default:
        break;
    }
    if (*end) {
        gp_log_error("ignoring %s=%s (not a number)", name, v);
        return dflt;
    }
    return x;
}
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

typedef struct hello_ctx {
    char host[256], user[256], program[1024];
    const gp_client_config *cfg; /* requirements, timeouts */
    const gp_server_config *srv; /* the server being tried: token, TLS, compression */
    double timeout_s;
    const char *desc;       /* the server being tried ("host:port"), for messages */
    const char *token_hint; /* what to check when the token is refused */
    int64_t
        restart_until; /* mono_ms deadline of the retries across a server restart; 0: none yet */
    char redirect_fp[GP_FINGERPRINT_CAP]; /* ATTEMPT_REDIRECT: the target's pin, "" if none */
    unsigned features; /* ATTEMPT_OK: GP_HELLO_LZ4 / GP_HELLO_KEEPALIVE, as both sides agreed */
} hello_ctx;

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

static int64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
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
 * -1 with msg filled. */
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
        return -1;
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

/* Hello on a connected socket (inside TLS when l->tls). Fills msg with the reason when not
 * ATTEMPT_OK. */
static int say_hello(gp_link *l, hello_ctx *hc, uint64_t va_base, uint64_t va_size, char *msg,
                     size_t mcap)
{
    gp_hello h = {
        .magic = GP_PROTO_MAGIC,
        .major = GP_PROTO_MAJOR,
        .minor = GP_PROTO_MINOR,
        .pid = (uint32_t)getpid(),
        .flags =
            want_lz4(hc->srv) | GP_HELLO_KEEPALIVE | (hc->cfg->keep_gpu ? GP_HELLO_KEEP_GPU : 0u),
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
            if (tls_handoff(l, hc, binding, msg, mcap) != 0)
                return ATTEMPT_TLS;
            keepalive = 0; /* the worker's part: it answers the hello, gpupoold sends nothing */
            continue;
        }
        if (!(hd.flags & GP_FLAG_REPLY) && hd.op == GP_OP_NOTICE) {
            int code = early_notice(body, hd.len);
            queued |= code == GP_INFO_QUEUED;
            keepalive |= code == GP_INFO_WORKING;
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
         * bytes}: 1.3 before redirect_fingerprint (1.4) and 1.6's, 1.5 before 1.6's 12. */
        static const uint16_t below[] = {4, 6}, pad[] = {16, 12};
        for (size_t i = 0; i < 2 && drc != 0 && drc != GP_PROTO_ETRAILING; i++) {
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
        gp_state_set_snapshot(&r);
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

static void fill_identity(hello_ctx *hc)
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

/* ============================================================== server selection == */

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
static void add_failure(char *failures, size_t cap, int *nfail, const char *desc, const char *why)
{
    size_t n = strlen(failures);
    if (n < cap)
        snprintf(failures + n, cap - n, "%s%s: %s", *nfail ? "; " : "", desc, why);
    (*nfail)++;
}

/* Probe every server with info (all at once) and put the candidates, best first, in order[].
 * Returns how many; the others are in failures (with their warning lines printed). */
static int select_servers(const gp_client_config *cfg, int *order, char *failures, size_t fcap,
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
                add_failure(failures, fcap, nfail, desc, why);
            } else if (r->free_matching > 0) {
                order[nfree++] = i;
            } else {
                wait_idx[nwait++] = i;
            }
            continue;
        }
        gp_log_info("server %s skipped: %s", desc, why);
        add_failure(failures, fcap, nfail, desc, why);
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

/* ================================================================== the session == */

#define REFUSED_WAIT_MS 3000 /* a refused connection is retried this long (a restart's gap) */
#define RESTART_RETRY_MS 250

/* A server restarting (why: msg): 1 after a pause when there is time left to try again, the
 * first call setting the deadline `budget_ms` from now (0: keep the one set), with one line for
 * the user when the server said so (`said_restarting`); 0 when the time is up. */
static int restart_wait(hello_ctx *hc, int64_t budget_ms, const char *msg, int said_restarting)
{
    int64_t now = mono_ms();
    if (!hc->restart_until) {
        if (budget_ms <= 0)
            return 0;
        hc->restart_until = now + budget_ms;
        /* A line for the user only when the server said it restarts: a refused connection is
         * more often a server that is not running, and then the one error line says it all. */
        if (said_restarting)
            gp_log_info("server %s: %s; trying again for up to %lld s", hc->desc, msg,
                        (long long)(budget_ms / 1000));
        else
            gp_log_debug("server %s: %s; trying again for up to %lld s (it may be restarting)",
                         hc->desc, msg, (long long)(budget_ms / 1000));
    } else if (budget_ms > 0 && now + budget_ms > hc->restart_until) {
        hc->restart_until = now + budget_ms; /* it said it restarts: the longer wait */
    }
    if (now >= hc->restart_until)
        return 0;
    struct timespec ts = {0, RESTART_RETRY_MS * 1000000L};
    nanosleep(&ts, NULL);
    return 1;
}

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
static int follow_redirect(const hello_ctx *hc, const gp_server_config *from, const char *where,
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

/* Connect and say hello to one server, with the window retries. ATTEMPT_OK with *fd_out and
 * *tls_out set, else the kind of failure with msg filled; ATTEMPT_FATAL after the one error line
 * was printed (no window at all). */
enum {
    ATTEMPT_FATAL = 100
};
static int try_server(hello_ctx *hc, uint64_t va_base, uint64_t va_size, uint64_t step,
                      int *base_index, int *fd_out, gp_tls **tls_out, char *msg, size_t mcap)
{
    const gp_server_config *srv = hc->srv, *named = hc->srv;
    if (gp_tls_trusted(srv, msg, mcap) != 0)
        return ATTEMPT_UNTRUSTED;
    if (srv->tls && gp_tls_setup(srv, msg, mcap) != 0)
        return ATTEMPT_TLS;
    /* A redirect's target (follow_redirect): the settings of the client's own entry for it, or
     * the same token and client certificate as the server that sent us (a fleet shares its
     * tokens), pinned with the fingerprint that server gave. */
    gp_server_config *hop = NULL;
    const char *first_desc = hc->desc;
    char hop_desc[600];
    int hops = 0, k = ATTEMPT_OK;
    for (;;) {
        /* The window first: device pointers must never alias our memory. */
        while (gp_vamap_window_size() == 0 && *base_index < VA_TRIES) {
            uint64_t b = va_base + (uint64_t)*base_index * step;
            if (gp_vamap_reserve_window(b, va_size) == 0)
                break;
            gp_log_debug("cannot reserve the address window at 0x%llx: %s", (unsigned long long)b,
                         strerror(errno));
            (*base_index)++;
        }
        if (gp_vamap_window_size() == 0) {
            gp_log_error("cannot reserve %llu bytes of address space for device memory "
                         "(tried %d bases from 0x%llx); set GPUPOOL_VA_BASE / "
                         "GPUPOOL_VA_SIZE to a free range",
                         (unsigned long long)va_size, VA_TRIES, (unsigned long long)va_base);
            k = ATTEMPT_FATAL;
            break;
        }
        int fd = gp_tcp_connect(srv->host, srv->port, hc->timeout_s, msg, mcap);
        if (fd < 0) {
            /* Refused: nobody listens. Between a stop and a start of gpupoold that lasts a
             * moment; once the server said it restarts, wait for it (else only briefly). */
            if (errno == ECONNREFUSED &&
                restart_wait(hc, hc->restart_until ? 0 : REFUSED_WAIT_MS, msg, 0))
                continue;
            k = ATTEMPT_CONNECT;
            break;
        }
        gp_link l = {.fd = fd};
        k = ATTEMPT_OK;
        if (srv->tls) {
            l.tls = gp_tls_connect(srv, fd, 0, gp_timeout_ms(hc->timeout_s), msg, mcap);
            if (!l.tls)
                k = ATTEMPT_TLS;
        }
        if (k == ATTEMPT_OK)
            k = say_hello(&l, hc, gp_vamap_window_base(), gp_vamap_window_size(), msg, mcap);
        if (k == ATTEMPT_OK) {
            *fd_out = fd;
            *tls_out = l.tls;
            break;
        }
        gp_tls_free(l.tls);
        close(fd);
        if (k == ATTEMPT_REDIRECT) {
            if (++hops > MAX_REDIRECTS) {
                snprintf(msg, mcap, "sent on from server to server more than %d times",
                         MAX_REDIRECTS);
                k = ATTEMPT_CONNECT;
                break;
            }
            if (!hop && !(hop = malloc(sizeof *hop))) {
                snprintf(msg, mcap, "out of memory");
                k = ATTEMPT_CONNECT;
                break;
            }
            char where[256];
            snprintf(where, sizeof where, "%s", msg);
            k = follow_redirect(hc, srv, where, hop, msg, mcap);
            if (k != ATTEMPT_OK)
                break;
            if (hop->tls && gp_tls_setup(hop, msg, mcap) != 0) {
                k = ATTEMPT_TLS;
                break;
            }
            gp_server_desc(hop, hop_desc, sizeof hop_desc);
            gp_log_info("server %s: a GPU of %s is held for this process; continuing there",
                        hc->desc, hop_desc);
            srv = hop;
            hc->srv = hop; /* its token, and its pin for the worker's session too */
            hc->desc = hop_desc;
            hc->restart_until = 0;
            continue;
        }
        if (k == ATTEMPT_RESTARTING &&
            restart_wait(hc, hc->timeout_s > 0 ? gp_timeout_ms(hc->timeout_s) : 60000, msg, 1))
            continue;
        if (k == ATTEMPT_RESTARTING)
            k = ATTEMPT_CONNECT;
        if (k == ATTEMPT_VAWINDOW && *base_index + 1 < VA_TRIES) {
            gp_log_debug("server %s cannot use window 0x%llx; trying the next base", hc->desc,
                         (unsigned long long)gp_vamap_window_base());
            gp_vamap_release_window();
            (*base_index)++;
            continue;
        }
        break;
    }
    if (k != ATTEMPT_OK && k != ATTEMPT_FATAL && hop != NULL) /* name the server that failed */
        snprintf(msg + strlen(msg), mcap - strlen(msg), " (at %s, where %s sent us)", hop_desc,
                 first_desc);
    hc->desc = first_desc;
    hc->srv = named;
    free(hop);
    return k;
}

/* The one error line when no server has been configured. */
static void no_server(const gp_client_config *cfg)
{
    if (*cfg->file)
        gp_log_error("GPUPOOL_SERVER is not set and %s names no server: no GPU server to run "
                     "CUDA on. Set GPUPOOL_SERVER=host:port (and GPUPOOL_TOKEN if the server "
                     "needs one), add a [[servers]] entry to %s (`gpupool login`), or start the "
                     "program with `gpupool run`.",
                     cfg->file, cfg->file);
    else
        gp_log_error("GPUPOOL_SERVER is not set: no GPU server to run CUDA on. Set "
                     "GPUPOOL_SERVER=host:port (and GPUPOOL_TOKEN if the server needs one), run "
                     "`gpupool login`, or start the program with `gpupool run`.");
}

static CUresult connect_with(const gp_client_config *cfg, int *sock_out, gp_tls **tls_out,
                             unsigned *features_out, char *server_desc, size_t desc_cap)
{
    if (cfg->nservers == 0) {
        no_server(cfg);
        return CUDA_ERROR_NO_DEVICE;
    }
    hello_ctx hc = {.cfg = cfg, .timeout_s = cfg->connect_timeout};
    fill_identity(&hc);
    const char *tok = getenv("GPUPOOL_TOKEN");
    while (tok && (*tok == ' ' || *tok == '\t' || *tok == '\n' || *tok == '\r'))
        tok++;
    char hint[4200];
    if ((tok && *tok) || !*cfg->file)
        snprintf(hint, sizeof hint, "GPUPOOL_TOKEN");
    else
        snprintf(hint, sizeof hint, "the token in %s", cfg->file);
    hc.token_hint = hint;

    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t va_base = env_u64("GPUPOOL_VA_BASE", DEFAULT_VA_BASE) & ~(page - 1);
    uint64_t va_size = (env_u64("GPUPOOL_VA_SIZE", DEFAULT_VA_SIZE) + page - 1) & ~(page - 1);
    if (va_size == 0)
        va_size = DEFAULT_VA_SIZE;
    uint64_t step = va_size > VA_STEP ? (va_size + VA_STEP - 1) / VA_STEP * VA_STEP : VA_STEP;

    char failures[4096] = "";
    int nfail = 0, last_kind = ATTEMPT_CONNECT;
    char last_msg[1024] = "";
    int order[GP_MAX_SERVERS], count;
    if (cfg->nservers == 1) {
        order[0] = 0;
        count = 1;
    } else {
        count = select_servers(cfg, order, failures, sizeof failures, &nfail);
    }
    int base_index = 0;
    for (int c = 0; c < count; c++) {
        const gp_server_config *srv = &cfg->servers[order[c]];
        gp_server_desc(srv, server_desc, desc_cap);
        hc.srv = srv;
        hc.desc = server_desc;
        int fd = -1;
        last_kind = try_server(&hc, va_base, va_size, step, &base_index, &fd, tls_out, last_msg,
                               sizeof last_msg);
        if (last_kind == ATTEMPT_OK) {
            *sock_out = fd;
            *features_out = hc.features;
            return CUDA_SUCCESS;
        }
        if (last_kind == ATTEMPT_FATAL)
            return CUDA_ERROR_NO_DEVICE;
        if (count > 1 || nfail > 0)
            gp_log_debug("server %s: %s; trying the next one", server_desc, last_msg);
        add_failure(failures, sizeof failures, &nfail, server_desc, last_msg);
    }
    *tls_out = NULL;
    if (nfail > 1 || count == 0) {
        gp_log_error("cannot use any gpupool server (%s). Are they running? Check "
                     "GPUPOOL_SERVER and GPUPOOL_TOKEN%s%s.",
                     failures, *cfg->file ? ", and " : "", cfg->file);
    } else if (last_kind == ATTEMPT_CONNECT) {
        gp_log_error("cannot connect to gpupool server %s (%s). Is gpupoold running there? "
                     "`gpupool doctor` checks the address (GPUPOOL_SERVER or the config file).",
                     server_desc, last_msg);
    } else if (last_kind == ATTEMPT_UNTRUSTED) {
        gp_log_error("%s", last_msg);
    } else if (last_kind == ATTEMPT_TLS) {
        gp_log_error("cannot use gpupool server %s: %s", server_desc, last_msg);
    } else if (last_kind == ATTEMPT_VAWINDOW) {
        gp_log_error("server %s could not reserve the client's device address window (%s); "
                     "set GPUPOOL_VA_BASE to another free range.",
                     server_desc, last_msg);
    } else {
        gp_log_error("server %s refused the session: %s", server_desc, last_msg);
    }
    return CUDA_ERROR_NO_DEVICE;
}

CUresult gp_connect(int *sock_out, gp_tls **tls_out, unsigned *features_out, char *server_desc,
                    size_t desc_cap)
{
    *tls_out = NULL;
    *features_out = 0;
    gp_client_config *cfg = malloc(sizeof *cfg);
    if (!cfg) {
        gp_log_error("out of memory reading the gpupool configuration");
        return CUDA_ERROR_NO_DEVICE;
    }
    char err[2048];
    CUresult r;
    if (gp_client_config_load(cfg, err, sizeof err) != 0) {
        gp_log_error("%s", err);
        r = CUDA_ERROR_NO_DEVICE;
    } else {
        r = connect_with(cfg, sock_out, tls_out, features_out, server_desc, desc_cap);
    }
    if (r != CUDA_SUCCESS)
        gp_vamap_release_window();
    free(cfg);
    return r;
}
