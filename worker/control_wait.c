/*
 * control_wait.c: a handler waits for gpupoold's answer to its request on the control socket
 * (CUDA IPC: h_ipc.c; server-to-server links: h_peer.c). The worker is single-threaded, so
 * whatever else gpupoold says meanwhile (worker_end, idle detach) is handled here as during any
 * wait (control_session.c).
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "worker.h"

ssize_t wk_ctl_wait_answer(struct worker *w, unsigned op, uint8_t *buf, size_t cap, int *fd,
                           int timeout_ms, int *timed_out, char *err, size_t errlen)
{
    uint64_t deadline = wk_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    *timed_out = 0;
    *fd = -1;
    for (;;) {
        uint64_t now = wk_now_ns();
        if (now >= deadline) {
            *timed_out = 1;
            snprintf(err, errlen, "gpupoold did not answer the worker in %d s", timeout_ms / 1000);
            return -1;
        }
        struct pollfd p = {.fd = w->ctl.fd, .events = POLLIN};
        int pr = poll(&p, 1, (int)((deadline - now) / 1000000ull) + 1);
        if (pr < 0 && errno == EINTR)
            continue;
        if (pr < 0) {
            snprintf(err, errlen, "waiting for gpupoold: %s", strerror(errno));
            return -1;
        }
        if (pr == 0)
            continue;
        int truncated;
        ssize_t n = wk_ctl_recv(w, buf, cap, fd, &truncated);
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            continue;
        if (n <= 0) {
            /* End of stream stays readable: the session's own wait sees the daemon gone. */
            snprintf(err, errlen, "gpupoold closed the worker's control socket");
            return -1;
        }
        if ((size_t)n >= GP_PROTO_HEADER_SIZE && !truncated && wk_ctl_decode(buf, (size_t)n, op))
            return n;
        if (*fd >= 0 && close(*fd) != 0)
            wk_warn("close: %s", strerror(errno));
        *fd = -1;
        if (wk_ctl_on_message(w, buf, n, truncated) != 0) {
            snprintf(err, errlen, "the session is ending");
            return -1;
        }
    }
}
