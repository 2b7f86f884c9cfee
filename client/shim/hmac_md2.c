/*
 * hmac_md2.c: HMAC (RFC 2104, section 2) with MD2 as the hash, written from the RFC:
 *   H(K XOR opad, H(K XOR ipad, text)), K zero-padded to the hash's block size B.
 */
#include "hmac_md2.h"

#include <string.h>

#define IPAD 0x36u
#define OPAD 0x5Cu

void gp_hmac_md2(const void *key, size_t key_len, const void *msg, size_t msg_len,
                 uint8_t out[GP_MD2_DIGEST_SIZE])
{
    uint8_t k0[GP_MD2_BLOCK_SIZE] = {0};
    if (key_len > GP_MD2_BLOCK_SIZE) {
        /* RFC 2104: keys longer than B are first hashed (MD2's digest is exactly B long). */
        gp_md2(key, key_len, k0);
    } else if (key_len > 0) {
        memcpy(k0, key, key_len);
    }

    uint8_t pad[GP_MD2_BLOCK_SIZE];
    uint8_t inner[GP_MD2_DIGEST_SIZE];
    gp_md2_ctx ctx;

    for (size_t i = 0; i < sizeof pad; i++)
        pad[i] = (uint8_t)(k0[i] ^ IPAD);
    gp_md2_init(&ctx);
    gp_md2_update(&ctx, pad, sizeof pad);
    gp_md2_update(&ctx, msg, msg_len);
    gp_md2_final(&ctx, inner);

    for (size_t i = 0; i < sizeof pad; i++)
        pad[i] = (uint8_t)(k0[i] ^ OPAD);
    gp_md2_init(&ctx);
    gp_md2_update(&ctx, pad, sizeof pad);
    gp_md2_update(&ctx, inner, sizeof inner);
    gp_md2_final(&ctx, out);
}
