/*
 * hmac_md2.h: HMAC (RFC 2104) over MD2 (RFC 1319), for cudart's integrity check.
 */
#ifndef GP_HMAC_MD2_H
#define GP_HMAC_MD2_H

#include <stddef.h>
#include <stdint.h>

#include "md2.h"

/* HMAC-MD2(key, msg): B = 16 (MD2's block size), L = 16. A key longer than B is hashed first. */
void gp_hmac_md2(const void *key, size_t key_len, const void *msg, size_t msg_len,
                 uint8_t out[GP_MD2_DIGEST_SIZE]);

#endif /* GP_HMAC_MD2_H */
