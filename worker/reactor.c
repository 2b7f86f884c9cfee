/*
 * reactor.c: the worker's waits. Whenever the worker must wait for the client socket (its next
 * frame, the rest of a copy's data, room to write replies, a TLS handshake), it waits here, and
 * the wait also watches what was registered (reactor.h): the signalfd (signals.c), the control
 * socket and the stats interval (control_session.c), the adoption socket and the orphan's grace
 * (adopt.c), and a parked session's hold on the client socket (detach.c). This file calls them
 * through their callbacks and names none of them, so that io.c, which waits, depends on none of
 * the files that handle what happens meanwhile.
 *
 * Re-entry, exactly (worker/README.md "The waits"):
 * - The frame dispatcher is never re-entered: loop.c's dispatch runs only from wk_worker_loop,
 *   and nothing here reads a frame or calls a handler. A handler that needs more of the
 *   client's data (copies: h_copy.c, compress.c; module images: h_module.c) or room for a long
 *   reply (wk_io_flush, wk_io_write_direct) waits here, inside its call.
 * - What does run inside such a call: the registered callbacks and timers. They must, or a
 *   client that stalls in the middle of a copy could not be ended by worker_end, a signal or the
 *   daemon's departure, and stats would stop during a long upload. None of them consumes client
 *   input or touches the input buffer (detach.c only peeks, and only when parked). In a call
 *   (w->in_call) a detach is refused: detach.c parks only from the idle wait, so the hold never
 *   applies inside a call. An adoption may wait up to 5 s for worker_adopt (adopt.c). A
 *   callback that ends the session sets closing and dead: the handler's read or write then
 *   fails, it returns, and the frame loop stops.
 * - A callback may itself write to the client (a notice, then a flush), whose wait may run
 *   callbacks again, one level deeper. io.c's in_write tells them that a write is in progress
 *   (they then skip the client's notice, which would land inside the half-written buffer); the
 *   tables here are only read during a wait, so a nested wait is safe.
 */
#include <errno.h>
#include <poll.h>

#include "worker.h"

/* The longest wait under a low-water mark (io.c sets w->lowat for a big upload): the kernel may
 * hold fewer bytes back than the mark early in a connection, and a wait for bytes that cannot
 * come would hang the copy. */
#define LOWAT_WAIT_MS 5

int wk_reactor_watch(struct wk_reactor *r, const int *fd, int any_event, wk_ready_fn ready,
                     void *ctx)
{
    if (r->watches == WK_MAX_WATCHES)
        return -1;
    r->watch[r->watches++] = (struct wk_watch){fd, any_event, ready, ctx};
    return 0;
}

int wk_reactor_timer(struct wk_reactor *r, wk_timer_fn due, void *ctx)
{
    if (r->timers == WK_MAX_TIMERS)
        return -1;
    r->timer[r->timers++] = (struct wk_timer){due, ctx};
    return 0;
}

void wk_reactor_hold_client(struct wk_reactor *r, wk_hold_fn hold, wk_ready_fn ready, void *ctx)
{
    r->hold = hold;
    r->held_ready = ready;
    r->hold_ctx = ctx;
}

int wk_reactor_watching(const struct wk_reactor *r)
{
    for (unsigned i = 0; i < r->watches; i++)
        if (*r->watch[i].fd >= 0)
            return 1;
    return 0;
}

static int held(const struct wk_reactor *r)
{
    return r->hold ? r->hold(r->hold_ctx) : -1;
}

/* Runs every timer: -1 when one says the session must stop, else 0 with *timeout the shortest
 * wait any of them allows (-1: none). */
static int run_timers(const struct wk_reactor *r, int *timeout)
{
    *timeout = -1;
    for (unsigned i = 0; i < r->timers; i++) {
        int ms = -1;
        if (r->timer[i].due(r->timer[i].ctx, &ms) != 0)
            return -1;
        if (ms >= 0 && (*timeout < 0 || ms < *timeout))
            *timeout = ms;
    }
    return 0;
}

/* Fills p[1..] with the open registered descriptors (which[k]: the watch of p[k]); their count
 * plus one. */
static nfds_t add_watches(const struct wk_reactor *r, struct pollfd *p, unsigned *which)
{
    nfds_t n = 1;
    for (unsigned i = 0; i < r->watches; i++) {
        if (*r->watch[i].fd < 0)
            continue;
        which[n] = i;
        p[n++] = (struct pollfd){.fd = *r->watch[i].fd, .events = POLLIN};
    }
    return n;
}

/* Calls the callbacks of the ready descriptors among p[1..n-1], in registration order: 0, or -1
 * as soon as one says the session must stop. */
static int call_ready(const struct wk_reactor *r, const struct pollfd *p, nfds_t n,
                      const unsigned *which)
{
    for (nfds_t k = 1; k < n; k++) {
        const struct wk_watch *wt = &r->watch[which[k]];
        short fire = wt->any_event ? p[k].revents : (short)(p[k].revents & POLLIN);
        if (fire && wt->ready(wt->ctx) != 0)
            return -1;
    }
    return 0;
}

/* The wait itself, with descriptors registered: 0 when the client socket is ready for `events`
 * (or hung up / in error: the next read or write tells which); -1 when the session must stop. */
static int wait_watching(struct worker *w, short events)
{
    const struct wk_reactor *r = &w->reactor;
    for (;;) {
        /* The set is rebuilt each round: the control socket comes and goes (adopt.c). A held
         * client socket (a parked session, detach.c) is only watched for its next frame, never
         * read, or not at all. */
        struct pollfd p[1 + WK_MAX_WATCHES] = {{.fd = w->fd, .events = events}};
        unsigned which[1 + WK_MAX_WATCHES] = {0};
        int hold = held(r);
        if (hold >= 0) {
            p[0].events = (short)hold;
            if (hold == 0)
                p[0].fd = -1;
        }
        nfds_t n = add_watches(r, p, which);
        int timeout;
        if (run_timers(r, &timeout) != 0)
            return -1;
        if (w->lowat && (timeout < 0 || timeout > LOWAT_WAIT_MS))
            timeout = LOWAT_WAIT_MS;
        int got = poll(p, n, timeout);
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0) {
            wk_client_lost(w, "poll", errno);
            return -1;
        }
        if (got == 0 && w->lowat)
            return 0; /* take what has come (the read does not wait) */
        if (got == 0)
            continue; /* a timer is due: the next round runs it */
        if (call_ready(r, p, n, which) != 0)
            return -1;
        if (p[0].revents && held(r) >= 0) { /* held: the holder's, not this wait's */
            if (r->held_ready(r->hold_ctx) != 0)
                return -1;
            continue;
        }
        if (p[0].revents)
            return 0;
    }
}

int wk_wait_client(struct worker *w, short events)
{
    if (!wk_reactor_watching(&w->reactor)) {
        /* Nothing else to watch (--fd mode without a signalfd): the fd may arrive non-blocking
         * (the daemon's asyncio sockets are); we clear that at start, but if it comes back
         * anyway, wait for readiness instead of spinning. */
        struct pollfd p = {.fd = w->fd, .events = events};
        for (;;) {
            int got = poll(&p, 1, w->lowat ? LOWAT_WAIT_MS : -1);
            if (got >= 0)
                return 0;
            if (errno != EINTR) {
                wk_client_lost(w, "poll", errno);
                return -1;
            }
        }
    }
    /* Waiting for the client's next frame with nothing half done: the one moment a detach may be
     * agreed (detach.c). */
    w->ctl.waiting = (events & POLLIN) && !w->in_write && !w->in_call && w->out_len == 0 &&
                     w->in_end == w->in_pos && w->ctl.in_session;
    if (w->ctl.waiting)
        w->ctl.idle_since_ns = wk_now_ns();
    int rc = wait_watching(w, events);
    w->ctl.waiting = 0;
    return rc;
}

int wk_io_check(struct worker *w)
{
    const struct wk_reactor *r = &w->reactor;
    struct pollfd p[1 + WK_MAX_WATCHES] = {{.fd = -1}}; /* p[0]: the client, not looked at */
    unsigned which[1 + WK_MAX_WATCHES] = {0};
    int timeout;
    if (run_timers(r, &timeout) != 0)
        return -1;
    nfds_t n = add_watches(r, p, which);
    int got;
    do {
        got = poll(p, n, 0);
    } while (got < 0 && errno == EINTR);
    if (got <= 0)
        return 0; /* nothing (or poll failed: the next wait will tell) */
    return call_ready(r, p, n, which);
}
