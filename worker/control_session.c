/*
 * control_session.c: the control channel during a session (worker/README.md "Control channel").
 * The waits (reactor.c) call on_control when the control socket is readable: worker_end, the
 * daemon's departure (the session ends, or goes on orphaned: adopt.c), or a message of idle
 * detach (detach.c); a timer sends worker_stats when due. At the end, worker_ended (written down
 * first for an adoptable session). The channel itself (send, receive, counters) is control.c.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "worker.h"

/* The daemon is gone (end of stream or an error on the control socket). A session that can be
 * adopted goes on (adopt.c), attached or detached (a detached one waits in host memory for its
 * client's next call; the new daemon seats it on a GPU again); otherwise nobody will account for
 * it any more, so it ends now and the client is told why, best effort. A session parked for a
 * checkpoint still under way ends too: the driver's state of this process is unknown. 0: carry
 * on (orphaned); -1: the session ends. */
static int daemon_gone(struct worker *w)
{
    if (w->ctl.parked && !w->ctl.detached) {
        wk_detach_daemon_gone(w);
        return -1;
    }
    if (wk_adopt_orphan(w) == 0)
        return 0;
    if (w->ctl.parked) {
        wk_detach_daemon_gone(w);
        return -1;
    }
    wk_log("the control socket was closed: gpupoold is gone; ending");
    w->ctl.gone = 1;
    wk_end_session(w, WK_END_SHUTDOWN, "gpupoold closed the control socket");
    wk_close_client(w, CUDA_ERROR_DEVICE_UNAVAILABLE,
                    "the gpupool server stopped; this session has ended");
    return -1;
}

/* The control socket is readable during a session: END (notice to the client, stop), end of
 * stream (the daemon is gone: stop), a message of idle detach (detach.c), or a message out of
 * place (logged, ignored). 0: carry on; -1: the session must stop. */
static int on_control(void *ctx)
{
    struct worker *w = ctx;
    uint8_t buf[WK_CTL_MAX + 1];
    int fd, truncated;
    ssize_t n = wk_ctl_recv(w, buf, WK_CTL_MAX, &fd, &truncated);
    if (fd >= 0) {
        wk_log("closing a descriptor sent on the control socket during a session");
        if (close(fd) != 0)
            wk_warn("close: %s", strerror(errno));
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
        return 0; /* spurious wake-up */
    if (n <= 0) {
        if (n < 0)
            wk_warn("reading the control socket: %s", strerror(errno));
        return daemon_gone(w);
    }
    return wk_ctl_on_message(w, buf, n, truncated);
}

int wk_ctl_on_message(struct worker *w, const uint8_t *buf, ssize_t n, int truncated)
{
    if ((size_t)n >= GP_PROTO_HEADER_SIZE && !truncated) {
        gp_frame_header h;
        gp_header_decode(buf, &h);
        if (h.op != GP_OP_WORKER_END && wk_ctl_decode(buf, (size_t)n, h.op) != NULL)
            return wk_detach_control(w, h.op, buf + GP_PROTO_HEADER_SIZE,
                                     (size_t)n - GP_PROTO_HEADER_SIZE);
    }
    gp_worker_end end;
    if (wk_ctl_decode(buf, (size_t)n, GP_OP_WORKER_END) == NULL ||
        gp_worker_end_decode(buf + GP_PROTO_HEADER_SIZE, (size_t)n - GP_PROTO_HEADER_SIZE, &end) !=
            0) {
        wk_warn("ignoring an unexpected control message of %zd bytes during a session", n);
        return 0;
    }
    int32_t code = end.code;
    char text[2048];
    snprintf(text, sizeof text, "%.*s", (int)end.text_len, end.text);
    if (!*text)
        snprintf(text, sizeof text, "the gpupool server ended this session");
    wk_detach_end_parked(w);
    wk_log("the server ended the session (%d): %s", code, text);
    wk_end_session(w, WK_END_SERVER_ENDED, "%s", text);
    wk_close_client(w, code, text);
    return -1;
}

void wk_ctl_send_end(struct worker *w)
{
    gp_worker_ended m = {.in_session = w->ctl.in_session ? 1u : 0u,
                         .session_id = w->ctl.in_session ? w->ctl.session_id : 0};
    char reason[64], detail[1024];
    WK_SET_TEXT(m.reason, reason, wk_end_reason_name(w->end_reason));
    WK_SET_TEXT(m.detail, detail,
                w->end_reason == WK_END_NONE ? "the connection ended" : w->end_detail);
    uint8_t lat[8 * WK_LAT_BUCKETS];
    wk_ctl_counters(w, &m.counters, lat);
    size_t n = WK_CTL_ENCODE(w, worker_ended, &m);
    /* An adoptable session writes its end down first: if the daemon goes before it records
     * this event (or there is none: orphaned), the next one reads the file. */
    int adoptable = w->ctl.in_session && w->ctl.listen_fd >= 0;
    if (adoptable)
        wk_adopt_write_end(w, n, w->ctl.fd < 0);
    (void)wk_ctl_send(w, n, 0);
}

/* Before each wait's poll: a stats event when one is due, while a daemon follows the session. */
static int stats_due(void *ctx, int *wait_ms)
{
    struct worker *w = ctx;
    *wait_ms = w->ctl.fd >= 0 ? wk_ctl_stats_tick(w) : -1;
    return 0;
}

int wk_ctl_watch(struct worker *w)
{
    if (wk_reactor_timer(&w->reactor, stats_due, w) != 0)
        return -1;
    return wk_reactor_watch(&w->reactor, &w->ctl.fd, 1, on_control, w);
}
