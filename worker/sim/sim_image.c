/*
 * sim_image.c: recognising the module images the driver accepts and picking the code for the
 * device: a fatbin wrapper (what cudart passes), a fatbin, a cubin (ELF), or PTX text.
 *
 * Fatbin layout (research notes, section 5, checked against nvcc 13 output): a 16-byte header
 * {u32 magic 0xBA55ED50, u16 version, u16 header size, u64 size of the entries}, then entries,
 * each {u16 kind (1 PTX, 2 ELF), u16 version, u32 header size, u64 payload size, ..., u32 sm at
 * 28, ..., u64 flags at 40}, its payload right after its header. Flag 0x8000 marks a ZSTD-
 * compressed payload and 0x2000 an LZ4 one. ZSTD code is read like plain code when the system's
 * libzstd.so.1 can be loaded (sim_zstd.c); otherwise, and for LZ4, such entries only tell the
 * sim that code for the device exists.
 *
 * The API passes images without a length. A fatbin states its own size; for a bare cubin the
 * extent is the furthest byte its headers point at; PTX ends at its NUL. Within that extent
 * everything is bounds-checked (sim_elf.c); the caller must supply a buffer that really holds
 * what the headers claim (the worker receives images with their length and can check it).
 */
#include <stdlib.h>
#include <string.h>

#include "sim_internal.h"

#define WRAPPER_MAGIC 0x466243b1u
#define FATBIN_MAGIC 0xBA55ED50u
#define MAX_IMAGE (1ull << 30) /* no real image comes close; bigger claims are garbage */
#define KIND_PTX 1
#define KIND_ELF 2
#define FLAG_ZSTD 0x8000u
#define FLAG_LZ4 0x2000u
#define FLAG_COMPRESSED (FLAG_ZSTD | FLAG_LZ4)

static uint16_t rd16(const unsigned char *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}
static uint32_t rd32(const unsigned char *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}
static uint64_t rd64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* SASS runs on devices of the same major version and an equal or higher minor; code whose
 * architecture we could not read (0) is given the benefit of the doubt. */
static bool sass_fits(int code_sm, int dev_sm)
{
    return code_sm == 0 || (code_sm / 10 == dev_sm / 10 && code_sm % 10 <= dev_sm % 10);
}

CUresult sim_fatbin_parse(const unsigned char *buf, size_t len, int dev_sm, struct sim_image *out)
{
    memset(out, 0, sizeof(*out));
    if (len < 16 || rd32(buf) != FATBIN_MAGIC)
        return CUDA_ERROR_INVALID_IMAGE;
    uint64_t hsize = rd16(buf + 6), fsize = rd64(buf + 8);
    if (hsize < 16 || hsize > len || fsize > len - hsize)
        return CUDA_ERROR_INVALID_IMAGE;
    uint64_t end = hsize + fsize;
    const unsigned char *best = NULL;
    uint64_t best_len = 0;
    int best_sm = -1;
    bool best_zstd = false, other_usable = false, any = false;
    bool zstd = sim_zstd_available();
    for (uint64_t p = hsize; p < end;) {
        if (end - p < 48)
            return CUDA_ERROR_INVALID_IMAGE;
        const unsigned char *e = buf + p;
        uint32_t ehs = rd32(e + 4);
        uint64_t psize = rd64(e + 8);
        if (ehs < 48 || ehs > end - p || psize > end - p - ehs)
            return CUDA_ERROR_INVALID_IMAGE;
        unsigned kind = rd16(e);
        int sm = (int)rd32(e + 28);
        uint64_t flags = rd64(e + 40);
        bool compressed = (flags & FLAG_COMPRESSED) != 0;
        any = true;
        if (kind == KIND_ELF && sass_fits(sm, dev_sm)) {
            bool readable = !compressed || (zstd && (flags & FLAG_COMPRESSED) == FLAG_ZSTD);
            if (!readable)
                other_usable = true;
            else if (sm > best_sm) { /* the newest code that fits, as the driver picks */
                best = e + ehs;
                best_len = psize;
                best_sm = sm;
                best_zstd = compressed;
            }
        } else if (kind == KIND_PTX && sm <= dev_sm) {
            other_usable = true; /* the driver would JIT it */
        }
        p += ehs + psize;
    }
    if (best) {
        unsigned char *plain = NULL;
        size_t plain_len = 0;
        if (best_zstd) {
            CUresult rc = sim_zstd_decompress(best, best_len, MAX_IMAGE, &plain, &plain_len);
            if (rc != CUDA_SUCCESS)
                return rc == CUDA_ERROR_OUT_OF_MEMORY ? rc : CUDA_ERROR_INVALID_IMAGE;
            best = plain;
            best_len = plain_len;
        }
        CUresult rc = sim_elf_parse(best, best_len, &out->elf); /* copies what it keeps */
        free(plain);
        return rc == CUDA_ERROR_OUT_OF_MEMORY ? rc
               : rc != CUDA_SUCCESS           ? CUDA_ERROR_INVALID_IMAGE
                                              : CUDA_SUCCESS;
    }
    if (other_usable) {
        out->any_name = true;
        return CUDA_SUCCESS;
    }
    return any ? CUDA_ERROR_NO_BINARY_FOR_GPU : CUDA_ERROR_INVALID_IMAGE;
}

/* The extent of a cubin: the furthest byte its ELF and section headers point at. */
static bool elf_extent(const unsigned char *b, uint64_t *len)
{
    uint64_t shoff = rd64(b + 40), phoff = rd64(b + 32);
    unsigned shentsize = rd16(b + 58), shnum = rd16(b + 60);
    unsigned phentsize = rd16(b + 54), phnum = rd16(b + 56);
    if (shentsize != 64 || shnum == 0 || shoff < 64 || shoff > MAX_IMAGE ||
        (uint64_t)shnum * 64 > MAX_IMAGE - shoff)
        return false;
    uint64_t end = shoff + (uint64_t)shnum * 64;
    if (phnum != 0) {
        if (phoff > MAX_IMAGE || (uint64_t)phnum * phentsize > MAX_IMAGE - phoff)
            return false;
        if (phoff + (uint64_t)phnum * phentsize > end)
            end = phoff + (uint64_t)phnum * phentsize;
    }
    for (unsigned i = 0; i < shnum; i++) {
        const unsigned char *h = b + shoff + (uint64_t)i * 64;
        uint64_t off = rd64(h + 24), size = rd64(h + 32);
        if (rd32(h + 4) == 8 /* NOBITS */)
            continue;
        if (off > MAX_IMAGE || size > MAX_IMAGE - off)
            return false;
        if (off + size > end)
            end = off + size;
    }
    *len = end;
    return true;
}

/* PTX is text: printable characters, whitespace, UTF-8 in comments, up to a NUL. */
static bool is_ptx(const unsigned char *b)
{
    size_t n = 0;
    for (; n < MAX_IMAGE && b[n] != '\0'; n++) {
        unsigned char c = b[n];
        if (c < 0x20 && c != '\t' && c != '\n' && c != '\r')
            return false;
    }
    if (n == MAX_IMAGE)
        return false;
    return memmem(b, n, ".version", 8) || memmem(b, n, ".target", 7) || memmem(b, n, ".entry", 6);
}

CUresult sim_image_load(const void *image, int dev_sm, struct sim_image *out)
{
    memset(out, 0, sizeof(*out));
    if (!image)
        return CUDA_ERROR_INVALID_VALUE;
    const unsigned char *b = image;
    uint32_t magic = rd32(b);
    if (magic == WRAPPER_MAGIC) {
        /* {int magic; int version; const void *fatbin; void *filename_or_fatbins} */
        uint32_t version = rd32(b + 4);
        const unsigned char *fb = NULL;
        memcpy(&fb, b + 8, sizeof(fb));
        if ((version != 1 && version != 2) || !fb)
            return CUDA_ERROR_INVALID_IMAGE;
        b = fb;
        magic = rd32(b);
        if (magic != FATBIN_MAGIC)
            return CUDA_ERROR_INVALID_IMAGE;
    }
    if (magic == FATBIN_MAGIC) {
        uint64_t hsize = rd16(b + 6), fsize = rd64(b + 8);
        if (hsize < 16 || hsize > 4096 || fsize > MAX_IMAGE)
            return CUDA_ERROR_INVALID_IMAGE;
        return sim_fatbin_parse(b, hsize + fsize, dev_sm, out);
    }
    static const unsigned char elf_magic[4] = {0x7f, 'E', 'L', 'F'};
    if (memcmp(b, elf_magic, 4) == 0) {
        uint64_t len = 0;
        if (b[4] != 2 || !elf_extent(b, &len))
            return CUDA_ERROR_INVALID_IMAGE;
        CUresult rc = sim_elf_parse(b, len, &out->elf);
        if (rc == CUDA_SUCCESS && !sass_fits(out->elf.sm, dev_sm)) {
            sim_elf_free(&out->elf);
            return CUDA_ERROR_NO_BINARY_FOR_GPU;
        }
        return rc;
    }
    if (is_ptx(b)) {
        out->any_name = true;
        sim_jit_cache_note((const char *)b);
        return CUDA_SUCCESS;
    }
    return CUDA_ERROR_INVALID_IMAGE;
}

void sim_image_free(struct sim_image *img)
{
    sim_elf_free(&img->elf);
}
