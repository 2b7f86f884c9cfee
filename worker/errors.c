/*
 * errors.c: error names and the deferred ("pending") error (the notices that carry them are
 * io.c's, the end of a session is end.c's, the log lines are log.c's).
 *
 * Fire-and-forget frames have no reply, so a failure is reported the way the real driver reports
 * asynchronous errors: by the next synchronising call (docs/architecture.md, "Pipelining and
 * deferred errors"). The notice carries the human-readable reason at once.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

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
