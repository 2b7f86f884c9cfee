/*
 * errors.c: error names, notices, the deferred ("pending") error and the end of a session
 * (the log lines are log.c's).
 *
 * Fire-and-forget frames have no reply, so a failure is reported the way the real driver reports
 * asynchronous errors: by the next synchronising call (docs/architecture.md, "Pipelining and
 * deferred errors"). The notice carries the human-readable reason at once.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

#include "worker.h"

const char *wk_err_name(struct worker *w, CUresult rc)
{
    if (rc >= 100000) {
        const char *n = gp_result_name(rc);
        if (n)
            return n;
    }
    const char *name = NULL;
    if (w->drv.cuGetErrorName && w->drv.cuGetErrorName(rc, &name) == CUDA_SUCCESS && name)
        return name;
    /* Not thread-safe, and need not be: the worker is single-threaded (worker.h). */
    static char buf[32];
    snprintf(buf, sizeof buf, "CUresult %d", rc);
    return buf;
}

void wk_send_notice(struct worker *w, int32_t code, uint16_t op, const char *text)
{
    gp_notice n = {0};
    n.code = code;
    n.op = op;
    n.text = text;
    size_t len = strlen(text);
    n.text_len = (uint32_t)(len > 4095 ? 4095 : len);
    size_t size = 16 + gp_notice_size(&n);
    uint8_t *p = wk_io_reserve(w, size);
    if (p)
        gp_notice_frame(p, 0, &n);
}

int wk_err_is_sticky(CUresult rc)
{
    /* The errors after which the driver refuses the context for good: every later call returns
     * them again (CUDA programming guide, "sticky" errors). */
    switch (rc) {
    case 214: /* CUDA_ERROR_ECC_UNCORRECTABLE */
    case CUDA_ERROR_ILLEGAL_ADDRESS:
    case 702: /* CUDA_ERROR_LAUNCH_TIMEOUT */
    case 710: /* CUDA_ERROR_ASSERT */
    case 714: /* CUDA_ERROR_HARDWARE_STACK_ERROR */
    case 715: /* CUDA_ERROR_ILLEGAL_INSTRUCTION */
    case 716: /* CUDA_ERROR_MISALIGNED_ADDRESS */
    case 717: /* CUDA_ERROR_INVALID_ADDRESS_SPACE */
    case 718: /* CUDA_ERROR_INVALID_PC */
    case CUDA_ERROR_LAUNCH_FAILED:
        return 1;
    default:
        return 0;
    }
}

void wk_defer_error(struct worker *w, uint16_t op, CUresult rc, const char *what_fmt, ...)
{
    /* The detail belongs to the call that just failed: read it before anything else calls in. */
    const char *detail = w->drv.sim_last_error_detail ? w->drv.sim_last_error_detail() : NULL;
    char what[1024];
    va_list ap;
    va_start(ap, what_fmt);
    int n = vsnprintf(what, sizeof what, what_fmt, ap);
    va_end(ap);
    if (n < 0)
        what[0] = '\0';

    /* First error wins, except that a sticky error replaces an ordinary one: it is what every
     * later synchronising call would report on the real driver. */
    if (w->pending == CUDA_SUCCESS || (wk_err_is_sticky(rc) && !wk_err_is_sticky(w->pending)))
        w->pending = rc;

    char text[4096];
    if (detail && detail[0])
        snprintf(text, sizeof text, "%s failed: %s (%s)", what, wk_err_name(w, rc), detail);
    else
        snprintf(text, sizeof text, "%s failed: %s", what, wk_err_name(w, rc));
    if (w->notices < WK_MAX_NOTICES) {
        wk_send_notice(w, rc, op, text);
    } else if (w->notices == WK_MAX_NOTICES) {
        /* A program that keeps failing in a loop must not flood the client with notices. */
        wk_send_notice(w, rc, op, "further errors suppressed until the next synchronising call");
    }
    if (w->notices <= WK_MAX_NOTICES)
        wk_log("%s", text);
    w->notices++;
}

CUresult wk_sync_result(struct worker *w, CUresult rc)
{
    if (w->pending == CUDA_SUCCESS)
        return rc;
    /* A call that itself failed reports its own error; the pending one waits for the next. */
    if (rc != CUDA_SUCCESS && rc != CUDA_ERROR_NOT_READY)
        return rc;
    CUresult p = w->pending;
    if (!wk_err_is_sticky(p))
        w->pending = CUDA_SUCCESS;
    w->notices = 0;
    return p;
}

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

void wk_close_client(struct worker *w, int32_t code, const char *text)
{
    if (!w->dead && w->fd >= 0) {
        if (!w->in_write) { /* in_write: the output buffer is being written, and not read */
            wk_send_notice(w, code, 0, text);
            (void)wk_io_flush(w); /* best effort: the client may be gone */
        }
        /* The client sees the end now, not after our teardown. */
        if (shutdown(w->fd, SHUT_RDWR) != 0 && errno != ENOTSOCK && errno != ENOTCONN)
            wk_log("shutdown of the client socket failed: %s", strerror(errno));
    }
    w->dead = 1;
}

void wk_protocol_error(struct worker *w, uint16_t op, const char *fmt, ...)
{
    char text[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    if (n < 0)
        text[0] = '\0';
    wk_log("protocol error, closing the connection: %s", text);
    wk_end_session(w, WK_END_PROTOCOL_ERROR, "%s", text);
    wk_send_notice(w, GP_EPROTO, op, text);
    /* Shut the socket at once: the client sees the end now, not after our teardown. */
    if (wk_io_flush(w) == 0 && shutdown(w->fd, SHUT_RDWR) != 0 && errno != ENOTSOCK)
        wk_log("shutdown of the client socket failed: %s", strerror(errno));
    w->closing = 1;
}
