/*
 * compress.c: the LZ4 block codec of compressed copies (compress.h), over liblz4.so.1 loaded at
 * run time. The library's three functions are declared here from its stable API.
 *
 * State: the library handle and function pointers are written once under lz4_once, then only
 * read.
 */
#include "compress.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int (*lz4_bound_fn)(int size);
typedef int (*lz4_compress_fn)(const char *src, char *dst, int src_size, int dst_cap);
typedef int (*lz4_decompress_fn)(const char *src, char *dst, int src_size, int dst_cap);

static pthread_once_t lz4_once = PTHREAD_ONCE_INIT;
static struct {
    lz4_compress_fn compress;
    lz4_decompress_fn decompress;
    char why[300];
} lz4; /* written once under lz4_once */

static void lz4_load(void)
{
    const char *name = getenv("GPUPOOL_LZ4_LIBRARY");
    if (!name || !*name)
        name = "liblz4.so.1";
    void *lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *e = dlerror();
        snprintf(lz4.why, sizeof lz4.why, "cannot load %s: %s", name, e ? e : "unknown error");
        return;
    }
    void *b = dlsym(lib, "LZ4_compressBound");
    void *c = dlsym(lib, "LZ4_compress_default");
    void *d = dlsym(lib, "LZ4_decompress_safe");
    if (!b || !c || !d) {
        snprintf(lz4.why, sizeof lz4.why, "%s lacks the LZ4 functions", name);
        (void)dlclose(lib);
        return;
    }
    /* dlsym's data pointers hold function addresses (POSIX); copied bytewise into them. */
    lz4_bound_fn bound;
    memcpy(&bound, &b, sizeof b);
    if (bound(GP_LZ4_BLOCK) <= 0) {
        snprintf(lz4.why, sizeof lz4.why, "%s does not work (LZ4_compressBound failed)", name);
        (void)dlclose(lib);
        return;
    }
    memcpy(&lz4.compress, &c, sizeof c);
    memcpy(&lz4.decompress, &d, sizeof d);
}

int gp_lz4_available(void)
{
    return pthread_once(&lz4_once, lz4_load) == 0 && lz4.decompress != NULL;
}

const char *gp_lz4_why(void)
{
    return gp_lz4_available() ? "" : lz4.why;
}

static void wr32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t rd32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

size_t gp_cz_encode(gp_cz_enc *st, const void *src, size_t n, uint8_t *out)
{
    const uint8_t *s = src;
    size_t w = 0;
    int can = gp_lz4_available();
    while (n > 0) {
        uint32_t raw = n < GP_LZ4_BLOCK ? (uint32_t)n : GP_LZ4_BLOCK;
        int stored = 0;
        /* It pays when the block shrinks to 7/8 or less: LZ4 fails (0) when it does not fit. */
        if (can && st->raw_run < GP_CZ_GIVE_UP && raw >= 8)
            stored = lz4.compress((const char *)s, (char *)out + w + GP_CZ_HDR, (int)raw,
                                  (int)(raw - raw / 8));
        if (stored > 0 && (uint32_t)stored < raw) {
            st->raw_run = 0;
        } else {
            stored = (int)raw;
            memcpy(out + w + GP_CZ_HDR, s, raw);
            st->raw_run++;
        }
        wr32(out + w, raw);
        wr32(out + w + 4, (uint32_t)stored);
        w += GP_CZ_HDR + (size_t)stored;
        s += raw;
        n -= raw;
    }
    return w;
}

int gp_cz_header(const uint8_t hdr[GP_CZ_HDR], uint64_t remaining, uint32_t *raw, uint32_t *stored,
                 const char **why)
{
    *raw = rd32(hdr);
    *stored = rd32(hdr + 4);
    if (*raw == 0 || *raw > GP_LZ4_BLOCK || *raw > remaining) {
        *why = "corrupt compressed copy (a block's raw length is 0, above the block size or "
               "beyond the copy)";
        return -1;
    }
    if (*stored == 0 || *stored > *raw) {
        *why = "corrupt compressed copy (a block's stored length is 0 or above its raw length)";
        return -1;
    }
    return 0;
}

int gp_cz_inflate(const uint8_t *src, uint32_t stored, void *dst, uint32_t raw, const char **why)
{
    if (!gp_lz4_available()) {
        *why = "compressed copy data arrived but liblz4 is not loaded";
        return -1;
    }
    int got = lz4.decompress((const char *)src, dst, (int)stored, (int)raw);
    if (got < 0 || (uint32_t)got != raw) {
        *why = "corrupt compressed copy (an LZ4 block does not decompress to its raw length)";
        return -1;
    }
    return 0;
}

int gp_cz_decode(const uint8_t *in, size_t in_len, void *dst, size_t n, const char **why)
{
    uint8_t *d = dst;
    size_t pos = 0, done = 0;
    while (done < n) {
        uint32_t raw, stored;
        if (in_len - pos < GP_CZ_HDR) {
            *why = "corrupt compressed copy (the data ends inside a block header)";
            return -1;
        }
        if (gp_cz_header(in + pos, n - done, &raw, &stored, why) != 0)
            return -1;
        pos += GP_CZ_HDR;
        if (in_len - pos < stored) {
            *why = "corrupt compressed copy (the data ends inside a block)";
            return -1;
        }
        if (stored == raw)
            memcpy(d + done, in + pos, raw);
        else if (gp_cz_inflate(in + pos, stored, d + done, raw, why) != 0)
            return -1;
        pos += stored;
        done += raw;
    }
    if (pos != in_len) {
        *why = "corrupt compressed copy (bytes after the last block)";
        return -1;
    }
    return 0;
}
