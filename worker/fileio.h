/*
 * fileio.h: files written whole or not at all (a base file: it includes nothing of the worker).
 */
#ifndef GP_WK_FILEIO_H
#define GP_WK_FILEIO_H

#include <stddef.h>

/* Writes data into tmp (created 0600; it must not exist), fsynced when `sync`, then renames it
 * to path: a reader sees the whole file or none. 0, or -1 with errno (tmp is removed). */
int wk_write_file_atomic(const char *tmp, const char *path, const void *data, size_t len, int sync);

#endif /* GP_WK_FILEIO_H */
