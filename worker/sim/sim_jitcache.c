/*
 * sim_jitcache.c: the simulated device's stand-in for the driver's PTX JIT cache. A real driver
 * compiles PTX at its load and, unless CUDA_CACHE_DISABLE=1, keeps the result in the folder
 * CUDA_CACHE_PATH names, so that the same PTX is not compiled again, in this process or the
 * next. The sim compiles nothing; it keeps, per PTX text, a file `sim-ptx-<FNV-1a of the text>`
 * there: created with the line "compiled" at the first load, "cached" appended at every later
 * one. Tests see through it that a worker was given a cache folder it may write (gpupoold's
 * `jit_cache_mib`, under the worker's sandbox) and that a second lease finds the first one's
 * entries. A failure here is no load failure: the real driver too compiles without its cache.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sim_internal.h"

static uint64_t fnv1a(const char *s)
{
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

static int write_all(int fd, const char *s)
{
    size_t n = strlen(s);
    return write(fd, s, n) == (ssize_t)n ? 0 : -1;
}

void sim_jit_cache_note(const char *ptx)
{
    const char *dir = getenv("CUDA_CACHE_PATH");
    const char *off = getenv("CUDA_CACHE_DISABLE");
    if (!dir || !*dir || (off && strcmp(off, "1") == 0))
        return;
    char path[4096];
    int n = snprintf(path, sizeof path, "%s/sim-ptx-%016llx", dir, (unsigned long long)fnv1a(ptx));
    if (n < 0 || (size_t)n >= sizeof path)
        return;
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    const char *line = "compiled\n";
    if (fd < 0 && errno == EEXIST) {
        fd = open(path, O_WRONLY | O_APPEND | O_CLOEXEC);
        line = "cached\n";
    }
    if (fd < 0) {
        fprintf(stderr, "gpupool-sim: PTX JIT cache %s: %s (loading without it)\n", path,
                strerror(errno));
        return;
    }
    if (write_all(fd, line) != 0)
        fprintf(stderr, "gpupool-sim: PTX JIT cache %s: write failed: %s\n", path, strerror(errno));
    if (close(fd) != 0)
        fprintf(stderr, "gpupool-sim: PTX JIT cache %s: close failed: %s\n", path, strerror(errno));
}
