/*
 * keepalive.c: the clock of a silent server (docs/protocol.md, "Keepalive"). When the hello
 * reply promised keepalives (GP_HELLO_KEEPALIVE), a live server is never silent towards a
 * waiting client for long, so conn.c counts the bytes that move (gp_ka_note_rx / _tx) and, each
 * time a read has waited GP_KA_SLICE_MS for nothing, asks gp_ka_silence what to do: ping the
 * server once it has been quiet for a third of GPUPOOL_SERVER_TIMEOUT, give it up once nothing
 * came in and nothing went out for the whole of it. This file sends and reads nothing itself.
 */
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>

#include "conn_state.h"
#include "shim.h"
#include "shim_core.h"

#define SERVER_TIMEOUT_DEFAULT 30.0 /* seconds; GPUPOOL_SERVER_TIMEOUT */

double gp_server_timeout_setting(void)
{
    const char *v = getenv("GPUPOOL_SERVER_TIMEOUT");
    if (!v || !*v)
        return SERVER_TIMEOUT_DEFAULT;
    char *end;
    double t = strtod(v, &end);
    if (*end || end == v || !(t == 0 || (t >= 3 && t <= 86400))) {
        static atomic_int said;
        if (!atomic_exchange(&said, 1))
            gp_log_error("GPUPOOL_SERVER_TIMEOUT=%s is not 0 or a number of seconds from 3 to "
                         "86400; using %.0f",
                         v, SERVER_TIMEOUT_DEFAULT);
        return SERVER_TIMEOUT_DEFAULT;
    }
    return t;
}

/* The clock is a connection's (gp_ka in its gp_conn): each server promises keepalives or not. */

int gp_ka_on(const gp_ka *ka)
{
    return atomic_load_explicit(&ka->on, memory_order_relaxed);
}

double gp_ka_timeout_s(const gp_ka *ka)
{
    return (double)ka->timeout_ns / 1e9;
}

/* Bytes moved: the server is alive (a sender's progress counts as much as a reply). */
void gp_ka_note_rx(gp_ka *ka)
{
    if (atomic_load_explicit(&ka->on, memory_order_relaxed))
        atomic_store_explicit(&ka->last_rx_ns, gp_mono_ns(), memory_order_relaxed);
}

void gp_ka_note_tx(gp_ka *ka)
{
    if (atomic_load_explicit(&ka->on, memory_order_relaxed))
        atomic_store_explicit(&ka->last_tx_ns, gp_mono_ns(), memory_order_relaxed);
}

uint64_t gp_ka_last_tx(gp_ka *ka)
{
    return atomic_load(&ka->last_tx_ns);
}

void gp_ka_restore_tx(gp_ka *ka, uint64_t ns)
{
    atomic_store(&ka->last_tx_ns, ns);
}

void gp_ka_arm(gp_ka *ka, int s, gp_tls *t, int promised)
{
    double timeout = gp_server_timeout_setting();
    if (!promised || timeout <= 0) {
        atomic_store(&ka->on, 0);
        gp_log_debug("keepalive: off (%s)",
                     promised ? "GPUPOOL_SERVER_TIMEOUT=0" : "the server sends none");
        return;
    }
    ka->timeout_ns = (uint64_t)(timeout * 1e9);
    uint64_t now = gp_mono_ns();
    atomic_store(&ka->last_rx_ns, now);
    atomic_store(&ka->last_tx_ns, now);
    atomic_store(&ka->last_ping_ns, now);
    /* Reads wake every slice; a write that moves nothing for the whole timeout fails. */
    struct timeval rt = {.tv_sec = GP_KA_SLICE_MS / 1000,
                         .tv_usec = (GP_KA_SLICE_MS % 1000) * 1000};
    struct timeval st = {.tv_sec = (time_t)timeout,
                         .tv_usec = (suseconds_t)((timeout - (double)(time_t)timeout) * 1e6)};
    if (setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &rt, sizeof rt) != 0 ||
        setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &st, sizeof st) != 0) {
        gp_log_debug("keepalive: setsockopt: %s; no server timeout", strerror(errno));
        return;
    }
    if (t)
        gp_tls_set_send_timeout(t, (int)(timeout * 1000));
    atomic_store(&ka->on, 1);
    gp_log_debug("keepalive: a server silent for %.0f s is given up (GPUPOOL_SERVER_TIMEOUT)",
                 timeout);
}

int gp_ka_silence(gp_ka *ka, const char **why)
{
    uint64_t now = gp_mono_ns(), rx = atomic_load(&ka->last_rx_ns),
             tx = atomic_load(&ka->last_tx_ns);
    uint64_t heard = rx > tx ? rx : tx;
    uint64_t quiet = now > heard ? now - heard : 0;
    if (quiet >= ka->timeout_ns) {
        snprintf(ka->why, sizeof ka->why,
                 "the server has not answered for %.0f s, not even a keepalive: it is hung or "
                 "stopped, or the network is cut (GPUPOOL_SERVER_TIMEOUT=%.0f)",
                 (double)quiet / 1e9, (double)ka->timeout_ns / 1e9);
        *why = ka->why;
        return -1;
    }
    if (quiet >= ka->timeout_ns / 3 && now - atomic_load(&ka->last_ping_ns) >= ka->timeout_ns / 3) {
        atomic_store(&ka->last_ping_ns, now);
        return 1;
    }
    return 0;
}
