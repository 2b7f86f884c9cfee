/*
 * gp_vmm.h: the virtual memory management calls and the default memory pool in the shim
 * (api_vmm.c), and what vamap.c keeps for them.
 *
 * A mapping made with cuMemMap is recorded in the VA map as a device range flagged
 * GP_RANGE_F_VMM, so copies into it are validated like cuMemAlloc memory; adjacent mappings form
 * one span for copies (as in the driver, where only the virtual addresses matter).
 */
#ifndef GP_VMM_H
#define GP_VMM_H

#include <stdint.h>

#include "shim.h"

/* Client-chosen handle kind of physical allocations (CUmemGenericAllocationHandle). */
#define GP_H_MEMHANDLE ((enum gp_handle_kind)18)

/* Range flags (gp_range.flags) of device ranges made by cuMemMap. */
#define GP_RANGE_F_VMM 0x100u      /* a cuMemMap mapping: not freeable with cuMemFree */
#define GP_RANGE_F_NOACCESS 0x200u /* mapped, but cuMemSetAccess has not granted access yet */

/* gp_vamap_device_span (shim.h) also accepts a span over adjacent accessible VMM mappings and
 * refuses mappings without access. */
/* Sets `set` and clears `clear` in the flags of the VMM ranges that exactly cover
 * [addr, addr+len): 0, or -1 (and nothing changed) when some byte is not VMM-mapped. */
int gp_vamap_vmm_flags(uint64_t addr, uint64_t len, unsigned set, unsigned clear);
/* Stream-ordered allocations alive now (GP_RANGE_F_ASYNC): requested bytes and mapped bytes. */
void gp_vamap_async_bytes(uint64_t *used, uint64_t *mapped);
/* A stream-ordered allocation was made: the pool's high-water marks follow (api_vmm.c). */
void gp_pool_note_alloc(void);

#endif /* GP_VMM_H */
