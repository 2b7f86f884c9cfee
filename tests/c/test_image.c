/*
 * Unit test of client/shim/image.c: image kinds and sizes, the fallback kernel parameter layout,
 * and robustness against truncated and corrupted images (run it under `make SAN=1` too).
 *
 * Usage: test_image [K.cubin K.fatbin]
 * Without arguments only the synthetic images built here are checked. With them, the files must
 * come from nvcc -cubin / -fatbin of tests/test_image.py's source: kernel `k(float a, const float
 * *x, float *y, int n)` and kernel `kbig(struct {int v[100];} b, long long *out)`.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "image.h"
#include "synth_image.h"

#include "gp_check_said.h"

/* ---- helpers ---------------------------------------------------------------------------- */

static uint8_t *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        exit(2);
    }
    if (fseek(f, 0, SEEK_END) != 0)
        exit(2);
    long n = ftell(f);
    if (n <= 0 || fseek(f, 0, SEEK_SET) != 0)
        exit(2);
    uint8_t *buf = malloc((size_t)n);
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n)
        exit(2);
    fclose(f);
    *len = (size_t)n;
    return buf;
}

/* An exact-size heap copy, so that AddressSanitizer sees any read past the end. */
static uint8_t *dup_exact(const uint8_t *src, size_t n)
{
    uint8_t *p = malloc(n ? n : 1);
    if (!p)
        exit(2);
    if (n)
        memcpy(p, src, n);
    return p;
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* ---- checks ----------------------------------------------------------------------------- */

static void expect_layout(const void *img, size_t len, const char *kernel, int n,
                          const uint32_t *offs, const uint32_t *sizes, const char *what)
{
    uint32_t o[64], s[64];
    int got = gp_image_param_info(img, len, kernel, o, s, 64);
    CHECK(got == n, "%s: %s has %d params, expected %d", what, kernel, got, n);
    for (int i = 0; i < n && i < got; i++)
        CHECK(o[i] == offs[i] && s[i] == sizes[i], "%s: %s param %d at %u size %u, expected %u/%u",
              what, kernel, i, o[i], s[i], offs[i], sizes[i]);
}

/* Every truncation must be refused (the size exceeds what is there) without reading past the
 * end, and random corruption must never crash. */
static void robustness(const uint8_t *img, size_t len, const char *kernel, const char *what)
{
    size_t sz;
    int kind;
    uint32_t o[16], s[16];
    for (size_t n = 0; n < len; n++) {
        uint8_t *t = dup_exact(img, n);
        CHECK(gp_image_size_n(t, n, &sz, &kind) != 0 || kind == GP_IMAGE_TEXT,
              "%s truncated to %zu accepted as kind %d size %zu", what, n, kind, sz);
        (void)gp_image_param_info(t, n, kernel, o, s, 16);
        free(t);
    }
    for (int iter = 0; iter < 20000; iter++) {
        uint8_t *t = dup_exact(img, len);
        int flips = 1 + (int)(rnd() % 8);
        for (int f = 0; f < flips; f++) {
            size_t at = (size_t)(rnd() % len);
            /* Favour the headers and tables, where corruption changes the parse. */
            if (rnd() % 2)
                at = (size_t)(rnd() % (len < 128 ? len : 128));
            if (rnd() % 4 == 0)
                at = len - 1 - (size_t)(rnd() % (len < 300 ? len : 300));
            t[at] = (uint8_t)rnd();
        }
        if (gp_image_size_n(t, len, &sz, &kind) == 0)
            CHECK(sz <= len, "%s corrupted: size %zu > %zu", what, sz, len);
        (void)gp_image_param_info(t, len, kernel, o, s, 16);
        free(t);
    }
}

static void synthetic(void)
{
    /* ELF. */
    const uint32_t offs[] = {0, 8, 16, 24}, sizes[] = {4, 8, 8, 4};
    size_t len, sz;
    int kind;
    uint8_t *elf = synth_elf("kern", offs, sizes, 4, &len);
    CHECK(gp_image_size_n(elf, len, &sz, &kind) == 0 && kind == GP_IMAGE_ELF && sz == len,
          "synthetic ELF: kind %d size %zu of %zu", kind, sz, len);
    CHECK(gp_image_size(elf, &sz, &kind) == 0 && sz == len, "synthetic ELF unbounded");
    expect_layout(elf, len, "kern", 4, offs, sizes, "synthetic ELF");
    uint32_t o[4], s[4];
    CHECK(gp_image_param_info(elf, len, "ker", o, s, 4) == -1, "a prefix of the name matched");
    CHECK(gp_image_param_info(elf, len, "kern2", o, s, 4) == -1, "a longer name matched");
    CHECK(gp_image_param_info(elf, len, "kern", o, s, 3) == -1, "max not honoured");
    robustness(elf, len, "kern", "synthetic ELF");

    /* CUDA ELF ABI 7 cubins (cuBLASLt's) put the toolkit version in e_version (123, 124):
     * accepted like ABI 8's e_version 1. */
    uint8_t *abi7 = dup_exact(elf, len);
    abi7[7] = 0x33, abi7[8] = 7, abi7[0x14] = 123;
    CHECK(gp_image_size_n(abi7, len, &sz, &kind) == 0 && kind == GP_IMAGE_ELF && sz == len,
          "ABI 7 ELF with e_version 123: kind %d size %zu of %zu", kind, sz, len);
    expect_layout(abi7, len, "kern", 4, offs, sizes, "ABI 7 ELF");
    free(abi7);

    /* A kernel without parameters has a section and no KPARAM records: 0 parameters. */
    size_t len0;
    uint8_t *elf0 = synth_elf("noargs", NULL, NULL, 0, &len0);
    CHECK(gp_image_param_info(elf0, len0, "noargs", o, s, 4) == 0, "no-arg kernel");

    /* Fatbin: a compressed ELF entry (garbage payload) is skipped, the next ELF is used. */
    uint8_t junk[100];
    for (size_t i = 0; i < sizeof junk; i++)
        junk[i] = (uint8_t)rnd();
    const char ptx[] = ".version 8.0\n";
    entry es[] = {
        {1, 0x8011, (const uint8_t *)ptx, sizeof ptx},
        {2, 0x8011, junk, sizeof junk},
        {2, 0x2011, elf0, len0},
        {2, 0x0011, elf, len},
    };
    size_t flen;
    uint8_t *fat = synth_fatbin(es, 4, &flen);
    CHECK(gp_image_size_n(fat, flen, &sz, &kind) == 0 && kind == GP_IMAGE_FATBIN && sz == flen,
          "synthetic fatbin: kind %d size %zu of %zu", kind, sz, flen);
    expect_layout(fat, flen, "kern", 4, offs, sizes, "synthetic fatbin");
    CHECK(gp_image_param_info(fat, flen, "noargs", o, s, 4) == -1,
          "an LZ4-flagged entry was parsed");
    robustness(fat, flen, "kern", "synthetic fatbin");

    /* Only compressed ELF: nothing found. */
    entry only[] = {{2, 0x8011, elf, len}};
    size_t clen;
    uint8_t *cfat = synth_fatbin(only, 1, &clen);
    CHECK(gp_image_param_info(cfat, clen, "kern", o, s, 4) == -1, "a ZSTD entry was parsed");

    /* Wrapper. */
    wrapper w = {(int32_t)GP_FATBIN_WRAPPER_MAGIC, 1, fat, NULL};
    CHECK(gp_image_size(&w, &sz, &kind) == 0 && kind == GP_IMAGE_WRAPPER && sz == flen,
          "wrapper: kind %d size %zu", kind, sz);
    CHECK(gp_image_data(&w, kind) == fat, "wrapper data");
    expect_layout(&w, sizeof w, "kern", 4, offs, sizes, "wrapper");
    wrapper bad = {(int32_t)GP_FATBIN_WRAPPER_MAGIC, 1, junk, NULL};
    CHECK(gp_image_size(&bad, &sz, &kind) == -1, "wrapper to garbage accepted");
    wrapper nul = {(int32_t)GP_FATBIN_WRAPPER_MAGIC, 1, NULL, NULL};
    CHECK(gp_image_size(&nul, &sz, &kind) == -1, "wrapper to NULL accepted");

    /* Absurd sizes are refused from the header alone. */
    uint8_t hdr[16];
    put32(hdr, GP_FATBIN_MAGIC), put16(hdr + 4, 1), put16(hdr + 6, 16);
    put64(hdr + 8, (uint64_t)3 << 30);
    CHECK(gp_image_size(hdr, &sz, &kind) == -1, "3 GiB fatbin accepted");
    put64(hdr + 8, UINT64_MAX - 8);
    CHECK(gp_image_size(hdr, &sz, &kind) == -1, "overflowing fatbin accepted");
    put16(hdr + 6, 4), put64(hdr + 8, 0);
    CHECK(gp_image_size(hdr, &sz, &kind) == -1, "short fatbin header accepted");
    uint8_t *e2 = dup_exact(elf, len);
    put64(e2 + 0x28, (uint64_t)1 << 62);
    CHECK(gp_image_size(e2, &sz, &kind) == -1, "ELF with absurd shoff accepted");
    free(e2);

    /* Text. */
    const char *text = "//\n// Generated by NVIDIA NVVM Compiler\n.version 8.8\n.target sm_90\n";
    CHECK(gp_image_size(text, &sz, &kind) == 0 && kind == GP_IMAGE_TEXT && sz == strlen(text) + 1,
          "PTX: kind %d size %zu", kind, sz);
    CHECK(gp_image_param_info(text, sz, "k", o, s, 4) == -1, "param info from PTX");
    CHECK(gp_image_size("", &sz, &kind) == -1, "empty text accepted");
    const uint8_t bin[] = {0x12, 0x34, 0x01, 0x02, 0x00};
    CHECK(gp_image_size(bin, &sz, &kind) == -1, "binary garbage accepted");
    const char unterminated[4] = {'a', 'b', 'c', 'd'};
    CHECK(gp_image_size_n(unterminated, 4, &sz, &kind) == -1, "unterminated text accepted");
    CHECK(gp_image_size(NULL, &sz, &kind) == -1, "NULL accepted");

    /* Pure random garbage of every small length. */
    for (size_t n = 0; n < 300; n++) {
        for (int rep = 0; rep < 50; rep++) {
            uint8_t *t = malloc(n ? n : 1);
            if (!t)
                exit(2);
            for (size_t i = 0; i < n; i++)
                t[i] = (uint8_t)rnd();
            if (n >= 4 && rep % 3 == 0)
                memcpy(t,
                       "\x7f"
                       "ELF",
                       4);
            if (n >= 4 && rep % 3 == 1)
                put32(t, GP_FATBIN_MAGIC);
            if (gp_image_size_n(t, n, &sz, &kind) == 0)
                CHECK(sz <= n, "garbage size %zu", sz);
            (void)gp_image_param_info(t, n, "k", o, s, 4);
            free(t);
        }
    }
    free(cfat);
    free(fat);
    free(elf0);
    free(elf);
}

static void real_files(const char *cubin_path, const char *fatbin_path)
{
    size_t clen, flen, sz;
    int kind;
    uint8_t *cubin = read_file(cubin_path, &clen);
    uint8_t *fat = read_file(fatbin_path, &flen);
    const uint32_t k_offs[] = {0, 8, 16, 24}, k_sizes[] = {4, 8, 8, 4};
    const uint32_t b_offs[] = {0, 400}, b_sizes[] = {400, 8};

    CHECK(gp_image_size_n(cubin, clen, &sz, &kind) == 0 && kind == GP_IMAGE_ELF && sz == clen,
          "nvcc cubin: kind %d size %zu, file %zu", kind, sz, clen);
    CHECK(gp_image_size(cubin, &sz, &kind) == 0 && sz == clen, "nvcc cubin unbounded");
    expect_layout(cubin, clen, "k", 4, k_offs, k_sizes, "nvcc cubin");
    expect_layout(cubin, clen, "kbig", 2, b_offs, b_sizes, "nvcc cubin");
    uint32_t o[8], s[8];
    CHECK(gp_image_param_info(cubin, clen, "nosuch", o, s, 8) == -1, "unknown kernel found");

    CHECK(gp_image_size_n(fat, flen, &sz, &kind) == 0 && kind == GP_IMAGE_FATBIN && sz == flen,
          "nvcc fatbin: kind %d size %zu, file %zu", kind, sz, flen);
    expect_layout(fat, flen, "k", 4, k_offs, k_sizes, "nvcc fatbin");
    expect_layout(fat, flen, "kbig", 2, b_offs, b_sizes, "nvcc fatbin");
    wrapper w = {(int32_t)GP_FATBIN_WRAPPER_MAGIC, 1, fat, NULL};
    CHECK(gp_image_size(&w, &sz, &kind) == 0 && kind == GP_IMAGE_WRAPPER && sz == flen,
          "wrapper of nvcc fatbin");
    expect_layout(&w, sizeof w, "kbig", 2, b_offs, b_sizes, "wrapper of nvcc fatbin");

    robustness(cubin, clen, "kbig", "nvcc cubin");
    robustness(fat, flen, "k", "nvcc fatbin");
    free(cubin);
    free(fat);
}

int main(int argc, char **argv)
{
    if (argc != 1 && argc != 3) {
        fprintf(stderr, "usage: %s [K.cubin K.fatbin]\n", argv[0]);
        return 2;
    }
    synthetic();
    if (argc == 3)
        real_files(argv[1], argv[2]);
    if (failures) {
        fprintf(stderr, "test_image: %d of %d checks failed\n", failures, checks);
        return 1;
    }
    printf("test_image: %d checks passed%s\n", checks, argc == 3 ? "" : " (synthetic only)");
    return 0;
}
