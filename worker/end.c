/*
 * end.c: why a session ends. The first cause is recorded (the control channel's worker_ended
 * reports it) and the frame loop is told to stop; what follows from it is left to the caller.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "worker.h"

void wk_end_session(struct worker *w, enum wk_end_reason reason, const char *fmt, ...)
{
    w->closing = 1;
    if (w->end_reason != WK_END_NONE)
        return; /* the first cause is the one worth reporting; the rest are its consequences */
    w->end_reason = reason;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(w->end_detail, sizeof w->end_detail, fmt, ap);
    va_end(ap);
    if (n < 0)
        w->end_detail[0] = '\0';
}

const char *wk_end_reason_name(enum wk_end_reason reason)
{
    switch (reason) {
    case WK_END_CLIENT_EXIT:
        return "client exit";
    case WK_END_PROTOCOL_ERROR:
        return "protocol error";
    case WK_END_SERVER_ENDED:
        return "server ended";
    case WK_END_SHUTDOWN:
        return "shutdown";
    case WK_END_WORKER_ERROR:
        return "worker error";
    case WK_END_DAEMON_LOST:
        return "daemon lost";
    case WK_END_NONE:
    case WK_END_CLIENT_LOST:
        break;
    }
    return "client lost";
}

void wk_client_lost(struct worker *w, const char *what, int err)
{
    if (!w->dead)
        wk_warn("client connection lost (%s: %s)", what, strerror(err));
    wk_end_session(w, WK_END_CLIENT_LOST, "client connection lost (%s: %s)", what, strerror(err));
    w->dead = 1;
}
