/*
 * image.c: sizes of device-code images and the fallback kernel parameter layout (image.h).
 *
 * Every read goes through rd(), which refuses to look at or past `avail` bytes; callers that do
 * not know the length pass SIZE_MAX and rely on the headers (and on GP_IMAGE_MAX_SIZE) instead,
 * exactly as the real driver must.
 */
#include "image.h"

#include <string.h>

#define ELF_HEADER_SIZE 64u
#define ELF_SHDR_SIZE 64u
#define ELF_PHDR_SIZE 56u
#define SHT_NOBITS 8u
#define SHN_XINDEX 0xffffu
#define MAX_SECTIONS (1u << 20)

#define FATBIN_HEADER_SIZE 16u
#define FATBIN_ENTRY_MIN_HEADER 0x30u /* up to and including the flags word */
#define FATBIN_ENTRY_ELF 2u
#define FATBIN_FLAG_LZ4 0x2000u
#define FATBIN_FLAG_ZSTD 0x8000u

#define EIFMT_NVAL 1u
#define EIFMT_BVAL 2u
#define EIFMT_HVAL 3u
#define EIFMT_SVAL 4u
#define EIATTR_KPARAM_INFO 0x17u

/* Copy n bytes at p + off into out if they lie below avail; 0, else -1. */
static int rd(const uint8_t *p, size_t avail, uint64_t off, size_t n, void *out)
{
    if (off > avail || n > avail - off)
        return -1;
    memcpy(out, p + off, n);
    return 0;
}

static int rd16(const uint8_t *p, size_t avail, uint64_t off, uint16_t *v)
{
    uint8_t b[2];
    if (rd(p, avail, off, 2, b))
        return -1;
    *v = (uint16_t)(b[0] | b[1] << 8);
    return 0;
}

static int rd32(const uint8_t *p, size_t avail, uint64_t off, uint32_t *v)
{
    uint8_t b[4];
    if (rd(p, avail, off, 4, b))
        return -1;
    *v = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
    return 0;
}

static int rd64(const uint8_t *p, size_t avail, uint64_t off, uint64_t *v)
{
    uint32_t lo, hi;
    if (rd32(p, avail, off, &lo) || rd32(p, avail, off + 4, &hi))
        return -1;
    *v = (uint64_t)hi << 32 | lo;
    return 0;
}

/* end = max(end, off + len), refusing overflow and absurd sizes. */
static int extend(uint64_t *end, uint64_t off, uint64_t len)
{
    if (off > GP_IMAGE_MAX_SIZE || len > GP_IMAGE_MAX_SIZE - off)
        return -1;
    if (off + len > *end)
        *end = off + len;
    return 0;
}

/* ---- ELF ------------------------------------------------------------------------------- */

typedef struct elf_info {
    uint64_t shoff;
    uint32_t nsec;
    uint32_t shstrndx;
} elf_info;

static int elf_size(const uint8_t *p, size_t avail, size_t *size, elf_info *info)
{
    uint8_t ident[16];
    if (rd(p, avail, 0, sizeof ident, ident))
        return -1;
    if (ident[0] != 0x7f || ident[1] != 'E' || ident[2] != 'L' || ident[3] != 'F')
        return -1;
    if (ident[4] != 2 /* ELFCLASS64 */ || ident[5] != 1 /* little-endian */)
        return -1;
    uint64_t phoff, shoff;
    uint16_t ehsize, phentsize, phnum, shentsize, shnum, shstrndx;
    /* e_version is not checked: nvcc 13 cubins (ABI 8) say 1, but cubins of the older CUDA ELF
     * ABI 7 (cuBLASLt's GEMM kernels, e_ident[8] = 7) put the toolkit version there (123, 124
     * seen), and the driver loads both. */
    if (rd64(p, avail, 0x20, &phoff) || rd64(p, avail, 0x28, &shoff) ||
        rd16(p, avail, 0x34, &ehsize) || rd16(p, avail, 0x36, &phentsize) ||
        rd16(p, avail, 0x38, &phnum) || rd16(p, avail, 0x3a, &shentsize) ||
        rd16(p, avail, 0x3c, &shnum) || rd16(p, avail, 0x3e, &shstrndx))
        return -1;
    if (ehsize < ELF_HEADER_SIZE)
        return -1;
    uint64_t end = 0;
    if (extend(&end, 0, ehsize))
        return -1;

    if (phnum) {
        if (phentsize < ELF_PHDR_SIZE)
            return -1;
        if (extend(&end, phoff, (uint64_t)phnum * phentsize))
            return -1;
        for (uint32_t i = 0; i < phnum; i++) {
            uint64_t base = phoff + (uint64_t)i * phentsize, off, filesz;
            if (rd64(p, avail, base + 0x08, &off) || rd64(p, avail, base + 0x20, &filesz))
                return -1;
            if (filesz && extend(&end, off, filesz))
                return -1;
        }
    }

    uint32_t nsec = shnum, strndx = shstrndx;
    if (shoff) {
        if (shentsize != ELF_SHDR_SIZE)
            return -1;
        if (nsec == 0 || strndx == SHN_XINDEX) {
            /* Extended numbering: section 0 carries the real count and string table index. */
            uint64_t count;
            uint32_t link;
            if (rd64(p, avail, shoff + 0x20, &count) || rd32(p, avail, shoff + 0x28, &link))
                return -1;
            if (nsec == 0) {
                if (count > MAX_SECTIONS)
                    return -1;
                nsec = (uint32_t)count;
            }
            if (strndx == SHN_XINDEX)
                strndx = link;
        }
        if (nsec == 0)
            return -1;
        if (extend(&end, shoff, (uint64_t)nsec * ELF_SHDR_SIZE))
            return -1;
        for (uint32_t i = 0; i < nsec; i++) {
            uint64_t base = shoff + (uint64_t)i * ELF_SHDR_SIZE, off, sz;
            uint32_t type;
            if (rd32(p, avail, base + 0x04, &type) || rd64(p, avail, base + 0x18, &off) ||
                rd64(p, avail, base + 0x20, &sz))
                return -1;
            if (type == 0 /* SHT_NULL */ || type == SHT_NOBITS || sz == 0)
                continue;
            if (extend(&end, off, sz))
                return -1;
        }
    } else {
        nsec = 0;
    }
    if (end > avail)
        return -1;
    *size = (size_t)end;
    if (info) {
        info->shoff = shoff;
        info->nsec = nsec;
        info->shstrndx = strndx;
    }
    return 0;
}

/* ---- fatbin ---------------------------------------------------------------------------- */

static int fatbin_size(const uint8_t *p, size_t avail, size_t *size, uint32_t *header_size)
{
    uint32_t magic;
    uint16_t hs;
    uint64_t fat;
    if (rd32(p, avail, 0, &magic) || magic != GP_FATBIN_MAGIC)
        return -1;
    if (rd16(p, avail, 6, &hs) || rd64(p, avail, 8, &fat))
        return -1;
    if (hs < FATBIN_HEADER_SIZE)
        return -1;
    uint64_t end = 0;
    if (extend(&end, hs, fat) || end > avail)
        return -1;
    *size = (size_t)end;
    if (header_size)
        *header_size = hs;
    return 0;
}

/* ---- text ------------------------------------------------------------------------------ */

static int text_byte(uint8_t c)
{
    return c >= 0x20 || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

static int text_size(const uint8_t *p, size_t avail, size_t *size)
{
    size_t lim = avail < GP_IMAGE_MAX_SIZE ? avail : GP_IMAGE_MAX_SIZE;
    for (size_t i = 0; i < lim; i++) {
        uint8_t c = p[i];
        if (c == 0) {
            if (i == 0)
                return -1;
            *size = i + 1;
            return 0;
        }
        if (!text_byte(c) || c == 0x7f)
            return -1;
    }
    return -1;
}

/* ---- public ---------------------------------------------------------------------------- */

typedef struct wrapper {
    int32_t magic;
    int32_t version;
    const void *data;
    const void *filename_or_fatbins;
} wrapper;

int gp_image_size_n(const void *image, size_t avail, size_t *size, int *kind)
{
    const uint8_t *p = image;
    if (!p || !size || !kind)
        return -1;
    /* Read the magic a byte at a time, stopping at a NUL: none of the magics holds a zero
     * byte, and a short text image must not be read past its terminator. */
    uint8_t m[4];
    size_t got = 0;
    while (got < 4 && got < avail && (m[got] = p[got]) != 0)
        got++;
    uint32_t magic = got == 4 ? (uint32_t)m[0] | (uint32_t)m[1] << 8 | (uint32_t)m[2] << 16 |
                                    (uint32_t)m[3] << 24
                              : 0;
    if (got == 4) {
        if (magic == GP_FATBIN_WRAPPER_MAGIC) {
            wrapper w;
            if (rd(p, avail, 0, sizeof w, &w))
                return -1;
            if (w.version < 1 || w.version > 2 || !w.data)
                return -1;
            if (fatbin_size(w.data, SIZE_MAX, size, NULL))
                return -1;
            *kind = GP_IMAGE_WRAPPER;
            return 0;
        }
        if (magic == GP_FATBIN_MAGIC) {
            if (fatbin_size(p, avail, size, NULL))
                return -1;
            *kind = GP_IMAGE_FATBIN;
            return 0;
        }
        if (magic == 0x464c457fu) { /* "\x7fELF" */
            if (elf_size(p, avail, size, NULL))
                return -1;
            *kind = GP_IMAGE_ELF;
            return 0;
        }
    }
    if (text_size(p, avail, size))
        return -1;
    *kind = GP_IMAGE_TEXT;
    return 0;
}

int gp_image_size(const void *image, size_t *size, int *kind)
{
    return gp_image_size_n(image, SIZE_MAX, size, kind);
}

const void *gp_image_data(const void *image, int kind)
{
    if (kind == GP_IMAGE_WRAPPER) {
        wrapper w;
        memcpy(&w, image, sizeof w);
        return w.data;
    }
    return image;
}

/* ---- parameter layout ------------------------------------------------------------------ */

#define UNSET UINT32_MAX

/* Parse the records of one .nv.info.<kernel> section. */
static int parse_kparams(const uint8_t *p, size_t avail, uint64_t off, uint64_t len,
                         uint32_t *offsets, uint32_t *sizes, int max)
{
    if (off > avail || len > avail - off)
        return -1;
    for (int i = 0; i < max; i++)
        offsets[i] = sizes[i] = UNSET;
    int count = 0;
    uint64_t pos = 0;
    while (pos < len) {
        if (len - pos < 4)
            return -1;
        uint8_t fmt = p[off + pos], attr = p[off + pos + 1];
        if (fmt == EIFMT_NVAL || fmt == EIFMT_BVAL || fmt == EIFMT_HVAL) {
            pos += 4;
            continue;
        }
        if (fmt != EIFMT_SVAL)
            return -1;
        uint16_t n;
        if (rd16(p, avail, off + pos + 2, &n))
            return -1;
        if (n > len - pos - 4)
            return -1;
        if (attr == EIATTR_KPARAM_INFO) {
            uint16_t ordinal, poff;
            uint32_t flags;
            if (n < 12)
                return -1;
            if (rd16(p, avail, off + pos + 8, &ordinal) || rd16(p, avail, off + pos + 10, &poff) ||
                rd32(p, avail, off + pos + 12, &flags))
                return -1;
            if (ordinal >= max || offsets[ordinal] != UNSET)
                return -1;
            offsets[ordinal] = poff;
            sizes[ordinal] = flags >> 18;
            if (ordinal + 1 > count)
                count = ordinal + 1;
        }
        pos += 4 + (uint64_t)n;
    }
    for (int i = 0; i < count; i++)
        if (offsets[i] == UNSET || sizes[i] == 0)
            return -1;
    return count;
}

static int elf_param_info(const uint8_t *p, size_t avail, const char *kernel, uint32_t *offsets,
                          uint32_t *sizes, int max)
{
    static const char prefix[] = ".nv.info.";
    const size_t plen = sizeof prefix - 1, klen = strlen(kernel);
    size_t size;
    elf_info ei;
    if (elf_size(p, avail, &size, &ei) || ei.nsec == 0 || ei.shstrndx >= ei.nsec)
        return -1;
    uint64_t strbase = ei.shoff + (uint64_t)ei.shstrndx * ELF_SHDR_SIZE, stroff, strsz;
    if (rd64(p, size, strbase + 0x18, &stroff) || rd64(p, size, strbase + 0x20, &strsz))
        return -1;
    if (stroff > size || strsz > size - stroff)
        return -1;
    const uint8_t *strtab = p + stroff;
    for (uint32_t i = 0; i < ei.nsec; i++) {
        uint64_t base = ei.shoff + (uint64_t)i * ELF_SHDR_SIZE, off, sz;
        uint32_t name;
        if (rd32(p, size, base, &name))
            return -1;
        if (name >= strsz || strsz - name < plen + klen + 1)
            continue;
        if (memcmp(strtab + name, prefix, plen) || memcmp(strtab + name + plen, kernel, klen) ||
            strtab[name + plen + klen] != 0)
            continue;
        if (rd64(p, size, base + 0x18, &off) || rd64(p, size, base + 0x20, &sz))
            return -1;
        return parse_kparams(p, size, off, sz, offsets, sizes, max);
    }
    return -1;
}

static int fatbin_param_info(const uint8_t *p, size_t avail, const char *kernel, uint32_t *offsets,
                             uint32_t *sizes, int max)
{
    size_t total;
    uint32_t hs;
    if (fatbin_size(p, avail, &total, &hs))
        return -1;
    uint64_t off = hs;
    while (off < total && total - off >= FATBIN_ENTRY_MIN_HEADER) {
        uint16_t ekind;
        uint32_t ehs;
        uint64_t psize, flags;
        if (rd16(p, total, off, &ekind) || rd32(p, total, off + 4, &ehs) ||
            rd64(p, total, off + 8, &psize) || rd64(p, total, off + 0x28, &flags))
            return -1;
        if (ehs < FATBIN_ENTRY_MIN_HEADER || ehs > total - off || psize > total - off - ehs)
            return -1;
        if (ekind == FATBIN_ENTRY_ELF && !(flags & (FATBIN_FLAG_LZ4 | FATBIN_FLAG_ZSTD))) {
            int r = elf_param_info(p + off + ehs, (size_t)psize, kernel, offsets, sizes, max);
            if (r >= 0)
                return r;
        }
        off += ehs + psize;
    }
    return -1;
}

int gp_image_param_info(const void *image, size_t size, const char *kernel, uint32_t *offsets,
                        uint32_t *sizes, int max)
{
    if (!image || !kernel || !offsets || !sizes || max < 0)
        return -1;
    size_t sz;
    int kind;
    if (gp_image_size_n(image, size, &sz, &kind))
        return -1;
    switch (kind) {
    case GP_IMAGE_WRAPPER:
        return fatbin_param_info(gp_image_data(image, kind), sz, kernel, offsets, sizes, max);
    case GP_IMAGE_FATBIN:
        return fatbin_param_info(image, sz, kernel, offsets, sizes, max);
    case GP_IMAGE_ELF:
        return elf_param_info(image, sz, kernel, offsets, sizes, max);
    default:
        return -1;
    }
}
