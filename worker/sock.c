/*
 * sock.c: the client socket as the worker wants it, whichever way it came (--fd, or with
 * worker_session on the control socket).
 */
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <string.h>
#include <sys/socket.h>

#include "log.h"
#include "sock.h"

/* The socket as the hot loop wants it: blocking (the daemon's asyncio sockets are not), and
 * without Nagle's delay on TCP (replies are small and latency-bound). */
int wk_prepare_socket(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0)
        return -1;
    if ((fl & O_NONBLOCK) && fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0)
        return -1;
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    if (getsockname(fd, (struct sockaddr *)&ss, &len) == 0 &&
        (ss.ss_family == AF_INET || ss.ss_family == AF_INET6)) {
        int one = 1, idle = 30, intvl = 10, cnt = 3;
        if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) != 0)
            wk_warn("TCP_NODELAY: %s", strerror(errno));
        /* A client machine that vanishes (powered off, cable pulled) is noticed within about a
         * minute even while the session is idle, and its lease ends as "client lost". A client
         * that is alive but stopped keeps its lease: its kernel still answers. */
        if (setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one) != 0 ||
            setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle) != 0 ||
            setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl) != 0 ||
            setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt) != 0)
            wk_warn("TCP keepalive: %s", strerror(errno));
    }
    return 0;
}
