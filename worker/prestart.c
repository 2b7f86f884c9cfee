/*
 * prestart.c: the life of a control-mode worker (--control-fd, worker/README.md).
 *
 * gpupoold starts one worker per free GPU before any client comes, so that a client's wait is
 * only the hello exchange: everything that does not depend on the hello (driver load, cuInit,
 * the primary context, the device snapshot) happens here first, then worker_ready goes out and
 * the worker waits for worker_session: the client socket (SCM_RIGHTS) and its hello. From then
 * on it is the same session as in --fd mode, with worker_started/worker_refused, worker_stats and
 * worker_ended reported on the control socket (messages of protocol/gpupool.toml, "control").
 * One worker serves one session and exits.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "sha256.h"
#include "sock.h"
#include "worker.h"

/* The longest worker_session: the frame header, its fixed fields and a hello of 64 KiB. */
#define MAX_SESSION_MESSAGE ((size_t)GP_PROTO_HEADER_SIZE + 24 + ((size_t)64 << 10))

/* What the daemon asked for while the worker waited for a session. */
enum wait_result {
    GOT_SESSION,
    GOT_END,
    GOT_SIGNAL,
    DAEMON_GONE,
    BAD_MESSAGE
};

/* `failed`: set-up failed; text says what to do. */
static void send_failed(struct worker *w, const char *text)
{
    wk_warn("set-up failed: %s", text);
    gp_worker_failed m;
    char error[2048];
    WK_SET_TEXT(m.error, error, text);
    (void)wk_ctl_send(w, WK_CTL_ENCODE(w, worker_failed, &m), 0);
}

static void send_ready(struct worker *w, uint64_t t0)
{
    gp_worker_ready m = {.pid = (uint32_t)getpid(),
                         .init_ms = (double)(wk_now_ns() - t0) / 1e6,
                         .total_memory = w->snap.total_mem};
    char device[256], uuid[64];
    WK_SET_TEXT(m.device, device, w->snap.name);
    wk_uuid_text(w, uuid);
    m.uuid = uuid;
    m.uuid_len = (uint32_t)strlen(uuid);
    (void)wk_ctl_send(w, WK_CTL_ENCODE(w, worker_ready, &m), 0);
}

/* A pre-session end (END or a signal before any client): `end` with session null. */
static void send_end_idle(struct worker *w, enum wk_end_reason reason, const char *detail)
{
    wk_end_session(w, reason, "%s", detail);
    wk_ctl_send_end(w);
}

/* Asks for SIGTERM when the daemon dies, and makes sure it has not died already: between our
 * fork and the prctl the parent may have gone, and then no signal would ever come. The control
 * socket tells: the daemon's end closes with it. -1: the daemon is gone. */
static int watch_parent(struct worker *w)
{
    pid_t parent = getppid();
    if (prctl(PR_SET_PDEATHSIG, SIGTERM) != 0)
        wk_warn("PR_SET_PDEATHSIG: %s (the control socket still tells when gpupoold goes)",
                strerror(errno));
    if (getppid() != parent)
        return -1;
    struct pollfd p = {.fd = w->ctl.fd, .events = POLLIN};
    if (poll(&p, 1, 0) == 1 && (p.revents & (POLLHUP | POLLERR)))
        return -1;
    return 0;
}

/* The control socket as the worker wants it: blocking (wk_ctl_send blocks for events that must
 * arrive) and not inherited by anything the driver might start. */
static int prepare_control(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || ((fl & O_NONBLOCK) && fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0))
        return -1;
    int fdfl = fcntl(fd, F_GETFD);
    if (fdfl < 0 || fcntl(fd, F_SETFD, fdfl | FD_CLOEXEC) != 0)
        return -1;
    return 0;
}

/* Waits for the daemon's first message (or a signal, or its departure). On GOT_SESSION, buf
 * holds the message (*len bytes) and *fd the client socket. */
static enum wait_result wait_session(struct worker *w, uint8_t *buf, size_t cap, size_t *len,
                                     int *fd)
{
    struct pollfd p[2] = {{.fd = w->ctl.fd, .events = POLLIN}, {.fd = w->sigfd, .events = POLLIN}};
    nfds_t n = w->sigfd >= 0 ? 2 : 1;
    for (;;) {
        int r = poll(p, n, -1);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            wk_warn("poll: %s", strerror(errno));
            return DAEMON_GONE;
        }
        if (n == 2 && (p[1].revents & POLLIN)) {
            struct signalfd_siginfo si;
            ssize_t got = read(w->sigfd, &si, sizeof si);
            int sig = got == (ssize_t)sizeof si ? (int)si.ssi_signo : 0;
            wk_log("%s before any session: exiting", sig ? strsignal(sig) : "signal");
            return GOT_SIGNAL;
        }
        if (!p[0].revents)
            continue;
        int truncated;
        ssize_t m = wk_ctl_recv(w, buf, cap, fd, &truncated);
        if (m < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            continue;
        if (m <= 0) {
            if (m < 0)
                wk_warn("reading the control socket: %s", strerror(errno));
            return DAEMON_GONE;
        }
        *len = (size_t)m;
        if (truncated) {
            wk_warn("a control message of more than %zu bytes was cut", cap);
            return BAD_MESSAGE;
        }
        if (wk_ctl_decode(buf, (size_t)m, GP_OP_WORKER_END) != NULL) {
            if (*fd >= 0 && close(*fd) != 0)
                wk_warn("close: %s", strerror(errno));
            *fd = -1;
            return GOT_END;
        }
        /* Anything else is meant to be worker_session; run_session checks it and says what is
         * wrong. */
        return GOT_SESSION;
    }
}

/* TLS: the client's first frame in our session must be a ping carrying the hand-over binding
 * (connect.c's handoff_binding: the first 8 bytes of SHA-256("gpupool tls handoff" NUL, hello
 * body)). Only the client that sent this hello inside gpupoold's TLS session can compute it:
 * whoever took over the TCP connection between the two sessions cannot use the lease. 0, or -1
 * with err. */
static int check_binding(struct worker *w, const uint8_t *hello, size_t hello_len, char *err,
                         size_t cap)
{
    static const char label[] = "gpupool tls handoff";
    gp_sha256_ctx c;
    uint8_t d[GP_SHA256_DIGEST_SIZE];
    gp_sha256_init(&c);
    gp_sha256_update(&c, label, sizeof label);
    gp_sha256_update(&c, hello, hello_len);
    gp_sha256_final(&c, d);
    gp_frame_header h;
    const uint8_t *body;
    if (wk_io_next_frame(w, &h, &body) != 1) {
        snprintf(err, cap, "the client left before proving the TLS hand-over");
        return -1;
    }
    gp_ping p;
    if (h.op != GP_OP_PING || (h.flags & GP_FLAG_REPLY) || gp_ping_decode(body, h.len, &p) != 0 ||
        p.token != gp_rd_u64(d)) {
        snprintf(err, cap,
                 "the client's first frame after the TLS hand-over is not the binding "
                 "of its hello (a connection taken over between the two TLS sessions?)");
        return -1;
    }
    return 0;
}

/* worker_refused for the session, with the client's result and text. */
static void send_refused(struct worker *w, uint64_t session, int32_t code, const char *text)
{
    gp_worker_refused m = {.session_id = session, .code = code};
    char error[2048];
    WK_SET_TEXT(m.error, error, text);
    (void)wk_ctl_send(w, WK_CTL_ENCODE(w, worker_refused, &m), 0);
}

/* One session on the client socket `fd` (ours now) with the hello in the worker_session message.
 * Returns the exit status. */
static int run_session(struct worker *w, const struct wk_options *base, const uint8_t *msg,
                       size_t len, int fd)
{
    struct wk_options o = *base;
    const uint8_t *body = wk_ctl_decode(msg, len, GP_OP_WORKER_SESSION);
    gp_worker_session sm;
    if (!body || gp_worker_session_decode(body, len - GP_PROTO_HEADER_SIZE, &sm) != 0 ||
        (sm.flags & ~(uint32_t)GP_WORKER_SESSION_TLS) != 0 || fd < 0) {
        char text[200];
        snprintf(text, sizeof text,
                 "malformed worker_session message (%zu bytes, op %u, %s); gpupoold and "
                 "gpupool-worker do not match: reinstall gpupool",
                 len, len >= GP_PROTO_HEADER_SIZE ? gp_rd_u16(msg + 4) : 0u,
                 fd < 0 ? "no client socket" : "with a socket");
        if (fd >= 0 && close(fd) != 0)
            wk_warn("close: %s", strerror(errno));
        send_failed(w, text);
        return 1;
    }
    o.session_id = sm.session_id;
    o.hello_req = sm.hello_req;
    o.memory_quota = sm.memory_quota;
    /* The lease's GPUs (issue 37), device 0 first; empty: this worker's own GPU only. */
    o.ndevices = (int)(sm.devices_count < WK_MAX_DEVICES ? sm.devices_count : WK_MAX_DEVICES);
    for (int i = 0; i < o.ndevices; i++)
        o.devices[i] = gp_arr_i32(sm.devices, (size_t)i);
    o.fd = fd;
    w->ctl.session_id = o.session_id;
    if (wk_prepare_socket(fd) != 0)
        wk_warn("preparing the client socket: %s", strerror(errno));
    w->fd = fd;

    if (!(sm.flags & GP_WORKER_SESSION_TLS))
        wk_tls_drop_key(w); /* no handshake to come: the key goes before any tenant byte */
    if (sm.flags & GP_WORKER_SESSION_TLS) {
        char err[400];
        if (wk_tls_accept(w, err, sizeof err) != 0 ||
            check_binding(w, sm.hello, sm.hello_len, err, sizeof err) != 0) {
            /* Nothing can reach the client but TLS alerts: tell the daemon, which logs it. */
            wk_log("session %llu: %s", (unsigned long long)o.session_id, err);
            send_refused(w, o.session_id, GP_EREFUSED, err);
            wk_session_end(w);
            return 1;
        }
    }

    gp_hello hello;
    int ok;
    if (wk_hello_decode(sm.hello, sm.hello_len, &hello) != 0) {
        wk_hello_refuse(w, o.hello_req, GP_EPROTO, "the server could not read the hello message");
        ok = 0;
    } else {
        ok = wk_session_start(w, &o, &hello) == 0;
    }
    if (!ok) {
        send_refused(w, o.session_id, w->refused_code, w->refused_text);
        wk_session_end(w);
        return 1;
    }
    /* `started` means the hello reply went out: send it now rather than with the first reply.
     * If the client is gone already, the loop ends at once with "client lost". */
    (void)wk_io_flush(w);
    snprintf(w->ctl.req_gpu, sizeof w->ctl.req_gpu, "%.*s", (int)hello.gpu_len, hello.gpu);
    snprintf(w->ctl.req_model, sizeof w->ctl.req_model, "%.*s", (int)hello.model_len, hello.model);
    w->ctl.req_min_memory = hello.min_memory;
    w->ctl.req_flags = hello.flags;
    (void)wk_adopt_listen(w); /* before `started`: the daemon may die right after reading it */
    w->ctl.in_session = 1;
    w->ctl.started_ns = w->ctl.stats_ns = wk_now_ns();
    gp_worker_started started = {.session_id = o.session_id,
                                 .adoptable = w->ctl.listen_fd >= 0 ? 1u : 0u};
    (void)wk_ctl_send(w, WK_CTL_ENCODE(w, worker_started, &started), 0);
    if (wk_test_compromise)
        wk_test_compromise(w, &o); /* the test build only (tests/c/worker/worker_compromise.c) */
    wk_log("session %llu: client pid %u (%.*s@%.*s, %.*s)", (unsigned long long)o.session_id,
           hello.pid, (int)hello.user_len, hello.user, (int)hello.host_len, hello.host,
           (int)hello.program_len, hello.program);
    wk_worker_loop(w);
    /* The client sees the end before our teardown (which may take a while on a real GPU). */
    if (!w->dead && shutdown(w->fd, SHUT_RDWR) != 0 && errno != ENOTCONN && errno != ENOTSOCK)
        wk_warn("shutdown of the client socket failed: %s", strerror(errno));
    w->dead = 1;
    if (w->ctl.no_driver) {
        /* The driver may hold this process locked or checkpointed (detach.c): a driver call
         * would wait for an attach that never comes. Nothing on the GPU is ours any more, and
         * the exit frees the host memory holding the saved state. */
        wk_ctl_send_end(w);
        wk_adopt_close(w);
        wk_log("session over while %s: exiting without releasing driver state",
               w->ctl.detached ? "detached" : "parked");
        fflush(NULL);
        _exit(0);
    }
    wk_session_end(w);
    wk_ctl_send_end(w);
    wk_adopt_close(w);
    return 0;
}

int wk_prestart_main(struct worker *w, const struct wk_options *o, uint64_t t0)
{
    if (prepare_control(w->ctl.fd) != 0) {
        wk_warn("preparing the control socket: %s", strerror(errno));
        return 1;
    }
    if (watch_parent(w) != 0) {
        wk_log("gpupoold exited before this worker started; exiting");
        return 0;
    }
    w->simulated = o->simulated;
    char err[512];
    if (o->tls_cert && wk_tls_setup(w, o, err, sizeof err) != 0) {
        send_failed(w, err);
        wk_session_end(w);
        return 1;
    }
    /* The TLS files are read: from here on the worker needs only its libraries, devices and
     * own folders. Before the driver loads: Landlock confines the thread that asks and the
     * threads it starts later, not those already running, and the driver starts its own. */
    if (!o->no_sandbox && wk_sandbox_apply(o, err, sizeof err) < 0) {
        char text[700];
        snprintf(text, sizeof text,
                 "%s (a bug, or a path gpupoold gives its workers is missing; "
                 "worker_sandbox = false turns the sandbox off)",
                 err);
        send_failed(w, text);
        wk_session_end(w);
        return 1;
    }
    int32_t code = 0;
    if (wk_device_open(w, o->driver, o->ordinal, &code, err, sizeof err) != 0) {
        char text[1024];
        snprintf(text, sizeof text,
                 "%s (check the driver and the GPU on the server: "
                 "nvidia-smi; for a simulated GPU, the sim library and its config%s)",
                 err,
                 o->no_sandbox ? ""
                               : "; if the GPU works outside gpupool, the driver may need a file "
                                 "the worker's sandbox refuses: try worker_sandbox = false and "
                                 "report it (docs/validation.md)");
        send_failed(w, text);
        wk_session_end(w);
        return 1;
    }
    send_ready(w, t0);
    wk_log("ready on %s (device %d) in %.1f ms", w->snap.name, o->ordinal,
           (double)(wk_now_ns() - t0) / 1e6);

    size_t cap = MAX_SESSION_MESSAGE;
    uint8_t *buf = malloc(cap);
    if (!buf) {
        send_failed(w, "out of memory");
        wk_session_end(w);
        return 1;
    }
    size_t len = 0;
    int fd = -1, status = 0;
    switch (wait_session(w, buf, cap, &len, &fd)) {
    case GOT_SESSION:
        status = run_session(w, o, buf, len, fd);
        break;
    case GOT_END:
        wk_log("the server retired this worker before any session");
        wk_session_end(w);
        send_end_idle(w, WK_END_SERVER_ENDED, "the server ended this worker before any session");
        break;
    case GOT_SIGNAL:
        wk_session_end(w);
        send_end_idle(w, WK_END_SHUTDOWN, "the server is shutting down");
        break;
    case DAEMON_GONE:
        wk_log("the control socket was closed: gpupoold is gone; exiting");
        wk_session_end(w);
        break;
    case BAD_MESSAGE:
        if (fd >= 0 && close(fd) != 0)
            wk_warn("close: %s", strerror(errno));
        send_failed(w, "an unexpected control message came instead of worker_session; gpupoold "
                       "and gpupool-worker do not match: reinstall gpupool");
        wk_session_end(w);
        status = 1;
        break;
    }
    free(buf);
    return status;
}
