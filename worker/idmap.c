/*
 * idmap.c: see idmap.h. Deletion shifts later entries of the same probe run back (no
 * tombstones), so lookups never degrade as ids are created and destroyed over a long session.
 */
#include "idmap.h"

#include <stdlib.h>

/* Client ids are tagged counters (0x6750... | kind << 40 | n): the low bits vary, the high bits
 * do not, so mix them all before masking. */
static size_t slot_of(uint64_t key, size_t cap)
{
    key ^= key >> 33;
    key *= 0xff51afd7ed558ccdull;
    key ^= key >> 33;
    key *= 0xc4ceb9fe1a85ec53ull;
    key ^= key >> 33;
    return (size_t)key & (cap - 1);
}

static size_t find(const struct idmap *m, uint64_t key)
{
    size_t i = slot_of(key, m->cap);
    while (m->slots[i].key != 0 && m->slots[i].key != key)
        i = (i + 1) & (m->cap - 1);
    return i;
}

void *wk_idmap_get(const struct idmap *m, uint64_t key)
{
    if (key == 0 || m->cap == 0)
        return NULL;
    size_t i = find(m, key);
    return m->slots[i].key == key ? m->slots[i].val : NULL;
}

static int grow(struct idmap *m)
{
    size_t ncap = m->cap ? m->cap * 2 : 16;
    struct idmap_slot *ns = calloc(ncap, sizeof *ns);
    if (!ns)
        return -1;
    struct idmap old = *m;
    m->slots = ns;
    m->cap = ncap;
    for (size_t i = 0; i < old.cap; i++) {
        if (old.slots[i].key != 0)
            m->slots[find(m, old.slots[i].key)] = old.slots[i];
    }
    free(old.slots);
    return 0;
}

int wk_idmap_put(struct idmap *m, uint64_t key, void *val)
{
    if (key == 0)
        return -1;
    /* Keep the load factor at most 1/2: probe runs stay short. */
    if ((m->count + 1) * 2 > m->cap && grow(m) != 0)
        return -2;
    size_t i = find(m, key);
    if (m->slots[i].key == key)
        return -1;
    m->slots[i].key = key;
    m->slots[i].val = val;
    m->count++;
    return 0;
}

void *wk_idmap_del(struct idmap *m, uint64_t key)
{
    if (key == 0 || m->cap == 0)
        return NULL;
    size_t mask = m->cap - 1;
    size_t i = find(m, key);
    if (m->slots[i].key != key)
        return NULL;
    void *val = m->slots[i].val;
    /* Backward-shift: move each following entry of the run into the hole when its home slot
     * does not lie cyclically in (hole, j]. */
    size_t hole = i, j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (m->slots[j].key == 0)
            break;
        size_t home = slot_of(m->slots[j].key, m->cap);
        int home_after_hole = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
        if (!home_after_hole) {
            m->slots[hole] = m->slots[j];
            hole = j;
        }
    }
    m->slots[hole].key = 0;
    m->slots[hole].val = NULL;
    m->count--;
    return val;
}

int wk_idmap_next(const struct idmap *m, size_t *pos, uint64_t *key, void **val)
{
    while (*pos < m->cap) {
        size_t i = (*pos)++;
        if (m->slots[i].key != 0) {
            *key = m->slots[i].key;
            *val = m->slots[i].val;
            return 1;
        }
    }
    return 0;
}

void wk_idmap_clear(struct idmap *m)
{
    free(m->slots);
    m->slots = NULL;
    m->cap = 0;
    m->count = 0;
}
