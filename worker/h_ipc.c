/*
 * h_ipc.c: CUDA IPC between the workers of one job on this server (issue 37, item 4;
 * docs/multi-gpu.md, "CUDA IPC between the workers of one job").
 *
 * Every allocation is VMM memory (h_memory.c), so an IPC handle is made the VMM way: the
 * allocation's physical memory is exported as a POSIX fd (cuMemExportToShareableHandle) and sent
 * to gpupoold on the control socket; gpupoold's broker keeps it and answers the 64 bytes the
 * program gets. Opening asks gpupoold for the fd of a handle (the broker gives it only to a
 * session of the exporter's token), imports it and maps it in this client's VA window. The fd
 * never reaches the client. The worker is single-threaded: while it waits for gpupoold's answer,
 * other control messages are handled as during any wait (control_session.c).
 *
 * Events (cuIpcGetEventHandle / cuIpcOpenEventHandle) need no fd: the driver's 64-byte event
 * handle is opened by any process of the machine, so it travels to gpupoold and back as bytes,
 * and gpupoold's broker gives the program its own handle (id and secret) instead, so that the
 * driver's bytes reach only a worker of the exporter's token.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "worker.h"

/* gpupoold answers from its event loop at once, unless stuck; well under the client's 30 s
 * server timeout (GPUPOOL_SERVER_TIMEOUT), as no keepalive notice goes out meanwhile. */
#define ANSWER_TIMEOUT_MS 10000

/* A request got no answer in time. Answers carry no request number, so its late answer could be
 * taken for a later request's (an export would hand the program the previous allocation's
 * handle): from then on this process makes no IPC request. A worker serves one session, so this
 * is the session's. */
static int ipc_stalled;

/* The allocation (of cuMemAlloc, made here) that holds dptr, and its base; NULL if none. */
static struct wk_obj *alloc_holding(struct worker *w, uint64_t dptr, uint64_t *base)
{
    size_t pos = 0;
    uint64_t key;
    void *val;
    while (wk_idmap_next(&w->allocs, &pos, &key, &val)) {
        struct wk_obj *o = val;
        if (o && dptr >= key && dptr - key < o->size) {
            *base = key;
            return o;
        }
    }
    return NULL;
}

/* Sends the n bytes WK_CTL_ENCODE put in w->ctl.out with `fd` attached (SCM_RIGHTS). 0 or -1. */
static int send_with_fd(struct worker *w, size_t n, int fd)
{
    if (w->ctl.fd < 0 || w->ctl.gone || n == 0)
        return -1;
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(sizeof(int))];
    } cm;
    memset(&cm, 0, sizeof cm);
    struct iovec iov = {.iov_base = w->ctl.out, .iov_len = n};
    struct msghdr msg = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cm.buf, .msg_controllen = sizeof cm.buf};
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
    ssize_t r;
    do {
        r = sendmsg(w->ctl.fd, &msg, MSG_NOSIGNAL);
    } while (r < 0 && errno == EINTR);
    if (r != (ssize_t)n) {
        wk_warn("sending a CUDA IPC export to gpupoold: %s", r < 0 ? strerror(errno) : "short");
        return -1;
    }
    return 0;
}

/* Waits for gpupoold's answer `op` (control_wait.c); on a timeout no IPC request is made again
 * in this process (ipc_stalled). */
static ssize_t wait_answer(struct worker *w, unsigned op, uint8_t *buf, size_t cap, int *fd,
                           char *err, size_t errlen)
{
    int timed_out = 0;
    ssize_t n = wk_ctl_wait_answer(w, op, buf, cap, fd, ANSWER_TIMEOUT_MS, &timed_out, err, errlen);
    if (timed_out) {
        /* Its answer may still come: ipc_unavailable refuses every later request. */
        ipc_stalled = 1;
        snprintf(err, errlen,
                 "gpupoold did not answer the worker's CUDA IPC request in %d s; CUDA IPC is "
                 "off for the rest of this process (see gpupoold's log for why it stalled, "
                 "then restart the program)",
                 ANSWER_TIMEOUT_MS / 1000);
    }
    return n;
}

static CUresult ipc_unavailable(const struct worker *w, char *err, size_t errlen)
{
    if (ipc_stalled) {
        snprintf(err, errlen,
                 "CUDA IPC is off for the rest of this process: gpupoold did not answer an "
                 "earlier CUDA IPC request in %d s, and a late answer could be taken for another "
                 "request's (see gpupoold's log for why it stalled, then restart the program)",
                 ANSWER_TIMEOUT_MS / 1000);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    if (w->ctl.fd >= 0 && !w->ctl.gone && w->ctl.in_session)
        return CUDA_SUCCESS;
    snprintf(err, errlen,
             "CUDA IPC needs gpupoold, and this session has none now (it was "
             "started by hand or its daemon is gone)");
    return CUDA_ERROR_NOT_SUPPORTED;
}

/* gpupoold's answer to our worker_ipc_export or worker_ipc_export_event: the program's handle. */
static CUresult await_exported(struct worker *w, uint8_t handle[64], char *err, size_t errlen)
{
    uint8_t buf[WK_CTL_MAX + 1];
    int got_fd = -1;
    ssize_t n = wait_answer(w, GP_OP_WORKER_IPC_EXPORTED, buf, WK_CTL_MAX, &got_fd, err, errlen);
    if (got_fd >= 0 && close(got_fd) != 0)
        wk_warn("close: %s", strerror(errno));
    gp_worker_ipc_exported a;
    if (n < 0)
        return CUDA_ERROR_NOT_SUPPORTED;
    if (gp_worker_ipc_exported_decode(buf + GP_PROTO_HEADER_SIZE, (size_t)n - GP_PROTO_HEADER_SIZE,
                                      &a) != 0) {
        snprintf(err, errlen, "gpupoold's answer to a CUDA IPC export was unreadable");
        return CUDA_ERROR_UNKNOWN;
    }
    if (a.code != 0) {
        snprintf(err, errlen, "%.*s", (int)a.error_len, a.error);
        return (CUresult)a.code;
    }
    memcpy(handle, a.handle, 64);
    return CUDA_SUCCESS;
}

static CUresult get_handle(struct worker *w, uint64_t dptr, uint8_t handle[64], char *err,
                           size_t errlen)
{
    CUresult rc = ipc_unavailable(w, err, errlen);
    if (rc != CUDA_SUCCESS)
        return rc;
    uint64_t base = 0;
    struct wk_obj *o = alloc_holding(w, dptr, &base);
    if (!o || o->kind == WK_ALLOC_IMPORTED) {
        snprintf(err, errlen, "0x%llx is not memory of this process's cuMemAlloc",
                 (unsigned long long)dptr);
        return CUDA_ERROR_INVALID_VALUE;
    }
    int fd = -1;
    rc = DRV(w, cuMemExportToShareableHandle, &fd, o->mem, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
             0);
    if (rc != CUDA_SUCCESS) {
        snprintf(err, errlen,
                 "the server's driver cannot export this allocation (%s): its GPU "
                 "or driver does not support POSIX file descriptor handles",
                 wk_err_name(w, rc));
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    gp_worker_ipc_export m = {
        .session_id = w->ctl.session_id, .size = o->size, .offset = dptr - base};
    int sent = send_with_fd(w, WK_CTL_ENCODE(w, worker_ipc_export, &m), fd);
    if (close(fd) != 0)
        wk_warn("close: %s", strerror(errno));
    if (sent != 0) {
        snprintf(err, errlen, "the worker could not reach gpupoold");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    return await_exported(w, handle, err, errlen);
}

/* Imports the fd, maps `size` bytes of it in the window for every device of the lease and
 * records it as an imported allocation; its base in *dptr. */
static CUresult map_import(struct worker *w, int fd, uint64_t size, uint64_t *dptr, char *err,
                           size_t errlen)
{
    if (size == 0 || size % w->gran != 0 || !w->va_reserved) {
        snprintf(err, errlen, "an exported allocation of %llu bytes cannot be mapped here",
                 (unsigned long long)size);
        return CUDA_ERROR_INVALID_VALUE;
    }
    CUmemGenericAllocationHandle h = 0;
    CUresult rc = DRV(w, cuMemImportFromShareableHandle, &h, (void *)(intptr_t)fd,
                      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (rc != CUDA_SUCCESS) {
        snprintf(err, errlen, "the server's driver could not import the memory (%s)",
                 wk_err_name(w, rc));
        return rc;
    }
    uint64_t addr;
    if (wk_vm_alloc(&w->vm, size, &addr) != 0) {
        snprintf(err, errlen, "this process's address window has no room for %llu bytes",
                 (unsigned long long)size);
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        goto release;
    }
    rc = DRV(w, cuMemMap, addr, size, 0, h, 0);
    if (rc != CUDA_SUCCESS)
        goto free_range;
    CUmemAccessDesc access[WK_MAX_DEVICES];
    int ndev = w->ndev > 0 ? w->ndev : 1;
    for (int k = 0; k < ndev; k++) {
        access[k].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        access[k].location.id = k == 0 ? w->dev : w->devs[k];
        access[k].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    }
    rc = DRV(w, cuMemSetAccess, addr, size, access, (size_t)ndev);
    if (rc != CUDA_SUCCESS)
        goto unmap;
    struct wk_obj *o = wk_obj_new(w->cur_ctx, NULL, NULL, 0);
    if (o) {
        o->size = size;
        o->mem = h;
        o->kind = WK_ALLOC_IMPORTED;
    }
    rc = wk_obj_bind(&w->allocs, addr, o);
    if (rc != CUDA_SUCCESS)
        goto unmap;
    *dptr = addr;
    return CUDA_SUCCESS;

unmap:
    if (DRV(w, cuMemUnmap, addr, size) != CUDA_SUCCESS)
        wk_warn("unmapping a failed CUDA IPC import at 0x%llx failed", (unsigned long long)addr);
free_range:
    if (wk_vm_free(&w->vm, addr, size) != 0)
        wk_error("out of memory: %llu bytes of the VA window are lost", (unsigned long long)size);
release:
    if (DRV(w, cuMemRelease, h) != CUDA_SUCCESS)
        wk_warn("releasing a failed CUDA IPC import failed");
    if (!*err)
        snprintf(err, errlen, "mapping the imported memory failed (%s)", wk_err_name(w, rc));
    return rc;
}

static CUresult open_handle(struct worker *w, const uint8_t handle[64], uint64_t *dptr, char *err,
                            size_t errlen)
{
    CUresult rc = ipc_unavailable(w, err, errlen);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (w->cur_ctx == 0)
        return CUDA_ERROR_INVALID_CONTEXT; /* as the driver without a current context */
    gp_worker_ipc_open m = {.session_id = w->ctl.session_id};
    memcpy(m.handle, handle, 64);
    if (wk_ctl_send(w, WK_CTL_ENCODE(w, worker_ipc_open, &m), 0) != 0) {
        snprintf(err, errlen, "the worker could not reach gpupoold");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    uint8_t buf[WK_CTL_MAX + 1];
    int fd = -1;
    ssize_t n = wait_answer(w, GP_OP_WORKER_IPC_OPENED, buf, WK_CTL_MAX, &fd, err, errlen);
    gp_worker_ipc_opened a;
    if (n < 0) {
        rc = CUDA_ERROR_NOT_SUPPORTED;
    } else if (gp_worker_ipc_opened_decode(buf + GP_PROTO_HEADER_SIZE,
                                           (size_t)n - GP_PROTO_HEADER_SIZE, &a) != 0) {
        snprintf(err, errlen, "gpupoold's answer to a CUDA IPC open was unreadable");
        rc = CUDA_ERROR_UNKNOWN;
    } else if (a.code != 0) {
        snprintf(err, errlen, "%.*s", (int)a.error_len, a.error);
        rc = (CUresult)a.code;
    } else if (fd < 0) {
        snprintf(err, errlen, "gpupoold's answer to a CUDA IPC open came without the memory");
        rc = CUDA_ERROR_UNKNOWN;
    } else {
        rc = map_import(w, fd, a.size, dptr, err, errlen);
    }
    if (fd >= 0 && close(fd) != 0)
        wk_warn("close: %s", strerror(errno));
    return rc;
}

/* The driver's handle of the client's event `id`, given to gpupoold for the program's handle. */
static CUresult get_event_handle(struct worker *w, uint64_t id, uint8_t handle[64], char *err,
                                 size_t errlen)
{
    CUresult rc = ipc_unavailable(w, err, errlen);
    if (rc != CUDA_SUCCESS)
        return rc;
    CUevent e = NULL;
    rc = wk_event_get(w, id, &e);
    if (rc != CUDA_SUCCESS) {
        snprintf(err, errlen, "0x%llx is not an event of this process", (unsigned long long)id);
        return rc;
    }
    CUipcEventHandle drv;
    rc = DRV(w, cuIpcGetEventHandle, &drv, e);
    if (rc != CUDA_SUCCESS) {
        /* The shim refuses events without CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING
         * (api_event.c), so the flags are not why the driver says INVALID_VALUE here. */
        snprintf(err, errlen, "the server's driver refused to export the event (%s)%s",
                 wk_err_name(w, rc),
                 rc == CUDA_ERROR_INVALID_VALUE || rc == CUDA_ERROR_NOT_SUPPORTED
                     ? ": the server's GPU or setup does not support interprocess events (under "
                       "MPS, or a device or driver without CUDA IPC); ask the operator, or share "
                       "results through host memory instead"
                     : "");
        return rc;
    }
    gp_worker_ipc_export_event m = {.session_id = w->ctl.session_id};
    memcpy(m.event, drv.reserved, sizeof m.event);
    if (wk_ctl_send(w, WK_CTL_ENCODE(w, worker_ipc_export_event, &m), 0) != 0) {
        snprintf(err, errlen, "the worker could not reach gpupoold");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    return await_exported(w, handle, err, errlen);
}

/* Asks gpupoold for the driver's handle behind the program's, opens it and binds the event to
 * the client's id `id` (as event_create). */
static CUresult open_event_handle(struct worker *w, uint64_t id, const uint8_t handle[64],
                                  char *err, size_t errlen)
{
    CUresult rc = ipc_unavailable(w, err, errlen);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (w->cur_ctx == 0)
        return CUDA_ERROR_INVALID_CONTEXT; /* as the driver without a current context */
    if (wk_idmap_get(&w->events, id)) {
        snprintf(err, errlen, "event id 0x%llx is taken", (unsigned long long)id);
        return CUDA_ERROR_INVALID_VALUE;
    }
    gp_worker_ipc_open_event m = {.session_id = w->ctl.session_id};
    memcpy(m.handle, handle, 64);
    if (wk_ctl_send(w, WK_CTL_ENCODE(w, worker_ipc_open_event, &m), 0) != 0) {
        snprintf(err, errlen, "the worker could not reach gpupoold");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    uint8_t buf[WK_CTL_MAX + 1];
    int fd = -1;
    ssize_t n = wait_answer(w, GP_OP_WORKER_IPC_EVENT_OPENED, buf, WK_CTL_MAX, &fd, err, errlen);
    if (fd >= 0 && close(fd) != 0)
        wk_warn("close: %s", strerror(errno));
    gp_worker_ipc_event_opened a;
    if (n < 0)
        return CUDA_ERROR_NOT_SUPPORTED;
    if (gp_worker_ipc_event_opened_decode(buf + GP_PROTO_HEADER_SIZE,
                                          (size_t)n - GP_PROTO_HEADER_SIZE, &a) != 0) {
        snprintf(err, errlen, "gpupoold's answer to a CUDA IPC event open was unreadable");
        return CUDA_ERROR_UNKNOWN;
    }
    if (a.code != 0) {
        snprintf(err, errlen, "%.*s", (int)a.error_len, a.error);
        return (CUresult)a.code;
    }
    CUipcEventHandle drv;
    memcpy(drv.reserved, a.event, sizeof drv.reserved);
    CUevent e = NULL;
    rc = DRV(w, cuIpcOpenEventHandle, &e, drv);
    if (rc != CUDA_SUCCESS) {
        snprintf(err, errlen, "the server's driver could not open the event (%s)",
                 wk_err_name(w, rc));
        return rc;
    }
    rc = wk_obj_bind(&w->events, id, wk_obj_new(w->cur_ctx, e, NULL, 0));
    if (rc != CUDA_SUCCESS) {
        if (DRV(w, cuEventDestroy, e) != CUDA_SUCCESS)
            wk_warn("destroying an unbound CUDA IPC event failed");
        snprintf(err, errlen, "out of memory for the opened event");
    }
    return rc;
}

WK_HANDLER(ipc_get_event_handle)
{
    gp_ipc_get_event_handle_reply r = {0};
    char err[1024] = "", text[1024];
    r.code = get_event_handle(w, m->event, r.handle, err, sizeof err);
    if (r.code == CUDA_SUCCESS)
        w->ctl.ipc_shared = 1; /* never detached: the other process's event names this one */
    else
        wk_log("cuIpcGetEventHandle(0x%llx): %s", (unsigned long long)m->event, err);
    WK_SET_TEXT(r.error, text, err);
    WK_REPLY(w, req, gp_ipc_get_event_handle_reply, &r);
}

WK_HANDLER(ipc_open_event_handle)
{
    gp_ipc_open_event_handle_reply r = {0};
    char err[1024] = "", text[1024];
    r.code = open_event_handle(w, m->event, m->handle, err, sizeof err);
    if (r.code == CUDA_SUCCESS)
        w->ctl.ipc_shared = 1; /* never detached (detach.c): its event lives in another process */
    else
        wk_log("cuIpcOpenEventHandle: %s", err);
    WK_SET_TEXT(r.error, text, err);
    WK_REPLY(w, req, gp_ipc_open_event_handle_reply, &r);
}

WK_HANDLER(ipc_get_mem_handle)
{
    gp_ipc_get_mem_handle_reply r = {0};
    char err[1024] = "", text[1024];
    r.code = get_handle(w, m->dptr, r.handle, err, sizeof err);
    if (r.code == CUDA_SUCCESS)
        w->ctl.ipc_shared = 1; /* never detached from now on (detach.c) */
    else
        wk_log("cuIpcGetMemHandle(0x%llx): %s", (unsigned long long)m->dptr, err);
    WK_SET_TEXT(r.error, text, err);
    WK_REPLY(w, req, gp_ipc_get_mem_handle_reply, &r);
}

WK_HANDLER(ipc_open_mem_handle)
{
    gp_ipc_open_mem_handle_reply r = {0};
    char err[1024] = "", text[1024];
    r.code = open_handle(w, m->handle, &r.dptr, err, sizeof err);
    if (r.code == CUDA_SUCCESS)
        w->ctl.ipc_shared = 1; /* never detached from now on (detach.c) */
    else
        wk_log("cuIpcOpenMemHandle: %s", err);
    WK_SET_TEXT(r.error, text, err);
    WK_REPLY(w, req, gp_ipc_open_mem_handle_reply, &r);
}

WK_HANDLER(ipc_close_mem_handle)
{
    gp_ipc_close_mem_handle_reply r = {.result = CUDA_SUCCESS};
    struct wk_obj *o = wk_idmap_get(&w->allocs, m->dptr);
    if (!o || o->kind != WK_ALLOC_IMPORTED) {
        r.result = CUDA_ERROR_INVALID_VALUE;
    } else {
        /* The driver waits for work that may use the mapping; so do we (as mem_free). */
        CUresult rc = WK_LONG(w, DRV(w, cuCtxSynchronize));
        if (rc != CUDA_SUCCESS)
            wk_warn("synchronising before cuIpcCloseMemHandle: %s", wk_err_name(w, rc));
        o = wk_idmap_del(&w->allocs, m->dptr);
        wk_obj_destroy_alloc(w, m->dptr, o);
        free(o);
    }
    WK_REPLY(w, req, gp_ipc_close_mem_handle_reply, &r);
}
