/*
 * test_compress.c: the LZ4 block codec of compressed copies (common/compress.c): round
 * trips of zeros, random and mixed data at the lengths where blocks begin and end, the adaptive
 * give-up, and the rejection of corrupt or oversized blocks. Needs liblz4.so.1 (exit 2 without).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gp_test.h"
#include "compress.h"

#define B GP_LZ4_BLOCK

static uint64_t seed = 0x9e3779b97f4a7c15ull;
static uint8_t rnd(void)
{
    seed ^= seed << 13;
    seed ^= seed >> 7;
    seed ^= seed << 17;
    return (uint8_t)(seed >> 24);
}

static void wr32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

/* Encode and decode n bytes of src; the wire size. */
static size_t round_trip(const uint8_t *src, size_t n)
{
    uint8_t *wire = malloc(gp_cz_bound(n) ? gp_cz_bound(n) : 1);
    uint8_t *back = malloc(n ? n : 1);
    CHECK(wire && back);
    if (!wire || !back)
        return 0;
    gp_cz_enc st = {0};
    size_t len = gp_cz_encode(&st, src, n, wire);
    CHECK(len <= gp_cz_bound(n));
    const char *why = NULL;
    memset(back, 0xa5, n);
    CHECK_EQ(gp_cz_decode(wire, len, back, n, &why), 0);
    if (why)
        fprintf(stderr, "decode: %s\n", why);
    CHECK(n == 0 || memcmp(back, src, n) == 0);
    free(wire);
    free(back);
    return len;
}

/* A decode of wire (len bytes) for n raw bytes must fail. */
static void rejects(const uint8_t *wire, size_t len, size_t n, const char *words)
{
    uint8_t *back = malloc(n ? n : 1);
    const char *why = NULL;
    CHECK_EQ(gp_cz_decode(wire, len, back, n, &why), -1);
    CHECK(why && strstr(why, words));
    if (why && !strstr(why, words))
        fprintf(stderr, "unexpected reason: %s\n", why);
    free(back);
}

int main(void)
{
    if (!gp_lz4_available()) {
        fprintf(stderr, "test_compress: liblz4.so.1 not loadable: %s\n", gp_lz4_why());
        return 2;
    }
    size_t big = 3 * (size_t)B + 12345;
    uint8_t *zeros = calloc(1, big), *random = malloc(big), *mixed = malloc(big);
    CHECK(zeros && random && mixed);
    if (!zeros || !random || !mixed)
        return gp_test_done("test_compress");
    for (size_t i = 0; i < big; i++)
        random[i] = rnd();
    /* mixed: one random block, one of zeros, one of text-like repeats, then random again */
    memcpy(mixed, random, big);
    memset(mixed + B, 0, B);
    for (size_t i = 2 * (size_t)B; i < 3 * (size_t)B; i++)
        mixed[i] = "gpupool "[i % 8];

    const size_t lens[] = {0, 1, 7, 8, 100, GP_LZ4_MIN_COPY, B - 1, B, B + 1, 2 * (size_t)B, big};
    for (size_t k = 0; k < sizeof lens / sizeof lens[0]; k++) {
        size_t n = lens[k];
        size_t blocks = (n + B - 1) / B;
        size_t z = round_trip(zeros, n);
        size_t r = round_trip(random, n);
        round_trip(mixed, n);
        CHECK_EQ(r, n + GP_CZ_HDR * blocks); /* random data is stored raw */
        if (n >= 4096)
            CHECK(z < n / 50); /* zeros shrink a lot */
    }

    /* Adaptive: after GP_CZ_GIVE_UP raw blocks the encoder stops trying, even on zeros. */
    {
        size_t n = (GP_CZ_GIVE_UP + 2) * (size_t)B;
        uint8_t *src = calloc(1, n), *wire = malloc(gp_cz_bound(n)), *back = malloc(n);
        CHECK(src && wire && back);
        if (src && wire && back) {
            for (size_t i = 0; i < GP_CZ_GIVE_UP * (size_t)B; i++)
                src[i] = rnd();
            gp_cz_enc st = {0};
            size_t len = gp_cz_encode(&st, src, n, wire);
            CHECK_EQ(len, gp_cz_bound(n));
            CHECK(st.raw_run >= GP_CZ_GIVE_UP);
            const char *why = NULL;
            CHECK_EQ(gp_cz_decode(wire, len, back, n, &why), 0);
            CHECK(memcmp(back, src, n) == 0);
            /* a fresh copy tries again */
            gp_cz_enc st2 = {0};
            CHECK(gp_cz_encode(&st2, src + GP_CZ_GIVE_UP * (size_t)B, B, wire) < B / 50);
        }
        free(src);
        free(wire);
        free(back);
    }

    /* Corrupt and oversized blocks. */
    {
        size_t n = 2 * (size_t)B;
        uint8_t *wire = malloc(gp_cz_bound(n) + 64);
        CHECK(wire != NULL);
        if (wire) {
            gp_cz_enc st = {0};
            size_t len = gp_cz_encode(&st, zeros, n, wire); /* two LZ4 blocks */
            uint8_t *bad = malloc(len + 64);
            CHECK(bad != NULL);
            if (bad) {
                memcpy(bad, wire, len);
                wr32(bad, B + 1); /* raw above the block size */
                rejects(bad, len, n, "raw length");
                memcpy(bad, wire, len);
                wr32(bad, 0); /* raw 0 */
                rejects(bad, len, n, "raw length");
                rejects(wire, len, B - 1, "beyond the copy");  /* a block past the copy's end */
                rejects(wire, len, B, "after the last block"); /* a block more than the copy */
                memcpy(bad, wire, len);
                wr32(bad + 4, B + 1); /* stored above raw */
                rejects(bad, len, n, "stored length");
                memcpy(bad, wire, len);
                wr32(bad + 4, 0);
                rejects(bad, len, n, "stored length");
                rejects(wire, len - 1, n, "ends inside"); /* truncated */
                rejects(wire, 4, n, "ends inside a block header");
                memcpy(bad, wire, len);
                bad[len] = 0;
                rejects(bad, len + 1, n, "after the last block");
                /* LZ4 data that does not decompress to raw_len: shorter raw length claimed */
                memcpy(bad, wire, len);
                wr32(bad, B - 4096);
                rejects(bad, len, n, "does not decompress");
                /* garbage LZ4 bytes (a match offset before the start) */
                memcpy(bad, wire, len);
                for (size_t i = GP_CZ_HDR; i < GP_CZ_HDR + 64; i++)
                    bad[i] = 0xff;
                rejects(bad, len, n, "does not decompress");
                free(bad);
            }
            free(wire);
        }
    }
    free(zeros);
    free(random);
    free(mixed);
    return gp_test_done("test_compress");
}
