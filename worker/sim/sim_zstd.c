/*
 * sim_zstd.c: ZSTD-compressed fatbin entries, read through the system's libzstd.so.1.
 *
 * nvcc, PyTorch and cuBLAS compress the ELF entries of their fatbins with ZSTD (fatbin entry flag
 * 0x8000). The real driver reads the code inside; so does the simulated device when it can load
 * libzstd.so.1 at run time (no build dependency: the sim declares the four functions it uses, from
 * zstd's stable API). Without it, compressed code stays opaque and the sim accepts any kernel name
 * in it (sim_image.c), as before.
 *
 * State: the library handle and function pointers are written once, under pthread_once, and only
 * read afterwards.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim_internal.h"

#define ZSTD_CONTENTSIZE_UNKNOWN (0ULL - 1)
#define ZSTD_CONTENTSIZE_ERROR (0ULL - 2)

typedef unsigned long long (*content_size_fn)(const void *src, size_t src_size);
typedef size_t (*frame_size_fn)(const void *src, size_t src_size);
typedef size_t (*decompress_fn)(void *dst, size_t dst_cap, const void *src, size_t src_size);
typedef unsigned (*is_error_fn)(size_t code);

static pthread_once_t zstd_once = PTHREAD_ONCE_INIT;
static struct {
    content_size_fn content_size;
    frame_size_fn frame_size;
    decompress_fn decompress;
    is_error_fn is_error;
} zstd; /* all set, or all NULL: written once under zstd_once */

static void zstd_load(void)
{
    void *lib = dlopen("libzstd.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib)
        return;
    void *cs = dlsym(lib, "ZSTD_getFrameContentSize");
    void *fs = dlsym(lib, "ZSTD_findFrameCompressedSize");
    void *dc = dlsym(lib, "ZSTD_decompress");
    void *ie = dlsym(lib, "ZSTD_isError");
    if (!cs || !fs || !dc || !ie) {
        if (dlclose(lib) != 0)
            fprintf(stderr, "gpupool-sim: dlclose(libzstd.so.1): %s\n", dlerror());
        return;
    }
    /* dlsym's data pointers hold function addresses (POSIX); copied bytewise into them. */
    memcpy(&zstd.content_size, &cs, sizeof(cs));
    memcpy(&zstd.frame_size, &fs, sizeof(fs));
    memcpy(&zstd.decompress, &dc, sizeof(dc));
    memcpy(&zstd.is_error, &ie, sizeof(ie));
}

bool sim_zstd_available(void)
{
    return pthread_once(&zstd_once, zstd_load) == 0 && zstd.decompress != NULL;
}

CUresult sim_zstd_decompress(const unsigned char *src, size_t src_len, size_t max_out,
                             unsigned char **out, size_t *out_len)
{
    *out = NULL;
    *out_len = 0;
    if (!sim_zstd_available())
        return CUDA_ERROR_NOT_SUPPORTED;
    size_t frame = zstd.frame_size(src, src_len); /* the payload may carry padding after it */
    if (zstd.is_error(frame))
        return CUDA_ERROR_INVALID_IMAGE;
    unsigned long long n = zstd.content_size(src, frame);
    if (n == ZSTD_CONTENTSIZE_UNKNOWN || n == ZSTD_CONTENTSIZE_ERROR || n == 0 || n > max_out)
        return CUDA_ERROR_INVALID_IMAGE;
    unsigned char *buf = malloc((size_t)n);
    if (!buf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    size_t got = zstd.decompress(buf, (size_t)n, src, frame);
    if (zstd.is_error(got) || got != n) {
        free(buf);
        return CUDA_ERROR_INVALID_IMAGE;
    }
    *out = buf;
    *out_len = got;
    return CUDA_SUCCESS;
}
