/*
 * fileio.c: files the worker leaves for others (the module cache, a session's end record),
 * written whole or not at all: into a temporary name, then renamed over the real one, so that a
 * reader never sees half a file.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "fileio.h"
#include "log.h"

int wk_write_file_atomic(const char *tmp, const char *path, const void *data, size_t len, int sync)
{
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0)
        return -1;
    const uint8_t *p = data;
    size_t done = 0;
    int ok = 1;
    while (done < len) {
        ssize_t r = write(fd, p + done, len - done);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            if (r == 0)
                errno = EIO;
            ok = 0;
            break;
        }
        done += (size_t)r;
    }
    if (ok && sync && fsync(fd) != 0)
        ok = 0;
    int saved = errno;
    if (close(fd) != 0 && ok) {
        ok = 0;
        saved = errno;
    }
    if (ok && rename(tmp, path) != 0) {
        ok = 0;
        saved = errno;
    }
    if (!ok) {
        if (unlink(tmp) != 0 && errno != ENOENT)
            wk_warn("cannot remove %s: %s", tmp, strerror(errno));
        errno = saved;
        return -1;
    }
    return 0;
}
