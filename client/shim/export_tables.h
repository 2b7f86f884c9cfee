/*
 * export_tables.h: cuGetExportTable, the driver's undocumented "dark API" tables that cudart,
 * cuBLAS and cuBLASLt ask for, served on the client (facts section 4); a table the shim does not
 * implement but the server's driver knows is served as trampolines (docs/architecture.md,
 * "Export tables").
 *
 * The tables need answers only the shim core has (which context is current, which context is a
 * device's primary one, what the server's driver knows). The core defines the hooks below;
 * export_tables.c calls them.
 */
#ifndef GP_EXPORT_TABLES_H
#define GP_EXPORT_TABLES_H

#include "gp_cuda.h"

/* ---- hooks the shim core DEFINES (export_tables.c calls them) ------------------------------ */

/* The calling thread's current context, or NULL if it has none. Called about once per runtime
 * call (context-local-storage get with ctx == NULL), so it must be cheap and must not block on
 * the network. */
CUcontext gp_ctx_current_for_tables(void);

/* Device `dev`'s primary context handle, WITHOUT retaining or activating it (cudart asks for the
 * handle before it retains it), or NULL if `dev` is not a valid device ordinal. */
CUcontext gp_ctx_primary_for_tables(int dev);

/* How many pointer-sized slots the server's driver's table `uuid` has, slot 0 (its size word)
 * included: > 0; 0 when the table has no size word the worker could read; -1 when the server's
 * driver does not know the table (refused, and not asked about again); -2 when there is no
 * server to ask, or it did not answer (refused this time only). One round trip. */
int gp_export_table_slots_for_tables(const CUuuid *uuid);

/* The tools-module table's slot 7 (a module's function iterator) run on the server, for a
 * module of this client: on CUDA_SUCCESS *value is what the driver's iterator returned and *count
 * how many times it called back; otherwise the error (bad handle, no server, a driver without
 * the table). */
CUresult gp_tools_module_functions_for_tables(CUcontext ctx, CUmodule module,
                                              unsigned long long flags, int32_t *value,
                                              uint32_t *count);

/* ---- functions export_tables.c DEFINES ------------------------------------------------------ */

/* The shim core calls this when a context goes away (cuCtxDestroy, the primary context's last
 * release or reset): every context-local-storage entry of `ctx` is dropped and its destructor,
 * if one was registered, runs as destructor(ctx, key, value). Must not be called with a lock
 * held that a destructor could need (destructors are cudart code and may call the driver). */
void gp_cls_context_destroyed(CUcontext ctx);

/* The addresses cuGetExportTable hands out for CUDART_INTERFACE and INTEGRITY_CHECK: the
 * integrity answer hashes them (integrity.c). */
const void *gp_export_table_cudart_interface(void);
const void *gp_export_table_integrity_check(void);

/* The calls so far to each slot of the tables served as trampolines (the tools-module table's
 * forwarded slot 7 included), for the per-call profile: up to max entries into out, in table
 * then slot order; returns how many entries there are (may exceed max). */
typedef struct gp_et_slot_calls {
    CUuuid table;
    uint32_t slot;
    uint64_t calls;
} gp_et_slot_calls;
size_t gp_export_table_slot_calls(gp_et_slot_calls *out, size_t max);

/* Exported driver entry point (strong definition; overrides the generated weak stub). */
CUresult cuGetExportTable(const void **ppExportTable, const CUuuid *pExportTableId);

#endif /* GP_EXPORT_TABLES_H */
