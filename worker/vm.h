/*
 * vm.h: first-fit allocator of address ranges inside the client's VA window.
 *
 * Device pointers must be addresses the client has reserved too (docs/architecture.md, "the VA
 * window"), so the worker, not the driver, chooses where each allocation goes. The allocator only
 * does arithmetic; mapping memory there is the caller's job (h_memory.c).
 */
#ifndef GP_WORKER_VM_H
#define GP_WORKER_VM_H

#include <stddef.h>
#include <stdint.h>

struct vm_range {
    uint64_t base, size;
};

struct vm {
    uint64_t base, size, align;
    struct vm_range *free; /* sorted by base, never adjacent (always coalesced) */
    size_t nfree, capfree;
};

/* Window [base, base+size); every range handed out is aligned to and a multiple of `align`
 * (a power of two). Returns 0, or -1 if out of memory. */
int wk_vm_init(struct vm *v, uint64_t base, uint64_t size, uint64_t align);
/* Allocates `size` bytes (a multiple of align). 0 and *addr; -1 no room; -2 out of memory. */
int wk_vm_alloc(struct vm *v, uint64_t size, uint64_t *addr);
/* Like wk_vm_alloc, with the start aligned to `align` (0, or a power of two >= v->align). */
int wk_vm_alloc_aligned(struct vm *v, uint64_t size, uint64_t align, uint64_t *addr);
/* Takes exactly [addr, addr+size) if it is free: 0, else -1 (cuMemAddressReserve's hint). */
int wk_vm_alloc_at(struct vm *v, uint64_t addr, uint64_t size);
/* Returns a range obtained from wk_vm_alloc. 0, or -1 if host memory ran out (the range is lost). */
int wk_vm_free(struct vm *v, uint64_t addr, uint64_t size);
/* Bytes still free (for logs and tests). */
uint64_t wk_vm_free_bytes(const struct vm *v);
void wk_vm_destroy(struct vm *v);

#endif /* GP_WORKER_VM_H */
