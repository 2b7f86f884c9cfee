/*
 * log.c: the worker's log lines. gpupoold reads the worker's stderr and logs each line at the
 * level its prefix gives.
 */
#include <stdarg.h>
#include <stdio.h>
#include <unistd.h>

#include "log.h"

/* One line on stderr, which gpupoold reads and logs. A warning or an error starts with the
 * sd-daemon(3) priority `<4>` or `<3>`, which gpupoold turns into the level of its record (so
 * `journalctl -p warning` finds it); an informational line has no prefix. */
static void log_line(int priority, const char *fmt, va_list ap)
{
    char line[1024];
    int n = vsnprintf(line, sizeof line, fmt, ap);
    if (n < 0)
        return;
    /* Lines quote what clients sent (a program's name, a module's error log): nothing of it may
     * break the line (a forged log line) or reach a terminal as an escape. Newlines and tabs
     * become spaces, every other control byte (C0, DEL, UTF-8's C1) '?'. */
    size_t len = (size_t)n < sizeof line ? (size_t)n : sizeof line - 1;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)line[i];
        if (c == '\n' || c == '\t')
            line[i] = ' ';
        else if (c < 0x20 || c == 0x7f)
            line[i] = '?';
        else if (c == 0xc2 && i + 1 < len && (unsigned char)line[i + 1] >= 0x80 &&
                 (unsigned char)line[i + 1] <= 0x9f)
            line[i] = line[i + 1] = '?';
    }
#ifdef WK_LOG_QUIET
    /* The fuzzing build (tests/fuzz/fuzz.mk): millions of sessions; the line is still formatted. */
    (void)priority;
    return;
#endif
    char mark[8] = "";
    if (priority < WK_LOG_INFO)
        (void)snprintf(mark, sizeof mark, "<%d>", priority);
    /* One fprintf per line: lines of concurrent workers in the daemon's log do not interleave. */
    fprintf(stderr, "%sgpupool-worker[%ld]: %s\n", mark, (long)getpid(), line);
}

void wk_log(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    log_line(WK_LOG_INFO, fmt, ap);
    va_end(ap);
}

void wk_warn(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    log_line(WK_LOG_WARNING, fmt, ap);
    va_end(ap);
}

void wk_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    log_line(WK_LOG_ERR, fmt, ap);
    va_end(ap);
}
