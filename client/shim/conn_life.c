/*
 * conn_life.c: the life of the process's connections: connecting them once (gp_conn_ensure,
 * from cuInit: every part of the lease, all or none), starting each one's receiver and flusher
 * threads, and their end: a forked child drops them without a word, the program's exit flushes
 * and says goodbye to every part, bounded by short timeouts, and (over TLS) joins the receivers.
 *
 * Apart from conn.c because it runs once or twice in a process's life, not per call: conn.c
 * carries the session (send, receive, loss) and needs nothing from here, while this file calls
 * conn.c's thread bodies and its loss and flush steps (conn_state.h) and fills conn_route.c's
 * parts table.
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "conn_state.h"
#include "connect_parts.h"
#include "shim.h"
#include "shim_core.h"

/* Connecting: once per process, under init_lock (a lease of several parts connects to all of
 * them under it); init_result says why it failed. */
static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;
static CUresult init_result = CUDA_ERROR_NOT_INITIALIZED; /* guarded by init_lock */

/* A spread lease's later parts (part 0's is gp_conn_process, conn_route.c): set up (conn_fresh)
 * and connected under init_lock, then entered in gp_conn_part. */
static gp_conn more_conns[GP_MAX_DEVICES - 1];

/* cuInit (shim_core.h): connect, then the calls that need initialisation work. */
CUresult gp_conn_init(void)
{
    CUresult r = gp_conn_ensure();
    if (r == CUDA_SUCCESS) {
        atomic_store(&gp_conn_initialized, 1);
        r = gp_check_init();
    }
    return r;
}

static void atfork_child(void);
static void at_exit(void);
static int stop_receiver(gp_conn *c);
static void say_goodbye(gp_conn *c);

/* Starts fn(arg) on a thread of ours; detached unless out is given (then the caller joins it). */
static int start_thread(void *(*fn)(void *), void *arg, const char *name, pthread_t *out)
{
    pthread_t t;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* the program's signals stay on its threads */
    int rc = pthread_create(&t, NULL, fn, arg);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0)
        return -1;
    pthread_setname_np(t, name);
    if (out)
        *out = t;
    else
        pthread_detach(t);
    return 0;
}

/* A connection's condition variables wait with CLOCK_MONOTONIC deadlines (its mutexes are
 * initialised statically). */
static void conn_init_conds(gp_conn *c)
{
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&c->flush_cv, &ca);
    pthread_cond_init(&c->role_cv, &ca);
    pthread_condattr_destroy(&ca);
}

static void init_once_handlers(void)
{
    conn_init_conds(&gp_conn_process);
    pthread_atfork(NULL, NULL, atfork_child); /* process-wide: acts on every connection */
}

/* The connection's own status (gp_check_init without the cuInit requirement). */
static CUresult conn_status(gp_conn *c)
{
    int s = atomic_load_explicit(&c->state, memory_order_acquire);
    if (s == ST_READY)
        return atomic_load(&c->dead) ? GP_LOST_CONNECTION_ERROR : CUDA_SUCCESS;
    if (s == ST_CLOSED)
        return CUDA_ERROR_DEINITIALIZED;
    if (s == ST_FORKED)
        return CUDA_ERROR_NOT_INITIALIZED;
    return CUDA_ERROR_NO_DEVICE;
}

/* A later part's connection, as gp_conn_process's static initialiser (conn_route.c) sets up
 * part 0's. Caller holds init_lock; nobody else sees c yet. */
static void conn_fresh(gp_conn *c)
{
    memset(c, 0, sizeof *c);
    c->sock = -1;
    pthread_mutex_init(&c->send_lock, NULL);
    pthread_mutex_init(&c->wait_lock, NULL);
    conn_init_conds(c);
    c->ws = (gp_writer){.sock = -1, .dead = &c->dead, .ka = &c->ka};
    c->rs = (gp_reader){.sock = -1, .ka = &c->ka, .quiet = gp_conn_silence_check, .owner = c};
}

/* A connection whose start failed (conn_start), or the started parts of a lease that could not
 * start whole (conns_open): killed first (marked dead, its waiters and its flusher woken: the
 * flusher ends), then its receiver stopped, out of the socket and the TLS state before they go.
 * A receiver that did not stop within stop_receiver's wait may still read into its buffer and
 * its TLS session: those are then left to it (a leak on a failed start, not a use after free). */
static void conn_abandon(gp_conn *c)
{
    gp_conn_kill(c);
    if (stop_receiver(c)) {
        free(c->rs.buf);
        c->rs.buf = NULL;
        gp_tls_free(c->tls);
        c->tls = NULL;
    }
    close(c->sock);
    c->sock = -1;
}
/* Start c on the connected part l: its receiver and flusher, its keepalive clock. Caller holds
 * init_lock. 0; or -1 with one line said and l's socket closed. */
static int conn_start(gp_conn *c, const gp_part_link *l)
{
    c->sock = l->fd;
    c->tls = l->tls;
    snprintf(c->server_desc, sizeof c->server_desc, "%s", l->desc);
    c->first_device = l->first_device;
    c->ndevices = l->ndevices;
    c->va_base = l->va_base;
    c->va_size = l->va_size;
    atomic_store(&c->lz4_on, (l->features & GP_HELLO_LZ4) != 0);
    int ok = 1;
    if (!c->rs.buf && !(c->rs.buf = malloc(GP_READ_BUF_SIZE))) {
        gp_log_error("cannot allocate the receive buffer");
        ok = 0;
    }
    if (ok) {
        /* Part 0's connection is initialised statically in conn_route.c, which calls nothing of
         * conn.c: its read slices' silence check is set here, for every part alike. */
        c->rs.quiet = gp_conn_silence_check;
        c->rs.owner = c;
        c->rs.sock = c->ws.sock = c->sock;
        c->rs.tls = c->ws.tls = c->tls;
        c->last_ctx_sent = UINT64_MAX;
        if (start_thread(gp_conn_receiver_main, c, "gpupool-recv", &c->receiver_thread) == 0)
            c->receiver_started = 1;
        if (!c->receiver_started ||
            start_thread(gp_conn_flusher_main, c, "gpupool-flush", NULL) != 0) {
            gp_log_error("cannot start the connection threads: %s", strerror(errno));
            ok = 0;
        }
    }
    if (!ok) {
        conn_abandon(c);
        return -1;
    }
    gp_ka_arm(&c->ka, c->sock, c->tls, (l->features & GP_HELLO_KEEPALIVE) != 0);
    return 0;
}

/* Every part's link (gp_connect_parts), only while connecting (under init_lock). */
static gp_part_link part_links[GP_MAX_DEVICES];

/* Connect the lease: one part (a server), or one connection per part of a spread lease, each
 * started as conn_start says; all or none. Caller holds init_lock; gp_conn_process.state is
 * ST_NONE. Leaves it ST_READY or ST_FAILED (init_result says why). */
static void conns_open(void)
{
    int n = 0, k = 0;
    init_result = gp_connect_parts(part_links, GP_MAX_DEVICES, &n);
    if (init_result == CUDA_SUCCESS) {
        for (k = 0; k < n; k++) {
            if (k > 0) {
                conn_fresh(&more_conns[k - 1]);
                gp_conn_part[k] = &more_conns[k - 1];
            }
            if (conn_start(gp_conn_part[k], &part_links[k]) != 0)
                break;
        }
        if (k < n) { /* a part could not start: none stays (its servers end the others) */
            for (int i = k + 1; i < n; i++) {
                gp_tls_free(part_links[i].tls);
                close(part_links[i].fd);
            }
            for (int i = 0; i < k; i++) {
                conn_abandon(gp_conn_part[i]);
            }
            init_result = CUDA_ERROR_NO_DEVICE;
        }
    }
    memset(part_links, 0, sizeof part_links); /* the sockets and sessions are the parts' now */
    if (init_result != CUDA_SUCCESS) {
        atomic_store_explicit(&gp_conn_process.state, ST_FAILED, memory_order_release);
        return;
    }
    atomic_store_explicit(&gp_conn_part_count, n, memory_order_release);
    atexit(at_exit);
    for (k = n - 1; k >= 0; k--) /* part 0 last: its state is what gp_conn_ensure reads */
        atomic_store_explicit(&gp_conn_part[k]->state, ST_READY, memory_order_release);
}

CUresult gp_conn_ensure(void)
{
    gp_conn *c = &gp_conn_process;
    int s = atomic_load_explicit(&c->state, memory_order_acquire);
    if (s == ST_READY || s == ST_CLOSED)
        return conn_status(c);
    if (s == ST_FAILED)
        return CUDA_ERROR_NO_DEVICE;
    if (s == ST_FORKED)
        return CUDA_ERROR_NOT_INITIALIZED;

    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, init_once_handlers);

    pthread_mutex_lock(&init_lock);
    s = atomic_load(&c->state);
    if (s == ST_NONE)
        conns_open();
    CUresult r = conn_status(c);
    pthread_mutex_unlock(&init_lock);
    return r;
}

/* ============================================================== fork and exit == */

static void atfork_child(void)
{
    /* Only this thread survives; the connections belong to the parent. Send nothing, and close
     * our copy of each socket so the parent's sessions end when the parent does. */
    int s = atomic_load(&gp_conn_process.state);
    if (s == ST_NONE || s == ST_FAILED)
        return; /* the child may connect on its own */
    int n = conn_nparts();
    for (int k = 0; k < n; k++) {
        gp_conn *c = gp_conn_part[k];
        if (c->sock >= 0)
            close(c->sock);
        c->sock = -1;
        atomic_store(&c->dead, 1);
        atomic_store(&c->state, ST_FORKED);
    }
    gp_log_debug("fork(): CUDA is not available in the child process (it was initialised in "
                 "the parent)");
}

/* CLOCK_REALTIME ns nanoseconds (under a second) from now: the deadline pthread's timed lock
 * and join take. */
static struct timespec realtime_after(long ns)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += ns;
    if (ts.tv_nsec >= 1000000000L)
        ts.tv_sec++, ts.tv_nsec -= 1000000000L;
    return ts;
}

static void at_exit(void)
{
    if (atomic_load(&gp_conn_process.state) != ST_READY)
        return; /* never connected, already closed, or a forked child (the thread is not ours) */
    if (!atomic_load(&gp_conn_process.dead))
        gp_conn_close_hook_run(); /* what must still talk to the worker (the profile's question) */
    int n = conn_nparts();
    for (int k = 0; k < n; k++) /* a goodbye to every part: each worker ends its session at once */
        if (atomic_load(&gp_conn_part[k]->state) == ST_READY &&
            !atomic_load(&gp_conn_part[k]->dead))
            say_goodbye(gp_conn_part[k]);
    for (int k = 0; k < n; k++)
        if (gp_conn_part[k]->tls)
            (void)stop_receiver(gp_conn_part[k]); /* at exit: one that did not stop is left */
}

/* The goodbye frame, 1 s at most: the worker then ends the session at once instead of waiting
 * for the socket to close. */
static void say_goodbye(gp_conn *c)
{
    struct timespec ts = realtime_after(200000000L);
    if (pthread_mutex_timedlock(&c->send_lock, &ts) != 0)
        return; /* a sender is stuck: just go */
    atomic_store(&c->state, ST_CLOSED);
    struct timeval tv = {.tv_sec = 1};
    setsockopt(c->sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    if (c->tls)
        gp_tls_set_send_timeout(c->tls, 1000);
    gp_goodbye m = {0};
    uint8_t f[16 + 1];
    size_t n = gp_goodbye_frame(f, gp_conn_new_req(), &m);
    if (!atomic_load(&c->dead))
        gp_conn_flush_locked(c, f, n, NULL, 0);
    pthread_mutex_unlock(&c->send_lock);
}

/* Over TLS, at exit (and when start-up fails half-way): the receiver thread must have ended
 * before OpenSSL's exit handler (registered before ours, so run after it) frees the library's
 * state. A receiver woken by the worker's close right after the goodbye was still in SSL_read,
 * or in OpenSSL's clean-up of its thread, while that handler ran: "double free" in
 * OPENSSL_cleanup after a program's last line (ASan, CI 2026-12-06; once in glibc in about three
 * full test runs before). Marked dead (nothing more is read or reported), its socket shut for
 * reading (a poll or read returns at once) and joined, 500 ms at most. 1 when no receiver runs
 * any more; 0 when the join timed out (it may still use the buffer and TLS state). */
static int stop_receiver(gp_conn *c)
{
    if (!c->receiver_started)
        return 1;
    c->receiver_started = 0;
    atomic_store(&c->dead, 1);
    if (c->sock >= 0)
        shutdown(c->sock, SHUT_RD);
    pthread_mutex_lock(&c->wait_lock);
    pthread_cond_broadcast(&c->role_cv);
    pthread_mutex_unlock(&c->wait_lock);
    struct timespec until = realtime_after(500000000L);
    if (pthread_timedjoin_np(c->receiver_thread, NULL, &until) != 0) {
        gp_log_debug("the receiver thread did not stop within 500 ms");
        return 0;
    }
    return 1;
}
