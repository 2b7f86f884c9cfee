/*
 * net.h: TCP connections to gpupool servers and frame I/O during a handshake (net.c), used by
 * connect.c (hello) and info_client.c (info). Shared by libcuda.so.1 and libnvidia-ml.so.1 (no
 * shim state).
 */
#ifndef GP_NET_H
#define GP_NET_H

#include <stddef.h>
#include <stdint.h>

#include "gp_tls.h"
#include "hostport.h" /* the address syntax: what a connection is given */

/* Connect with a timeout (seconds; <= 0: the system's) for the whole attempt: the addresses of
 * the name share it, each gets only the time left (name resolution itself has no timeout).
 * Then TCP_NODELAY and keepalive with short probes. The fd (blocking, close-on-exec), or -1 with
 * err filled ("Connection refused", "timed out", a resolver error). */
int gp_tcp_connect(const char *host, const char *port, double timeout_s, char *err, size_t ecap);
/* The same by an absolute deadline (gp_now() seconds; 0: none). */
int gp_tcp_connect_until(const char *host, const char *port, double deadline, char *err,
                         size_t ecap);

/* A connection during a handshake: the socket, and the TLS session on it (or NULL). */
typedef struct gp_link {
    int fd;
    gp_tls *tls;
    char err[300]; /* the TLS layer's last error */
} gp_link;

/* Write all of it: 0, or -1 (errno; EPROTO: TLS, text in l->err). */
int gp_link_write(gp_link *l, const void *p, size_t n);
/* Read exactly n bytes within timeout_ms for the whole read (-1: forever): 0, or -1 with errno
 * (ETIMEDOUT, ECONNRESET for end of stream, EPROTO for a TLS error: text in l->err). */
int gp_link_read(gp_link *l, void *p, size_t n, int timeout_ms);
/* The same by an absolute deadline (gp_now() seconds; 0: none): every wait, TLS included, gets
 * only the time left. */
int gp_link_read_until(gp_link *l, void *p, size_t n, double deadline);
/* The text for errno value err after a failed gp_link_read/gp_link_write. */
const char *gp_link_error(gp_link *l, int err);

/* Milliseconds for a poll() from seconds (<= 0: -1, no limit). */
int gp_timeout_ms(double timeout_s);
/* Monotonic seconds; a deadline timeout_s from now (<= 0: 0, none); the milliseconds left until
 * a deadline for a poll() (0 once it has passed; -1 for no deadline). */
double gp_now(void);
double gp_deadline(double timeout_s);
int gp_left_ms(double deadline);

#endif /* GP_NET_H */
