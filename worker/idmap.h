/*
 * idmap.h: u64 id -> pointer map (open addressing, linear probing).
 *
 * The client names streams, events, contexts, modules and functions itself (docs/architecture.md,
 * "Handles chosen on the client"); every frame that uses one costs a lookup here, so the map is
 * a flat array with no allocation on the lookup path. Key 0 is never stored (it marks an empty
 * slot, and no client id is 0).
 */
#ifndef GP_WORKER_IDMAP_H
#define GP_WORKER_IDMAP_H

#include <stddef.h>
#include <stdint.h>

struct idmap_slot {
    uint64_t key; /* 0: empty */
    void *val;
};

struct idmap {
    struct idmap_slot *slots;
    size_t cap; /* power of two, or 0 before the first insert */
    size_t count;
};

/* The value stored under key, or NULL. */
void *wk_idmap_get(const struct idmap *m, uint64_t key);
/* 0 on success; -1 if key is 0 or already present; -2 if out of memory. */
int wk_idmap_put(struct idmap *m, uint64_t key, void *val);
/* Removes key; returns its value, or NULL if absent. */
void *wk_idmap_del(struct idmap *m, uint64_t key);
/* Iteration: start with *pos = 0; returns 1 and the next entry, or 0 at the end. The map must not
 * change during an iteration (collect keys first, then delete). */
int wk_idmap_next(const struct idmap *m, size_t *pos, uint64_t *key, void **val);
/* Frees the slot array (not the values). */
void wk_idmap_clear(struct idmap *m);

#endif /* GP_WORKER_IDMAP_H */
