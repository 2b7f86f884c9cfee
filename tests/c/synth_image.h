/*
 * synth_image.h: minimal device-code images built in memory for the C tests: an ELF64 "cubin"
 * with a .nv.info.<kernel> section of EIATTR_KPARAM_INFO records, fatbins of given entries,
 * and the fatbin wrapper that cudart passes to cuLibraryLoadData.
 */
#ifndef GP_TEST_SYNTH_IMAGE_H
#define GP_TEST_SYNTH_IMAGE_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "image.h"

static inline void put16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8);
}
static inline void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> 8 * i);
}
static inline void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> 8 * i);
}

/* ---- a synthetic cubin ------------------------------------------------------------------ */

/* Builds a minimal ELF64 with sections: NULL, .shstrtab, .nv.info.<kernel> holding KPARAM_INFO
 * records (in reverse order, as nvcc writes them) for the given offsets/sizes, plus one HVAL
 * and one NVAL record, and a NOBITS section whose size must not count. */
static inline uint8_t *synth_elf(const char *kernel, const uint32_t *offs, const uint32_t *sizes,
                                 int n, size_t *len)
{
    char names[512];
    size_t nl = 0;
    names[nl++] = 0;
    size_t n_shstr = nl;
    nl += (size_t)sprintf(names + nl, ".shstrtab") + 1;
    size_t n_info = nl;
    nl += (size_t)sprintf(names + nl, ".nv.info.%s", kernel) + 1;
    size_t n_bss = nl;
    nl += (size_t)sprintf(names + nl, ".nv.global") + 1;

    size_t info_len = (size_t)n * 16 + 4 + 4;
    size_t off_names = 64, off_info = off_names + nl, off_sh = (off_info + info_len + 7) & ~7u;
    size_t total = off_sh + 4 * 64;
    uint8_t *p = calloc(1, total);
    if (!p)
        exit(2);
    memcpy(p,
           "\x7f"
           "ELF",
           4);
    p[4] = 2, p[5] = 1, p[6] = 1, p[7] = 0x41;
    put16(p + 0x10, 2), put16(p + 0x12, 190), put32(p + 0x14, 1);
    put64(p + 0x28, off_sh);
    put16(p + 0x34, 64), put16(p + 0x3a, 64), put16(p + 0x3c, 4), put16(p + 0x3e, 1);
    memcpy(p + off_names, names, nl);
    uint8_t *r = p + off_info;
    r[0] = 3, r[1] = 0x1b, put16(r + 2, 0xff), r += 4; /* HVAL */
    for (int i = n - 1; i >= 0; i--) {
        r[0] = 4, r[1] = 0x17, put16(r + 2, 12);
        put32(r + 4, 0), put16(r + 8, (uint16_t)i), put16(r + 10, (uint16_t)offs[i]);
        put32(r + 12, sizes[i] << 18 | 0x1f000);
        r += 16;
    }
    r[0] = 1, r[1] = 0x50, r += 4; /* NVAL */
    uint8_t *sh = p + off_sh;
    /* [1] .shstrtab */
    put32(sh + 64 + 0, (uint32_t)n_shstr), put32(sh + 64 + 4, 3);
    put64(sh + 64 + 0x18, off_names), put64(sh + 64 + 0x20, nl);
    /* [2] .nv.info.<kernel> */
    put32(sh + 128 + 0, (uint32_t)n_info), put32(sh + 128 + 4, 0x70000000);
    put64(sh + 128 + 0x18, off_info), put64(sh + 128 + 0x20, info_len);
    /* [3] NOBITS with a huge size */
    put32(sh + 192 + 0, (uint32_t)n_bss), put32(sh + 192 + 4, 8);
    put64(sh + 192 + 0x18, off_sh), put64(sh + 192 + 0x20, 1ull << 40);
    *len = total;
    return p;
}

/* A fatbin of the given entries: {kind, flags, payload}. */
typedef struct entry {
    uint16_t kind;
    uint64_t flags;
    const uint8_t *data;
    size_t len;
} entry;

static inline uint8_t *synth_fatbin(const entry *e, int n, size_t *len)
{
    size_t total = 16;
    for (int i = 0; i < n; i++)
        total += 64 + ((e[i].len + 7) & ~(size_t)7);
    uint8_t *p = calloc(1, total);
    if (!p)
        exit(2);
    put32(p, GP_FATBIN_MAGIC), put16(p + 4, 1), put16(p + 6, 16), put64(p + 8, total - 16);
    size_t off = 16;
    for (int i = 0; i < n; i++) {
        size_t padded = (e[i].len + 7) & ~(size_t)7;
        put16(p + off, e[i].kind), put16(p + off + 2, 0x101), put32(p + off + 4, 64);
        put64(p + off + 8, padded), put32(p + off + 0x1c, 90), put64(p + off + 0x28, e[i].flags);
        memcpy(p + off + 64, e[i].data, e[i].len);
        off += 64 + padded;
    }
    *len = total;
    return p;
}

typedef struct wrapper {
    int32_t magic, version;
    const void *data, *extra;
} wrapper;

#endif /* GP_TEST_SYNTH_IMAGE_H */
