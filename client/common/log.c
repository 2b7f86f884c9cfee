/*
 * log.c: the shim's only way to talk to the user: one line to stderr, prefixed "gpupool: ".
 *
 * GPUPOOL_LOG selects what is shown: "quiet" (errors only), "info" (the default) or "debug".
 * Each line goes out in a single write(2) so that lines from different threads (and from the
 * program itself) never interleave mid-line. Shared by libcuda.so.1 and libnvidia-ml.so.1: no
 * shim state here.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "gp_log.h"

enum {
    LVL_ERROR = 0,
    LVL_INFO = 1,
    LVL_DEBUG = 2
};

static atomic_int log_level = -1; /* -1: GPUPOOL_LOG not read yet */

static int level(void)
{
    int l = atomic_load_explicit(&log_level, memory_order_relaxed);
    if (l >= 0)
        return l;
    const char *env = getenv("GPUPOOL_LOG");
    l = LVL_INFO;
    if (env && (strcasecmp(env, "quiet") == 0 || strcasecmp(env, "error") == 0 ||
                strcasecmp(env, "0") == 0))
        l = LVL_ERROR;
    else if (env && (strcasecmp(env, "debug") == 0 || strcasecmp(env, "2") == 0))
        l = LVL_DEBUG;
    atomic_store_explicit(&log_level, l, memory_order_relaxed);
    return l;
}

static void emit(const char *fmt, va_list ap)
{
    char line[2048];
    int saved = errno;
    size_t n = (size_t)snprintf(line, sizeof line, "gpupool: ");
    int k = vsnprintf(line + n, sizeof line - n - 1, fmt, ap);
    if (k < 0)
        k = 0;
    n += (size_t)k < sizeof line - n - 1 ? (size_t)k : sizeof line - n - 2;
    if (n > 0 && line[n - 1] == '\n')
        n--; /* callers may or may not end with a newline */
    /* Lines often carry a server's words (notices, refusals): no control character of theirs
     * reaches the user's terminal (an escape sequence could rewrite what it shows). */
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)line[i];
        if (c == '\n' || c == '\r')
            line[i] = ' ';
        else if ((c < 0x20 && c != '\t') || c == 0x7f)
            line[i] = '?';
    }
    line[n++] = '\n';
    const char *p = line;
    while (n > 0) {
        ssize_t w = write(STDERR_FILENO, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            break;
        p += w;
        n -= (size_t)w;
    }
    errno = saved;
}

void gp_log_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    emit(fmt, ap);
    va_end(ap);
}

void gp_log_info(const char *fmt, ...)
{
    if (level() < LVL_INFO)
        return;
    va_list ap;
    va_start(ap, fmt);
    emit(fmt, ap);
    va_end(ap);
}

int gp_log_debug_enabled(void)
{
    return level() >= LVL_DEBUG;
}

void gp_log_debug(const char *fmt, ...)
{
    if (level() < LVL_DEBUG)
        return;
    va_list ap;
    va_start(ap, fmt);
    emit(fmt, ap);
    va_end(ap);
}
