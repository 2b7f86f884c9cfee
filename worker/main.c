/*
 * main.c: gpupool-worker's command line, the hello on stdin, and the exit codes that gpupoold
 * relies on (worker/README.md). Two modes:
 *
 *   gpupool-worker --control-fd N --driver PATH --device ORDINAL --cache-dir DIR [--simulated]
 *                  [--tls-cert PATH --tls-key PATH [--tls-client-ca PATH]]
 *                  [--adopt-dir DIR --orphan-grace SECONDS] [--sandbox-rw DIR]... [--sandbox-ro PATH]...
 *                  [--no-sandbox]
 *       control mode (prestart.c): set up before any client, then take one session from the
 *       daemon over the control socket (with TLS when SESSION says so: tls.c); with --adopt-dir
 *       and a grace above 0 the session outlives its daemon for that long (adopt.c)
 *   gpupool-worker --fd N --driver PATH --device ORDINAL --cache-dir DIR --session-id ID
 *                  --hello-req REQ [--simulated] [--devices ORDINAL,ORDINAL...]
 *       one client socket and its hello on stdin (the original mode; the tests drive it);
 *       --devices: a lease of several GPUs, the first being --device (what worker_session's
 *       devices says in control mode; issue 37)
 *
 * Every worker is made not dumpable, without core files and with no_new_privs first thing;
 * a control-mode worker then enters its Landlock sandbox once it has read its TLS files, before
 * the driver loads (sandbox.c): --sandbox-rw names a folder it must still write besides
 * --cache-dir and --adopt-dir (the simulated GPU's memory), --sandbox-ro a file or folder it must
 * still read (the simulated GPU's config), --no-sandbox skips the Landlock step (gpupoold's `worker_sandbox = false`, for a
 * driver that needs more than sandbox.c allows).
 *
 *   exit 0  the session ended: goodbye, end of stream, lost connection, a protocol violation,
 *           SIGTERM/SIGINT (the client gets a notice first), END, or the daemon went away (and,
 *           with --adopt-dir, none adopted the session within the grace)
 *   exit 1  the session could not start (the hello reply says why), set-up failed (control mode:
 *           the `failed` event says why), or a failure on our side
 *   exit 2  usage error (nothing was sent to the client)
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "sock.h"
#include "worker.h"

#define MAX_HELLO_BODY ((size_t)64 << 10) /* a hello is a few KiB at most (spec limits) */

static void usage(const char *why)
{
    wk_error("usage error: %s", why);
    fprintf(stderr,
            "usage: gpupool-worker --control-fd N --driver PATH --device ORDINAL "
            "--cache-dir DIR [--simulated]\n"
            "                      [--tls-cert PATH --tls-key PATH [--tls-client-ca PATH]]\n"
            "                      [--adopt-dir DIR --orphan-grace SECONDS]\n"
            "                      [--sandbox-rw DIR]... [--sandbox-ro PATH]... [--no-sandbox]\n"
            "       gpupool-worker --fd N --driver PATH --device ORDINAL --cache-dir DIR "
            "--session-id ID --hello-req REQ [--simulated]\n"
            "                      [--devices ORDINAL,ORDINAL...]\n");
}

static int parse_u64(const char *s, uint64_t *out)
{
    if (!s || !*s || *s == '-')
        return -1;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno != 0 || *end != '\0')
        return -1;
    *out = v;
    return 0;
}

/* --devices 0,2,3 (--fd mode; control mode gets them with worker_session): the lease's GPUs in
 * the program's order, the first being --device (issue 37). */
static int parse_devices(const char *v, struct wk_options *o)
{
    o->ndevices = 0;
    while (*v) {
        char *end;
        errno = 0;
        long d = strtol(v, &end, 10);
        if (errno != 0 || end == v || d < 0 || d > 1024 || o->ndevices == WK_MAX_DEVICES ||
            (*end != ',' && *end != '\0'))
            return -1;
        o->devices[o->ndevices++] = (int)d;
        v = *end == ',' ? end + 1 : end;
    }
    return o->ndevices > 0 ? 0 : -1;
}

static int parse_args(int argc, char **argv, struct wk_options *o)
{
    memset(o, 0, sizeof *o);
    uint64_t fd = 0, cfd = 0, dev = 0;
    int have = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--simulated") == 0) {
            o->simulated = 1;
            continue;
        }
        if (strcmp(a, "--no-sandbox") == 0) {
            o->no_sandbox = 1;
            continue;
        }
        if (i + 1 >= argc) {
            usage("an option lacks its value");
            return -1;
        }
        const char *v = argv[++i];
        int bad = 0;
        if (strcmp(a, "--fd") == 0) {
            bad = parse_u64(v, &fd) != 0 || fd > 1000000;
            have |= 1;
        } else if (strcmp(a, "--control-fd") == 0) {
            bad = parse_u64(v, &cfd) != 0 || cfd > 1000000;
            have |= 64;
        } else if (strcmp(a, "--driver") == 0) {
            o->driver = v;
            have |= 2;
        } else if (strcmp(a, "--device") == 0) {
            bad = parse_u64(v, &dev) != 0 || dev > 1024;
            have |= 4;
        } else if (strcmp(a, "--devices") == 0) {
            bad = parse_devices(v, o) != 0;
        } else if (strcmp(a, "--cache-dir") == 0) {
            o->cache_dir = v;
            bad = !*v;
            have |= 8;
        } else if (strcmp(a, "--session-id") == 0) {
            bad = parse_u64(v, &o->session_id) != 0;
            have |= 16;
        } else if (strcmp(a, "--tls-cert") == 0) {
            o->tls_cert = v;
            bad = !*v;
        } else if (strcmp(a, "--tls-key") == 0) {
            o->tls_key = v;
            bad = !*v;
        } else if (strcmp(a, "--tls-client-ca") == 0) {
            o->tls_client_ca = v;
            bad = !*v;
        } else if (strcmp(a, "--adopt-dir") == 0) {
            o->adopt_dir = v;
            bad = !*v;
        } else if (strcmp(a, "--sandbox-rw") == 0) {
            bad = *v != '/' || o->n_sandbox_rw == WK_MAX_SANDBOX_RW;
            if (!bad)
                o->sandbox_rw[o->n_sandbox_rw++] = v;
        } else if (strcmp(a, "--sandbox-ro") == 0) {
            bad = *v != '/' || o->n_sandbox_ro == WK_MAX_SANDBOX_RW;
            if (!bad)
                o->sandbox_ro[o->n_sandbox_ro++] = v;
        } else if (strcmp(a, "--orphan-grace") == 0) {
            /* seconds, with up to 3 decimals: "300", "2.5" */
            char *end;
            errno = 0;
            double g = strtod(v, &end);
            bad = errno != 0 || *end != '\0' || end == v || !(g >= 0 && g <= 86400 * 7);
            o->orphan_grace_ms = bad ? 0 : (uint64_t)(g * 1000 + 0.5);
        } else if (strcmp(a, "--memory-quota") == 0) {
            /* bytes (--fd mode; control mode: worker_session's memory_quota): quota.c */
            bad = parse_u64(v, &o->memory_quota) != 0;
        } else if (strcmp(a, "--hello-req") == 0) {
            bad = parse_u64(v, &o->hello_req) != 0;
            have |= 32;
        } else {
            usage("unknown option");
            return -1;
        }
        if (bad) {
            usage("an option has an invalid value");
            return -1;
        }
    }
    /* --control-fd replaces --fd, --session-id and --hello-req (they come with SESSION). */
    if (have & 64 ? have != (64 | 2 | 4 | 8) : have != 63) {
        usage(have & 64 ? "--control-fd needs --driver, --device and --cache-dir, and excludes "
                          "--fd, --session-id and --hello-req"
                        : "a required option is missing");
        return -1;
    }
    if ((o->adopt_dir || o->orphan_grace_ms) && !(have & 64)) {
        usage("--adopt-dir and --orphan-grace are for control mode");
        return -1;
    }
    if ((o->tls_cert || o->tls_key || o->tls_client_ca) &&
        (!(have & 64) || !o->tls_cert || !o->tls_key)) {
        usage("--tls-cert and --tls-key go together (--tls-client-ca needs them), in control "
              "mode only");
        return -1;
    }
    o->fd = have & 1 ? (int)fd : -1;
    o->control_fd = have & 64 ? (int)cfd : -1;
    o->ordinal = (int)dev;
    return 0;
}

/* The hello body, as the daemon received it, from stdin. NULL on error. */
static uint8_t *read_hello(size_t *len)
{
    uint8_t *buf = malloc(MAX_HELLO_BODY);
    if (!buf)
        return NULL;
    size_t n = 0;
    for (;;) {
        ssize_t r = read(STDIN_FILENO, buf + n, MAX_HELLO_BODY - n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 || (r > 0 && n + (size_t)r == MAX_HELLO_BODY)) {
            wk_warn("reading the hello from stdin: %s", r < 0 ? strerror(errno) : "too long");
            free(buf);
            return NULL;
        }
        if (r == 0)
            break;
        n += (size_t)r;
    }
    *len = n;
    return buf;
}

/* The control socket must be what the daemon makes: a SOCK_SEQPACKET socket. */
static int check_control_fd(int fd)
{
    int type = 0;
    socklen_t len = sizeof type;
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_SEQPACKET)
        return -1;
    return 0;
}

/* --fd mode: the hello from stdin, then serve. The exit status. */
static int fd_mode(struct worker *w, const struct wk_options *o)
{
    int status = 1;
    size_t hello_len = 0;
    uint8_t *hello_body = read_hello(&hello_len);
    gp_hello hello;
    if (!hello_body || wk_hello_decode(hello_body, hello_len, &hello) != 0) {
        wk_hello_refuse(w, o->hello_req, GP_EPROTO, "the server could not read the hello message");
    } else if (wk_session_start(w, o, &hello) == 0) {
        wk_log("client pid %u (%.*s@%.*s, %.*s)", hello.pid, (int)hello.user_len, hello.user,
               (int)hello.host_len, hello.host, (int)hello.program_len, hello.program);
        wk_worker_loop(w);
        status = 0;
    }
    free(hello_body);
    return status;
}

int main(int argc, char **argv)
{
    uint64_t t0 = wk_now_ns();
    /* First: nothing of this process (its key, its tenant's data) may leak through a core file
     * or another process of our user attaching to it (sandbox.c). A failure is logged. */
    (void)wk_harden_process();
    if (wk_tls_clear_on_free() != 0)
        wk_warn("OpenSSL allocated memory before main: its freed buffers are not cleared");
    struct wk_options o;
    if (parse_args(argc, argv, &o) != 0)
        return 2;
    if (o.control_fd >= 0 && check_control_fd(o.control_fd) != 0) {
        usage("--control-fd is not an open SOCK_SEQPACKET socket");
        return 2;
    }
    if (o.fd >= 0 && wk_prepare_socket(o.fd) != 0) {
        usage("--fd is not an open descriptor");
        return 2;
    }
    /* Writes to a vanished client must fail with EPIPE, not kill us before we clean up. */
    if (signal(SIGPIPE, SIG_IGN) == SIG_ERR)
        wk_warn("cannot ignore SIGPIPE: %s", strerror(errno));

    /* Before the driver starts its threads, which inherit the signal mask (signals.c). */
    int sigfd = wk_signals_open();

    /* All state of the session; see worker.h for why there is no global state. */
    struct worker *w = calloc(1, sizeof *w);
    if (!w || wk_io_init(w, o.fd, sigfd) != 0) {
        wk_error("out of memory at start");
        return 1;
    }
    /* What the waits watch besides the client (reactor.c), in the order they are served when
     * several are ready: a signal, then the daemon, then a new daemon adopting the session. */
    if (wk_signals_watch(w) != 0 || wk_ctl_watch(w) != 0 || wk_adopt_watch(w) != 0) {
        wk_error("the worker's watch table is too small (a bug)");
        return 1;
    }
    wk_detach_watch(w);
    w->simulated = o.simulated;
    w->ctl.fd = -1;
    w->ctl.listen_fd = -1;
    w->ctl.adopt_dir = o.adopt_dir;
    w->ctl.grace_ns = o.orphan_grace_ms * 1000000ull;
    int status;
    if (o.control_fd >= 0) {
        w->ctl.fd = o.control_fd;
        status = wk_prestart_main(w, &o, t0); /* releases the session itself, before `end` */
    } else {
        status = fd_mode(w, &o);
        wk_session_end(w);
    }
    wk_io_free(w);
    wk_tls_free(w);
    free(w);
    if (sigfd >= 0 && close(sigfd) != 0)
        wk_warn("closing the signalfd: %s", strerror(errno));
    return status;
}
