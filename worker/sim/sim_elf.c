/*
 * sim_elf.c: just enough of a CUDA ELF (cubin) reader for the simulated device: kernel names,
 * each kernel's parameter layout and register count, and global variables with their sizes and
 * initial contents.
 *
 * The image comes from the network, so this parser assumes nothing: every offset, size, count and
 * string is checked against the buffer before use, and all multi-byte fields are read with memcpy
 * (no unaligned loads). A malformed image gives CUDA_ERROR_INVALID_IMAGE, never a crash.
 *
 * Layout facts (see the research notes, section 5): each kernel has a section ".nv.info.<name>"
 * holding attribute records {u8 format, u8 attribute, ...}; format 4 records carry a u16 length and
 * that many bytes, formats 1-3 are 4 bytes in all. Attribute 0x17 (KPARAM_INFO) describes one
 * parameter: u32 index, u16 ordinal, u16 offset, u32 flags with the size in flags >> 18. Attribute
 * 0x19 (CBANK_PARAM_SIZE) is the total parameter size. The shared ".nv.info" section has 0x2f
 * (REGCOUNT) records: u32 symbol index, u32 registers.
 */
#include <stdlib.h>
#include <string.h>

#include "sim_internal.h"

#define EM_CUDA 190
#define SHT_SYMTAB 2
#define SHT_NOBITS 8
#define SHN_LORESERVE 0xff00
#define STT_OBJECT 1
#define STT_FUNC 2
#define STB_LOCAL 0
#define STO_CUDA_ENTRY 0x10
#define EIFMT_SVAL 4
#define EIATTR_KPARAM_INFO 0x17
#define EIATTR_CBANK_PARAM_SIZE 0x19
#define EIATTR_REGCOUNT 0x2f
#define MAX_PARAMS 8192 /* far above the driver's 32764-byte parameter limit in 4-byte params */

struct shdr {
    uint32_t name, type;
    uint64_t offset, size;
    uint32_t link;
    uint64_t entsize;
    const char *sname; /* NULL when the name is not a valid string */
};

struct elf {
    const unsigned char *b;
    size_t len;
    struct shdr *sh;
    unsigned shnum;
};

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

static bool in_bounds(size_t len, uint64_t off, uint64_t n)
{
    return off <= len && n <= len - off;
}

/* A NUL-terminated string at offset off of string section idx, or NULL. */
static const char *str_at(const struct elf *e, unsigned idx, uint64_t off)
{
    if (idx >= e->shnum || e->sh[idx].type == SHT_NOBITS || off >= e->sh[idx].size)
        return NULL;
    const char *s = (const char *)e->b + e->sh[idx].offset + off;
    return memchr(s, '\0', e->sh[idx].size - off) ? s : NULL;
}

static struct sim_elf_kernel *find_kernel(struct sim_elf_info *info, const char *name)
{
    for (size_t i = 0; i < info->nkernels; i++)
        if (strcmp(info->kernels[i].name, name) == 0)
            return &info->kernels[i];
    return NULL;
}

static struct sim_elf_kernel *add_kernel(struct sim_elf_info *info, const char *name)
{
    struct sim_elf_kernel *k = find_kernel(info, name);
    if (k)
        return k;
    struct sim_elf_kernel *n = realloc(info->kernels, (info->nkernels + 1) * sizeof(*n));
    if (!n)
        return NULL;
    info->kernels = n;
    k = &n[info->nkernels];
    memset(k, 0, sizeof(*k));
    k->name = strdup(name);
    if (!k->name)
        return NULL;
    k->nparams = -1;
    k->regs = -1;
    info->nkernels++;
    return k;
}

static bool add_global(struct sim_elf_info *info, const char *name, uint64_t size,
                       const unsigned char *init)
{
    for (size_t i = 0; i < info->nglobals; i++)
        if (strcmp(info->globals[i].name, name) == 0)
            return true; /* first definition wins */
    struct sim_elf_global *n = realloc(info->globals, (info->nglobals + 1) * sizeof(*n));
    if (!n)
        return false;
    info->globals = n;
    struct sim_elf_global *g = &n[info->nglobals];
    memset(g, 0, sizeof(*g));
    g->name = strdup(name);
    g->size = size;
    if (!g->name)
        return false;
    info->nglobals++; /* counted now so that sim_elf_free releases it even if the copy fails */
    if (init) {
        g->init = malloc(size);
        if (!g->init)
            return false;
        memcpy(g->init, init, size);
    }
    return true;
}

/* Parameter records of one kernel's .nv.info section. Leaves k->nparams at -1 when the records
 * are inconsistent: the layout is then unknown, which is not an image error. */
static bool parse_kparams(const unsigned char *b, uint64_t size, struct sim_elf_kernel *k)
{
    uint32_t(*rec)[3] = NULL; /* ordinal, offset, size */
    size_t nrec = 0;
    uint64_t cbank = 0;
    bool consistent = true;
    for (uint64_t p = 0; p + 4 <= size;) {
        unsigned fmt = b[p], attr = b[p + 1];
        if (fmt != EIFMT_SVAL) {
            if (fmt < 1 || fmt > 3) {
                consistent = false; /* unknown record format: cannot walk further */
                break;
            }
            if (attr == EIATTR_CBANK_PARAM_SIZE)
                cbank = rd16(b + p + 2);
            p += 4;
            continue;
        }
        uint64_t vlen = rd16(b + p + 2);
        if (vlen > size - p - 4) {
            consistent = false;
            break;
        }
        const unsigned char *v = b + p + 4;
        if (attr == EIATTR_KPARAM_INFO && vlen >= 12) {
            if (nrec >= MAX_PARAMS) {
                consistent = false;
                break;
            }
            uint32_t(*n)[3] = realloc(rec, (nrec + 1) * sizeof(*rec));
            if (!n) {
                free(rec);
                return false;
            }
            rec = n;
            rec[nrec][0] = rd16(v + 4);
            rec[nrec][1] = rd16(v + 6);
            rec[nrec][2] = rd32(v + 8) >> 18;
            nrec++;
        }
        p += 4 + vlen;
    }
    struct sim_param *params = NULL;
    if (consistent && nrec > 0) {
        params = calloc(nrec, sizeof(*params));
        if (!params) {
            free(rec);
            return false;
        }
        /* Records come in any order (nvcc writes them last to first); each ordinal once. */
        for (size_t i = 0; i < nrec && consistent; i++) {
            uint32_t ord = rec[i][0], off = rec[i][1], sz = rec[i][2];
            if (ord >= nrec || params[ord].size != 0 || sz == 0 || (cbank != 0 && off + sz > cbank))
                consistent = false;
            else
                params[ord] = (struct sim_param){.offset = off, .size = sz};
        }
    }
    free(rec);
    if (consistent) {
        k->params = params;
        k->nparams = (int)nrec;
    } else {
        free(params);
    }
    return true;
}

/* The global .nv.info section: register counts by symbol index. */
static void parse_regcounts(const struct elf *e, const unsigned char *b, uint64_t size,
                            const struct shdr *symtab, struct sim_elf_info *info)
{
    for (uint64_t p = 0; p + 4 <= size;) {
        unsigned fmt = b[p], attr = b[p + 1];
        if (fmt != EIFMT_SVAL) {
            if (fmt < 1 || fmt > 3)
                return;
            p += 4;
            continue;
        }
        uint64_t vlen = rd16(b + p + 2);
        if (vlen > size - p - 4)
            return;
        if (attr == EIATTR_REGCOUNT && vlen >= 8 && symtab) {
            uint64_t sym = rd32(b + p + 4);
            uint32_t regs = rd32(b + p + 8);
            if (sym < symtab->size / 24) {
                const unsigned char *s = e->b + symtab->offset + sym * 24;
                const char *name = str_at(e, symtab->link, rd32(s));
                struct sim_elf_kernel *k = name ? find_kernel(info, name) : NULL;
                if (k && regs <= 255)
                    k->regs = (int)regs;
            }
        }
        p += 4 + vlen;
    }
}

static bool is_global_section(const char *n)
{
    if (!n)
        return false;
    if (strncmp(n, ".nv.global", 10) == 0)
        return true;
    /* .nv.constant0.* is the parameter bank; the user's __constant__ data lives in the others. */
    return strncmp(n, ".nv.constant", 12) == 0 && strncmp(n, ".nv.constant0", 13) != 0;
}

static CUresult parse_symbols(const struct elf *e, const struct shdr *st, struct sim_elf_info *info)
{
    if (st->entsize != 24 || st->link >= e->shnum)
        return CUDA_ERROR_INVALID_IMAGE;
    uint64_t n = st->size / 24;
    for (uint64_t i = 1; i < n; i++) {
        const unsigned char *s = e->b + st->offset + i * 24;
        uint32_t name_off = rd32(s);
        unsigned type = s[4] & 0xf, other = s[5];
        uint16_t shndx = rd16(s + 6);
        uint64_t value = rd64(s + 8), size = rd64(s + 16);
        const char *name = str_at(e, st->link, name_off);
        if (!name || !*name || shndx == 0 || shndx >= SHN_LORESERVE || shndx >= e->shnum)
            continue;
        if (type == STT_FUNC && (other & STO_CUDA_ENTRY)) {
            if (!add_kernel(info, name))
                return CUDA_ERROR_OUT_OF_MEMORY;
        } else if (type == STT_OBJECT && size > 0 && is_global_section(e->sh[shndx].sname)) {
            const struct shdr *sec = &e->sh[shndx];
            const unsigned char *init = NULL;
            if (sec->type != SHT_NOBITS && value <= sec->size && size <= sec->size - value)
                init = e->b + sec->offset + value;
            if (!add_global(info, name, size, init))
                return CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    return CUDA_SUCCESS;
}

/* Older toolchains did not mark entry points; then every global function is one. */
static CUresult fallback_kernels(const struct elf *e, const struct shdr *st,
                                 struct sim_elf_info *info)
{
    uint64_t n = st->size / 24;
    for (uint64_t i = 1; i < n; i++) {
        const unsigned char *s = e->b + st->offset + i * 24;
        const char *name = str_at(e, st->link, rd32(s));
        uint16_t shndx = rd16(s + 6);
        if (name && *name && (s[4] & 0xf) == STT_FUNC && (s[4] >> 4) != STB_LOCAL && shndx != 0 &&
            !add_kernel(info, name))
            return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return CUDA_SUCCESS;
}

static int elf_sm(const unsigned char *b)
{
    uint32_t flags = rd32(b + 48);
    unsigned osabi = b[7], abiver = b[8];
    if (osabi == 0x41 && abiver >= 8)
        return (int)((flags >> 8) & 0xff); /* CUDA 13 layout: sm in bits 8..15 */
    if (osabi == 0x33)
        return (int)(flags & 0xff); /* the older layout: sm in the low byte */
    return 0;
}

static CUresult parse(struct elf *e, struct sim_elf_info *info)
{
    const unsigned char *b = e->b;
    static const unsigned char magic[4] = {0x7f, 'E', 'L', 'F'};
    if (e->len < 64 || memcmp(b, magic, 4) != 0 || b[4] != 2 /* 64-bit */ ||
        b[5] != 1 /* little endian */ || rd16(b + 18) != EM_CUDA)
        return CUDA_ERROR_INVALID_IMAGE;
    uint64_t shoff = rd64(b + 40);
    unsigned shentsize = rd16(b + 58), shnum = rd16(b + 60), shstrndx = rd16(b + 62);
    if (shentsize != 64 || shnum == 0 || shstrndx >= shnum ||
        !in_bounds(e->len, shoff, (uint64_t)shnum * 64))
        return CUDA_ERROR_INVALID_IMAGE;
    info->sm = elf_sm(b);
    e->sh = calloc(shnum, sizeof(*e->sh));
    if (!e->sh)
        return CUDA_ERROR_OUT_OF_MEMORY;
    e->shnum = shnum;
    for (unsigned i = 0; i < shnum; i++) {
        const unsigned char *h = b + shoff + (uint64_t)i * 64;
        struct shdr *s = &e->sh[i];
        s->name = rd32(h);
        s->type = rd32(h + 4);
        s->offset = rd64(h + 24);
        s->size = rd64(h + 32);
        s->link = rd32(h + 40);
        s->entsize = rd64(h + 56);
        if (s->type != SHT_NOBITS && !in_bounds(e->len, s->offset, s->size))
            return CUDA_ERROR_INVALID_IMAGE;
    }
    for (unsigned i = 0; i < shnum; i++)
        e->sh[i].sname = str_at(e, shstrndx, e->sh[i].name);

    const struct shdr *symtab = NULL;
    for (unsigned i = 0; i < shnum && !symtab; i++)
        if (e->sh[i].type == SHT_SYMTAB)
            symtab = &e->sh[i];
    CUresult rc = symtab ? parse_symbols(e, symtab, info) : CUDA_SUCCESS;
    if (rc != CUDA_SUCCESS)
        return rc;
    /* Kernels named by their .nv.info.<name> section, with their parameter layouts. */
    for (unsigned i = 0; i < shnum; i++) {
        const char *n = e->sh[i].sname;
        if (!n || strncmp(n, ".nv.info.", 9) != 0 || n[9] == '\0' || e->sh[i].type == SHT_NOBITS)
            continue;
        struct sim_elf_kernel *k = add_kernel(info, n + 9);
        if (!k || !parse_kparams(b + e->sh[i].offset, e->sh[i].size, k))
            return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (info->nkernels == 0 && symtab && (rc = fallback_kernels(e, symtab, info)) != CUDA_SUCCESS)
        return rc;
    for (unsigned i = 0; i < shnum; i++) {
        const char *n = e->sh[i].sname;
        if (n && strcmp(n, ".nv.info") == 0 && e->sh[i].type != SHT_NOBITS)
            parse_regcounts(e, b + e->sh[i].offset, e->sh[i].size, symtab, info);
    }
    return CUDA_SUCCESS;
}

CUresult sim_elf_parse(const unsigned char *buf, size_t len, struct sim_elf_info *out)
{
    memset(out, 0, sizeof(*out));
    struct elf e = {.b = buf, .len = len};
    CUresult rc = parse(&e, out);
    free(e.sh);
    if (rc != CUDA_SUCCESS)
        sim_elf_free(out);
    return rc;
}

void sim_elf_free(struct sim_elf_info *info)
{
    for (size_t i = 0; i < info->nkernels; i++) {
        free(info->kernels[i].name);
        free(info->kernels[i].params);
    }
    for (size_t i = 0; i < info->nglobals; i++) {
        free(info->globals[i].name);
        free(info->globals[i].init);
    }
    free(info->kernels);
    free(info->globals);
    memset(info, 0, sizeof(*info));
}
