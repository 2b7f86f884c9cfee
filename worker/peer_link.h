/*
 * peer_link.h: the records of a server-to-server link between two workers of a spread lease
 * (issue 37, item 3; docs/protocol.md, "Server-to-server links"): each record is
 * `u32 len` (little-endian, the ciphertext's length), the ciphertext, a 16-byte GCM tag;
 * AES-256-GCM under the link's key, nonce = 4 zero bytes + the u64 little-endian record counter,
 * AAD = the 4 bytes of len. Only one end of a link encrypts (the sender), so no nonce repeats.
 * Includes nothing of the worker: h_peer.c uses it.
 */
#ifndef GP_WORKER_PEER_LINK_H
#define GP_WORKER_PEER_LINK_H

#include <stddef.h>
#include <stdint.h>

#define WK_PEER_DATA_MAX ((size_t)1 << 20)                 /* bytes of memory per DATA record */
#define WK_PEER_RECORD_MAX (WK_PEER_DATA_MAX + 64)         /* the longest ciphertext (len) */
#define WK_PEER_TAG 16                                     /* GCM tag */
#define WK_PEER_BUF (4 + WK_PEER_RECORD_MAX + WK_PEER_TAG) /* one whole record */
#define WK_PEER_KEY 32

/* Record kinds (the plaintext's first byte). */
enum wk_peer_kind {
    WK_PEER_HELLO = 1, /* u64 link_id: the link's first record */
    WK_PEER_COPY = 2,  /* u64 copy_id, u64 size: DATA records with size bytes follow */
    WK_PEER_DATA = 3,  /* the next bytes of the copy */
    WK_PEER_ABORT = 4, /* i32 code: the sender failed mid-copy; both ends close the link */
};

/* One end of a link: its socket (non-blocking) and its cipher (the key lives only there). */
struct wk_peer_end {
    int fd;
    int sealing;    /* 1: this end encrypts (the sender), 0: it decrypts */
    uint64_t count; /* the next record's nonce counter */
    struct evp_cipher_ctx_st *cipher;
};

/* Sets up an end on fd (made non-blocking; a TCP socket gets TCP_USER_TIMEOUT timeout_ms) with
 * the key. 0, or -1 with err (fd closed). The caller clears its copy of the key. */
int wk_peer_end_open(struct wk_peer_end *e, int fd, int sealing, const uint8_t key[WK_PEER_KEY],
                     int timeout_ms, char *err, size_t errlen);
/* Closes the socket and frees the cipher (OpenSSL clears the key schedule). Idempotent. */
void wk_peer_end_close(struct wk_peer_end *e);
/* Seals one record (kind, then hn bytes of head, then dn bytes of data; 1 + hn + dn at most
 * WK_PEER_RECORD_MAX) into rec (WK_PEER_BUF bytes) and writes it whole within timeout_ms (one
 * deadline for the whole record). 0, or -1 with err. */
int wk_peer_write(struct wk_peer_end *e, uint8_t kind, const void *head, size_t hn,
                  const void *data, size_t dn, uint8_t *rec, int timeout_ms, char *err,
                  size_t errlen);
/* Reads one record into rec (WK_PEER_BUF bytes), the whole of it within timeout_ms (one
 * deadline from the call: a peer that dribbles bytes fails as a silent one), and opens it in
 * place: its plaintext at *plain (kind first), *n bytes. 0, or -1
 * with err (the other end closed or went silent, a record too long, or one that does not
 * decrypt: a wrong key or altered data). */
int wk_peer_read(struct wk_peer_end *e, uint8_t *rec, int timeout_ms, uint8_t **plain, size_t *n,
                 char *err, size_t errlen);

static inline void wk_peer_put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static inline uint64_t wk_peer_get64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

#endif /* GP_WORKER_PEER_LINK_H */
