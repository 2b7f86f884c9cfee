/*
 * sim_export.c: cuGetExportTable on the simulated device: two small tables, so that the worker's
 * and the shim's export-table paths (docs/architecture.md, "Export tables") are tested without a
 * GPU.
 *
 * - The tools-module table (6e163fbe-b958-444d-835c-e182aff1991e, NVIDIA's CU_ETID_ToolsModule):
 *   slot 0 its size in bytes (the driver's convention), slot 7 the per-module function iterator
 *   it(ctx, module, cb, opaque, module, 0), which calls cb(opaque, function, module) once per
 *   kernel of the module and returns CUDA_SUCCESS. The other slots are NULL: nobody may call
 *   them (the worker never calls anything but slot 7).
 * - A table only the simulated device knows (uuid "gpupool sim tbl\0" in ASCII), its size word
 *   and NULL slots: the shim does not implement it, so a client gets trampolines for it.
 * Any other uuid: CUDA_ERROR_INVALID_VALUE, as the driver answers an unknown table.
 */
#include <stdint.h>
#include <string.h>

#include "sim_api.h"
#include "sim_internal.h"

typedef void (*sim_tools_cb)(void *opaque, void *node, void *owner);
typedef void (*sim_et_fn)(void);
typedef union sim_et_slot {
    size_t size;
    sim_et_fn fn;
} sim_et_slot;

enum {
    TOOLS_SLOTS = 8,
    TEST_SLOTS = 6
};

static const uint8_t TOOLS_MODULE_UUID[16] = {0x6e, 0x16, 0x3f, 0xbe, 0xb9, 0x58, 0x44, 0x4d,
                                              0x83, 0x5c, 0xe1, 0x82, 0xaf, 0xf1, 0x99, 0x1e};
static const uint8_t SIM_TEST_UUID[16] = {'g', 'p', 'u', 'p', 'o', 'o', 'l', ' ',
                                          's', 'i', 'm', ' ', 't', 'b', 'l', 0};

struct iterate {
    sim_tools_cb cb;
    void *opaque;
    void *owner;
};

static void call_back(void *arg, uint64_t fh)
{
    struct iterate *it = arg;
    it->cb(it->opaque, (void *)(uintptr_t)fh, it->owner);
}

/* Slot 7. The context argument is not needed (a module knows its context); the second module
 * argument must be the first one or NULL, and the last 0, as every caller seen passes them. */
static CUresult tools_module_functions(CUcontext ctx, CUmodule module, sim_tools_cb cb,
                                       void *opaque, CUmodule module2, unsigned long long flags)
{
    (void)ctx;
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (cb == NULL || flags != 0 || (module2 != NULL && module2 != module))
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    struct iterate it = {.cb = cb, .opaque = opaque, .owner = (void *)module};
    long n = sim_module_foreach_function((uint64_t)(uintptr_t)module, call_back, &it);
    return sim_leave(n < 0 ? CUDA_ERROR_INVALID_HANDLE : CUDA_SUCCESS);
}

static const sim_et_slot tools_module_table[TOOLS_SLOTS] = {
    [0] = {.size = sizeof(sim_et_slot) * TOOLS_SLOTS},
    [7] = {.fn = (sim_et_fn)tools_module_functions},
};

static const sim_et_slot sim_test_table[TEST_SLOTS] = {
    [0] = {.size = sizeof(sim_et_slot) * TEST_SLOTS},
};

CUresult cuGetExportTable(const void **ppExportTable, const CUuuid *pExportTableId)
{
    if (ppExportTable == NULL || pExportTableId == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    *ppExportTable = NULL;
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (memcmp(pExportTableId->bytes, TOOLS_MODULE_UUID, 16) == 0)
        *ppExportTable = tools_module_table;
    else if (memcmp(pExportTableId->bytes, SIM_TEST_UUID, 16) == 0)
        *ppExportTable = sim_test_table;
    return sim_leave(*ppExportTable != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE);
}
