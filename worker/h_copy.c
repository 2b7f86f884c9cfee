/*
 * h_copy.c: host<->device copies, and the device-side ones: device to device and memsets.
 *
 * Large copies go through two pinned staging buffers used alternately, each with an event that
 * completes when the device copy using it is done: while the device copies chunk n out of one
 * buffer, the socket fills (or drains) the other with chunk n+1, so network and PCIe transfers
 * overlap. Small copies go straight between the socket buffers and the device.
 *
 * The buffers are pinned "portable" memory allocated in the primary context (valid for every
 * context); events belong to one context, so they are (re)created in the current context when it
 * changes. Without pinned memory or events the same code runs synchronously.
 *
 * On the simulated device (the library exports gpupoolSimHostPointer), copies larger than that
 * move straight between the socket and the device memory, which is host memory there: the
 * staging buffers and the device copy (a CPU memcpy standing in for a GPU's DMA engine) are
 * skipped, so that the CPU does only what the remoting itself costs. Real drivers take the
 * staging path.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "worker.h"

static void events_destroy(struct worker *w)
{
    for (int i = 0; i < 2; i++) {
        if (w->st.ev[i]) {
            if (w->st.busy[i] && DRV(w, cuEventSynchronize, w->st.ev[i]) != CUDA_SUCCESS)
                wk_warn("waiting for a staging copy failed");
            if (DRV(w, cuEventDestroy, w->st.ev[i]) != CUDA_SUCCESS)
                wk_warn("destroying a staging event failed");
        }
        w->st.ev[i] = NULL;
        w->st.busy[i] = 0;
    }
    w->st.ev_ctx = 0;
}

void wk_staging_drop_events(struct worker *w, uint64_t ctx_id)
{
    if (w->st.ev_ctx == ctx_id)
        events_destroy(w);
}

void wk_staging_release(struct worker *w)
{
    events_destroy(w);
    for (int i = 0; i < 2; i++) {
        if (!w->st.buf[i])
            continue;
        if (w->st.pinned) {
            CUresult rc = DRV(w, cuMemFreeHost, w->st.buf[i]);
            if (rc != CUDA_SUCCESS)
                wk_warn("freeing a staging buffer: %s", wk_err_name(w, rc));
        } else {
            free(w->st.buf[i]);
        }
        w->st.buf[i] = NULL;
    }
    w->st.pinned = 0;
}

static int pinned_alloc(struct worker *w)
{
    if (!w->drv.cuMemHostAlloc || !w->drv.cuMemFreeHost)
        return -1;
    /* Allocate in the primary context: it outlives every context the client creates. */
    CUcontext cur = w->cur_ctx ? wk_ctx_handle(w, w->cur_ctx) : NULL;
    if (cur != w->primary && w->drv.cuCtxSetCurrent(w->primary) != CUDA_SUCCESS)
        return -1;
    int ok = 1;
    for (int i = 0; i < 2 && ok; i++) {
        CUresult rc = w->drv.cuMemHostAlloc(&w->st.buf[i], WK_CHUNK, CU_MEMHOSTALLOC_PORTABLE);
        if (rc != CUDA_SUCCESS) {
            wk_warn("pinned staging memory unavailable (%s); copies run synchronously",
                    wk_err_name(w, rc));
            w->st.buf[i] = NULL;
            ok = 0;
        }
    }
    if (!ok && w->st.buf[0]) {
        if (w->drv.cuMemFreeHost(w->st.buf[0]) != CUDA_SUCCESS)
            wk_warn("freeing a staging buffer failed");
        w->st.buf[0] = NULL;
    }
    if (cur != w->primary && w->drv.cuCtxSetCurrent(cur) != CUDA_SUCCESS)
        wk_warn("restoring the current context after allocating staging memory failed");
    return ok ? 0 : -1;
}

/* Staging buffers, and events in the current context when possible. 0, or -1 (out of memory). */
static int staging_ensure(struct worker *w)
{
    if (!w->st.buf[0]) {
        if (pinned_alloc(w) == 0) {
            w->st.pinned = 1;
        } else {
            w->st.buf[0] = malloc(WK_CHUNK);
            w->st.buf[1] = malloc(WK_CHUNK);
            if (!w->st.buf[0] || !w->st.buf[1]) {
                wk_staging_release(w);
                return -1;
            }
        }
    }
    if (w->st.pinned && w->cur_ctx != 0 && w->st.ev_ctx != w->cur_ctx) {
        events_destroy(w);
        for (int i = 0; i < 2; i++) {
            if (DRV(w, cuEventCreate, &w->st.ev[i], CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) {
                w->st.ev[i] = NULL;
                events_destroy(w); /* without both events we copy synchronously */
                return 0;
            }
        }
        w->st.ev_ctx = w->cur_ctx;
    }
    return 0;
}

/* Waits until buf[i] is free to reuse; returns the error of the copy that used it, if any. */
static CUresult staging_wait(struct worker *w, int i)
{
    if (!w->st.busy[i])
        return CUDA_SUCCESS;
    w->st.busy[i] = 0;
    /* The wait may be long: replies go out first. (A failed flush marks the connection dead;
     * we still wait, since the buffer must not be reused or freed under the copy.) */
    if (w->out_len > 0)
        (void)wk_io_flush(w);
    return DRV(w, cuEventSynchronize, w->st.ev[i]);
}

/* After queueing a copy that uses buf[i] on stream s: record its event, or, when we cannot,
 * wait for the stream (pageable copies are synchronous already). */
static CUresult staging_mark(struct worker *w, int i, CUstream s)
{
    if (!w->st.pinned)
        return CUDA_SUCCESS;
    if (w->st.ev[0] && w->st.ev_ctx == w->cur_ctx &&
        DRV(w, cuEventRecord, w->st.ev[i], s) == CUDA_SUCCESS) {
        w->st.busy[i] = 1;
        return CUDA_SUCCESS;
    }
    return DRV(w, cuStreamSynchronize, s);
}

/* The bulk data of a host-to-device copy, through the staging buffers. After an error the rest
 * of the data is still read (and dropped) to keep the stream in sync. -1: connection gone. */
static int htod_staged(struct worker *w, const gp_memcpy_htod *m, CUstream s, CUresult *rc)
{
    uint64_t n = m->data_len, done = 0;
    int i = 0;
    while (done < n) {
        size_t chunk = n - done < WK_CHUNK ? (size_t)(n - done) : WK_CHUNK;
        CUresult wr = staging_wait(w, i);
        if (*rc == CUDA_SUCCESS)
            *rc = wr;
        if ((wk_cz_copy(w, n) ? wk_cz_read(w, w->st.buf[i], chunk)
                              : wk_io_read_bulk(w, w->st.buf[i], chunk)) != 0)
            return -1;
        if (*rc == CUDA_SUCCESS)
            *rc = DRV_BUSY(w, cuMemcpyHtoDAsync, m->dst + done, w->st.buf[i], chunk, s);
        if (*rc == CUDA_SUCCESS)
            *rc = staging_mark(w, i, s);
        done += chunk;
        i ^= 1;
    }
    /* A synchronous copy is complete before the client's next frame runs. */
    for (int k = 0; k < 2 && !m->is_async; k++) {
        CUresult wr = staging_wait(w, k);
        if (*rc == CUDA_SUCCESS)
            *rc = wr;
    }
    return 0;
}

/* The simulated device (driver.h: sim_host_pointer): the bulk data of a host-to-device copy is
 * read from the socket straight into the device memory, with no staging buffer and no device
 * copy. The range is checked first; after an error the data is still read (and dropped). Streams
 * are synchronous in the sim, so every earlier call on any stream is complete and the copy is
 * complete (for a synchronous copy too) when this returns. -1: connection gone. */
static int htod_sim_direct(struct worker *w, const gp_memcpy_htod *m, CUresult *rc)
{
    void *dst = NULL;
    *rc = w->drv.sim_host_pointer(m->dst, (size_t)m->data_len, &dst);
    if (wk_cz_copy(w, m->data_len))
        return wk_cz_read(w, *rc == CUDA_SUCCESS ? dst : NULL, (size_t)m->data_len);
    return wk_io_read_bulk(w, *rc == CUDA_SUCCESS ? dst : NULL, m->data_len);
}

/* The largest copy that can name a valid device range: the client's whole VA window, or the
 * device's memory size where that is larger (the driver places module globals itself). */
static uint64_t copy_limit(const struct worker *w)
{
    return w->va_size > w->snap.total_mem ? w->va_size : w->snap.total_mem;
}

uint64_t wk_copy_limit(const struct worker *w)
{
    return copy_limit(w);
}

WK_HANDLER(memcpy_htod)
{
    uint64_t n = m->data_len;
    /* A length no device range can have comes from a broken or hostile client: its bulk (up to
     * 2^64 bytes) is not worth draining, and nothing it claims may reach the accounting. */
    if (n > copy_limit(w)) {
        wk_protocol_error(w, GP_OP_MEMCPY_HTOD,
                          "a host-to-device copy of %llu bytes is larger than any device range "
                          "(%llu bytes at most)",
                          (unsigned long long)n, (unsigned long long)copy_limit(w));
        return;
    }
    CUstream s;
    CUresult rc = wk_stream_get(w, m->stream, &s);
    int cz = wk_cz_copy(w, n); /* the bulk is LZ4 blocks (compress.c) */
    if (rc == CUDA_SUCCESS && !cz && n <= WK_SMALL_COPY && wk_io_buffered(w) >= n) {
        /* All in the input buffer: a pageable-source copy, done with the source on return. */
        if (n > 0)
            rc = DRV_BUSY(w, cuMemcpyHtoDAsync, m->dst, wk_io_buffered_ptr(w), n, s);
        wk_io_consume(w, n);
    } else if (rc == CUDA_SUCCESS && w->drv.sim_host_pointer && n <= SIZE_MAX) {
        if (htod_sim_direct(w, m, &rc) != 0)
            return;
    } else if (rc == CUDA_SUCCESS && staging_ensure(w) == 0) {
        if (htod_staged(w, m, s, &rc) != 0)
            return;
    } else {
        if (rc == CUDA_SUCCESS)
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        /* a failed call still consumes its data */
        if ((cz ? wk_cz_read(w, NULL, (size_t)n) : wk_io_read_bulk(w, NULL, n)) != 0)
            return;
    }
    /* Counted once the whole bulk has arrived (each branch above returns when the connection
     * failed first): the daemon's accounting sees only bytes that crossed the network. */
    w->stats.h2d_bytes += n;
    if (!cz) {
        w->cz.h2d_raw += n;
        w->cz.h2d_wire += n;
    }
    if (rc != CUDA_SUCCESS)
        wk_defer_error(w, GP_OP_MEMCPY_HTOD, rc, "copy of %llu bytes to device address 0x%llx",
                       (unsigned long long)n, (unsigned long long)m->dst);
}

/* A large device-to-host copy: the first chunk decides between an error reply and a data reply;
 * after that the reply is committed to `size` bytes, so a later failure sends zeros for the rest
 * and becomes the pending error. */
static void dtoh_staged(struct worker *w, uint64_t req, const gp_memcpy_dtoh *m, CUstream s)
{
    gp_memcpy_dtoh_reply r = {0};
    uint64_t n = m->size;
    if (wk_io_flush(w) != 0)
        return;
    if (n > UINT64_MAX - m->src) { /* a range that wraps the address space is never valid */
        r.result = CUDA_ERROR_INVALID_VALUE;
        WK_REPLY(w, req, gp_memcpy_dtoh_reply, &r);
        return;
    }
    if (staging_ensure(w) != 0) {
        r.result = CUDA_ERROR_OUT_OF_MEMORY;
        WK_REPLY(w, req, gp_memcpy_dtoh_reply, &r);
        return;
    }
    /* Both buffers may still feed an earlier asynchronous host-to-device copy. */
    CUresult rc = staging_wait(w, 0);
    CUresult rc1 = staging_wait(w, 1);
    if (rc == CUDA_SUCCESS)
        rc = rc1;
    size_t first = n < WK_CHUNK ? (size_t)n : WK_CHUNK;
    if (rc == CUDA_SUCCESS)
        rc = DRV_BUSY(w, cuMemcpyDtoHAsync, w->st.buf[0], m->src, first, s);
    if (rc == CUDA_SUCCESS)
        rc = staging_mark(w, 0, s);
    if (rc == CUDA_SUCCESS)
        rc = staging_wait(w, 0);
    /* Probe the last byte too: a range that runs off its allocation is refused now, while an
     * error reply is still possible. */
    if (rc == CUDA_SUCCESS && n > first) {
        rc = DRV_BUSY(w, cuMemcpyDtoHAsync, w->st.buf[1], m->src + n - 1, 1, s);
        if (rc == CUDA_SUCCESS)
            rc = staging_mark(w, 1, s);
        if (rc == CUDA_SUCCESS)
            rc = staging_wait(w, 1);
    }
    if (rc != CUDA_SUCCESS) {
        r.result = rc;
        WK_REPLY(w, req, gp_memcpy_dtoh_reply, &r);
        return;
    }
    r.data_len = n;
    WK_REPLY(w, req, gp_memcpy_dtoh_reply, &r);
    w->stats.d2h_bytes += n;

    CUresult late = CUDA_SUCCESS;
    uint64_t off = 0;
    int i = 0, raw_run = 0, cz = wk_cz_copy(w, n);
    if (!cz) {
        w->cz.d2h_raw += n;
        w->cz.d2h_wire += n;
    }
    while (off < n) {
        size_t len = n - off < WK_CHUNK ? (size_t)(n - off) : WK_CHUNK;
        uint64_t next = off + len;
        size_t nlen = n - next < WK_CHUNK ? (size_t)(n - next) : WK_CHUNK;
        /* Queue chunk n+1 into the other buffer, then send chunk n while the device works. */
        if (nlen > 0 && late == CUDA_SUCCESS) {
            late = DRV_BUSY(w, cuMemcpyDtoHAsync, w->st.buf[i ^ 1], m->src + next, nlen, s);
            if (late == CUDA_SUCCESS)
                late = staging_mark(w, i ^ 1, s);
        }
        if ((cz ? wk_cz_write(w, w->st.buf[i], len, &raw_run)
                : wk_io_write_direct(w, w->st.buf[i], len)) != 0)
            return;
        if (nlen > 0) {
            CUresult wr = staging_wait(w, i ^ 1);
            if (late == CUDA_SUCCESS)
                late = wr;
            if (late != CUDA_SUCCESS)
                memset(w->st.buf[i ^ 1], 0, nlen);
        }
        off = next;
        i ^= 1;
    }
    if (late != CUDA_SUCCESS)
        wk_defer_error(w, GP_OP_MEMCPY_DTOH, late, "copy of %llu bytes from device address 0x%llx",
                       (unsigned long long)n, (unsigned long long)m->src);
}

/* The simulated device: a large device-to-host copy is written to the socket straight from the
 * device memory. The whole range is checked before the reply, so an error is always an error
 * reply without data. Streams are synchronous in the sim: every earlier call is complete. */
static void dtoh_sim_direct(struct worker *w, uint64_t req, const gp_memcpy_dtoh *m)
{
    gp_memcpy_dtoh_reply r = {0};
    void *src = NULL;
    r.result = w->drv.sim_host_pointer(m->src, (size_t)m->size, &src);
    if (r.result != CUDA_SUCCESS) {
        WK_REPLY(w, req, gp_memcpy_dtoh_reply, &r);
        return;
    }
    r.data_len = m->size;
    WK_REPLY(w, req, gp_memcpy_dtoh_reply, &r);
    w->stats.d2h_bytes += m->size;
    if (wk_cz_copy(w, m->size)) {
        int raw_run = 0;
        (void)wk_cz_write(w, src, (size_t)m->size, &raw_run);
        return;
    }
    w->cz.d2h_raw += m->size;
    w->cz.d2h_wire += m->size;
    (void)wk_io_write_direct(w, src, (size_t)m->size); /* flushes the reply header first */
}

WK_HANDLER(memcpy_dtoh)
{
    gp_memcpy_dtoh_reply r = {0};
    CUstream s;
    r.result = wk_stream_get(w, m->stream, &s);
    /* A synchronous copy is a synchronising call: an earlier deferred error is its result. */
    if (r.result == CUDA_SUCCESS && !m->is_async)
        r.result = wk_sync_result(w, CUDA_SUCCESS);
    if (r.result != CUDA_SUCCESS || m->size == 0) {
        WK_REPLY(w, req, gp_memcpy_dtoh_reply, &r);
        return;
    }
    int large = m->size > WK_SMALL_COPY || wk_cz_copy(w, m->size); /* blocks: never the small way */
    if (large && w->drv.sim_host_pointer && m->size <= SIZE_MAX) {
        dtoh_sim_direct(w, req, m);
        return;
    }
    if (large) {
        dtoh_staged(w, req, m, s);
        return;
    }
    /* Small: copy straight into the output buffer behind the reply header. The destination is
     * pageable, so the call returns when the copy is complete. */
    r.data_len = m->size;
    size_t hdr = 16 + gp_memcpy_dtoh_reply_size(&r);
    uint8_t *p = wk_io_reserve(w, hdr + (size_t)m->size);
    if (!p)
        return;
    r.result = DRV_BUSY(w, cuMemcpyDtoHAsync, p + hdr, m->src, (size_t)m->size, s);
    if (r.result != CUDA_SUCCESS) {
        wk_io_unreserve(w, hdr + (size_t)m->size);
        r.data_len = 0;
        WK_REPLY(w, req, gp_memcpy_dtoh_reply, &r);
        return;
    }
    gp_memcpy_dtoh_reply_frame(p, req, &r);
    w->stats.d2h_bytes += m->size;
    w->cz.d2h_raw += m->size;
    w->cz.d2h_wire += m->size;
}

/* ============================================= device-side copies and memsets == */

WK_HANDLER(memcpy_dtod)
{
    CUstream s;
    CUresult rc = wk_stream_get(w, m->stream, &s);
    if (rc == CUDA_SUCCESS && m->size > 0)
        rc = DRV_BUSY(w, cuMemcpyDtoDAsync, m->dst, m->src, m->size, s);
    if (rc != CUDA_SUCCESS)
        wk_defer_error(w, GP_OP_MEMCPY_DTOD, rc, "copy of %llu bytes from 0x%llx to 0x%llx",
                       (unsigned long long)m->size, (unsigned long long)m->src,
                       (unsigned long long)m->dst);
}

WK_HANDLER(memset)
{
    CUstream s;
    CUresult rc = wk_stream_get(w, m->stream, &s);
    if (rc == CUDA_SUCCESS) {
        /* The synchronous variants are the same operation on the default stream; the client does
         * not wait for either, so the asynchronous call serves both. */
        switch (m->elem_size) {
        case 1:
            rc = DRV_BUSY(w, cuMemsetD8Async, m->dst, (unsigned char)m->value, m->count, s);
            break;
        case 2:
            rc = DRV_BUSY(w, cuMemsetD16Async, m->dst, (unsigned short)m->value, m->count, s);
            break;
        case 4:
            rc = DRV_BUSY(w, cuMemsetD32Async, m->dst, m->value, m->count, s);
            break;
        default:
            rc = CUDA_ERROR_INVALID_VALUE;
        }
    }
    if (rc != CUDA_SUCCESS)
        wk_defer_error(w, GP_OP_MEMSET, rc, "memset of %llu %u-byte elements at 0x%llx",
                       (unsigned long long)m->count, m->elem_size, (unsigned long long)m->dst);
}

WK_HANDLER(memset_2d)
{
    CUstream s;
    CUresult rc = wk_stream_get(w, m->stream, &s);
    if (rc == CUDA_SUCCESS) {
        switch (m->elem_size) {
        case 1:
            rc = DRV_BUSY(w, cuMemsetD2D8Async, m->dst, m->pitch, (unsigned char)m->value, m->width,
                          m->height, s);
            break;
        case 2:
            rc = DRV_BUSY(w, cuMemsetD2D16Async, m->dst, m->pitch, (unsigned short)m->value,
                          m->width, m->height, s);
            break;
        case 4:
            rc =
                DRV_BUSY(w, cuMemsetD2D32Async, m->dst, m->pitch, m->value, m->width, m->height, s);
            break;
        default:
            rc = CUDA_ERROR_INVALID_VALUE;
        }
    }
    if (rc != CUDA_SUCCESS)
        wk_defer_error(w, GP_OP_MEMSET_2D, rc, "2D memset of %llux%llu %u-byte elements at 0x%llx",
                       (unsigned long long)m->width, (unsigned long long)m->height, m->elem_size,
                       (unsigned long long)m->dst);
}

/* ============================================= the staging buffers for h_peer.c == */

int wk_staging_ready(struct worker *w)
{
    return staging_ensure(w);
}

CUresult wk_staging_mark(struct worker *w, int i, CUstream s)
{
    return staging_mark(w, i, s);
}

CUresult wk_staging_wait(struct worker *w, int i)
{
    return staging_wait(w, i);
}
