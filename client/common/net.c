/*
 * net.c: TCP connections to gpupool servers and exact reads/writes during a handshake, plain or
 * through a TLS session (net.h). Shared by libcuda.so.1 and libnvidia-ml.so.1: no shim state.
 */
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include "net.h"

int gp_timeout_ms(double timeout_s)
{
    if (!(timeout_s > 0))
        return -1;
    if (timeout_s > 2000000.0)
        return 2000000000; /* ~23 days: as good as forever */
    int ms = (int)(timeout_s * 1000);
    return ms > 0 ? ms : 1;
}

double gp_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

double gp_deadline(double timeout_s)
{
    return timeout_s > 0 ? gp_now() + timeout_s : 0;
}

int gp_left_ms(double deadline)
{
    if (deadline <= 0)
        return -1;
    double left = deadline - gp_now();
    return left <= 0 ? 0 : gp_timeout_ms(left);
}

static void set_keepalive(int fd)
{
    int one = 1, idle = 10, intvl = 5, cnt = 3;
    /* Best effort: a socket without these options still works, only less promptly. */
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    (void)setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
    (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
    (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
    (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
    /* No TCP_USER_TIMEOUT: a worker busy in a long synchronous call legitimately lets its
     * receive window fill up, and that must not end the session. */
}

int gp_tcp_connect_until(const char *host, const char *port, double deadline, char *err,
                         size_t ecap)
{
    /* getaddrinfo has no timeout of its own: a resolver that hangs holds us for as long as it
     * takes (its own retries, typically a few seconds). The addresses it gives then share what
     * is left of the deadline. */
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    int g = getaddrinfo(host, port, &hints, &res);
    if (g != 0) {
        snprintf(err, ecap, "%s", g == EAI_SYSTEM ? strerror(errno) : gai_strerror(g));
        return -1;
    }
    int fd = -1;
    snprintf(err, ecap, "no address");
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        if (deadline > 0 && gp_left_ms(deadline) == 0) {
            snprintf(err, ecap, "timed out");
            break;
        }
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) {
            snprintf(err, ecap, "%s", strerror(errno));
            continue;
        }
        int fl = fcntl(fd, F_GETFL);
        int rc = fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
        if (rc == 0)
            rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
        if (rc != 0 && errno == EINPROGRESS) {
            struct pollfd p = {.fd = fd, .events = POLLOUT};
            int pr;
            do
                pr = poll(&p, 1, gp_left_ms(deadline)); /* only the time left, for each address */
            while (pr < 0 && errno == EINTR);
            if (pr == 0) {
                errno = ETIMEDOUT;
                rc = -1;
            } else if (pr < 0) {
                rc = -1; /* poll itself failed: errno says why; the socket is not connected */
            } else {
                int soerr = 0;
                socklen_t sl = sizeof soerr;
                if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) != 0)
                    soerr = errno;
                errno = soerr;
                rc = soerr ? -1 : 0;
            }
        }
        if (rc == 0 && fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) == 0) {
            set_keepalive(fd);
            break;
        }
        snprintf(err, ecap, "%s", errno == ETIMEDOUT ? "timed out" : strerror(errno));
        int saved = errno; /* the caller tells a refused connection (a restart) apart */
        close(fd);
        errno = saved;
        fd = -1;
    }
    int saved = errno;
    freeaddrinfo(res);
    errno = saved;
    return fd;
}

int gp_tcp_connect(const char *host, const char *port, double timeout_s, char *err, size_t ecap)
{
    return gp_tcp_connect_until(host, port, gp_deadline(timeout_s), err, ecap);
}

static int write_all_fd(int fd, const uint8_t *p, size_t n)
{
    while (n > 0) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Exactly n bytes by deadline (0: none). */
static int read_all_fd(int fd, uint8_t *p, size_t n, double deadline)
{
    while (n > 0) {
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        int pr = poll(&pf, 1, gp_left_ms(deadline)); /* recomputed for every chunk */
        if (pr < 0 && errno == EINTR)
            continue;
        if (pr == 0) {
            errno = ETIMEDOUT;
            return -1;
        }
        if (pr < 0)
            return -1;
        ssize_t r = recv(fd, p, n, 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r == 0)
            errno = ECONNRESET;
        if (r <= 0)
            return -1;
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

int gp_link_write(gp_link *l, const void *p, size_t n)
{
    if (!l->tls)
        return write_all_fd(l->fd, p, n);
    if (gp_tls_write(l->tls, p, n, l->err, sizeof l->err) == 0)
        return 0;
    errno = EPROTO;
    return -1;
}

int gp_link_read_until(gp_link *l, void *buf, size_t n, double deadline)
{
    uint8_t *p = buf;
    if (!l->tls)
        return read_all_fd(l->fd, p, n, deadline);
    while (n > 0) {
        /* gp_tls_read bounds its whole call by the milliseconds it is given: what is left. */
        ssize_t r = gp_tls_read(l->tls, p, n, gp_left_ms(deadline), l->err, sizeof l->err);
        if (r == 0)
            errno = ECONNRESET;
        if (r <= 0) {
            if (r < 0 && errno != ETIMEDOUT)
                errno = EPROTO;
            return -1;
        }
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

int gp_link_read(gp_link *l, void *buf, size_t n, int timeout_ms)
{
    return gp_link_read_until(l, buf, n, timeout_ms < 0 ? 0 : gp_now() + timeout_ms / 1000.0);
}

const char *gp_link_error(gp_link *l, int err)
{
    if (err == ECONNRESET)
        return "connection closed";
    return err == EPROTO && l->tls ? l->err : strerror(err);
}
