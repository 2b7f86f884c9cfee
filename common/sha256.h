/*
 * sha256.h: SHA-256 (FIPS 180-4), dependency-free.
 *
 * Used for module content hashes by the shim (the name under which the worker caches an image)
 * and by the worker, which links this file too.
 */
#ifndef GP_SHA256_H
#define GP_SHA256_H

#include <stddef.h>
#include <stdint.h>

#define GP_SHA256_BLOCK_SIZE 64
#define GP_SHA256_DIGEST_SIZE 32

typedef struct gp_sha256_ctx {
    uint32_t h[8];
    uint64_t total_len;                /* bytes hashed so far */
    uint8_t buf[GP_SHA256_BLOCK_SIZE]; /* a partial block not yet processed */
    size_t buf_len;
} gp_sha256_ctx;

void gp_sha256_init(gp_sha256_ctx *ctx);
void gp_sha256_update(gp_sha256_ctx *ctx, const void *data, size_t len);
/* Writes the digest; the context must be re-initialised to reuse. */
void gp_sha256_final(gp_sha256_ctx *ctx, uint8_t out[GP_SHA256_DIGEST_SIZE]);
/* One-shot digest of `len` bytes. */
void gp_sha256(const void *data, size_t len, uint8_t out[GP_SHA256_DIGEST_SIZE]);
/* Lower-case hex of a digest into `hex` (65 bytes with the terminating NUL). */
void gp_sha256_hex(const uint8_t digest[GP_SHA256_DIGEST_SIZE],
                   char hex[2 * GP_SHA256_DIGEST_SIZE + 1]);

#endif /* GP_SHA256_H */
