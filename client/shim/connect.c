/*
 * connect.c: starting a session with a gpupool server (conn.c runs it once cuInit asks): the
 * session's steps in order, and the one error line when none works. The units it uses
 * (connect_internal.h): connect_select.c picks the order of the servers, connect_hello.c says
 * hello on a connected socket, connect_redirect.c decides where a fleet's redirect may lead.
 *
 * The servers, their tokens and TLS settings, the timeouts and the GPU requirements come from
 * the client configuration (client_config.c: the file, then GPUPOOL_SERVER, GPUPOOL_TOKEN,
 * GPUPOOL_TLS*, GPUPOOL_CONNECT_TIMEOUT, GPUPOOL_GPU...). One server is used as it is (no
 * probe, no added latency); with several, connect_select.c orders them and when a hello fails
 * the next candidate follows.
 *
 * For the chosen server: reserve the VA window first (device pointers must never alias this
 * process's memory), connect with a timeout (connect_timeout, default 10 s; TCP_NODELAY;
 * keepalive with short probes), send hello and read the answer. A server that cannot use our
 * window answers GP_EVAWINDOW and we retry with the next base (0x200000000000,
 * 0x240000000000, ...). While every GPU is taken the server keeps the hello unanswered and sends
 * queue notices (GP_INFO_QUEUED): we print each one and wait, for as long as it takes. A server
 * that restarts is retried for a while; a fleet's redirect is followed (at most MAX_REDIRECTS
 * hops). Whatever fails is said in ONE line on stderr, with what to do about it, and cuInit then
 * answers CUDA_ERROR_NO_DEVICE.
 *
 * TLS (tls = true / GPUPOOL_TLS=1, or an address written tls://host:port; tls.c,
 * docs/protocol.md "TLS"): the hello goes to gpupoold inside a first TLS session; when the lease
 * starts gpupoold sends GP_INFO_HANDOFF, both sides close that session (close_notify), and a
 * second TLS session on the same socket, with the worker, carries the hello reply and everything
 * after it (connect_hello.c).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "client_config.h"
#include "connect_internal.h"
#include "connect_parts.h"
#include "net.h"
#include "shim.h"
#include "shim_core.h"

#define DEFAULT_VA_BASE 0x200000000000ull
#define DEFAULT_VA_SIZE (1ull << 40)
#define VA_STEP 0x40000000000ull /* 4 TiB between candidate bases */
#define VA_TRIES 8

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

/* A server that closes the connection during the TLS handshake without a word is most often
 * busy: gpupoold closes a connection at once past its limits on handshakes in progress
 * (max_handshakes, max_handshakes_per_address: gpupoold/remoting/admission.py), which a burst of
 * clients from one address meets. 1 after a pause (BUSY_FIRST_MS doubling to BUSY_MAX_MS, each
 * jittered so that a burst does not come back in step) while the connect timeout (0: 60 s) from
 * the first such close has time left; else 0 with the one message in msg, which names both
 * causes (a busy server, or one that wants a client certificate). */
#define BUSY_FIRST_MS 50
#define BUSY_MAX_MS 1000
static int busy_wait(hello_ctx *hc, char *msg, size_t mcap)
{
    int64_t now = mono_ms();
    if (!hc->busy_since)
        hc->busy_since = now;
    int tries = ++hc->busy_tries;
    int64_t budget = hc->timeout_s > 0 ? gp_timeout_ms(hc->timeout_s) : 60000;
    int64_t left = hc->busy_since + budget - now;
    if (left <= 0) {
        snprintf(msg, mcap,
                 "TLS handshake failed: the server closed the connection during the handshake, "
                 "%d time%s in %.1f s. It may be busy: gpupoold closes new connections at once "
                 "while too many handshakes are in progress (its max_handshakes, "
                 "max_handshakes_per_address), so try again in a moment or ask its operator; "
                 "if it requires a client certificate, set GPUPOOL_TLS_CERT and "
                 "GPUPOOL_TLS_KEY to one its tls_client_ca signed",
                 tries, tries == 1 ? "" : "s", (double)(now - hc->busy_since) / 1000);
        return 0;
    }
    int64_t pause = BUSY_FIRST_MS << (tries < 6 ? tries - 1 : 5);
    if (pause > BUSY_MAX_MS)
        pause = BUSY_MAX_MS;
    unsigned seed = (unsigned)getpid() ^ (unsigned)now ^ (unsigned)tries;
    pause = pause / 2 + rand_r(&seed) % (pause / 2 + 1); /* half to the whole of it */
    if (pause > left)
        pause = left;
    gp_log_debug("server %s closed the TLS handshake (it may be busy); trying again in %lld ms",
                 hc->desc, (long long)pause);
    struct timespec ts = {(time_t)(pause / 1000), (long)(pause % 1000) * 1000000L};
    nanosleep(&ts, NULL);
    return 1;
}

/* Connect and say hello to one server, with the window retries. ATTEMPT_OK with *fd_out and
 * *tls_out set, else the kind of failure with msg filled; ATTEMPT_FATAL after the one error line
 * was printed (no window at all). */
static int try_server(hello_ctx *hc, uint64_t va_base, uint64_t va_size, uint64_t step,
                      int *base_index, int *fd_out, gp_tls **tls_out, char *msg, size_t mcap)
{
    const gp_server_config *srv = hc->srv, *named = hc->srv;
    hc->busy_since = 0;
    hc->busy_tries = 0;
    if (gp_tls_trusted(srv, msg, mcap) != 0)
        return ATTEMPT_UNTRUSTED;
    if (srv->tls && gp_tls_setup(srv, msg, mcap) != 0)
        return ATTEMPT_TLS;
    /* A redirect's target (follow_redirect): the settings of the client's own entry for it, or
     * the same token and client certificate as the server that sent us (a fleet shares its
     * tokens), pinned with the fingerprint that server gave. */
    gp_server_config *hop = NULL;
    const char *first_desc = hc->desc;
    char hop_desc[600] = ""; /* set once a redirect is followed */
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
            if (!l.tls && errno == ECONNRESET && busy_wait(hc, msg, mcap)) {
                close(fd);
                continue;
            }
            if (!l.tls) {
                k = ATTEMPT_TLS;
            } else {
                /* Its handshake went through: not busy now, a later close is a new episode
                 * with its own time (not one counted from a close long ago). */
                hc->busy_since = 0;
                hc->busy_tries = 0;
            }
        }
        if (k == ATTEMPT_OK && hc->parts) /* a part: its slice of the window */
            k = gp_connect_hello(&l, hc, hc->part_va_base, hc->part_va_size, msg, mcap);
        else if (k == ATTEMPT_OK)
            k = gp_connect_hello(&l, hc, gp_vamap_window_base(), gp_vamap_window_size(), msg, mcap);
        if (k == ATTEMPT_OK) {
            *fd_out = fd;
            *tls_out = l.tls;
            break;
        }
        gp_tls_free(l.tls);
        close(fd);
        if ((k == ATTEMPT_REDIRECT || k == ATTEMPT_PARTS) && hc->parts) {
            snprintf(msg, mcap,
                     "it sent this client on elsewhere, but the server of a part must hold that "
                     "part's GPUs itself");
            k = ATTEMPT_REFUSED;
            break;
        }
        if (k == ATTEMPT_PARTS) {
            /* Every part's settings now, while `srv` (which sent them) is at hand. */
            k = gp_connect_resolve_parts(hc, srv, hc->plan, msg, mcap);
            if (k == ATTEMPT_OK)
                k = ATTEMPT_PARTS;
            break;
        }
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
            k = gp_connect_follow_redirect(hc, srv, where, hop, msg, mcap);
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
            hc->busy_since = 0;
            hc->busy_tries = 0;
            continue;
        }
        if (k == ATTEMPT_RESTARTING &&
            restart_wait(hc, hc->timeout_s > 0 ? gp_timeout_ms(hc->timeout_s) : 60000, msg, 1))
            continue;
        if (k == ATTEMPT_RESTARTING)
            k = ATTEMPT_CONNECT;
        if (k == ATTEMPT_VAWINDOW && *base_index + 1 < VA_TRIES && !hc->parts) {
            gp_log_debug("server %s cannot use window 0x%llx; trying the next base", hc->desc,
                         (unsigned long long)gp_vamap_window_base());
            gp_vamap_release_window();
            (*base_index)++;
            continue;
        }
        break;
    }
    if (k != ATTEMPT_OK && k != ATTEMPT_FATAL && k != ATTEMPT_PARTS &&
        *hop_desc) /* name the server that failed */
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

/* "2 GPUs at a:7070, 2 GPUs at b:7070": a spread lease's parts, for messages. */
static void describe_parts(const gp_spread_plan *plan, char *out, size_t cap)
{
    size_t n = 0;
    out[0] = 0;
    for (int i = 0; i < plan->nparts && n < cap; i++)
        n += (size_t)snprintf(out + n, cap - n, "%s%d GPU%s at %s", i ? ", " : "",
                              plan->part[i].gpus, plan->part[i].gpus == 1 ? "" : "s",
                              plan->part[i].server);
}

static void close_links(gp_part_link *links, int n)
{
    for (int i = 0; i < n; i++) {
        gp_tls_free(links[i].tls);
        links[i].tls = NULL;
        close(links[i].fd);
        links[i].fd = -1;
    }
}

/* The parts of a spread lease (hc->plan, every part's settings decided: try_server), connected
 * in order: for each, the hello of that part (its group, index, GPUs and window slice) with the
 * retries of one server (a restart, a busy TLS listener). All, or none: a part that fails closes
 * those connected before it, and one line says which part, where and why (the fleet releases the
 * parts nobody claims). `from` names the server that sent the parts. */
static CUresult connect_spread(const hello_ctx *hc, const char *from, gp_part_link *links, int cap,
                               int *nparts)
{
    const gp_spread_plan *plan = hc->plan;
    int n = plan->nparts;
    char what[2048];
    describe_parts(plan, what, sizeof what);
    if (n > cap) { /* a caller with room for fewer connections (gp_connect holds one) */
        gp_log_error("server %s offered this process's %d GPUs spread over %d servers (%s), but "
                     "this connect step has room for %d connection%s. Set GPUPOOL_SPREAD=0 "
                     "(spread = false) to wait for one server with all %d GPUs.",
                     from, hc->cfg->gpus, n, what, cap, cap == 1 ? "" : "s", hc->cfg->gpus);
        return CUDA_ERROR_NO_DEVICE;
    }
    gp_log_info("server %s: this process's %d GPUs are spread over %d servers (%s); connecting "
                "to each",
                from, hc->cfg->gpus, n, what);
    hello_ctx *ph = malloc(sizeof *ph);
    /* The parts' replies wait until every part is in: a part that fails leaves no snapshot. */
    struct part_reply {
        uint8_t *body;
        size_t len;
    } *replies = calloc((size_t)n, sizeof *replies);
    if (!ph || !replies) {
        free(ph);
        free(replies);
        gp_log_error("out of memory connecting the parts of a spread lease");
        return CUDA_ERROR_NO_DEVICE;
    }
    char msg[1024] = "";
    int done = 0, kind = ATTEMPT_OK;
    for (; done < n; done++) {
        gp_part_link *pl = &links[done];
        memset(pl, 0, sizeof *pl);
        pl->fd = -1;
        *ph = *hc;
        ph->plan = NULL;
        ph->srv = &plan->hop[done];
        gp_server_desc(ph->srv, pl->desc, sizeof pl->desc);
        ph->desc = pl->desc;
        ph->restart_until = 0;
        ph->spread_group = plan->group;
        ph->part = done;
        ph->parts = n;
        ph->part_gpus = plan->part[done].gpus;
        ph->part_reply = NULL;
        if (gp_connect_slice(gp_vamap_window_base(), gp_vamap_window_size(), n, done,
                             &ph->part_va_base, &ph->part_va_size) != 0) {
            snprintf(msg, sizeof msg,
                     "the address window (%llu bytes) is too small for %d slices of 2 MiB; set "
                     "GPUPOOL_VA_SIZE larger",
                     (unsigned long long)gp_vamap_window_size(), n);
            kind = ATTEMPT_VAWINDOW;
            break;
        }
        int no_move = VA_TRIES; /* a part's window is its slice: never moved */
        kind = try_server(ph, 0, 0, 0, &no_move, &pl->fd, &pl->tls, msg, sizeof msg);
        if (kind != ATTEMPT_OK)
            break;
        pl->features = ph->features;
        pl->first_device = plan->part[done].first_device;
        pl->ndevices = plan->part[done].gpus;
        pl->va_base = ph->part_va_base;
        pl->va_size = ph->part_va_size;
        pl->session_id = ph->session_id;
        replies[done].body = ph->part_reply;
        replies[done].len = ph->part_reply_len;
    }
    free(ph);
    if (kind == ATTEMPT_OK)
        for (int i = 0; i < n; i++)
            gp_connect_store_part(links[i].first_device, links[i].ndevices, replies[i].body,
                                  replies[i].len);
    for (int i = 0; i < n; i++)
        free(replies[i].body);
    free(replies);
    if (kind != ATTEMPT_OK) {
        close_links(links, done);
        gp_log_error("cannot connect part %d of %d (%d GPU%s at %s) of this process's lease "
                     "spread over %d servers: %s. The parts connected before it were closed; "
                     "the fleet releases the parts nobody claims.",
                     done + 1, n, plan->part[done].gpus, plan->part[done].gpus == 1 ? "" : "s",
                     plan->part[done].server, n, msg);
        return CUDA_ERROR_NO_DEVICE;
    }
    *nparts = n;
    return CUDA_SUCCESS;
}

static CUresult connect_with(const gp_client_config *cfg, gp_spread_plan *plan, gp_part_link *links,
                             int cap, int *nparts)
{
    if (cfg->nservers == 0) {
        no_server(cfg);
        return CUDA_ERROR_NO_DEVICE;
    }
    hello_ctx hc = {.cfg = cfg, .timeout_s = cfg->connect_timeout, .plan = plan};
    gp_connect_identity(&hc);
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
        count = gp_connect_select(cfg, order, failures, sizeof failures, &nfail);
    }
    int base_index = 0;
    char *server_desc = links[0].desc;
    for (int c = 0; c < count; c++) {
        const gp_server_config *srv = &cfg->servers[order[c]];
        gp_server_desc(srv, server_desc, sizeof links[0].desc);
        hc.srv = srv;
        hc.desc = server_desc;
        int fd = -1;
        gp_tls *tls = NULL;
        last_kind = try_server(&hc, va_base, va_size, step, &base_index, &fd, &tls, last_msg,
                               sizeof last_msg);
        if (last_kind == ATTEMPT_OK) {
            gp_part_link *one = &links[0];
            one->fd = fd;
            one->tls = tls;
            one->features = hc.features;
            one->first_device = 0;
            one->ndevices = gp_device_announced();
            one->va_base = gp_vamap_window_base();
            one->va_size = gp_vamap_window_size();
            one->session_id = hc.session_id;
            *nparts = 1;
            return CUDA_SUCCESS;
        }
        if (last_kind == ATTEMPT_PARTS) {
            char from[sizeof links[0].desc];
            snprintf(from, sizeof from, "%s", server_desc);
            return connect_spread(&hc, from, links, cap, nparts);
        }
        if (last_kind == ATTEMPT_FATAL)
            return CUDA_ERROR_NO_DEVICE;
        if (count > 1 || nfail > 0)
            gp_log_debug("server %s: %s; trying the next one", server_desc, last_msg);
        gp_connect_add_failure(failures, sizeof failures, &nfail, server_desc, last_msg);
    }
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

CUresult gp_connect_parts(gp_part_link *parts, int cap, int *nparts)
{
    *nparts = 0;
    if (cap < 1)
        return CUDA_ERROR_INVALID_VALUE;
    memset(parts, 0, sizeof *parts);
    parts[0].fd = -1;
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
        gp_state_set_spread_copy(cfg->spread_copy);
        /* Room for the parts a fleet may name, when this process asks for a spread lease and
         * the caller can hold more than one connection (else the hello does not ask to spread:
         * the fleet would hold GPUs on several servers for a lease it then cannot take). */
        gp_spread_plan *plan = NULL;
        if (cfg->spread && cfg->gpus > 1 && cap > 1 && !(plan = calloc(1, sizeof *plan))) {
            gp_log_error("out of memory reading the gpupool configuration");
            r = CUDA_ERROR_NO_DEVICE;
        } else {
            r = connect_with(cfg, plan, parts, cap, nparts);
        }
        gp_spread_plan_free(plan);
    }
    if (r != CUDA_SUCCESS)
        gp_vamap_release_window();
    free(cfg);
    return r;
}

/* One connection: a lease of one server (conn.c connects with gp_connect_parts, one connection
 * per part). A spread lease fails here with its own line (connect_spread) before any part is
 * connected. */
CUresult gp_connect(int *sock_out, gp_tls **tls_out, unsigned *features_out, char *server_desc,
                    size_t desc_cap)
{
    *tls_out = NULL;
    *features_out = 0;
    gp_part_link one;
    int n = 0;
    CUresult r = gp_connect_parts(&one, 1, &n);
    if (r != CUDA_SUCCESS)
        return r;
    *sock_out = one.fd;
    *tls_out = one.tls;
    *features_out = one.features;
    snprintf(server_desc, desc_cap, "%s", one.desc);
    return CUDA_SUCCESS;
}
