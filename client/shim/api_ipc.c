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
 * Events go the same way: cuIpcGetEventHandle's 64 bytes are the broker's too (an id and a secret
 * for the driver's event handle, which gpupoold keeps), and cuIpcOpenEventHandle makes an event
 * here whose worker opened the driver's handle. Recording such an event waits for the worker
 * (api_event.c), so that the other process never waits for a record still on its way.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "shim.h"
#include "shim_core.h"

/* CUipcMemHandle: 64 opaque bytes, passed by value to cuIpcOpenMemHandle as in the driver. */
typedef struct {
    char reserved[64];
} gp_ipc_mem_handle;

#define GP_IPC_HANDLE_SIZE_AT 32 /* the allocation's size in the broker's layout (IpcHandle) */
#define GP_IPC_LAZY_ENABLE_PEER_ACCESS 0x1u

/* The program's out-pointer checked and the calling thread's context entered, as every IPC call
 * but close begins. */
static CUresult ipc_enter(const void *out)
{
    return out ? gp_ctx_enter() : CUDA_ERROR_INVALID_VALUE;
}

/* One round trip of an IPC call: CUDA_SUCCESS with the reply in *rep, or the error to return. */
static CUresult ipc_send(uint8_t *frame, size_t len, gp_reply *rep)
{
    *rep = (gp_reply){0};
    if (!frame)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = gp_request(frame, len, NULL, 0, NULL, 0, rep);
    return r == CUDA_SUCCESS ? r : gp_cu_result(r);
}

/* Frames *msgp_ as message type_ and sends it; r_ gets ipc_send's result, rep_ the reply. */
#define IPC_SEND(type_, msgp_, rep_, r_)                                                           \
    do {                                                                                           \
        GP_FRAME(ipc_buf, ipc_len, type_, msgp_);                                                  \
        (r_) = ipc_send(ipc_buf, ipc_len, &(rep_));                                                \
        GP_FRAME_FREE(ipc_buf);                                                                    \
    } while (0)

/* The call's own result from a decoded reply (`undecodable`: the decoder's non-zero return),
 * with the server's words said when it refused: the driver prints nothing, but its reasons are
 * local; here the result alone would leave the user guessing which of the server's checks
 * failed. */
static CUresult ipc_answer(const char *call, int undecodable, int32_t code, const char *error,
                           uint32_t error_len)
{
    if (undecodable)
        return CUDA_ERROR_UNKNOWN;
    CUresult r = gp_cu_result(code);
    if (r != CUDA_SUCCESS && error_len)
        gp_log_error("%s failed (CUDA error %d): %.*s", call, (int)r, (int)error_len, error);
    return r;
}

/* Every call of the ipc group whose reply carries code + error: frames *msgp_ as message type_,
 * waits for the reply into rep_ (a gp_reply: gp_reply_free it once reply_ is read, as reply_'s
 * text points into it), decodes it into reply_ (a type_##_reply) and sets r_ to the call's
 * CUresult for the program. */
#define IPC_CALL(call_, type_, msgp_, reply_, rep_, r_)                                            \
    do {                                                                                           \
        IPC_SEND(type_, msgp_, rep_, r_);                                                          \
        memset(&(reply_), 0, sizeof(reply_));                                                      \
        if ((r_) == CUDA_SUCCESS) {                                                                \
            int bad_ = type_##_reply_decode((rep_).body, (rep_).len, &(reply_));                   \
            (r_) = ipc_answer(call_, bad_, (reply_).code, (reply_).error, (reply_).error_len);     \
        }                                                                                          \
    } while (0)

/* The end of cuIpcGet*Handle: IPC_CALL, and the reply's 64 bytes to the program's handle. */
#define IPC_RETURN_HANDLE(call_, type_, msgp_, out_)                                               \
    do {                                                                                           \
        type_##_reply ipc_reply;                                                                   \
        gp_reply ipc_rep;                                                                          \
        CUresult ipc_r;                                                                            \
        IPC_CALL(call_, type_, msgp_, ipc_reply, ipc_rep, ipc_r);                                  \
        if (ipc_r == CUDA_SUCCESS)                                                                 \
            memcpy((out_)->reserved, ipc_reply.handle, sizeof((out_)->reserved));                  \
        gp_reply_free(&ipc_rep);                                                                   \
        return ipc_r;                                                                              \
    } while (0)

GP_EXPORT CUresult cuIpcGetMemHandle(gp_ipc_mem_handle *pHandle, CUdeviceptr dptr)
{
    gp_range rg;
    CUresult r = ipc_enter(pHandle);
    if (r == CUDA_SUCCESS && (gp_vamap_find(dptr, &rg) != 0 || rg.kind != GP_RANGE_DEVICE))
        r = CUDA_ERROR_INVALID_VALUE;
    if (r != CUDA_SUCCESS)
        return r;
    gp_conn_use_ctx(rg.ctx);
    gp_ipc_get_mem_handle m = {.dptr = dptr};
    IPC_RETURN_HANDLE("cuIpcGetMemHandle", gp_ipc_get_mem_handle, &m, pHandle);
}

GP_EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, gp_ipc_mem_handle handle,
                                         unsigned int Flags)
{
    CUresult r = ipc_enter((Flags & ~GP_IPC_LAZY_ENABLE_PEER_ACCESS) ? NULL : pdptr);
    if (r != CUDA_SUCCESS)
        return r;
    gp_ipc_open_mem_handle m = {.flags = Flags};
    memcpy(m.handle, handle.reserved, sizeof m.handle);
    gp_ipc_open_mem_handle_reply a;
    gp_reply rep;
    IPC_CALL("cuIpcOpenMemHandle", gp_ipc_open_mem_handle, &m, a, rep, r);
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
    gp_reply rep;
    IPC_SEND(gp_ipc_close_mem_handle, &m, rep, r);
    gp_reply_free(&rep);
    return r;
}

GP_EXPORT CUresult cuIpcGetEventHandle(CUipcEventHandle *pHandle, CUevent event)
{
    const unsigned need = CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING;
    gp_ipc_get_event_handle m = {.event = (uint64_t)(uintptr_t)event};
    const gp_event_obj *ev = NULL;
    CUresult r = gp_check_init();
    if (r == CUDA_SUCCESS && !(ev = gp_handle_get(m.event, GP_H_EVENT)))
        r = CUDA_ERROR_INVALID_HANDLE;
    else if (r == CUDA_SUCCESS && (!pHandle || (ev->flags & need) != need))
        r = CUDA_ERROR_INVALID_VALUE; /* as the driver */
    if (r != CUDA_SUCCESS)
        return r;
    gp_conn_use_ctx(ev->ctx);
    IPC_RETURN_HANDLE("cuIpcGetEventHandle", gp_ipc_get_event_handle, &m, pHandle);
}

GP_EXPORT CUresult cuIpcOpenEventHandle(CUevent *phEvent, CUipcEventHandle handle)
{
    CUresult r = ipc_enter(phEvent);
    if (r != CUDA_SUCCESS)
        return r;
    /* The driver: the opened event behaves like one made with CU_EVENT_DISABLE_TIMING. */
    gp_event_obj *ev = gp_event_new(CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING);
    if (!ev)
        return CUDA_ERROR_OUT_OF_MEMORY;
    gp_ipc_open_event_handle m = {.event = ev->id};
    memcpy(m.handle, handle.reserved, sizeof m.handle);
    gp_ipc_open_event_handle_reply a;
    gp_reply rep;
    IPC_CALL("cuIpcOpenEventHandle", gp_ipc_open_event_handle, &m, a, rep, r);
    gp_reply_free(&rep);
    if (r != CUDA_SUCCESS) {
        free(gp_handle_remove(ev->id, GP_H_EVENT));
        return r;
    }
    *phEvent = (CUevent)(uintptr_t)ev->id;
    return CUDA_SUCCESS;
}
