/*
 * api_export.c: what the export tables (export_tables.c) ask the server: whether its driver knows
 * a table the shim does not implement and how many slots it has, and the tools-module table's
 * function iterator (slot 7) run there (docs/architecture.md, "Export tables"). The tables
 * themselves, their trampolines and the stand-in nodes are export_tables.c's.
 */
#include <stdint.h>
#include <string.h>

#include "export_tables.h"
#include "shim.h"

int gp_export_table_slots_for_tables(const CUuuid *uuid)
{
    if (uuid == NULL || gp_check_init() != CUDA_SUCCESS)
        return -2; /* no server to ask (yet) */
    gp_export_table_info m = {0};
    memcpy(m.uuid, uuid->bytes, sizeof m.uuid);
    GP_FRAME(frame, flen, gp_export_table_info, &m);
    if (!frame)
        return -2;
    gp_reply reply;
    CUresult r = gp_request(frame, flen, NULL, 0, NULL, 0, &reply);
    GP_FRAME_FREE(frame);
    if (r == GP_LOST_CONNECTION_ERROR || (int32_t)r >= 100000 || (int32_t)r < 0)
        return -2; /* the server did not answer the question */
    if (r != CUDA_SUCCESS)
        return -1; /* the server's driver refuses the table too */
    gp_export_table_info_reply rep = {0};
    int slots = -2;
    if (gp_export_table_info_reply_decode(reply.body, reply.len, &rep))
        gp_log_error("cuGetExportTable: malformed reply");
    else
        slots = rep.slots > INT32_MAX ? INT32_MAX : (int)rep.slots;
    gp_reply_free(&reply);
    return slots;
}

CUresult gp_tools_module_functions_for_tables(CUcontext ctx, CUmodule module,
                                              unsigned long long flags, int32_t *value,
                                              uint32_t *count)
{
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    if (ctx != NULL && gp_ctx_check(ctx) == 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    /* A module of this client (a library's module alias is not: the worker knows modules by the
     * ids cuModuleLoad* gave). The worker runs the iterator in the module's own context. */
    uint64_t h = (uint64_t)(uintptr_t)module;
    if (gp_handle_get(h, GP_H_MODULE) == NULL)
        return CUDA_ERROR_INVALID_HANDLE;
    gp_tools_module_functions m = {.module = h, .flags = flags};
    GP_FRAME(frame, flen, gp_tools_module_functions, &m);
    if (!frame)
        return CUDA_ERROR_OUT_OF_MEMORY;
    gp_reply reply;
    r = gp_request(frame, flen, NULL, 0, NULL, 0, &reply);
    GP_FRAME_FREE(frame);
    if (r != CUDA_SUCCESS)
        return gp_cu_result(r);
    gp_tools_module_functions_reply rep = {0};
    if (gp_tools_module_functions_reply_decode(reply.body, reply.len, &rep)) {
        gp_log_error("export table tools-module slot 7: malformed reply");
        r = CUDA_ERROR_UNKNOWN;
    } else {
        *value = rep.value;
        *count = rep.count;
    }
    gp_reply_free(&reply);
    return r;
}
