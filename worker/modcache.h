/*
 * modcache.h: module images by SHA-256, in memory (this session) and on disk
 * (<cache-dir>/modules/<namespace>/<hex sha256>, kept across sessions), so that an image crosses
 * the network at most once per server and token (docs/architecture.md, "Module images").
 *
 * The namespace is derived from the session's token: a token finds only the images it uploaded
 * itself, so no tenant can load another's image by its hash or learn that it was ever loaded.
 * The disk cache is bounded per namespace and in total (modcache.c, "Eviction").
 */
#ifndef GP_WORKER_MODCACHE_H
#define GP_WORKER_MODCACHE_H

#include <stddef.h>
#include <stdint.h>

struct mc_entry {
    uint8_t sha[32];
    uint8_t *data; /* len bytes + a NUL (a PTX image must be a C string) */
    size_t len;
    struct mc_entry *next;
};

/* Bounds of the caches; wk_modcache_init sets the defaults (modcache.c). */
struct mc_limits {
    uint64_t token_bytes, token_files; /* one namespace on disk */
    uint64_t total_bytes, total_files; /* the whole disk cache, all namespaces */
    uint64_t memory_bytes;             /* this session's memory cache */
};

struct modcache {
    struct mc_entry *head; /* most recently used first */
    size_t mem_bytes;      /* image bytes held in memory */
    char *root;            /* <cache-dir>/modules, or NULL when the disk cache is unusable */
    char *dir;             /* <root>/<namespace>, or NULL when the disk cache is unusable */
    char ns[17];           /* the namespace: 16 hex digits */
    unsigned tmp_seq;      /* makes temporary file names unique within this process */
    int scanned;           /* this session has run the eviction scan once */
    uint64_t unscanned_files, unscanned_bytes; /* written since the last scan */
    struct mc_limits lim;
};

/* The namespace of a token: the first 16 hex digits of SHA-256("gpupool module cache\0" ||
 * token). The token itself is never written anywhere. */
void wk_modcache_namespace(const char *token, size_t token_len, char out[17]);
/* Creates <cache_dir>/modules/<namespace of token> if needed; without it, only the memory cache
 * works. 0 or -1 (out of memory). */
int wk_modcache_init(struct modcache *c, const char *cache_dir, const char *token,
                     size_t token_len);
/* The image with this hash: from memory, else from this namespace on disk (verified;
 * expected_size 0 = any). NULL on a miss. */
const struct mc_entry *wk_modcache_get(struct modcache *c, const uint8_t sha[32],
                                       uint64_t expected_size);
/* Keeps `data` (malloc'ed, len + 1 bytes, NUL-terminated; ownership passes to the cache, which
 * frees it on failure) under sha, and writes it to disk unless it is there already (then evicts
 * what is over the limits). NULL if out of memory. The caller has verified the hash. */
const struct mc_entry *wk_modcache_put(struct modcache *c, const uint8_t sha[32], uint8_t *data,
                                       size_t len);
void wk_modcache_free(struct modcache *c);

#endif /* GP_WORKER_MODCACHE_H */
