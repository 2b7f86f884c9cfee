/*
 * export_tables.h: cuGetExportTable, the driver's undocumented "dark API" tables that cudart,
 * cuBLAS and cuBLASLt ask for, served entirely on the client (facts section 4).
 *
 * The tables need two answers only the shim core has (which context is current, which context
 * is a device's primary one). The core defines the two hooks below; export_tables.c calls them.
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

/* Exported driver entry point (strong definition; overrides the generated weak stub). */
CUresult cuGetExportTable(const void **ppExportTable, const CUuuid *pExportTableId);

#endif /* GP_EXPORT_TABLES_H */
