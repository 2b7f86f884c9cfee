/*
 * connect.c: starting a session with a gpupool server (conn.c runs it once cuInit asks).
 *
 * For each entry of GPUPOOL_SERVER ("host:port", "[v6]:port" or a bare host for port 7070; a
 * comma-separated list is tried in order): reserve the VA window first (device pointers must
 * never alias this process's memory), connect with a timeout (GPUPOOL_CONNECT_TIMEOUT seconds,
 * default 10; TCP_NODELAY; keepalive with short probes), send hello and read the answer. A
 * server that cannot use our window answers GP_EVAWINDOW and we retry with the next base
 * (0x200000000000, 0x240000000000, ...). The hello carries the GPU requirements of
 * requirements.c. While every GPU is taken the server keeps the hello unanswered and sends
 * queue notices (GP_INFO_QUEUED): we print each one and wait, for as long as it takes. Whatever
 * fails is said in ONE line on stderr, with what to do about it, and cuInit then answers
 * CUDA_ERROR_NO_DEVICE.
 *
 * TLS (GPUPOOL_TLS=1, or an entry written tls://host:port; tls.c, docs/protocol.md "TLS"): the
 * hello goes to gpupoold inside a first TLS session; when the lease starts gpupoold sends
 * GP_INFO_HANDOFF, both sides close that session (close_notify), and a second TLS session on the
 * same socket, with the worker, carries the hello reply and everything after it.
 */
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include "sha256.h"
#include "shim.h"
#include "shim_core.h"

#define DEFAULT_PORT "7070" /* gpupoold's default remoting listener (docs/configuration.md) */
#define DEFAULT_VA_BASE 0x200000000000ull
#define DEFAULT_VA_SIZE (1ull << 40)
#define VA_STEP 0x40000000000ull /* 4 TiB between candidate bases */
#define VA_TRIES 8


/* "prog arg1 arg2" from /proc/self/cmdline, argv[0] reduced to its basename. */
static size_t program_string(char *out, size_t cap) {
    char raw[8192];
    size_t n = 0;
    FILE *f = fopen("/proc/self/cmdline", "rb");
    if (f) {
        n = fread(raw, 1, sizeof raw - 1, f);
        fclose(f);
    }
    if (n == 0) return gp_utf8_clean(out, cap, "?", 1);
    raw[n] = 0;
    const char *argv0 = raw, *slash = strrchr(argv0, '/');
    const char *start = slash ? slash + 1 : argv0;
    size_t len = strlen(start);
    char joined[8192];
    memcpy(joined, start, len);
    size_t j = len;
    for (size_t i = strlen(raw); i < n; i++) joined[j++] = raw[i] ? raw[i] : ' ';
    while (j > 0 && joined[j - 1] == ' ') j--;
    return gp_utf8_clean(out, cap, joined, j);
}

static uint64_t env_u64(const char *name, uint64_t dflt) {
    const char *v = getenv(name);
    if (!v || !*v) return dflt;
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 0);
    if (errno || end == v) {
        gp_log_error("ignoring %s=%s (not a number)", name, v);
        return dflt;
    }
    switch (*end) {
    case 'k': case 'K': x <<= 10; end++; break;
    case 'm': case 'M': x <<= 20; end++; break;
    case 'g': case 'G': x <<= 30; end++; break;
    case 't': case 'T': x <<= 40; end++; break;
    default: break;
    }
    if (*end) {
        gp_log_error("ignoring %s=%s (not a number)", name, v);
        return dflt;
    }
    return x;
}

/* Split "host:port" / "[v6]:port"; a bare host name (no colon at all) means gpupoold's default
 * port. 0, or -1. */
static int split_hostport(const char *s, char *host, size_t hcap, char *port, size_t pcap) {
    const char *colon;
    if (!strchr(s, ':') && s[0] != '[') {
        if (strlen(s) >= hcap || !*s) return -1;
        strcpy(host, s);
        snprintf(port, pcap, "%s", DEFAULT_PORT);
        return 0;
    }
    if (s[0] == '[') {
        const char *close = strchr(s, ']');
        if (!close || close[1] != ':') return -1;
        if ((size_t)(close - s - 1) >= hcap) return -1;
        memcpy(host, s + 1, (size_t)(close - s - 1));
        host[close - s - 1] = 0;
        colon = close + 1;
    } else {
        colon = strrchr(s, ':');
        if (!colon || (size_t)(colon - s) >= hcap) return -1;
        memcpy(host, s, (size_t)(colon - s));
        host[colon - s] = 0;
    }
    if (!colon[1] || strlen(colon + 1) >= pcap) return -1;
    strcpy(port, colon + 1);
    return host[0] ? 0 : -1;
}

static void set_keepalive(int fd) {
    int one = 1, idle = 10, intvl = 5, cnt = 3;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
    /* No TCP_USER_TIMEOUT: a worker busy in a long synchronous call legitimately lets its
     * receive window fill up, and that must not end the session. */
}

/* Connect with a timeout. The fd, or -1 with err filled. */
static int tcp_connect(const char *host, const char *port, double timeout_s, char *err,
                       size_t ecap) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    int g = getaddrinfo(host, port, &hints, &res);
    if (g != 0) {
        snprintf(err, ecap, "%s", g == EAI_SYSTEM ? strerror(errno) : gai_strerror(g));
        return -1;
    }
    int fd = -1;
    snprintf(err, ecap, "no address");
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) {
            snprintf(err, ecap, "%s", strerror(errno));
            continue;
        }
        int fl = fcntl(fd, F_GETFL);
        fcntl(fd, F_SETFL, fl | O_NONBLOCK);
        int rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
        if (rc != 0 && errno == EINPROGRESS) {
            struct pollfd p = {.fd = fd, .events = POLLOUT};
            int ms = timeout_s <= 0 ? -1 : (int)(timeout_s * 1000);
            int pr;
            do pr = poll(&p, 1, ms);
            while (pr < 0 && errno == EINTR);
            if (pr == 0) {
                errno = ETIMEDOUT;
                rc = -1;
            } else if (pr < 0) {
                rc = -1; /* poll itself failed: errno says why; the socket is not connected */
            } else {
                int soerr = 0;
                socklen_t sl = sizeof soerr;
                getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
                errno = soerr;
                rc = soerr ? -1 : 0;
            }
        }
        if (rc == 0) {
            fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
            set_keepalive(fd);
            break;
        }
        snprintf(err, ecap, "%s", errno == ETIMEDOUT ? "timed out" : strerror(errno));
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    return fd;
}

/* The connection during the handshake: the socket, and the TLS session on it (or NULL). */
typedef struct link {
    int fd;
    gp_tls *tls;
    char err[300]; /* the TLS layer's last error */
} hs_link;

static int write_all_fd(int fd, const uint8_t *p, size_t n) {
    while (n > 0) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Read exactly n bytes; waits at most timeout_ms per chunk (-1: forever). 0 or -1. */
static int read_all_fd(int fd, uint8_t *p, size_t n, int timeout_ms) {
    while (n > 0) {
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        int pr = poll(&pf, 1, timeout_ms);
        if (pr < 0 && errno == EINTR) continue;
        if (pr == 0) {
            errno = ETIMEDOUT;
            return -1;
        }
        if (pr < 0) return -1;
        ssize_t r = recv(fd, p, n, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r == 0) errno = ECONNRESET;
        if (r <= 0) return -1;
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

static int link_write(hs_link *l, const uint8_t *p, size_t n) {
    if (!l->tls) return write_all_fd(l->fd, p, n);
    if (gp_tls_write(l->tls, p, n, l->err, sizeof l->err) == 0) return 0;
    errno = EPROTO;
    return -1;
}

/* read_all_fd through the link; a TLS error leaves errno EPROTO and its text in l->err. */
static int link_read(hs_link *l, uint8_t *p, size_t n, int timeout_ms) {
    if (!l->tls) return read_all_fd(l->fd, p, n, timeout_ms);
    while (n > 0) {
        ssize_t r = gp_tls_read(l->tls, p, n, timeout_ms, l->err, sizeof l->err);
        if (r == 0) errno = ECONNRESET;
        if (r <= 0) {
            if (r < 0 && errno != ETIMEDOUT) errno = EPROTO;
            return -1;
        }
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

static const char *link_error(hs_link *l, int err) {
    if (err == ECONNRESET) return "connection closed";
    return err == EPROTO && l->tls ? l->err : strerror(err);
}

enum { ATTEMPT_OK, ATTEMPT_CONNECT, ATTEMPT_REFUSED, ATTEMPT_VAWINDOW, ATTEMPT_TLS };

typedef struct hello_ctx {
    char host[256], user[256], program[1024];
    gp_requirements req;
    const char *token;
    size_t token_len;
    double timeout_s;
    const char *desc; /* the server being tried, for messages */
    const char *tls_host; /* the name the server's certificate must carry */
} hello_ctx;

/* A notice before the hello reply. No CUDA call has run on the server yet, so it is never the
 * deferred error of one: print it and record nothing. Every one is printed, bypassing
 * gp_conn_notice's table of texts already shown: queue updates are news each time, and a long
 * wait must not fill that table for the session. 1 if it was a queue notice. */
static int early_notice(const uint8_t *body, size_t len) {
    gp_notice m;
    if (gp_notice_decode(body, len, &m) != 0) {
        gp_log_debug("malformed notice before the hello reply ignored");
        return 0;
    }
    if (gp_code_is_info(m.code)) {
        if (m.text_len) gp_log_info("%.*s", (int)m.text_len, m.text);
        return m.code == GP_INFO_QUEUED;
    }
    if (m.text_len) gp_log_error("%.*s", (int)m.text_len, m.text);
    return 0;
}

/* The hand-over binding (docs/protocol.md, "TLS"): the first 8 bytes of
 * SHA-256("gpupool tls handoff" NUL, hello body). Only the client and gpupoold know the hello
 * (it carries the token and travelled inside the daemon's TLS session); the worker gets it in
 * SESSION. The client's first frame in the worker's session is a ping carrying this value, so
 * that nobody who took over the TCP connection between the two sessions can use the lease. */
static uint64_t handoff_binding(const uint8_t *body, size_t len) {
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
static int tls_handoff(hs_link *l, const hello_ctx *hc, uint64_t binding, char *msg,
                       size_t mcap) {
    int ms = hc->timeout_s <= 0 ? -1 : (int)(hc->timeout_s * 1000);
    int rc = gp_tls_close(l->tls, ms, msg, mcap);
    gp_tls_free(l->tls);
    l->tls = NULL;
    if (rc != 0) return -1;
    l->tls = gp_tls_connect(l->fd, hc->tls_host, 1, ms, msg, mcap);
    if (!l->tls) return -1;
    gp_ping p = {.token = binding};
    uint8_t f[16 + 8];
    size_t n = gp_ping_frame(f, gp_conn_new_req(), &p);
    if (link_write(l, f, n) != 0) {
        snprintf(msg, mcap, "TLS hand-over: %s", link_error(l, errno));
        return -1;
    }
    return 0;
}

/* A TLS alert instead of an answer: with TLS 1.3 the server checks our certificate after our
 * side of the handshake has finished, so a missing or refused one shows up here. */
static int tls_refusal(hs_link *l, char *msg, size_t mcap) {
    const char *hint = "";
    if (strstr(l->err, "certificate required"))
        hint = "; it requires a client certificate that its tls_client_ca signed: set "
               "GPUPOOL_TLS_CERT and GPUPOOL_TLS_KEY";
    else if (strstr(l->err, "unknown ca") || strstr(l->err, "certificate"))
        hint = "; it did not accept the client certificate (GPUPOOL_TLS_CERT): use one that its "
               "tls_client_ca signed";
    snprintf(msg, mcap, "TLS: the server ended the connection (%s)%s", l->err, hint);
    return ATTEMPT_TLS;
}

/* Hello on a connected socket (inside TLS when l->tls). Fills msg with the reason when not
 * ATTEMPT_OK. */
static int say_hello(hs_link *l, const hello_ctx *hc, uint64_t va_base, uint64_t va_size,
                     char *msg, size_t mcap) {
    gp_hello h = {
        .magic = GP_PROTO_MAGIC, .major = GP_PROTO_MAJOR, .minor = GP_PROTO_MINOR,
        .pid = (uint32_t)getpid(), .flags = 0,
        .host = hc->host, .host_len = (uint32_t)strlen(hc->host),
        .user = hc->user, .user_len = (uint32_t)strlen(hc->user),
        .program = hc->program, .program_len = (uint32_t)strlen(hc->program),
        .token = hc->token, .token_len = (uint32_t)hc->token_len,
        .gpu = hc->req.gpu, .gpu_len = (uint32_t)strlen(hc->req.gpu),
        .model = hc->req.model, .model_len = (uint32_t)strlen(hc->req.model),
        .min_memory = hc->req.min_memory,
        .va_base = va_base, .va_size = va_size,
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
    int ok = link_write(l, f, n) == 0;
    free(f);
    if (!ok && l->tls) {
        /* The server may have ended the session with an alert (a refused client certificate):
         * read it, it says more than the failed write. */
        int err = errno;
        uint8_t b;
        if (link_read(l, &b, 1, 2000) != 0 && errno == EPROTO) return tls_refusal(l, msg, mcap);
        errno = err;
    }
    if (!ok) {
        snprintf(msg, mcap, "sending hello: %s", link_error(l, errno));
        return ATTEMPT_CONNECT;
    }

    int waited_note = 0, queued = 0;
    for (;;) {
        uint8_t hb[16];
        /* The server may queue us until a GPU is free: wait without limit. A server that says
         * nothing for 5 s (an older one, or one busy starting a worker) gets one line, unless it
         * already told us our place in the queue. */
        int rc = link_read(l, hb, 1, 5000);
        if (rc != 0 && errno == ETIMEDOUT) {
            if (!waited_note++ && !queued)
                gp_log_info("waiting for server %s to answer (it may be waiting for a free GPU)",
                            hc->desc);
            continue;
        }
        if (rc != 0 || link_read(l, hb + 1, 15, 30000) != 0) {
            if (errno == EPROTO && l->tls) return tls_refusal(l, msg, mcap);
            snprintf(msg, mcap, "no answer to hello: %s", link_error(l, errno));
            return ATTEMPT_CONNECT;
        }
        gp_frame_header hd;
        gp_header_decode(hb, &hd);
        if (hd.len > GP_PROTO_MAX_BODY) {
            snprintf(msg, mcap, "it does not answer like a gpupool server; is the port right?");
            return ATTEMPT_CONNECT;
        }
        uint8_t *body = malloc(hd.len ? hd.len : 1);
        if (!body || link_read(l, body, hd.len, 30000) != 0) {
            free(body);
            snprintf(msg, mcap, "no answer to hello: %s", link_error(l, errno));
            return ATTEMPT_CONNECT;
        }
        if (!(hd.flags & GP_FLAG_REPLY) && hd.op == GP_OP_NOTICE && l->tls &&
            hd.len >= 4 && (int32_t)gp_rd_u32(body) == GP_INFO_HANDOFF) {
            free(body);
            if (tls_handoff(l, hc, binding, msg, mcap) != 0) return ATTEMPT_TLS;
            continue;
        }
        if (!(hd.flags & GP_FLAG_REPLY) && hd.op == GP_OP_NOTICE) {
            queued |= early_notice(body, hd.len);
            free(body);
            continue;
        }
        if (!(hd.flags & GP_FLAG_REPLY) || hd.op != GP_OP_HELLO || hd.len < 4) {
            free(body);
            snprintf(msg, mcap, "it does not answer like a gpupool server; is the port right?");
            return ATTEMPT_CONNECT;
        }
        gp_hello_reply r;
        int decoded = gp_hello_reply_decode(body, hd.len, &r) == 0;
        int32_t result = (int32_t)gp_rd_u32(body);
        if (result == GP_EVAWINDOW) {
            free(body);
            snprintf(msg, mcap, "the server could not reserve the address window");
            return ATTEMPT_VAWINDOW;
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
                snprintf(msg + strlen(msg), mcap - strlen(msg),
                         " (check GPUPOOL_TOKEN)");
            free(body);
            return ATTEMPT_REFUSED;
        }
        if (!decoded) {
            free(body);
            snprintf(msg, mcap, "malformed hello reply (client and server versions differ?)");
            return ATTEMPT_REFUSED;
        }
        if (r.major != GP_PROTO_MAJOR) {
            snprintf(msg, mcap, "server speaks protocol %u.%u, this client %u.%u", r.major,
                     r.minor, GP_PROTO_MAJOR, GP_PROTO_MINOR);
            free(body);
            return ATTEMPT_REFUSED;
        }
        if (r.va_size && (r.va_base != va_base || r.va_size != va_size))
            gp_log_debug("server reports window 0x%llx+0x%llx, ours is 0x%llx+0x%llx",
                         (unsigned long long)r.va_base, (unsigned long long)r.va_size,
                         (unsigned long long)va_base, (unsigned long long)va_size);
        gp_state_set_snapshot(&r);
        gp_log_debug("connected to %s (%.*s%s, session %llu, device \"%.*s\", driver %d, "
                     "window 0x%llx+0x%llx)",
                     hc->desc, (int)r.server_len, r.server, r.simulated ? ", simulated" : "",
                     (unsigned long long)r.session_id, (int)r.name_len, r.name,
                     r.driver_version, (unsigned long long)va_base, (unsigned long long)va_size);
        free(body);
        return ATTEMPT_OK;
    }
}

static void fill_identity(hello_ctx *hc) {
    char buf[512];
    if (gethostname(buf, sizeof buf) != 0) strcpy(buf, "?");
    buf[sizeof buf - 1] = 0;
    gp_utf8_clean(hc->host, sizeof hc->host, buf, strlen(buf));
    struct passwd pw, *res = NULL;
    char pwbuf[4096];
    const char *user = NULL;
    if (getpwuid_r(geteuid(), &pw, pwbuf, sizeof pwbuf, &res) == 0 && res) user = res->pw_name;
    if (!user) user = getenv("USER");
    if (!user) {
        snprintf(buf, sizeof buf, "uid%u", (unsigned)geteuid());
        user = buf;
    }
    gp_utf8_clean(hc->user, sizeof hc->user, user, strlen(user));
    program_string(hc->program, sizeof hc->program);
}

/* GPUPOOL_TLS: 1/yes/true/on, or 0/no/false/off/unset. -1 (said why) for anything else. */
static int tls_from_env(void) {
    const char *v = getenv("GPUPOOL_TLS");
    if (!v || !*v || !strcmp(v, "0") || !strcasecmp(v, "no") || !strcasecmp(v, "false") ||
        !strcasecmp(v, "off"))
        return 0;
    if (!strcmp(v, "1") || !strcasecmp(v, "yes") || !strcasecmp(v, "true") ||
        !strcasecmp(v, "on"))
        return 1;
    gp_log_error("GPUPOOL_TLS=%s is not understood: use 1 (TLS) or 0 (plain TCP)", v);
    return -1;
}

CUresult gp_connect(int *sock_out, gp_tls **tls_out, char *server_desc, size_t desc_cap) {
    const char *list = getenv("GPUPOOL_SERVER");
    if (!list || !*list) {
        gp_log_error("GPUPOOL_SERVER is not set: no GPU server to run CUDA on. Set "
                     "GPUPOOL_SERVER=host:port (and GPUPOOL_TOKEN if the server needs one), or "
                     "start the program with `gpupool run`.");
        return CUDA_ERROR_NO_DEVICE;
    }
    hello_ctx hc = {0};
    const char *tok = getenv("GPUPOOL_TOKEN");
    hc.token = tok ? tok : "";
    hc.token_len = strlen(hc.token);
    if (hc.token_len > 4096) {
        gp_log_error("GPUPOOL_TOKEN is longer than 4096 bytes; is it the right value?");
        return CUDA_ERROR_NO_DEVICE;
    }
    if (gp_requirements_from_env(&hc.req) != 0) return CUDA_ERROR_NO_DEVICE; /* it said why */
    int tls_all = tls_from_env();
    if (tls_all < 0) return CUDA_ERROR_NO_DEVICE;
    *tls_out = NULL;
    fill_identity(&hc);
    const char *to = getenv("GPUPOOL_CONNECT_TIMEOUT");
    hc.timeout_s = to && *to ? atof(to) : 10.0;

    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t va_base = env_u64("GPUPOOL_VA_BASE", DEFAULT_VA_BASE) & ~(page - 1);
    uint64_t va_size = (env_u64("GPUPOOL_VA_SIZE", DEFAULT_VA_SIZE) + page - 1) & ~(page - 1);
    if (va_size == 0) va_size = DEFAULT_VA_SIZE;
    uint64_t step = va_size > VA_STEP ? (va_size + VA_STEP - 1) / VA_STEP * VA_STEP : VA_STEP;

    char *servers = strdup(list);
    if (!servers) return CUDA_ERROR_NO_DEVICE;
    char failures[2048] = "";
    int nfail = 0, last_kind = ATTEMPT_CONNECT;
    char last_msg[1024] = "";
    int base_index = 0;
    CUresult result = CUDA_ERROR_NO_DEVICE;

    char *save = NULL;
    for (char *entry = strtok_r(servers, ",", &save); entry; entry = strtok_r(NULL, ",", &save)) {
        while (*entry == ' ' || *entry == '\t') entry++;
        size_t el = strlen(entry);
        while (el > 0 && (entry[el - 1] == ' ' || entry[el - 1] == '\t')) entry[--el] = 0;
        if (!*entry) continue;
        int use_tls = tls_all;
        if (strncmp(entry, "tls://", 6) == 0) {
            use_tls = 1;
            entry += 6;
        }
        snprintf(server_desc, desc_cap, "%s", entry);
        char host[256], port[32];
        if (split_hostport(entry, host, sizeof host, port, sizeof port) != 0) {
            snprintf(last_msg, sizeof last_msg, "not of the form host:port");
            last_kind = ATTEMPT_REFUSED;
            goto failed;
        }
        if (!strchr(entry, ':')) snprintf(server_desc, desc_cap, "%s:%s", host, port);
        hc.desc = server_desc;
        hc.tls_host = host;
        if (use_tls && gp_tls_setup(last_msg, sizeof last_msg) != 0) {
            last_kind = ATTEMPT_TLS;
            goto failed;
        }
        for (;;) {
            /* The window first: device pointers must never alias our memory. */
            while (gp_vamap_window_size() == 0 && base_index < VA_TRIES) {
                uint64_t b = va_base + (uint64_t)base_index * step;
                if (gp_vamap_reserve_window(b, va_size) == 0) break;
                gp_log_debug("cannot reserve the address window at 0x%llx: %s",
                             (unsigned long long)b, strerror(errno));
                base_index++;
            }
            if (gp_vamap_window_size() == 0) {
                gp_log_error("cannot reserve %llu bytes of address space for device memory "
                             "(tried %d bases from 0x%llx); set GPUPOOL_VA_BASE / "
                             "GPUPOOL_VA_SIZE to a free range",
                             (unsigned long long)va_size, VA_TRIES, (unsigned long long)va_base);
                free(servers);
                return CUDA_ERROR_NO_DEVICE;
            }
            int fd = tcp_connect(host, port, hc.timeout_s, last_msg, sizeof last_msg);
            if (fd < 0) {
                last_kind = ATTEMPT_CONNECT;
                goto failed;
            }
            hs_link l = {.fd = fd};
            int k = ATTEMPT_OK;
            if (use_tls) {
                int ms = hc.timeout_s <= 0 ? -1 : (int)(hc.timeout_s * 1000);
                l.tls = gp_tls_connect(fd, host, 0, ms, last_msg, sizeof last_msg);
                if (!l.tls) k = ATTEMPT_TLS;
            }
            if (k == ATTEMPT_OK)
                k = say_hello(&l, &hc, gp_vamap_window_base(), gp_vamap_window_size(), last_msg,
                              sizeof last_msg);
            if (k == ATTEMPT_OK) {
                *sock_out = fd;
                *tls_out = l.tls;
                free(servers);
                return CUDA_SUCCESS;
            }
            gp_tls_free(l.tls);
            close(fd);
            last_kind = k;
            if (k == ATTEMPT_VAWINDOW && base_index + 1 < VA_TRIES) {
                gp_log_debug("server %s cannot use window 0x%llx; trying the next base", entry,
                             (unsigned long long)gp_vamap_window_base());
                gp_vamap_release_window();
                base_index++;
                continue;
            }
            goto failed;
        }
    failed:
        nfail++;
        snprintf(failures + strlen(failures), sizeof failures - strlen(failures), "%s%s: %s",
                 nfail > 1 ? "; " : "", entry, last_msg);
    }
    free(servers);
    if (nfail == 0) {
        gp_log_error("GPUPOOL_SERVER is empty: set GPUPOOL_SERVER=host:port.");
    } else if (nfail > 1) {
        gp_log_error("cannot use any gpupool server (%s). Are they running? Check "
                     "GPUPOOL_SERVER and GPUPOOL_TOKEN.",
                     failures);
    } else if (last_kind == ATTEMPT_CONNECT) {
        gp_log_error("cannot connect to gpupool server %s (%s). Is gpupoold running there? Set "
                     "GPUPOOL_SERVER=host:port.",
                     server_desc, last_msg);
    } else if (last_kind == ATTEMPT_TLS) {
        gp_log_error("cannot use gpupool server %s: %s", server_desc, last_msg);
    } else if (last_kind == ATTEMPT_VAWINDOW) {
        gp_log_error("server %s could not reserve the client's device address window (%s); "
                     "set GPUPOOL_VA_BASE to another free range.",
                     server_desc, last_msg);
    } else {
        gp_log_error("server %s refused the session: %s", server_desc, last_msg);
    }
    gp_vamap_release_window();
    return result;
}
