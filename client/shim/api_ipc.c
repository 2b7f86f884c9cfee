/*
 * api_ipc.c: CUDA IPC memory handles between processes of one job on one server (issue 37,
 * item 4; docs/multi-gpu.md, "CUDA IPC between the workers of one job").
 *
 * A handle is 64 bytes the program passes to another process however it likes. gpupool's are
 * written by the server (gpupoold's broker, gpupoold/workers/ipc_broker.py): they name memory the
 * exporting process's worker gave to gpupoold, with a secret, and only a process of the same
 * token whose GPU is on the same server can open them. The memory never passes through here:
 * the opening process's worker maps it in this process's VA window, and the pointer is recorded
 * as device memory so that copies and pointer queries treat it like any other.
 *
 * cuIpcGetEventHandle / cuIpcOpenEventHandle are still refused (gp_unimplemented).
 */
#include <stdint.h>
#include <string.h>

#include "shim.h"
#include "shim_core.h"

/* CUipcMemHandle: 64 opaque bytes, passed by value to cuIpcOpenMemHandle as in the driver. */
typedef struct {
    char reserved[64];
} gp_ipc_mem_handle;

#define GP_IPC_HANDLE_SIZE_AT 32 /* the allocation's size in the broker's layout (IpcHandle) */
#define GP_IPC_LAZY_ENABLE_PEER_ACCESS 0x1u

/* The server's words when it refused (the driver prints nothing, but its reasons are local; here
 * the result alone would leave the user guessing which of the server's checks failed). */
static void say_why(const char *call, CUresult r, const char *error, uint32_t error_len)
{
    if (error_len)
        gp_log_error("%s failed (CUDA error %d): %.*s", call, (int)r, (int)error_len, error);
}

GP_EXPORT CUresult cuIpcGetMemHandle(gp_ipc_mem_handle *pHandle, CUdeviceptr dptr)
{
    if (!pHandle)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_ctx_enter();
    if (r != CUDA_SUCCESS)
        return r;
    gp_range rg;
    if (gp_vamap_find(dptr, &rg) != 0 || rg.kind != GP_RANGE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    gp_conn_use_ctx(rg.ctx);
    gp_ipc_get_mem_handle m = {.dptr = dptr};
    GP_FRAME(buf, len, gp_ipc_get_mem_handle, &m);
    if (!buf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    gp_reply rep;
    r = gp_request(buf, len, NULL, 0, NULL, 0, &rep);
    GP_FRAME_FREE(buf);
    if (r != CUDA_SUCCESS)
        return gp_cu_result(r);
    gp_ipc_get_mem_handle_reply a;
    if (gp_ipc_get_mem_handle_reply_decode(rep.body, rep.len, &a) != 0) {
        gp_reply_free(&rep);
        return CUDA_ERROR_UNKNOWN;
    }
    r = gp_cu_result(a.code);
    if (r == CUDA_SUCCESS)
        memcpy(pHandle->reserved, a.handle, sizeof pHandle->reserved);
    else
        say_why("cuIpcGetMemHandle", r, a.error, a.error_len);
    gp_reply_free(&rep);
    return r;
}

GP_EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, gp_ipc_mem_handle handle,
                                         unsigned int Flags)
{
    if (!pdptr || (Flags & ~GP_IPC_LAZY_ENABLE_PEER_ACCESS))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_ctx_enter();
    if (r != CUDA_SUCCESS)
        return r;
    gp_ipc_open_mem_handle m = {.flags = Flags};
    memcpy(m.handle, handle.reserved, sizeof m.handle);
    GP_FRAME(buf, len, gp_ipc_open_mem_handle, &m);
    if (!buf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    gp_reply rep;
    r = gp_request(buf, len, NULL, 0, NULL, 0, &rep);
    GP_FRAME_FREE(buf);
    if (r != CUDA_SUCCESS)
        return gp_cu_result(r);
    gp_ipc_open_mem_handle_reply a;
    if (gp_ipc_open_mem_handle_reply_decode(rep.body, rep.len, &a) != 0) {
        gp_reply_free(&rep);
        return CUDA_ERROR_UNKNOWN;
    }
    r = gp_cu_result(a.code);
    if (r != CUDA_SUCCESS)
        say_why("cuIpcOpenMemHandle", r, a.error, a.error_len);
    uint64_t dptr = a.dptr;
    gp_reply_free(&rep);
    if (r != CUDA_SUCCESS)
        return r;
    if (dptr == 0 || !gp_vamap_in_window(dptr))
        return CUDA_ERROR_UNKNOWN;
    uint64_t size;
    memcpy(&size, handle.reserved + GP_IPC_HANDLE_SIZE_AT, sizeof size); /* little-endian */
    gp_range rg = {.base = dptr,
                   .size = size,
                   .kind = GP_RANGE_DEVICE,
                   .ctx = gp_ctx_current(),
                   .flags = GP_RANGE_F_IPC,
                   .mapped_size = size};
    if (gp_vamap_add(&rg) != 0)
        gp_log_error("the CUDA IPC memory at 0x%llx+%llu overlaps a range this process already "
                     "has; copies to it may be refused",
                     (unsigned long long)dptr, (unsigned long long)size);
    *pdptr = dptr;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult cuIpcOpenMemHandle(CUdeviceptr *pdptr, gp_ipc_mem_handle handle,
                                      unsigned int Flags)
{
    return cuIpcOpenMemHandle_v2(pdptr, handle, Flags);
}

GP_EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr dptr)
{
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    gp_range rg;
    if (gp_vamap_find(dptr, &rg) != 0 || rg.base != dptr || !(rg.flags & GP_RANGE_F_IPC))
        return CUDA_ERROR_INVALID_VALUE;
    if (gp_vamap_remove(dptr, &rg) != 0)
        return CUDA_ERROR_INVALID_VALUE; /* closed meanwhile */
    gp_conn_use_ctx(rg.ctx);
    gp_ipc_close_mem_handle m = {.dptr = dptr};
    GP_FRAME(buf, len, gp_ipc_close_mem_handle, &m);
    if (!buf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    gp_reply rep;
    r = gp_request(buf, len, NULL, 0, NULL, 0, &rep);
    GP_FRAME_FREE(buf);
    gp_reply_free(&rep);
    return r == CUDA_SUCCESS ? r : gp_cu_result(r);
}
