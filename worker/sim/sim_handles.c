/*
 * sim_handles.c: the handles the sim gives out (contexts, streams, events, modules, functions,
 * memory allocations) and the objects behind them.
 *
 * A handle is a tagged integer: 0x5100000000000000 | kind << 48 | serial number. It is never a
 * pointer, so the sim can check any value a caller passes (a stale handle, garbage from the
 * network) by looking it up, instead of dereferencing it. Serial numbers are not reused, so a
 * destroyed handle stays invalid. The table is an open-addressing hash map; the caller holds
 * sim_lock.
 */
#include <stdlib.h>

#include "sim_internal.h"

#define TAG 0x5100000000000000ull
#define KIND_SHIFT 48
#define SERIAL_MASK ((1ull << KIND_SHIFT) - 1)
#define EMPTY 0ull
#define TOMBSTONE 1ull /* never a handle: handles always carry TAG */

struct slot {
    uint64_t key;
    void *obj;
};

static struct slot *table;
static size_t capacity; /* power of two */
static size_t used;     /* live + tombstones: what decides when to grow */
static uint64_t next_serial = 1;

static size_t hash(uint64_t key)
{
    /* Serial numbers are sequential; a multiplicative hash spreads them over the table. */
    return (size_t)((key * 0x9e3779b97f4a7c15ull) >> 17);
}

/* Rehashes into a table sized for the live entries (dropping tombstones): it grows when handles
 * accumulate and stays the same size when they are only created and destroyed. */
static bool rehash(void)
{
    size_t live = 0;
    for (size_t i = 0; i < capacity; i++)
        live += table[i].key != EMPTY && table[i].key != TOMBSTONE;
    size_t ncap = 256;
    while ((live + 1) * 4 > ncap) /* at most a quarter full afterwards */
        ncap *= 2;
    struct slot *nt = calloc(ncap, sizeof(*nt));
    if (!nt)
        return false;
    for (size_t i = 0; i < capacity; i++) {
        if (table[i].key == EMPTY || table[i].key == TOMBSTONE)
            continue;
        size_t j = hash(table[i].key) & (ncap - 1);
        while (nt[j].key != EMPTY)
            j = (j + 1) & (ncap - 1);
        nt[j] = table[i];
    }
    free(table);
    table = nt;
    capacity = ncap;
    used = live;
    return true;
}

uint64_t sim_handle_new(enum sim_kind kind, void *obj)
{
    /* Keep the load (tombstones included) under one half so that probes stay short. */
    if ((used + 1) * 2 > capacity && !rehash())
        return 0;
    uint64_t key = TAG | ((uint64_t)kind << KIND_SHIFT) | (next_serial++ & SERIAL_MASK);
    size_t j = hash(key) & (capacity - 1);
    while (table[j].key != EMPTY && table[j].key != TOMBSTONE)
        j = (j + 1) & (capacity - 1);
    if (table[j].key == EMPTY)
        used++;
    table[j].key = key;
    table[j].obj = obj;
    return key;
}

static struct slot *find(uint64_t key)
{
    if (capacity == 0 || (key & ~(SERIAL_MASK | (0xffull << KIND_SHIFT))) != TAG)
        return NULL;
    size_t j = hash(key) & (capacity - 1);
    for (size_t n = 0; n < capacity; n++) {
        if (table[j].key == EMPTY)
            return NULL;
        if (table[j].key == key)
            return &table[j];
        j = (j + 1) & (capacity - 1);
    }
    return NULL;
}

void *sim_handle_get(uint64_t h, enum sim_kind kind)
{
    if (((h >> KIND_SHIFT) & 0xff) != (uint64_t)kind)
        return NULL;
    struct slot *s = find(h);
    return s ? s->obj : NULL;
}

void sim_handle_del(uint64_t h)
{
    struct slot *s = find(h);
    if (s) {
        s->key = TOMBSTONE;
        s->obj = NULL;
    }
}

void sim_handle_foreach(enum sim_kind kind, void (*fn)(uint64_t h, void *obj, void *arg), void *arg)
{
    /* Deleting turns a slot into a tombstone and never moves another entry, so the scan stays
     * valid while fn deletes the handle it was given. */
    for (size_t i = 0; i < capacity; i++) {
        uint64_t key = table[i].key;
        if (key == EMPTY || key == TOMBSTONE)
            continue;
        if (((key >> KIND_SHIFT) & 0xff) == (uint64_t)kind)
            fn(key, table[i].obj, arg);
    }
}
