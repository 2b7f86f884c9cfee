/*
 * handles.c: handles the client chooses for streams, events, contexts, modules and functions.
 *
 * A handle is GP_HANDLE_TAG | kind << 40 | n, with n from one process-wide counter, and it is
 * also the object's id on the wire (docs/architecture.md): creating a stream or an event costs
 * no round trip. The map from handle to object is an open-addressing hash table (linear
 * probing, backward-shift deletion) under a read-write lock: lookups, by far the most common
 * operation (every launch and stream call), take the read side only.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "shim.h"

typedef struct slot {
    uint64_t h; /* 0 = empty */
    void *obj;
} slot;

static pthread_rwlock_t map_lock = PTHREAD_RWLOCK_INITIALIZER;
static slot *slots; /* guarded by map_lock */
static size_t cap;  /* power of two, or 0 */
static size_t count;
/* n starts above the fixed handles (the primary context is n = 1). */
static atomic_uint_fast64_t next_n = 16;

#define N_MASK ((1ull << 40) - 1)

static size_t hash(uint64_t h)
{
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return (size_t)h;
}

/* Index of h, or of the empty slot where it would go. Caller holds the lock; cap > 0. */
static size_t probe(uint64_t h)
{
    size_t mask = cap - 1, i = hash(h) & mask;
    while (slots[i].h != 0 && slots[i].h != h)
        i = (i + 1) & mask;
    return i;
}

/* Caller holds the write lock. */
static int grow(void)
{
    size_t ncap = cap ? cap * 2 : 64;
    slot *n = calloc(ncap, sizeof *n);
    if (!n)
        return -1;
    slot *old = slots;
    size_t ocap = cap;
    slots = n;
    cap = ncap;
    for (size_t i = 0; i < ocap; i++)
        if (old[i].h)
            slots[probe(old[i].h)] = old[i];
    free(old);
    return 0;
}

/* Caller holds the write lock. */
static void remove_at(size_t i)
{
    size_t mask = cap - 1;
    slots[i].h = 0;
    slots[i].obj = NULL;
    count--;
    for (size_t j = (i + 1) & mask; slots[j].h; j = (j + 1) & mask) {
        size_t home = hash(slots[j].h) & mask;
        int stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
        if (!stays) {
            slots[i] = slots[j];
            slots[j].h = 0;
            slots[j].obj = NULL;
            i = j;
        }
    }
}

static int insert_locked(uint64_t h, void *obj)
{
    if ((count + 1) * 2 > cap && grow() != 0)
        return -1;
    size_t i = probe(h);
    if (slots[i].h == h)
        return -1;
    slots[i].h = h;
    slots[i].obj = obj;
    count++;
    return 0;
}

uint64_t gp_handle_new(enum gp_handle_kind kind, void *obj)
{
    uint64_t n = atomic_fetch_add(&next_n, 1) & N_MASK;
    uint64_t h = GP_HANDLE_TAG | ((uint64_t)kind << 40) | n;
    pthread_rwlock_wrlock(&map_lock);
    int rc = insert_locked(h, obj);
    pthread_rwlock_unlock(&map_lock);
    return rc == 0 ? h : 0;
}

int gp_handle_register(uint64_t h, enum gp_handle_kind kind, void *obj)
{
    if (gp_handle_kind_of(h) != (int)kind)
        return -1;
    pthread_rwlock_wrlock(&map_lock);
    int rc = insert_locked(h, obj);
    pthread_rwlock_unlock(&map_lock);
    return rc;
}

void *gp_handle_get(uint64_t h, enum gp_handle_kind kind)
{
    if (gp_handle_kind_of(h) != (int)kind)
        return NULL;
    void *obj = NULL;
    pthread_rwlock_rdlock(&map_lock);
    if (cap) {
        size_t i = probe(h);
        if (slots[i].h == h)
            obj = slots[i].obj;
    }
    pthread_rwlock_unlock(&map_lock);
    return obj;
}

void *gp_handle_remove(uint64_t h, enum gp_handle_kind kind)
{
    if (gp_handle_kind_of(h) != (int)kind)
        return NULL;
    void *obj = NULL;
    pthread_rwlock_wrlock(&map_lock);
    if (cap) {
        size_t i = probe(h);
        if (slots[i].h == h) {
            obj = slots[i].obj;
            remove_at(i);
        }
    }
    pthread_rwlock_unlock(&map_lock);
    return obj;
}

int gp_handle_remove_if(enum gp_handle_kind kind, int (*pred)(uint64_t h, void *obj, void *arg),
                        void *arg, void (*dispose)(void *obj))
{
    void **gone = NULL;
    size_t ngone = 0, gcap = 0;
    pthread_rwlock_wrlock(&map_lock);
    for (size_t i = 0; i < cap;) {
        uint64_t h = slots[i].h;
        if (h && gp_handle_kind_of(h) == (int)kind && (!pred || pred(h, slots[i].obj, arg))) {
            if (ngone == gcap) {
                size_t ncap = gcap ? gcap * 2 : 16;
                void **n = realloc(gone, ncap * sizeof *n);
                if (!n)
                    break; /* out of memory: remove what we could */
                gone = n;
                gcap = ncap;
            }
            gone[ngone++] = slots[i].obj;
            remove_at(i);
            continue; /* slot i now holds a shifted entry (or is empty): look again */
        }
        i++;
    }
    pthread_rwlock_unlock(&map_lock);
    if (dispose)
        for (size_t k = 0; k < ngone; k++)
            dispose(gone[k]);
    free(gone);
    return (int)ngone;
}
