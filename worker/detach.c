/*
 * detach.c: the worker's side of idle detach (docs/architecture.md, "Idle detach").
 *
 * gpupoold asks (worker_detach_ask) when a lease looks idle; only the worker can tell whether it
 * is: a client blocked in a long synchronise sends nothing, yet its lease is busy. So the worker
 * answers from its wait for the client's next frame only (reactor.c sets `waiting` there, with
 * nothing half read or written), when the client has been silent for the time asked and every
 * stream it created is complete. Having said yes it parks: client frames stay unread in the
 * socket while gpupoold checkpoints this process (gpupool-checkpoint detach: its device memory
 * moves into our host memory), scrubs the GPU and hands it to another. The client's next frame
 * makes the socket readable: we ask for a GPU (worker_wants_gpu) and keep the client informed
 * (keepalive notices, as during a long call) until gpupoold has restored us on one
 * (worker_attached); then the frame is read and served as if nothing happened.
 *
 * A parked process may be locked or checkpointed by the driver at any moment, so it makes no
 * driver call until attached; a session that ends while parked exits without releasing anything
 * (prestart.c): the process's exit frees its host memory, and the GPU was scrubbed already.
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

#include "pacing.h"
#include "worker.h"

static void say_no(struct worker *w, uint32_t lasting, uint64_t idle_ms, const char *why)
{
    gp_worker_detach_no m = {
        .session_id = w->ctl.session_id, .lasting = lasting, .idle_ms = idle_ms};
    char text[1024];
    WK_SET_TEXT(m.why, text, why);
    (void)wk_ctl_send(w, WK_CTL_ENCODE(w, worker_detach_no, &m), 0);
}

/* The first stream with work still queued or running, or 0 when all are complete. */
static uint64_t busy_stream(struct worker *w)
{
    size_t pos = 0;
    uint64_t id;
    void *val;
    while (wk_idmap_next(&w->streams, &pos, &id, &val)) {
        const struct wk_obj *o = val;
        if (DRV(w, cuStreamQuery, (CUstream)o->h) != CUDA_SUCCESS)
            return id;
    }
    return 0;
}

static void on_ask(struct worker *w, const gp_worker_detach_ask *m)
{
    char why[256];
    if (!w->ctl.in_session || m->session_id != w->ctl.session_id) {
        say_no(w, 0, 0, "not serving that session");
        return;
    }
    if (w->ctl.ipc_shared) { /* lasting: the mappings in other processes outlive any idle */
        say_no(w, 1, 0, "the program shares device memory or events through CUDA IPC");
        return;
    }
    if (w->ctl.parked) { /* asked twice: the first answer stands */
        wk_warn("worker_detach_ask while parked; ignored");
        return;
    }
    if (!w->ctl.waiting) {
        say_no(w, 0, 0, "a call is being served");
        return;
    }
    uint64_t idle_ms = (wk_now_ns() - w->ctl.idle_since_ns) / 1000000u;
    if (idle_ms < m->idle_ms) {
        snprintf(why, sizeof why, "the client sent a frame %llu ms ago",
                 (unsigned long long)idle_ms);
        say_no(w, 0, idle_ms, why);
        return;
    }
    uint64_t s = busy_stream(w);
    if (s != 0) {
        snprintf(why, sizeof why, "work is queued or running on stream %llu",
                 (unsigned long long)s);
        say_no(w, 0, 0, why);
        return;
    }
    gp_worker_detach_ok ok = {
        .session_id = w->ctl.session_id, .idle_ms = idle_ms, .mem_used = w->stats.mem_used};
    if (wk_ctl_send(w, WK_CTL_ENCODE(w, worker_detach_ok, &ok), 0) != 0)
        return; /* the daemon is gone: the poll sees it */
    w->ctl.parked = w->ctl.no_driver = 1;
    w->ctl.want_sent = 0;
    wk_log("idle for %llu ms: parked for a detach (%llu bytes of device memory)",
           (unsigned long long)idle_ms, (unsigned long long)w->stats.mem_used);
    int links = w->peer_links_open;
    if (links > 0) /* their sockets stay with the worker: a peer copy after the attach works */
        wk_log("parked with %d server-to-server link(s) open: their sockets stay open; a link "
               "whose other end gave up meanwhile fails its next copy, which then goes through "
               "the client",
               links);
}

static void on_attached(struct worker *w, const gp_worker_attached *m)
{
    if (!w->ctl.parked) {
        wk_warn("worker_attached while not parked; ignored");
        return;
    }
    int was_detached = w->ctl.detached;
    if (w->ctl.want_sent)
        (void)hb_leave(w, CUDA_SUCCESS); /* keepalive notices stop: replies follow */
    w->ctl.parked = w->ctl.want_sent = w->ctl.detached = w->ctl.no_driver = 0;
    if (was_detached) {
        /* The device may be another one now: its UUID is what the snapshot reports. */
        CUuuid uuid;
        memset(&uuid, 0, sizeof uuid);
        if (DRV(w, cuDeviceGetUuid, &uuid, w->dev) == CUDA_SUCCESS)
            memcpy(w->snap.uuid, uuid.bytes, 16);
    }
    if (m->moved) /* a share's launches are paced with the shares of the GPU it is on now */
        wk_pace_move(m->uuid, m->uuid_len);
    wk_log("attached again%s (%.*s)", m->moved ? " on another GPU" : "", (int)m->uuid_len, m->uuid);
}

#define DECODE(kind_, var_)                                                                        \
    gp_##kind_ var_;                                                                               \
    if (gp_##kind_##_decode(body, n, &var_) != 0) {                                                \
        wk_warn("ignoring a malformed " #kind_ " message (%zu bytes)", n);                         \
        return 0;                                                                                  \
    }

int wk_detach_control(struct worker *w, unsigned op, const uint8_t *body, size_t n)
{
    switch (op) {
    case GP_OP_WORKER_DETACH_ASK: {
        DECODE(worker_detach_ask, m);
        on_ask(w, &m);
        return 0;
    }
    case GP_OP_WORKER_DETACHED: {
        DECODE(worker_detached, m);
        if (!w->ctl.parked) {
            wk_warn("worker_detached while not parked; ignored");
            return 0;
        }
        w->ctl.detached = 1;
        w->ctl.detaches++;
        wk_log("detached: the GPU serves another lease; this session's memory waits in host "
               "memory");
        return 0;
    }
    case GP_OP_WORKER_ATTACHED: {
        DECODE(worker_attached, m);
        on_attached(w, &m);
        return 0;
    }
    default:
        wk_warn("ignoring an unexpected control message (op %u) during a session", op);
        return 0;
    }
}

/* Parked, and the client socket is readable: a frame (ask gpupoold for a GPU) or the client's
 * end (the session ends as client lost). 0 carry on, -1 stop. */
static int on_client(void *ctx)
{
    struct worker *w = ctx;
    uint8_t c;
    ssize_t r;
    do {
        r = recv(w->fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    } while (r < 0 && errno == EINTR);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
        return 0; /* spurious */
    if (r <= 0) {
        wk_detach_end_parked(w);
        wk_log("the client went away while %s", w->ctl.detached ? "detached" : "parked");
        wk_end_session(w, WK_END_CLIENT_LOST,
                       "the client closed the connection while its "
                       "lease was %s",
                       w->ctl.detached ? "detached" : "idle");
        w->dead = 1;
        return -1;
    }
    if (w->ctl.fd < 0) {
        /* Orphaned (adopt.c): the gpupoold that adopts us is told at once (wk_detach_adopted). */
        wk_log("the client called while no gpupoold follows this detached session: it waits "
               "for the next gpupoold");
    } else {
        gp_worker_wants_gpu m = {.session_id = w->ctl.session_id};
        if (wk_ctl_send(w, WK_CTL_ENCODE(w, worker_wants_gpu, &m), 0) != 0)
            return 0; /* the daemon is gone: the poll sees it */
    }
    w->ctl.want_sent = 1;
    hb_enter(w); /* the client waits for a reply: keepalive notices until attached */
    return 0;
}

void wk_detach_restate(struct worker *w)
{
    if (!w->ctl.parked || !w->ctl.detached)
        return;
    /* worker_detach_ok again, unasked: "parked and detached, this much device memory saved";
     * it comes before worker_adopted, so the daemon knows the session has no GPU when it
     * takes it over. */
    gp_worker_detach_ok ok = {.session_id = w->ctl.session_id,
                              .idle_ms = (wk_now_ns() - w->ctl.idle_since_ns) / 1000000u,
                              .mem_used = w->stats.mem_used};
    (void)wk_ctl_send(w, WK_CTL_ENCODE(w, worker_detach_ok, &ok), 0);
}

void wk_detach_adopted(struct worker *w)
{
    if (!w->ctl.parked || !w->ctl.detached || !w->ctl.want_sent)
        return;
    gp_worker_wants_gpu m = {.session_id = w->ctl.session_id};
    (void)wk_ctl_send(w, WK_CTL_ENCODE(w, worker_wants_gpu, &m), 0);
}

void wk_detach_end_parked(struct worker *w)
{
    if (!w->ctl.parked)
        return;
    if (w->ctl.want_sent)
        (void)hb_leave(w, CUDA_SUCCESS);
    w->ctl.parked = w->ctl.want_sent = 0;
}

void wk_detach_daemon_gone(struct worker *w)
{
    wk_log("gpupoold went away while this session was %s; ending it",
           w->ctl.detached ? "detached" : "parked");
    w->ctl.gone = 1;
    wk_detach_end_parked(w);
    wk_end_session(w, WK_END_SHUTDOWN, "gpupoold went away while the lease was idle");
    wk_close_client(w, CUDA_ERROR_DEVICE_UNAVAILABLE,
                    "the gpupool server stopped while this process idled; this session has ended");
}

/* Parked, the waits watch the client socket for its next frame only, never read it, and not at
 * all once that frame has asked for a GPU. */
static int client_held(void *ctx)
{
    const struct worker *w = ctx;
    if (!w->ctl.parked)
        return -1;
    return w->ctl.want_sent ? 0 : POLLIN;
}

void wk_detach_watch(struct worker *w)
{
    wk_reactor_hold_client(&w->reactor, client_held, on_client, w);
}
