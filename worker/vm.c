/*
 * vm.c: see vm.h. The free list is a sorted array: allocations are few (programs and frameworks
 * sub-allocate from large blocks), so a linear first-fit scan is cheap and simple to trust.
 */
#include "vm.h"

#include <stdlib.h>
#include <string.h>

int wk_vm_init(struct vm *v, uint64_t base, uint64_t size, uint64_t align)
{
    memset(v, 0, sizeof *v);
    v->base = base;
    v->size = size;
    v->align = align;
    v->free = malloc(16 * sizeof *v->free);
    if (!v->free)
        return -1;
    v->capfree = 16;
    if (size > 0) {
        v->free[0].base = base;
        v->free[0].size = size;
        v->nfree = 1;
    }
    return 0;
}

int wk_vm_alloc(struct vm *v, uint64_t size, uint64_t *addr)
{
    if (size == 0 || size % v->align != 0)
        return -1;
    for (size_t i = 0; i < v->nfree; i++) {
        struct vm_range *r = &v->free[i];
        if (r->size < size)
            continue;
        *addr = r->base;
        r->base += size;
        r->size -= size;
        if (r->size == 0) {
            memmove(r, r + 1, (v->nfree - i - 1) * sizeof *r);
            v->nfree--;
        }
        return 0;
    }
    return -1;
}

/* Removes [addr, addr+size) from free range i, which contains it; -1 only if out of memory. */
static int carve(struct vm *v, size_t i, uint64_t addr, uint64_t size)
{
    struct vm_range *r = &v->free[i];
    uint64_t head = addr - r->base, tail = r->base + r->size - (addr + size);
    if (head == 0 && tail == 0) {
        memmove(r, r + 1, (v->nfree - i - 1) * sizeof *r);
        v->nfree--;
        return 0;
    }
    if (head == 0) {
        r->base = addr + size;
        r->size = tail;
        return 0;
    }
    if (tail == 0) {
        r->size = head;
        return 0;
    }
    if (v->nfree == v->capfree) { /* split in two: one more free range */
        struct vm_range *n = realloc(v->free, 2 * v->capfree * sizeof *n);
        if (!n)
            return -1;
        v->free = n;
        v->capfree *= 2;
        r = &v->free[i];
    }
    memmove(r + 2, r + 1, (v->nfree - i - 1) * sizeof *r);
    v->nfree++;
    r->size = head;
    r[1].base = addr + size;
    r[1].size = tail;
    return 0;
}

int wk_vm_alloc_aligned(struct vm *v, uint64_t size, uint64_t align, uint64_t *addr)
{
    if (align <= v->align)
        return wk_vm_alloc(v, size, addr);
    if (size == 0 || size % v->align != 0 || (align & (align - 1)) != 0)
        return -1;
    for (size_t i = 0; i < v->nfree; i++) {
        const struct vm_range *r = &v->free[i];
        uint64_t a = (r->base + align - 1) & ~(align - 1);
        if (a < r->base || a - r->base > r->size || r->size - (a - r->base) < size)
            continue;
        if (carve(v, i, a, size) != 0)
            return -2;
        *addr = a;
        return 0;
    }
    return -1;
}

int wk_vm_alloc_at(struct vm *v, uint64_t addr, uint64_t size)
{
    if (size == 0 || size % v->align != 0 || addr % v->align != 0 || addr + size < addr)
        return -1;
    for (size_t i = 0; i < v->nfree; i++) {
        const struct vm_range *r = &v->free[i];
        if (addr >= r->base && addr - r->base <= r->size && r->size - (addr - r->base) >= size)
            return carve(v, i, addr, size) == 0 ? 0 : -1;
    }
    return -1;
}

int wk_vm_free(struct vm *v, uint64_t addr, uint64_t size)
{
    if (size == 0)
        return 0;
    /* i: first free range above addr. */
    size_t i = 0;
    while (i < v->nfree && v->free[i].base < addr)
        i++;
    int join_prev = i > 0 && v->free[i - 1].base + v->free[i - 1].size == addr;
    int join_next = i < v->nfree && addr + size == v->free[i].base;
    if (join_prev && join_next) {
        v->free[i - 1].size += size + v->free[i].size;
        memmove(&v->free[i], &v->free[i + 1], (v->nfree - i - 1) * sizeof v->free[0]);
        v->nfree--;
    } else if (join_prev) {
        v->free[i - 1].size += size;
    } else if (join_next) {
        v->free[i].base = addr;
        v->free[i].size += size;
    } else {
        if (v->nfree == v->capfree) {
            struct vm_range *n = realloc(v->free, 2 * v->capfree * sizeof *n);
            if (!n)
                return -1;
            v->free = n;
            v->capfree *= 2;
        }
        memmove(&v->free[i + 1], &v->free[i], (v->nfree - i) * sizeof v->free[0]);
        v->free[i].base = addr;
        v->free[i].size = size;
        v->nfree++;
    }
    return 0;
}

uint64_t wk_vm_free_bytes(const struct vm *v)
{
    uint64_t n = 0;
    for (size_t i = 0; i < v->nfree; i++)
        n += v->free[i].size;
    return n;
}

void wk_vm_destroy(struct vm *v)
{
    free(v->free);
    memset(v, 0, sizeof *v);
}
