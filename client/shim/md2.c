/*
 * md2.c: MD2 (RFC 1319), written from the RFC's description (sections 3.1 to 3.5).
 */
#include "md2.h"

#include <string.h>

/* RFC 1319's substitution table, a permutation of 0..255 built from the digits of pi (a
 * constant of the algorithm). The unit test checks it is a permutation and the RFC vectors. */
static const uint8_t PI_SUBST[256] = {
    41,  46,  67,  201, 162, 216, 124, 1,   61,  54,  84,  161, 236, 240, 6,   19,  98,  167, 5,
    243, 192, 199, 115, 140, 152, 147, 43,  217, 188, 76,  130, 202, 30,  155, 87,  60,  253, 212,
    224, 22,  103, 66,  111, 24,  138, 23,  229, 18,  190, 78,  196, 214, 218, 158, 222, 73,  160,
    251, 245, 142, 187, 47,  238, 122, 169, 104, 121, 145, 21,  178, 7,   63,  148, 194, 16,  137,
    11,  34,  95,  33,  128, 127, 93,  154, 90,  144, 50,  39,  53,  62,  204, 231, 191, 247, 151,
    3,   255, 25,  48,  179, 72,  165, 181, 209, 215, 94,  146, 42,  172, 86,  170, 198, 79,  184,
    56,  210, 150, 164, 125, 182, 118, 252, 107, 226, 156, 116, 4,   241, 69,  157, 112, 89,  100,
    113, 135, 32,  134, 91,  207, 101, 230, 45,  168, 2,   27,  96,  37,  173, 174, 176, 185, 246,
    28,  70,  97,  105, 52,  64,  126, 15,  85,  71,  163, 35,  221, 81,  175, 58,  195, 92,  249,
    206, 186, 197, 234, 38,  44,  83,  13,  110, 133, 40,  132, 9,   211, 223, 205, 244, 65,  129,
    77,  82,  106, 220, 55,  200, 108, 193, 171, 250, 36,  225, 123, 8,   12,  189, 177, 74,  120,
    136, 149, 139, 227, 99,  232, 109, 233, 203, 213, 254, 59,  0,   29,  57,  242, 239, 183, 14,
    102, 88,  208, 228, 166, 119, 114, 248, 235, 117, 75,  10,  49,  68,  80,  180, 143, 237, 31,
    26,  219, 153, 141, 51,  159, 17,  131, 20,
};

/* Section 3.4: mix one 16-byte block into the 48-byte state with 18 rounds. */
static void compress(uint8_t x[48], const uint8_t block[16])
{
    for (int j = 0; j < 16; j++) {
        x[16 + j] = block[j];
        x[32 + j] = (uint8_t)(x[16 + j] ^ x[j]);
    }
    unsigned t = 0;
    for (unsigned round = 0; round < 18; round++) {
        for (int k = 0; k < 48; k++) {
            x[k] ^= PI_SUBST[t];
            t = x[k];
        }
        t = (t + round) & 0xFFu;
    }
}

/* Section 3.2 (with the RFC erratum: the checksum byte is XORed, not assigned). */
static void update_checksum(gp_md2_ctx *ctx, const uint8_t block[16])
{
    uint8_t l = ctx->last;
    for (int j = 0; j < 16; j++) {
        ctx->checksum[j] ^= PI_SUBST[block[j] ^ l];
        l = ctx->checksum[j];
    }
    ctx->last = l;
}

static void process_block(gp_md2_ctx *ctx, const uint8_t block[16])
{
    update_checksum(ctx, block);
    compress(ctx->state, block);
}

void gp_md2_init(gp_md2_ctx *ctx)
{
    memset(ctx, 0, sizeof *ctx);
}

void gp_md2_update(gp_md2_ctx *ctx, const void *data, size_t len)
{
    if (len == 0)
        return; /* data may be NULL then, and memcpy must not see a NULL pointer */
    const uint8_t *p = data;
    if (ctx->buf_len > 0) {
        size_t take = GP_MD2_BLOCK_SIZE - ctx->buf_len;
        if (take > len)
            take = len;
        memcpy(ctx->buf + ctx->buf_len, p, take);
        ctx->buf_len += take;
        p += take;
        len -= take;
        if (ctx->buf_len < GP_MD2_BLOCK_SIZE)
            return;
        process_block(ctx, ctx->buf);
        ctx->buf_len = 0;
    }
    while (len >= GP_MD2_BLOCK_SIZE) {
        process_block(ctx, p);
        p += GP_MD2_BLOCK_SIZE;
        len -= GP_MD2_BLOCK_SIZE;
    }
    if (len > 0) {
        memcpy(ctx->buf, p, len);
        ctx->buf_len = len;
    }
}

void gp_md2_final(gp_md2_ctx *ctx, uint8_t out[GP_MD2_DIGEST_SIZE])
{
    /* Section 3.1: pad with n bytes of value n (1..16), always at least one. */
    uint8_t pad = (uint8_t)(GP_MD2_BLOCK_SIZE - ctx->buf_len);
    memset(ctx->buf + ctx->buf_len, pad, pad);
    process_block(ctx, ctx->buf);
    /* Section 3.3: the checksum is the last block; it does not feed the checksum itself. */
    uint8_t checksum[16];
    memcpy(checksum, ctx->checksum, sizeof checksum);
    compress(ctx->state, checksum);
    memcpy(out, ctx->state, GP_MD2_DIGEST_SIZE);
    memset(ctx, 0, sizeof *ctx);
}

void gp_md2(const void *data, size_t len, uint8_t out[GP_MD2_DIGEST_SIZE])
{
    gp_md2_ctx ctx;
    gp_md2_init(&ctx);
    gp_md2_update(&ctx, data, len);
    gp_md2_final(&ctx, out);
}
