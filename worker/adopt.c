/*
 * adopt.c: a session outlives its gpupoold (worker/README.md "Adoption").
 *
 * A control-mode worker started with --adopt-dir DIR and --orphan-grace S > 0 listens, from the
 * start of its session, on DIR/lease-<session id>.sock (SOCK_SEQPACKET, 0600, in the daemon's
 * private state directory). When the control socket closes (gpupoold stopped, restarted,
 * crashed) the worker is "orphaned": it keeps serving its client, with no daemon, for at most S
 * seconds. A new gpupoold connects to the socket and sends worker_adopt; the worker answers with
 * worker_adopted (who it is, what it serves, its counters) and that connection becomes the
 * control socket, exactly as the first one was. worker_adopt may carry a descriptor: the new
 * daemon's log pipe, which replaces stdout and stderr (the old ones lead to the dead daemon).
 *
 * A detached session (detach.c) is orphaned too: it stays parked, its device memory in our host
 * memory; a client frame meanwhile is noted (keepalive notices to the client), and the adopting
 * daemon hears both before and after worker_adopted (wk_detach_restate, wk_detach_adopted), then
 * seats the session on a GPU again as if it had never left.
 *
 * When the grace period passes with no daemon, the session ends ("daemon lost"): the client is
 * told, everything is released. An adoptable session always leaves its worker_ended frame in
 * DIR/lease-<session id>.end before it reports it: a daemon that dies (or stops) between the
 * report and its record, and the next gpupoold, still know how the lease ended. The daemon
 * removes the file once its record is written.
 *
 * Like containerd's shims, this is what lets `systemctl restart gpupoold` and package upgrades
 * keep every running job: the worker owns the client connection and the GPU context, the daemon
 * is a supervisor that may come and go.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "pacing.h"
#include "worker.h"

#define ADOPT_READ_MS 5000 /* a connected daemon has this long to send worker_adopt */

static void adopt_path(const struct worker *w, char *buf, size_t cap, const char *suffix)
{
    snprintf(buf, cap, "%s/lease-%llu.%s", w->ctl.adopt_dir, (unsigned long long)w->ctl.session_id,
             suffix);
}

int wk_adopt_listen(struct worker *w)
{
    if (!w->ctl.adopt_dir || w->ctl.grace_ns == 0)
        return 0; /* the session ends with its daemon, as it always did */
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    char path[PATH_MAX_ADOPT];
    adopt_path(w, path, sizeof path, "sock");
    if (strlen(path) >= sizeof a.sun_path) {
        wk_warn("adoption socket path %s is longer than a Unix socket allows (%zu bytes): this "
                "session ends with gpupoold (use a shorter state_dir)",
                path, sizeof a.sun_path - 1);
        return -1;
    }
    memcpy(a.sun_path, path, strlen(path) + 1);
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
        wk_warn("adoption socket: %s; this session ends with gpupoold", strerror(errno));
        return -1;
    }
    if (unlink(path) != 0 && errno != ENOENT) /* a stale one of an earlier run */
        wk_warn("removing the stale %s: %s", path, strerror(errno));
    mode_t old = umask(077); /* the daemon's user only, whatever the directory allows */
    int rc = bind(fd, (struct sockaddr *)&a, sizeof a);
    umask(old);
    if (rc != 0 || listen(fd, 2) != 0) {
        wk_warn("adoption socket %s: %s; this session ends with gpupoold", path, strerror(errno));
        if (close(fd) != 0)
            wk_warn("close: %s", strerror(errno));
        return -1;
    }
    w->ctl.listen_fd = fd;
    /* From now on the daemon's death must not end us: no SIGTERM at its exit (watch_parent
     * asked for one before the session); the control socket's end of stream tells instead. */
    if (prctl(PR_SET_PDEATHSIG, 0) != 0)
        wk_warn("PR_SET_PDEATHSIG: %s", strerror(errno));
    return 0;
}

void wk_adopt_close(struct worker *w)
{
    if (w->ctl.listen_fd < 0)
        return;
    if (close(w->ctl.listen_fd) != 0)
        wk_warn("closing the adoption socket: %s", strerror(errno));
    w->ctl.listen_fd = -1;
    char path[PATH_MAX_ADOPT];
    adopt_path(w, path, sizeof path, "sock");
    if (unlink(path) != 0 && errno != ENOENT)
        wk_warn("removing %s: %s", path, strerror(errno));
}

int wk_adopt_orphan(struct worker *w)
{
    if (!w->ctl.in_session || w->ctl.listen_fd < 0 || w->dead)
        return -1;
    if (close(w->ctl.fd) != 0)
        wk_warn("closing the control socket: %s", strerror(errno));
    w->ctl.fd = -1;
    w->ctl.orphan_since = wk_now_ns();
    wk_log("gpupoold is gone: serving on, waiting up to %g s for a new gpupoold to adopt this "
           "session",
           (double)w->ctl.grace_ns / 1e9);
    return 0;
}

/* Milliseconds until the grace period ends (0: over), or -1 when a daemon follows us. */
static int grace_left_ms(const struct worker *w)
{
    if (!w->ctl.orphan_since)
        return -1;
    uint64_t now = wk_now_ns(), end = w->ctl.orphan_since + w->ctl.grace_ns;
    return now >= end ? 0 : (int)((end - now + 999999) / 1000000);
}

/* Before each wait's poll: when the grace period is over, end the session (client told): -1;
 * else 0, and *wait_ms the time left of it (-1: a daemon follows us). */
static int grace_due(void *ctx, int *wait_ms)
{
    struct worker *w = ctx;
    *wait_ms = grace_left_ms(w);
    if (*wait_ms != 0)
        return 0;
    double s = (double)w->ctl.grace_ns / 1e9;
    wk_log("no gpupoold adopted this %ssession within %g s: ending it",
           w->ctl.detached ? "detached " : "", s);
    wk_detach_end_parked(w); /* detached: no driver call at the end (no_driver stays set) */
    wk_end_session(w, WK_END_DAEMON_LOST,
                   "gpupoold stopped and no new gpupoold adopted the session within %g s "
                   "(worker_orphan_grace)",
                   s);
    char text[300];
    snprintf(text, sizeof text, "the gpupool server has been gone for %g s; this session has ended",
             s);
    wk_close_client(w, CUDA_ERROR_DEVICE_UNAVAILABLE, text);
    return -1;
}

/* worker_adopted's flags: whether the client asked to keep its GPU, and whether this session
 * runs as a share of a shared GPU: a quota and the GPU's pacing record, which gpupoold gives
 * every worker of a shared GPU (pool/share_leases.py), not a whole-GPU lease that has a quota on
 * an unshared GPU. */
static uint32_t adopted_flags(const struct worker *w)
{
    const char *pace_dir = getenv(WK_PACE_DIR_ENV);
    uint32_t flags = GP_ADOPTED_SAID;
    if (w->ctl.req_flags & GP_HELLO_KEEP_GPU)
        flags |= GP_ADOPTED_KEEP_GPU;
    if (w->quota.limit > 0 && pace_dir && *pace_dir)
        flags |= GP_ADOPTED_SHARE;
    return flags;
}

/* worker_adopted: who we are, what we serve, the counters so far. */
static void send_adopted(struct worker *w)
{
    gp_worker_adopted m = {
        .session_id = w->ctl.session_id,
        .pid = (uint32_t)getpid(),
        .control = GP_WORKER_CONTROL_VERSION,
        .device = w->ordinal,
        .orphaned_s = w->ctl.orphan_since ? (double)(wk_now_ns() - w->ctl.orphan_since) / 1e9 : 0.0,
        .min_memory = w->ctl.req_min_memory,
        .memory_quota = w->quota.limit, /* a share's (issue 32): adopted as a share again */
        .flags = adopted_flags(w),
    };
    char uuid[64], gpu[256], model[256];
    wk_uuid_text(w, uuid); /* ASCII already */
    m.uuid = uuid;
    m.uuid_len = (uint32_t)strlen(uuid);
    WK_SET_TEXT(m.gpu, gpu, w->ctl.req_gpu);
    WK_SET_TEXT(m.model, model, w->ctl.req_model);
    uint8_t lat[8 * WK_LAT_BUCKETS];
    wk_ctl_counters(w, &m.counters, lat);
    (void)wk_ctl_send(w, WK_CTL_ENCODE(w, worker_adopted, &m), 0);
}

/* worker_adopt_refused on the adoption connection fd, which is closed. */
static void refuse(struct worker *w, int fd, const char *why)
{
    gp_worker_adopt_refused m = {.session_id = w->ctl.session_id};
    char error[1024];
    WK_SET_TEXT(m.error, error, why);
    size_t n = WK_CTL_ENCODE(w, worker_adopt_refused, &m);
    if (n && send(fd, w->ctl.out, n, MSG_NOSIGNAL | MSG_DONTWAIT) < 0)
        wk_warn("refusing an adoption: %s", strerror(errno));
    if (close(fd) != 0)
        wk_warn("close: %s", strerror(errno));
}

/* Only the daemon's own user (or root) may adopt: the socket's mode says so already; the peer's
 * credentials say it again, whatever happened to the directory. */
static int peer_allowed(int fd)
{
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0)
        return 0;
    return cred.uid == geteuid() || cred.uid == 0;
}

/* The adoption socket is readable: accept, check, take worker_adopt, send worker_adopted. Always
 * 0 (a bad adoption attempt is refused and changes nothing). */
static int on_adopt(void *ctx)
{
    struct worker *w = ctx;
    int fd = accept4(w->ctl.listen_fd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED)
            wk_warn("accepting on the adoption socket: %s", strerror(errno));
        return 0;
    }
    if (!peer_allowed(fd)) {
        wk_warn("refused an adoption from another user");
        refuse(w, fd, "only gpupoold's own user may adopt this worker");
        return 0;
    }
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int r;
    do {
        r = poll(&p, 1, ADOPT_READ_MS);
    } while (r < 0 && errno == EINTR);
    uint8_t buf[256];
    int passed = -1, truncated = 0;
    ssize_t n = -1;
    if (r == 1) {
        int saved = w->ctl.fd;
        w->ctl.fd = fd; /* wk_ctl_recv reads w->ctl.fd */
        n = wk_ctl_recv(w, buf, sizeof buf, &passed, &truncated);
        w->ctl.fd = saved;
    }
    gp_worker_adopt adopt;
    const uint8_t *body =
        n > 0 && !truncated ? wk_ctl_decode(buf, (size_t)n, GP_OP_WORKER_ADOPT) : NULL;
    if (!body || gp_worker_adopt_decode(body, (size_t)n - GP_PROTO_HEADER_SIZE, &adopt) != 0) {
        wk_warn("an adoption connection sent no valid worker_adopt message (%zd bytes); ignored",
                n);
        if (passed >= 0 && close(passed) != 0)
            wk_warn("close: %s", strerror(errno));
        refuse(w, fd, "expected a worker_adopt message");
        return 0;
    }
    uint32_t version = adopt.control, daemon_pid = adopt.daemon_pid;
    if (version != GP_WORKER_CONTROL_VERSION) {
        char why[160];
        snprintf(why, sizeof why, "this worker speaks control version %d, gpupoold asked for %u",
                 GP_WORKER_CONTROL_VERSION, version);
        wk_warn("refused an adoption: %s", why);
        if (passed >= 0 && close(passed) != 0)
            wk_warn("close: %s", strerror(errno));
        refuse(w, fd, why);
        return 0;
    }
    if (w->ctl.fd >= 0) {
        wk_warn("refused an adoption: a gpupoold already follows this session");
        if (passed >= 0 && close(passed) != 0)
            wk_warn("close: %s", strerror(errno));
        refuse(w, fd,
               "another gpupoold already follows this session (two "
               "daemons on one state directory?)");
        return 0;
    }
    if (passed >= 0) { /* the new daemon's log pipe becomes our stdout and stderr */
        if (dup2(passed, STDOUT_FILENO) < 0 || dup2(passed, STDERR_FILENO) < 0)
            wk_warn("taking the new log pipe: %s", strerror(errno));
        if (close(passed) != 0)
            wk_warn("close: %s", strerror(errno));
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || ((fl & O_NONBLOCK) && fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0))
        wk_warn("making the control socket blocking: %s", strerror(errno));
    double orphaned = w->ctl.orphan_since ? (double)(wk_now_ns() - w->ctl.orphan_since) / 1e9 : 0;
    w->ctl.fd = fd;
    w->ctl.gone = 0;
    wk_detach_restate(w);
    send_adopted(w);
    wk_detach_adopted(w);
    w->ctl.orphan_since = 0;
    w->ctl.sent = w->stats; /* the event carried them */
    w->ctl.stats_ns = wk_now_ns();
    wk_log("adopted by gpupoold pid %u after %.1f s on our own", daemon_pid, orphaned);
    return 0;
}

void wk_adopt_write_end(struct worker *w, size_t n, int alone)
{
    if (!w->ctl.adopt_dir || n == 0)
        return;
    char path[PATH_MAX_ADOPT], tmp[PATH_MAX_ADOPT + 8];
    adopt_path(w, path, sizeof path, "end");
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    if (unlink(tmp) != 0 && errno != ENOENT) /* a leftover of a crash */
        wk_warn("removing %s: %s", tmp, strerror(errno));
    if (wk_write_file_atomic(tmp, path, w->ctl.out, n, alone) != 0) {
        wk_error("cannot record the session's end in %s: %s", path, strerror(errno));
        return;
    }
    if (alone)
        wk_log("no gpupoold follows this session: its end is recorded in %s for the next one",
               path);
}

int wk_adopt_watch(struct worker *w)
{
    if (wk_reactor_timer(&w->reactor, grace_due, w) != 0)
        return -1;
    return wk_reactor_watch(&w->reactor, &w->ctl.listen_fd, 0, on_adopt, w);
}
