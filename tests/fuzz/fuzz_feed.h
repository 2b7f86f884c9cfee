/*
 * fuzz_feed.h: the peer of a fuzz target that reads a socket: a thread that sends the input
 * (then shuts its side for writing) and reads and drops whatever comes back until the target
 * closes, so that the target never blocks on a full socket.
 */
#ifndef GP_FUZZ_FEED_H
#define GP_FUZZ_FEED_H

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/socket.h>

struct fuzz_feed {
    int fd;
    const uint8_t *data;
    size_t size;
    pthread_t thread;
};

static void *fuzz_feed_main(void *arg)
{
    struct fuzz_feed *f = arg;
    char sink[65536];
    size_t off = 0;
    while (off < f->size) {
        ssize_t r = send(f->fd, f->data + off, f->size - off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (r > 0) {
            off += (size_t)r;
            continue;
        }
        if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
            break; /* the target closed: it stopped reading */
        if (recv(f->fd, sink, sizeof sink, MSG_DONTWAIT) == 0)
            break;
    }
    (void)shutdown(f->fd, SHUT_WR);
    while (recv(f->fd, sink, sizeof sink, 0) > 0)
        ;
    return NULL;
}

/* Starts the peer on fd (one end of a socketpair); aborts if it cannot. */
static void fuzz_feed_start(struct fuzz_feed *f, int fd, const uint8_t *data, size_t size)
{
    f->fd = fd;
    f->data = data;
    f->size = size;
    if (pthread_create(&f->thread, NULL, fuzz_feed_main, f) != 0)
        abort();
}

static void fuzz_feed_join(struct fuzz_feed *f)
{
    if (pthread_join(f->thread, NULL) != 0)
        abort();
}

#endif /* GP_FUZZ_FEED_H */
