/*
 * modcache.h: module images by SHA-256, in memory (this session) and on disk (shared by all the
 * workers of a server, <cache-dir>/modules/<hex sha256>), so that an image crosses the network
 * at most once per server (docs/architecture.md, "Module images").
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

struct modcache {
    struct mc_entry *head;
    char *dir;        /* <cache-dir>/modules, or NULL when the disk cache is unusable */
    unsigned tmp_seq; /* makes temporary file names unique within this process */
};

/* Creates <cache_dir>/modules if needed; without it, only the memory cache works. 0 or -1 (out
 * of memory). */
int wk_modcache_init(struct modcache *c, const char *cache_dir);
/* The image with this hash: from memory, else from disk (verified; expected_size 0 = any).
 * NULL on a miss. */
const struct mc_entry *wk_modcache_get(struct modcache *c, const uint8_t sha[32],
                                       uint64_t expected_size);
/* Keeps `data` (malloc'ed, len + 1 bytes, NUL-terminated; ownership passes to the cache, which
 * frees it on failure) under sha, and writes it to disk unless it is there already. NULL if out
 * of memory. The caller has verified the hash. */
const struct mc_entry *wk_modcache_put(struct modcache *c, const uint8_t sha[32], uint8_t *data,
                                       size_t len);
void wk_modcache_free(struct modcache *c);

#endif /* GP_WORKER_MODCACHE_H */
