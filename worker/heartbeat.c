/*
 * heartbeat.c: a live worker is never silent towards a waiting client (docs/protocol.md,
 * "Keepalive").
 *
 * The worker is single-threaded: while it is inside a long driver call (a kernel on the
 * simulated device, a synchronise, a module's JIT) it reads and writes nothing, and a client
 * cannot tell that from a hung server. So a second thread watches: when the main thread has been
 * inside one long call (marked with WK_LONG) for GP_KEEPALIVE_MS / 2, it writes a GP_INFO_WORKING
 * notice (empty text) to the client, and again every GP_KEEPALIVE_MS / 2 until the call returns.
 * A stopped or hung worker sends nothing, and the client's timeout fires.
 *
 * Only the main thread touches the socket otherwise, and only outside WK_LONG calls: the
 * heartbeat thread writes only while `busy` is set, and the main thread, leaving a long
 * call, waits for a notice being written (`sending`) before it uses the socket again. The two
 * flags are sequentially consistent atomics (each side stores its own, then loads the other's),
 * so at most one thread touches the socket (or the TLS session) at any time. Only sessions whose
 * client asked for it (hello flag GP_HELLO_KEEPALIVE) get the thread.
 */
#include <errno.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "worker.h"

#define HB_EVERY_NS ((uint64_t)GP_KEEPALIVE_MS * 1000000ull / 2)
#define HB_TICK_NS 100000000ull /* how often the thread looks */
#define HB_WRITE_LIMIT_MS 10000 /* a notice the client does not take within this: lost */

/* Writes the whole frame, or nothing when the socket is full at the start (the next beat tries
 * again). A frame written in part and then stuck would break the stream: the connection is shut
 * instead (the main thread then ends the session as a lost client). */
static void write_frame(struct worker *w, const uint8_t *p, size_t n)
{
    size_t done = 0;
    uint64_t start = wk_now_ns();
    while (done < n) {
        ssize_t r;
        short wait = POLLOUT;
        if (w->ssl) {
            char err[200];
            r = wk_tls_io(w, (void *)(p + done), n - done, 1, &wait, err, sizeof err);
            if (r < 0 && wait == 0) {
                wk_warn("keepalive: %s", err);
                break;
            }
        } else {
            r = send(w->fd, p + done, n - done, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                break; /* the client is gone: the main thread will see it too */
        }
        if (r > 0) {
            done += (size_t)r;
            continue;
        }
        if (done == 0 && !w->ssl)
            return; /* nothing written: skip this beat */
        if ((wk_now_ns() - start) / 1000000ull >= HB_WRITE_LIMIT_MS)
            break;
        struct pollfd pf = {.fd = w->fd, .events = wait};
        if (poll(&pf, 1, 100) < 0 && errno != EINTR)
            break;
    }
    /* Over TLS the record went into the session's write buffer (tls.c gathers records and
     * sends them together); the main thread, inside its long call, flushes nothing: send it
     * now, or the client never sees the keepalive. */
    int flushed = 1;
    while (w->ssl && done == n) {
        char err[200];
        short wait = 0;
        if (wk_tls_flush(w, &wait, err, sizeof err) == 0)
            break;
        if (wait == 0) {
            wk_warn("keepalive: %s", err);
            flushed = 0;
            break;
        }
        if ((wk_now_ns() - start) / 1000000ull >= HB_WRITE_LIMIT_MS) {
            flushed = 0;
            break;
        }
        struct pollfd pf = {.fd = w->fd, .events = wait};
        if (poll(&pf, 1, 100) < 0 && errno != EINTR) {
            flushed = 0;
            break;
        }
    }
    if ((done > 0 && done < n) || !flushed) {
        wk_warn("keepalive: the client took only part of a notice; closing the connection (its "
                "stream would be broken)");
        if (shutdown(w->fd, SHUT_RDWR) != 0 && errno != ENOTCONN)
            wk_warn("shutdown of the client socket failed: %s", strerror(errno));
    }
}

static void beat(struct worker *w)
{
    gp_notice m = {.code = GP_INFO_WORKING, .op = 0, .text = "", .text_len = 0};
    uint8_t frame[16 + 16];
    size_t n = gp_notice_frame(frame, 0, &m);
    if (pthread_mutex_lock(&w->hb.lock) != 0)
        return;
    atomic_store(&w->hb.sending, 1);
    if (atomic_load(&w->hb.busy)) /* still inside a long call: the socket is ours */
        write_frame(w, frame, n);
    atomic_store(&w->hb.sending, 0);
    if (pthread_mutex_unlock(&w->hb.lock) != 0)
        wk_warn("keepalive: unlocking failed");
}

/* Sleeps one tick, or less when wk_hb_stop wakes us. 1 when it is time to stop. */
static int tick(struct worker *w)
{
    struct timespec until;
    if (clock_gettime(CLOCK_MONOTONIC, &until) != 0)
        return 1;
    until.tv_nsec += (long)HB_TICK_NS;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    int stop = 0;
    if (pthread_mutex_lock(&w->hb.wake_lock) != 0)
        return 1;
    while (!(stop = atomic_load(&w->hb.stop))) {
        int rc = pthread_cond_timedwait(&w->hb.wake, &w->hb.wake_lock, &until);
        if (rc == ETIMEDOUT)
            break;
        if (rc != 0 && rc != EINTR) {
            stop = 1;
            break;
        }
    }
    if (pthread_mutex_unlock(&w->hb.wake_lock) != 0)
        return 1;
    return stop;
}

static void *hb_main(void *arg)
{
    struct worker *w = arg;
    uint64_t last_beat = 0, seen_calls = 0, seen_at = 0;
    while (!tick(w)) {
        uint64_t calls = atomic_load(&w->hb.calls), now = wk_now_ns();
        if (!atomic_load(&w->hb.busy) || calls != seen_calls) {
            seen_calls = calls; /* idle, or another call: its time starts now */
            seen_at = now;
            continue;
        }
        if (now - seen_at >= HB_EVERY_NS && now - last_beat >= HB_EVERY_NS) {
            beat(w);
            last_beat = now;
        }
    }
    return NULL;
}

int wk_hb_start(struct worker *w)
{
    if (w->hb.running)
        return 0;
    atomic_store(&w->hb.stop, 0);
    atomic_store(&w->hb.busy, 0);
    atomic_store(&w->hb.calls, 0);
    atomic_store(&w->hb.sending, 0);
    pthread_condattr_t ca;
    if (pthread_mutex_init(&w->hb.lock, NULL) != 0)
        return -1;
    if (pthread_mutex_init(&w->hb.wake_lock, NULL) != 0) {
        (void)pthread_mutex_destroy(&w->hb.lock);
        return -1;
    }
    /* Timed waits on the monotonic clock: a wall-clock step must not stretch a tick. */
    if (pthread_condattr_init(&ca) != 0 || pthread_condattr_setclock(&ca, CLOCK_MONOTONIC) != 0 ||
        pthread_cond_init(&w->hb.wake, &ca) != 0) {
        (void)pthread_mutex_destroy(&w->hb.wake_lock);
        (void)pthread_mutex_destroy(&w->hb.lock);
        return -1;
    }
    (void)pthread_condattr_destroy(&ca);
    /* The thread must not take SIGTERM/SIGINT: the main thread's signalfd reads them (they are
     * blocked in every thread already, since main() blocked them before anything started). */
    int rc = pthread_create(&w->hb.thread, NULL, hb_main, w);
    if (rc != 0) {
        wk_warn("keepalive thread: %s; long calls will look like a silent server", strerror(rc));
        (void)pthread_cond_destroy(&w->hb.wake);
        (void)pthread_mutex_destroy(&w->hb.wake_lock);
        if (pthread_mutex_destroy(&w->hb.lock) != 0)
            wk_warn("keepalive: destroying the lock failed");
        return -1;
    }
    w->hb.running = 1;
    return 0;
}

void wk_hb_stop(struct worker *w)
{
    if (!w->hb.running)
        return;
    /* Under wake_lock, so that the thread cannot miss the signal between its check and wait. */
    if (pthread_mutex_lock(&w->hb.wake_lock) == 0) {
        atomic_store(&w->hb.stop, 1);
        if (pthread_cond_signal(&w->hb.wake) != 0 || pthread_mutex_unlock(&w->hb.wake_lock) != 0)
            wk_warn("keepalive: waking the thread failed");
    } else {
        atomic_store(&w->hb.stop, 1); /* it still stops, within a tick */
    }
    int rc = pthread_join(w->hb.thread, NULL);
    if (rc != 0)
        wk_warn("joining the keepalive thread: %s", strerror(rc));
    if (pthread_cond_destroy(&w->hb.wake) != 0 || pthread_mutex_destroy(&w->hb.wake_lock) != 0 ||
        pthread_mutex_destroy(&w->hb.lock) != 0)
        wk_warn("keepalive: destroying its locks failed");
    w->hb.running = 0;
}

void wk_hb_wait_writer(struct worker *w)
{
    if (pthread_mutex_lock(&w->hb.lock) == 0 && pthread_mutex_unlock(&w->hb.lock) != 0)
        wk_warn("keepalive: unlocking failed");
}
