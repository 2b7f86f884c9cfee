/*
 * h_export.c: the driver's export tables, for the client's cuGetExportTable of a table the shim
 * does not implement (client/shim/api_export.c, docs/architecture.md "Export tables").
 *
 * Every byte of these requests comes from the client: the worker only looks the uuid up, reads a
 * table's size word (never sending it: an implausible one could be a pointer), and calls one
 * slot of one table, the tools-module table's function iterator (slot 7), in the one form every
 * caller was seen to use. It calls no other slot of any table on a client's say-so.
 */
#include <string.h>

#include "worker.h"

/* Slots beyond this are not believed: no export table seen has more than a few dozen. */
#define WK_ET_MAX_SLOTS 65536
#define WK_TOOLS_ITERATOR_SLOT 7

static const uint8_t TOOLS_MODULE_UUID[16] = {0x6e, 0x16, 0x3f, 0xbe, 0xb9, 0x58, 0x44, 0x4d,
                                              0x83, 0x5c, 0xe1, 0x82, 0xaf, 0xf1, 0x99, 0x1e};

/* The driver's table `uuid` and its slot count from the size word (0: none plausible). */
static CUresult get_table(struct worker *w, const uint8_t uuid[16], const uint64_t **table,
                          uint32_t *slots)
{
    CUuuid id;
    memcpy(id.bytes, uuid, 16);
    const void *t = NULL;
    CUresult rc = DRV(w, cuGetExportTable, &t, &id);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (t == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t size = 0;
    memcpy(&size, t, sizeof size); /* the size word: every table is at least one word long */
    *slots = size >= 16 && size % 8 == 0 && size / 8 <= WK_ET_MAX_SLOTS ? (uint32_t)(size / 8) : 0;
    *table = t;
    return CUDA_SUCCESS;
}

WK_HANDLER(export_table_info)
{
    gp_export_table_info_reply r = {0};
    const uint64_t *table = NULL;
    r.result = get_table(w, m->uuid, &table, &r.slots);
    if (r.result != CUDA_SUCCESS)
        r.slots = 0;
    WK_REPLY(w, req, gp_export_table_info_reply, &r);
}

typedef void (*wk_tools_cb)(void *opaque, void *node, void *owner);
typedef CUresult (*wk_tools_iterator)(CUcontext ctx, CUmodule module, wk_tools_cb cb, void *opaque,
                                      CUmodule module2, unsigned long long flags);

/* The worker's callback: counts the functions; the nodes stay on the server. */
static void count_node(void *opaque, void *node, void *owner)
{
    (void)node;
    (void)owner;
    uint32_t *count = opaque;
    if (*count < UINT32_MAX)
        (*count)++;
}

WK_HANDLER(tools_module_functions)
{
    gp_tools_module_functions_reply r = {0};
    struct wk_obj *mod = wk_idmap_get(&w->modules, m->module);
    const uint64_t *table = NULL;
    uint32_t slots = 0;
    if (!mod || mod->kind != 0) {
        r.result = CUDA_ERROR_INVALID_HANDLE;
    } else if (m->flags != 0) {
        r.result = CUDA_ERROR_NOT_SUPPORTED;
    } else if ((r.result = get_table(w, TOOLS_MODULE_UUID, &table, &slots)) == CUDA_SUCCESS) {
        wk_tools_iterator it = NULL;
        if (slots > WK_TOOLS_ITERATOR_SLOT) /* the slot lies inside the table */
            memcpy(&it, &table[WK_TOOLS_ITERATOR_SLOT], sizeof it);
        if (it == NULL) {
            r.result = CUDA_ERROR_NOT_SUPPORTED;
        } else {
            CUmodule h = (CUmodule)mod->h;
            r.result = CUDA_SUCCESS;
            r.value = it(wk_ctx_handle(w, mod->owner), h, count_node, &r.count, h, 0);
        }
    }
    WK_REPLY(w, req, gp_tools_module_functions_reply, &r);
}
