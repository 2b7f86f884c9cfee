/*
 * md2.h: the MD2 message digest (RFC 1319), written from the RFC.
 *
 * MD2 is long broken as a cryptographic hash; we need it only because cudart's integrity
 * check (export table INTEGRITY_CHECK) is an HMAC over MD2 and must be answered exactly.
 */
#ifndef GP_MD2_H
#define GP_MD2_H

#include <stddef.h>
#include <stdint.h>

#define GP_MD2_BLOCK_SIZE 16
#define GP_MD2_DIGEST_SIZE 16

typedef struct gp_md2_ctx {
    uint8_t state[48];              /* X in the RFC: 16 bytes of digest + 32 of work space */
    uint8_t checksum[16];           /* C in the RFC, updated block by block */
    uint8_t last;                   /* L in the RFC: last checksum byte written */
    uint8_t buf[GP_MD2_BLOCK_SIZE]; /* a partial block not yet processed */
    size_t buf_len;
} gp_md2_ctx;

void gp_md2_init(gp_md2_ctx *ctx);
void gp_md2_update(gp_md2_ctx *ctx, const void *data, size_t len);
/* Pads, appends the checksum and writes the digest. The context must be re-initialised to reuse. */
void gp_md2_final(gp_md2_ctx *ctx, uint8_t out[GP_MD2_DIGEST_SIZE]);
/* One-shot digest of `len` bytes. */
void gp_md2(const void *data, size_t len, uint8_t out[GP_MD2_DIGEST_SIZE]);

#endif /* GP_MD2_H */
