/*
 * signals.c: SIGTERM and SIGINT. gpupoold stops workers with SIGTERM (and PR_SET_PDEATHSIG sends
 * it when the daemon dies before a session): both become a signalfd that the waits watch
 * (reactor.c), so that the client is told, and everything is released, before the worker exits.
 */
#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include "worker.h"

int wk_signals_open(void)
{
    /* Blocked before the driver starts its threads, which inherit the mask. */
    int sigfd = -1;
    sigset_t stop;
    if (sigemptyset(&stop) == 0 && sigaddset(&stop, SIGTERM) == 0 &&
        sigaddset(&stop, SIGINT) == 0 && sigprocmask(SIG_BLOCK, &stop, NULL) == 0) {
        sigfd = signalfd(-1, &stop, SFD_CLOEXEC);
        if (sigfd < 0) {
            wk_warn("signalfd: %s; SIGTERM ends the worker at once", strerror(errno));
            if (sigprocmask(SIG_UNBLOCK, &stop, NULL) != 0)
                wk_warn("sigprocmask: %s", strerror(errno));
        }
    } else {
        wk_warn("cannot block SIGTERM: %s", strerror(errno));
    }
    return sigfd;
}

/* A signal arrived during a session (the daemon stops us, or it died: PR_SET_PDEATHSIG): tell
 * the client, stop serving. Always -1: the session must stop. */
static int on_signal(void *ctx)
{
    struct worker *w = ctx;
    struct signalfd_siginfo si;
    ssize_t n = read(w->sigfd, &si, sizeof si);
    int sig = n == (ssize_t)sizeof si ? (int)si.ssi_signo : 0;
    wk_detach_end_parked(w);
    wk_log("%s: ending the session", sig ? strsignal(sig) : "signal");
    wk_end_session(w, WK_END_SHUTDOWN, "%s: the server is shutting down",
                   sig ? strsignal(sig) : "signal");
    if (!w->in_write) { /* else the client is not reading anyway */
        wk_send_notice(w, CUDA_ERROR_DEVICE_UNAVAILABLE, 0,
                       "the gpupool server is shutting down; this session has ended");
        (void)wk_io_flush(w); /* best effort: the client may be gone */
    }
    w->dead = 1;
    return -1;
}

int wk_signals_watch(struct worker *w)
{
    return wk_reactor_watch(&w->reactor, &w->sigfd, 0, on_signal, w);
}
