/*
 * reactor.h: what the worker's waits watch besides the client socket. Each descriptor and timer
 * is registered by the file that owns it (main.c calls their registration functions once, at
 * start), with a callback and its context; the waits (reactor.c) poll them all and call the
 * callbacks, naming none of them. A base header: it includes nothing of the worker.
 */
#ifndef GP_WK_REACTOR_H
#define GP_WK_REACTOR_H

#define WK_MAX_WATCHES 4 /* the signalfd, the control socket, the adoption socket */
#define WK_MAX_TIMERS 4  /* the stats interval, the orphan's grace */

/* A descriptor is ready, or a held client socket is: 0 carry on, -1 the session must stop (the
 * wait returns -1). */
typedef int (*wk_ready_fn)(void *ctx);
/* Runs before every poll of a wait and in every check: 0 or -1 as above; *wait_ms: the longest
 * the poll may wait before the timer must run again (-1: no limit). */
typedef int (*wk_timer_fn)(void *ctx, int *wait_ms);
/* Whether the client socket is held back from the waits (a parked session, detach.c): -1 not
 * held; else the events to watch it for meanwhile (0: not watched at all). */
typedef int (*wk_hold_fn)(void *ctx);

struct wk_watch {
    const int *fd; /* read at every wait: the descriptor comes and goes (-1: not watched now) */
    int any_event; /* call on any event (hang-up, error), not only on POLLIN */
    wk_ready_fn ready;
    void *ctx;
};

struct wk_timer {
    wk_timer_fn due;
    void *ctx;
};

struct wk_reactor {
    struct wk_watch watch[WK_MAX_WATCHES]; /* called in this order when several are ready */
    unsigned watches;
    struct wk_timer timer[WK_MAX_TIMERS]; /* run in this order */
    unsigned timers;
    wk_hold_fn hold; /* NULL: the client socket is never held */
    wk_ready_fn held_ready;
    void *hold_ctx;
};

/* Registration: 0, or -1 when the table is full (a bug: the sizes above count every owner). */
int wk_reactor_watch(struct wk_reactor *r, const int *fd, int any_event, wk_ready_fn ready,
                     void *ctx);
int wk_reactor_timer(struct wk_reactor *r, wk_timer_fn due, void *ctx);
/* While hold says so, the client socket's readiness calls ready instead of ending the wait. */
void wk_reactor_hold_client(struct wk_reactor *r, wk_hold_fn hold, wk_ready_fn ready, void *ctx);
/* Whether any registered descriptor is open now. */
int wk_reactor_watching(const struct wk_reactor *r);

#endif /* GP_WK_REACTOR_H */
