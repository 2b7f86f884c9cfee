/*
 * log.h: the worker's log lines on stderr (a base file: it includes nothing of the worker).
 */
#ifndef GP_WK_LOG_H
#define GP_WK_LOG_H

/* Log lines: information, and the warnings and errors gpupoold logs at their level (sd-daemon(3)
 * priorities). */
enum {
    WK_LOG_ERR = 3,
    WK_LOG_WARNING = 4,
    WK_LOG_INFO = 6
};
void wk_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void wk_warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void wk_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif /* GP_WK_LOG_H */
