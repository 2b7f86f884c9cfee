/*
 * utf8.h: valid UTF-8 out of any bytes (utf8.c). Dependency-free; shared by the client libraries
 * and the worker.
 */
#ifndef GP_UTF8_H
#define GP_UTF8_H

#include <stddef.h>

/* Copy src (n bytes) into dst as valid UTF-8 of at most cap-1 bytes (invalid bytes become '?',
 * truncation never splits a character), NUL-terminated; returns the length. cap >= 1. */
size_t gp_utf8_clean(char *dst, size_t cap, const char *src, size_t n);

#endif /* GP_UTF8_H */
