/*
 * gp_log.h: the client libraries' only way to talk to the user (log.c): one line to stderr,
 * prefixed "gpupool: ". GPUPOOL_LOG=quiet silences info, debug adds debug. Shared by
 * libcuda.so.1 and libnvidia-ml.so.1 (no shim state).
 */
#ifndef GP_LOG_H
#define GP_LOG_H

void gp_log_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void gp_log_info(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void gp_log_debug(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* 1 when debug lines are shown (GPUPOOL_LOG=debug): skip building what nobody will see. */
int gp_log_debug_enabled(void);

#endif /* GP_LOG_H */
