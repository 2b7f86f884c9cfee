/*
 * sha256.c: SHA-256 as specified in FIPS 180-4 (sections 4.1.2, 4.2.2, 5.1.1, 5.3.3, 6.2).
 */
#include "sha256.h"

#include <string.h>

/* Section 4.2.2: the first 32 bits of the fractional parts of the cube roots of the first 64
 * primes. */
static const uint32_t K[64] = {
    0x428a2f98u, 0x71374491u, 0xb5c0fbcfu, 0xe9b5dba5u, 0x3956c25bu, 0x59f111f1u, 0x923f82a4u,
    0xab1c5ed5u, 0xd807aa98u, 0x12835b01u, 0x243185beu, 0x550c7dc3u, 0x72be5d74u, 0x80deb1feu,
    0x9bdc06a7u, 0xc19bf174u, 0xe49b69c1u, 0xefbe4786u, 0x0fc19dc6u, 0x240ca1ccu, 0x2de92c6fu,
    0x4a7484aau, 0x5cb0a9dcu, 0x76f988dau, 0x983e5152u, 0xa831c66du, 0xb00327c8u, 0xbf597fc7u,
    0xc6e00bf3u, 0xd5a79147u, 0x06ca6351u, 0x14292967u, 0x27b70a85u, 0x2e1b2138u, 0x4d2c6dfcu,
    0x53380d13u, 0x650a7354u, 0x766a0abbu, 0x81c2c92eu, 0x92722c85u, 0xa2bfe8a1u, 0xa81a664bu,
    0xc24b8b70u, 0xc76c51a3u, 0xd192e819u, 0xd6990624u, 0xf40e3585u, 0x106aa070u, 0x19a4c116u,
    0x1e376c08u, 0x2748774cu, 0x34b0bcb5u, 0x391c0cb3u, 0x4ed8aa4au, 0x5b9cca4fu, 0x682e6ff3u,
    0x748f82eeu, 0x78a5636fu, 0x84c87814u, 0x8cc70208u, 0x90befffau, 0xa4506cebu, 0xbef9a3f7u,
    0xc67178f2u,
};

static inline uint32_t rotr(uint32_t x, unsigned n)
{
    return (x >> n) | (x << (32u - n));
}

static inline uint32_t load_be32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

static inline void store_be32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

/* Section 6.2.2: one 512-bit block. */
static void compress(uint32_t h[8], const uint8_t block[GP_SHA256_BLOCK_SIZE])
{
    uint32_t w[64];
    for (int t = 0; t < 16; t++)
        w[t] = load_be32(block + 4 * t);
    for (int t = 16; t < 64; t++) {
        uint32_t s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
        uint32_t s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
        w[t] = w[t - 16] + s0 + w[t - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
    for (int t = 0; t < 64; t++) {
        uint32_t big_s1 = rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25);
        uint32_t ch = (e & f) ^ (~e & g);
        uint32_t t1 = hh + big_s1 + ch + K[t] + w[t];
        uint32_t big_s0 = rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22);
        uint32_t maj = (a & b) ^ (a & c) ^ (b & c);
        uint32_t t2 = big_s0 + maj;
        hh = g;
        g = f;
        f = e;
        e = d + t1;
        d = c;
        c = b;
        b = a;
        a = t1 + t2;
    }
    h[0] += a;
    h[1] += b;
    h[2] += c;
    h[3] += d;
    h[4] += e;
    h[5] += f;
    h[6] += g;
    h[7] += hh;
}

void gp_sha256_init(gp_sha256_ctx *ctx)
{
    /* Section 5.3.3: the first 32 bits of the fractional parts of the square roots of the first
     * eight primes. */
    static const uint32_t H0[8] = {0x6a09e667u, 0xbb67ae85u, 0x3c6ef372u, 0xa54ff53au,
                                   0x510e527fu, 0x9b05688cu, 0x1f83d9abu, 0x5be0cd19u};
    memcpy(ctx->h, H0, sizeof H0);
    ctx->total_len = 0;
    ctx->buf_len = 0;
}

void gp_sha256_update(gp_sha256_ctx *ctx, const void *data, size_t len)
{
    if (len == 0)
        return; /* data may be NULL then, and memcpy must not see a NULL pointer */
    const uint8_t *p = data;
    ctx->total_len += len;
    if (ctx->buf_len > 0) {
        size_t take = GP_SHA256_BLOCK_SIZE - ctx->buf_len;
        if (take > len)
            take = len;
        memcpy(ctx->buf + ctx->buf_len, p, take);
        ctx->buf_len += take;
        p += take;
        len -= take;
        if (ctx->buf_len < GP_SHA256_BLOCK_SIZE)
            return;
        compress(ctx->h, ctx->buf);
        ctx->buf_len = 0;
    }
    while (len >= GP_SHA256_BLOCK_SIZE) {
        compress(ctx->h, p);
        p += GP_SHA256_BLOCK_SIZE;
        len -= GP_SHA256_BLOCK_SIZE;
    }
    if (len > 0) {
        memcpy(ctx->buf, p, len);
        ctx->buf_len = len;
    }
}

void gp_sha256_final(gp_sha256_ctx *ctx, uint8_t out[GP_SHA256_DIGEST_SIZE])
{
    /* Section 5.1.1: a 1 bit, zeros to 56 mod 64 bytes, then the length in bits, big-endian. */
    uint64_t bits = ctx->total_len * 8u;
    ctx->buf[ctx->buf_len++] = 0x80u;
    if (ctx->buf_len > GP_SHA256_BLOCK_SIZE - 8) {
        memset(ctx->buf + ctx->buf_len, 0, GP_SHA256_BLOCK_SIZE - ctx->buf_len);
        compress(ctx->h, ctx->buf);
        ctx->buf_len = 0;
    }
    memset(ctx->buf + ctx->buf_len, 0, GP_SHA256_BLOCK_SIZE - 8 - ctx->buf_len);
    store_be32(ctx->buf + 56, (uint32_t)(bits >> 32));
    store_be32(ctx->buf + 60, (uint32_t)bits);
    compress(ctx->h, ctx->buf);
    for (int i = 0; i < 8; i++)
        store_be32(out + 4 * i, ctx->h[i]);
    memset(ctx, 0, sizeof *ctx);
}

void gp_sha256(const void *data, size_t len, uint8_t out[GP_SHA256_DIGEST_SIZE])
{
    gp_sha256_ctx ctx;
    gp_sha256_init(&ctx);
    gp_sha256_update(&ctx, data, len);
    gp_sha256_final(&ctx, out);
}

void gp_sha256_hex(const uint8_t digest[GP_SHA256_DIGEST_SIZE],
                   char hex[2 * GP_SHA256_DIGEST_SIZE + 1])
{
    static const char digits[] = "0123456789abcdef";
    for (int i = 0; i < GP_SHA256_DIGEST_SIZE; i++) {
        hex[2 * i] = digits[digest[i] >> 4];
        hex[2 * i + 1] = digits[digest[i] & 0xF];
    }
    hex[2 * GP_SHA256_DIGEST_SIZE] = '\0';
}
