/*
 * compress.h: the LZ4 block format of compressed copies (docs/protocol.md, "Compressed copies"),
 * shared by the client shim and the worker (both link compress.c).
 *
 * With LZ4 negotiated in the hello, the bulk of a copy of at least GP_LZ4_MIN_COPY bytes is a
 * sequence of blocks: u32 raw_len, u32 stored_len (little-endian), then stored_len bytes.
 * stored_len == raw_len: the bytes are stored raw; otherwise they are LZ4 data that decompresses
 * to exactly raw_len bytes. raw_len is GP_LZ4_BLOCK for every block but the last of a copy.
 *
 * liblz4.so.1 is loaded at run time (no build dependency); GPUPOOL_LZ4_LIBRARY names another file.
 */
#ifndef GP_COMPRESS_H
#define GP_COMPRESS_H

#include <stddef.h>
#include <stdint.h>

#include "gp_protocol.h"

#define GP_CZ_HDR 8u
/* After this many blocks in a row stored raw, the rest of the copy is stored raw untried. */
#define GP_CZ_GIVE_UP 4

/* 1 when liblz4 could be loaded (loaded once, thread-safely), else 0. */
int gp_lz4_available(void);
/* Why it could not be loaded ("" when it could). */
const char *gp_lz4_why(void);

/* Whether a copy of n bytes is sent as blocks when compression is on. */
static inline int gp_cz_applies(uint64_t n)
{
    return n >= GP_LZ4_MIN_COPY;
}
/* Wire bytes of n raw bytes at most (every block stored raw). */
static inline uint64_t gp_cz_bound(uint64_t n)
{
    return n + GP_CZ_HDR * ((n + GP_LZ4_BLOCK - 1) / GP_LZ4_BLOCK);
}

typedef struct gp_cz_enc {
    int raw_run; /* blocks stored raw in a row; GP_CZ_GIVE_UP or more: stop trying */
} gp_cz_enc;

/* Encode n raw bytes (any length) as blocks into out, whose capacity is gp_cz_bound(n); the
 * bytes written. Blocks start at src: callers pass pieces that are whole blocks but the last. */
size_t gp_cz_encode(gp_cz_enc *st, const void *src, size_t n, uint8_t *out);

/* Read a block header; checks raw_len against the block size and `remaining` raw bytes of the
 * copy, stored_len against raw_len. 0, or -1 with *why. */
int gp_cz_header(const uint8_t hdr[GP_CZ_HDR], uint64_t remaining, uint32_t *raw, uint32_t *stored,
                 const char **why);
/* Decompress one block's stored bytes (stored < raw) into dst (raw bytes). 0, or -1 with *why. */
int gp_cz_inflate(const uint8_t *src, uint32_t stored, void *dst, uint32_t raw, const char **why);
/* Decode a whole block stream of in_len bytes into dst (n raw bytes). 0, or -1 with *why. */
int gp_cz_decode(const uint8_t *in, size_t in_len, void *dst, size_t n, const char **why);

#endif
