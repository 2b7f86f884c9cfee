/*
 * api_copy.c: copies (host to device, device to host, device to device, either way by address,
 * 2D) and memsets; the worker's side is worker/h_copy.c.
 *
 * - Host-to-device copies are checked against the VA map and pushed without a reply: the call
 *   returns once the data is in the socket or copied into the send batch, so the caller's buffer
 *   may be reused at once (the driver's pageable-copy semantic).
 * - Synchronous device-to-host copies wait, the data going straight from the socket into the
 *   destination. Asynchronous ones do not wait: the receiver thread writes the data into the
 *   destination before any later reply is delivered, so it is in place by the next
 *   synchronising call. Deviation: the driver makes an "async" copy into *pageable* memory
 *   synchronous; here it completes at the next synchronising call whatever the destination
 *   (programs read the result after synchronising, as CUDA requires for pinned memory).
 * - Mapped (zero-copy) host memory: its device alias is its host address (api_memory.c), which
 *   the remote GPU cannot reach; memsets and copies naming it are done here on this machine's
 *   memory, after the stream's earlier work (see "mapped host memory" below).
 * - A lease spread over servers (docs/multi-gpu.md, "Across servers"): a copy or memset goes to
 *   the connection of its context's part. One whose device pointer lies in another part's slice
 *   of the window goes to that part instead (elsewhere()): its worker runs it in the primary
 *   context of the address's device (go_to); the program's stream lives on its own part only,
 *   so the call waits for that stream first and then runs synchronously on the other part (the
 *   async forms too). A copy between two parts goes from server to server (api_peer.c), else
 *   through this process (copy_across).
 * The _ptds / _ptsz variants run the same code with the per-thread default stream.
 */
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

#include "compress.h"
#include "gp_graph.h"
#include "gp_vmm.h"
#include "shim.h"
#include "shim_core.h"

/* The stream argument of a synchronous call: the legacy default stream, or the per-thread
 * default stream for the _ptds variants. */
#define SYNC_STREAM(ptds) ((ptds) ? (uint64_t)(uintptr_t)CU_STREAM_PER_THREAD : 0)

/* ==================================================================== copies == */

/* A spread lease: the part holding device address a when it is not the part the thread's next
 * frame goes to, else -1 (always -1 for a lease of one server, at the cost of one load). */
static int other_part(uint64_t a)
{
    if (__builtin_expect(gp_conn_parts() == 1, 1))
        return -1;
    int p = gp_conn_part_of_addr(a);
    return p >= 0 && p != gp_conn_next_part() ? p : -1;
}

/* The device ordinal holding device address a on part p (from the range's context; else the
 * part's first device). */
static int device_of_addr(uint64_t a, int p)
{
    gp_range rg;
    const gp_ctx_obj *c = gp_conn_find_range(a, &rg) == 0 ? gp_ctx_obj_get(rg.ctx) : NULL;
    if (c && gp_conn_part_of_device(c->device) == p)
        return c->device;
    for (int d = 0; d < gp_device_count(); d++)
        if (gp_conn_part_of_device(d) == p)
            return d;
    return 0;
}

/* The thread's frames go to part p, in the primary context of the device holding a there: the
 * usual context switch (last_ctx_sent) goes out with the first frame, so that worker runs them
 * in a context that exists on the address's device whatever it had current before (none, after
 * the program destroyed its last context there). Returns the thread's own context for
 * come_back. */
static uint64_t go_to(int p, uint64_t a)
{
    uint64_t own = gp_conn_wire_ctx();
    gp_conn_use_ctx(GP_PRIMARY_CTX_OF(device_of_addr(a, p)));
    gp_conn_route(p);
    return own;
}

static void come_back(uint64_t own)
{
    gp_conn_route(-1);
    gp_conn_use_ctx(own);
}

/* The end of a call run on another part: wait there until the device has done it (a reply to
 * a ping would only say the frame was handled), so it is done when the call returns, before any
 * later work of the program on any part. */
static CUresult done_there(CUresult r)
{
    return r == CUDA_SUCCESS ? gp_stream_wait_wire(0) : r;
}

/* A capturing stream cannot hold a call of another part (its graph replays on its own part's
 * worker): the capture is invalidated and CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED returned, as for
 * a host copy in a capture (gp_capture_host_copy). CUDA_SUCCESS when not capturing. */
static CUresult capture_refuses_other_part(uint64_t wire)
{
    if (!gp_capture_sync_call(wire))
        return CUDA_SUCCESS;
    static atomic_int said;
    if (!atomic_exchange(&said, 1))
        gp_log_error("a copy or memset of memory on another server of the lease, on a capturing "
                     "stream, is not supported (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED; the "
                     "capture is invalidated): capture work of the stream's own server only");
    return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
}

/* Before a call runs on another part: the stream's earlier work (on the thread's own part) is
 * done, then the thread's frames go to part p (go_to). The caller runs the call on that worker's
 * legacy stream (wire 0), waits for it (done_there) and calls come_back(*own) after. */
static CUresult elsewhere(int p, uint64_t a, uint64_t wire, uint64_t *own)
{
    *own = gp_conn_wire_ctx();
    CUresult r = capture_refuses_other_part(wire);
    if (r != CUDA_SUCCESS)
        return r;
    r = gp_stream_wait_wire(wire);
    if (r == CUDA_SUCCESS)
        *own = go_to(p, a);
    return r;
}

static CUresult htod(CUdeviceptr dst, const void *src, size_t n, uint64_t wire, int is_async)
{
    if (n == 0)
        return CUDA_SUCCESS;
    if (!src || !gp_vamap_device_span(dst, n))
        return CUDA_ERROR_INVALID_VALUE;
    int p = other_part(dst);
    if (p >= 0) {
        uint64_t own;
        CUresult r = elsewhere(p, dst, wire, &own);
        if (r == CUDA_SUCCESS)
            r = done_there(htod(dst, src, n, 0, 0));
        come_back(own);
        return r;
    }
    gp_memcpy_htod m = {.dst = dst, .stream = wire, .is_async = (uint32_t)is_async, .data_len = n};
    GP_FRAME(buf, len, gp_memcpy_htod, &m);
    if (!buf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = gp_conn_lz4() && gp_cz_applies(n) ? gp_post_lz4(buf, len, src, n)
                                                   : gp_post(buf, len, src, n);
    GP_FRAME_FREE(buf);
    return r;
}

static CUresult dtoh_sync(void *dst, CUdeviceptr src, size_t n, uint64_t wire)
{
    if (n == 0)
        return CUDA_SUCCESS;
    if (!dst || !gp_vamap_device_span(src, n))
        return CUDA_ERROR_INVALID_VALUE;
    int p = other_part(src);
    if (p >= 0) { /* its reply says the copy is done: no more waiting there */
        uint64_t own;
        CUresult r = elsewhere(p, src, wire, &own);
        if (r == CUDA_SUCCESS)
            r = dtoh_sync(dst, src, n, 0);
        come_back(own);
        return r;
    }
    gp_memcpy_dtoh m = {.src = src, .size = n, .stream = wire, .is_async = 0};
    GP_FRAME(buf, len, gp_memcpy_dtoh, &m);
    if (!buf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    gp_reply rep;
    CUresult r = gp_request(buf, len, NULL, 0, dst, n, &rep);
    GP_FRAME_FREE(buf);
    if (r == CUDA_SUCCESS && rep.bulk_len != n)
        r = CUDA_ERROR_UNKNOWN;
    gp_reply_free(&rep);
    return gp_sync_result(r);
}

static CUresult dtoh_async(void *dst, CUdeviceptr src, size_t n, uint64_t wire)
{
    if (n == 0)
        return CUDA_SUCCESS;
    if (!dst || !gp_vamap_device_span(src, n))
        return CUDA_ERROR_INVALID_VALUE;
    if (other_part(src) >= 0)
        return dtoh_sync(dst, src, n, wire); /* another part: synchronous (elsewhere) */
    gp_memcpy_dtoh m = {.src = src, .size = n, .stream = wire, .is_async = 1};
    GP_FRAME(buf, len, gp_memcpy_dtoh, &m);
    if (!buf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = gp_request_detached(buf, len, dst, n);
    GP_FRAME_FREE(buf);
    return r;
}

/* A copy between two parts of a spread lease: server to server when the two servers can link
 * (api_peer.c, gp_spread_copy_direct; spread_copy in the client configuration), else through
 * this process: device to host from the
 * source part into a bounce buffer, host to device to the destination part, ACROSS_CHUNK at a
 * time. Pipelined: while chunk i is written to the destination, chunk i+1 is already asked of
 * the source (a detached read whose reply lands in the other buffer; a round trip on the source
 * then says it is in, replies coming in order). After the stream's earlier work (waited for
 * first) and before its later work (the writes are synchronous on the destination's worker, whose
 * connection carries the later frames of that part in order): synchronous, the async forms too.
 * The data crosses the network twice (docs/multi-gpu.md, "Across servers"). */
#define ACROSS_CHUNK ((size_t)8 << 20)

static CUresult dtoh_sync(void *dst, CUdeviceptr src, size_t n, uint64_t wire);
static CUresult htod(CUdeviceptr dst, const void *src, size_t n, uint64_t wire, int is_async);

/* Ask part ps for n bytes at src into dst, without waiting (its reply lands in dst). */
static CUresult across_read(void *dst, CUdeviceptr src, size_t n, int ps)
{
    gp_memcpy_dtoh m = {.src = src, .size = n, .stream = 0, .is_async = 0};
    GP_FRAME(buf, len, gp_memcpy_dtoh, &m);
    if (!buf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    uint64_t own = go_to(ps, src);
    CUresult r = gp_request_detached(buf, len, dst, n);
    come_back(own);
    GP_FRAME_FREE(buf);
    return r;
}

static CUresult copy_across(CUdeviceptr dst, int pd, CUdeviceptr src, int ps, size_t n,
                            uint64_t wire)
{
    CUresult r = capture_refuses_other_part(wire);
    if (r == CUDA_SUCCESS)
        r = gp_stream_wait_wire(wire);
    if (r != CUDA_SUCCESS)
        return r;
    int through_client = 1;
    r = gp_spread_copy_direct(dst, pd, GP_PRIMARY_CTX_OF(device_of_addr(dst, pd)), src, ps,
                              GP_PRIMARY_CTX_OF(device_of_addr(src, ps)), n, &through_client);
    if (!through_client)
        return gp_sync_result(r);
    size_t chunk = n < ACROSS_CHUNK ? n : ACROSS_CHUNK;
    uint8_t *bounce[2] = {malloc(chunk), malloc(chunk)};
    if (!bounce[0] || !bounce[1]) {
        free(bounce[0]);
        free(bounce[1]);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    uint64_t own = go_to(ps, src);
    r = dtoh_sync(bounce[0], src, chunk, 0); /* the first chunk */
    come_back(own);
    /* A wait for a read that failed because the part was lost (conn_fail wakes every waiter at
     * once) may return while the source's receiver is still reading that reply into a bounce
     * buffer: then the buffers are left to it, never freed (a leak of 2 chunks on a lost lease,
     * instead of a write into freed memory). Any other error (the server's, or a pending one of
     * earlier async work) comes after the whole reply was read: the buffers are freed. */
    int read_in_doubt = r == GP_LOST_CONNECTION_ERROR;
    for (size_t off = 0, i = 0; r == CUDA_SUCCESS && off < n; off += chunk, i++) {
        size_t len = n - off < chunk ? n - off : chunk;
        size_t next = off + len, next_len = n - next < chunk ? n - next : chunk;
        int reading = next < n && (r = across_read(bounce[(i + 1) % 2], src + next, next_len,
                                                   ps)) == CUDA_SUCCESS;
        /* a detached read whose request was half sent when the part was lost */
        read_in_doubt |= next < n && !reading && r == GP_LOST_CONNECTION_ERROR;
        if (r == CUDA_SUCCESS) {
            own = go_to(pd, dst);
            r = htod(dst + off, bounce[i % 2], len, 0, 0);
            come_back(own);
        }
        if (reading) { /* even after a failed write: the buffer must not go while read into */
            own = go_to(ps, src);
            CUresult rt = gp_round_trip(); /* the detached read is in once this returns */
            come_back(own);
            read_in_doubt |= rt != CUDA_SUCCESS; /* lost, or no ping sent: still outstanding */
            if (r == CUDA_SUCCESS)
                r = rt == CUDA_SUCCESS ? gp_take_pending_error() : rt; /* failed at the source */
        }
    }
    if (r == CUDA_SUCCESS) { /* the writes done on the destination's device before we return */
        own = go_to(pd, dst);
        r = done_there(r);
        come_back(own);
    }
    if (!read_in_doubt) {
        free(bounce[0]);
        free(bounce[1]);
    }
    return gp_sync_result(r);
}

static CUresult dtod(CUdeviceptr dst, CUdeviceptr src, size_t n, uint64_t wire, int is_async)
{
    if (n == 0)
        return CUDA_SUCCESS;
    if (!gp_vamap_device_span(dst, n) || !gp_vamap_device_span(src, n))
        return CUDA_ERROR_INVALID_VALUE;
    if (gp_conn_parts() > 1) {
        int ps = gp_conn_part_of_addr(src), pd = gp_conn_part_of_addr(dst);
        if (ps >= 0 && pd >= 0 && ps != pd)
            return copy_across(dst, pd, src, ps, n, wire);
        int p = other_part(src);
        if (p >= 0) { /* both on another part */
            uint64_t own;
            CUresult r = elsewhere(p, src, wire, &own);
            if (r == CUDA_SUCCESS)
                r = done_there(dtod(dst, src, n, 0, 0));
            come_back(own);
            return r;
        }
    }
    gp_memcpy_dtod m = {
        .dst = dst, .src = src, .size = n, .stream = wire, .is_async = (uint32_t)is_async};
    GP_FRAME(buf, len, gp_memcpy_dtod, &m);
    if (!buf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = gp_post(buf, len, NULL, 0);
    GP_FRAME_FREE(buf);
    return r;
}

/* Enter a call on `stream` (async) or on the default stream of a sync call. */
static CUresult enter(CUstream stream, int is_async, int ptds, uint64_t *wire)
{
    if (is_async)
        return gp_stream_enter(stream, wire);
    *wire = SYNC_STREAM(ptds);
    return gp_ctx_enter();
}

#define ENTER(stream, is_async, ptds)                                                              \
    uint64_t wire;                                                                                 \
    do {                                                                                           \
        CUresult er_ = enter((stream), (is_async), (ptds), &wire);                                 \
        if (er_ != CUDA_SUCCESS)                                                                   \
            return er_;                                                                            \
    } while (0)

/* ======================================================== mapped host memory == */

/* A copy or memset whose side is mapped host memory (cuMemHostAlloc'd or registered, named by
 * its device alias, which is its host address) cannot run on the remote GPU, but what the
 * program meant can run here, on its own memory. In stream order: the shim waits for the stream's
 * earlier work (an async device-to-host copy of it may still be landing in those bytes: replies
 * come in order, so they are in place once the wait returns) and then does it on this thread, as
 * cuLaunchHostFunc does (api_stream.c); work queued on the stream later is sent after it returns,
 * so it sees the result. The cost: a round trip, and an async call returns once it is done.
 * Kernels reading or writing the memory still cannot (api_memory.c says so once). */
static int mapped(uint64_t addr, size_t n)
{
    return n > 0 && gp_vamap_host_span(addr, n);
}

static CUresult host_to_host(uint64_t dst, uint64_t src, size_t n, uint64_t wire)
{
    if (!dst || !src)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = gp_stream_wait_wire(wire);
    if (r != CUDA_SUCCESS)
        return r;
    memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    return CUDA_SUCCESS;
}

/* A device-to-device copy with a mapped side: host to host, device to host into it, or host to
 * device from it as the stream's earlier work left it. */
static CUresult dtod_mapped(CUdeviceptr dst, int dst_mapped, CUdeviceptr src, int src_mapped,
                            size_t n, uint64_t wire, int is_async)
{
    CUresult r = is_async ? gp_capture_host_copy(wire, "cuMemcpyDtoDAsync (mapped host memory)")
                          : CUDA_SUCCESS;
    if (r != CUDA_SUCCESS)
        return r;
    if (dst_mapped && src_mapped)
        return host_to_host(dst, src, n, wire);
    if (dst_mapped)
        return is_async ? dtoh_async((void *)(uintptr_t)dst, src, n, wire)
                        : dtoh_sync((void *)(uintptr_t)dst, src, n, wire);
    if (!gp_vamap_device_span(dst, n))
        return CUDA_ERROR_INVALID_VALUE;
    r = gp_stream_wait_wire(wire);
    return r == CUDA_SUCCESS ? htod(dst, (const void *)(uintptr_t)src, n, wire, is_async) : r;
}

/* Fills `count` elements of `elem` bytes (1, 2 or 4) with the low bytes of `value`. */
static void fill(unsigned char *p, uint32_t value, uint32_t elem, size_t count)
{
    if (elem == 1) {
        memset(p, (int)(value & 0xffu), count);
        return;
    }
    uint16_t v16 = (uint16_t)value;
    for (size_t i = 0; i < count; i++)
        memcpy(p + i * elem, elem == 2 ? (const void *)&v16 : (const void *)&value, elem);
}

/* A memset of `height` rows `pitch` apart, each `width` elements, on mapped host memory. */
static CUresult memset_mapped(uint64_t dst, size_t pitch, uint32_t value, uint32_t elem,
                              size_t width, size_t height, uint64_t wire, int is_async)
{
    CUresult r =
        is_async ? gp_capture_host_copy(wire, "cuMemsetAsync (mapped host memory)") : CUDA_SUCCESS;
    if (r == CUDA_SUCCESS)
        r = gp_stream_wait_wire(wire);
    for (size_t i = 0; r == CUDA_SUCCESS && i < height; i++)
        fill((unsigned char *)(uintptr_t)(dst + i * pitch), value, elem, width);
    return r;
}

/* ============================================================ copies by kind == */

static CUresult copy_htod(CUdeviceptr dst, const void *src, size_t n, CUstream s, int is_async,
                          int ptds)
{
    ENTER(s, is_async, ptds);
    /* Host memory in a capture cannot replay on the server (api_graph.c). */
    CUresult cr = is_async ? gp_capture_host_copy(wire, "cuMemcpyHtoDAsync") : CUDA_SUCCESS;
    if (cr != CUDA_SUCCESS)
        return cr;
    if (mapped(dst, n))
        return host_to_host(dst, (uint64_t)(uintptr_t)src, n, wire);
    return htod(dst, src, n, wire, is_async);
}

static CUresult copy_dtoh(void *dst, CUdeviceptr src, size_t n, CUstream s, int is_async, int ptds)
{
    ENTER(s, is_async, ptds);
    CUresult cr = is_async ? gp_capture_host_copy(wire, "cuMemcpyDtoHAsync") : CUDA_SUCCESS;
    if (cr != CUDA_SUCCESS)
        return cr;
    if (mapped(src, n))
        return host_to_host((uint64_t)(uintptr_t)dst, src, n, wire);
    return is_async ? dtoh_async(dst, src, n, wire) : dtoh_sync(dst, src, n, wire);
}

static CUresult copy_dtod(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s, int is_async,
                          int ptds)
{
    ENTER(s, is_async, ptds);
    int dm = mapped(dst, n), sm = mapped(src, n);
    if (dm || sm)
        return dtod_mapped(dst, dm, src, sm, n, wire, is_async);
    return dtod(dst, src, n, wire, is_async);
}

GP_EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount)
{
    return copy_htod(dstDevice, srcHost, ByteCount, NULL, 0, 0);
}
GP_EXPORT CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dstDevice, const void *srcHost,
                                        size_t ByteCount)
{
    return copy_htod(dstDevice, srcHost, ByteCount, NULL, 0, 1);
}
GP_EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost,
                                        size_t ByteCount, CUstream hStream)
{
    return copy_htod(dstDevice, srcHost, ByteCount, hStream, 1, 0);
}
GP_EXPORT CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dstDevice, const void *srcHost,
                                             size_t ByteCount, CUstream hStream)
{
    return copy_htod(dstDevice, srcHost, ByteCount, gp_ptsz(hStream), 1, 0);
}

GP_EXPORT CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount)
{
    return copy_dtoh(dstHost, srcDevice, ByteCount, NULL, 0, 0);
}
GP_EXPORT CUresult cuMemcpyDtoH_v2_ptds(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount)
{
    return copy_dtoh(dstHost, srcDevice, ByteCount, NULL, 0, 1);
}
GP_EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                                        CUstream hStream)
{
    return copy_dtoh(dstHost, srcDevice, ByteCount, hStream, 1, 0);
}
GP_EXPORT CUresult cuMemcpyDtoHAsync_v2_ptsz(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                                             CUstream hStream)
{
    return copy_dtoh(dstHost, srcDevice, ByteCount, gp_ptsz(hStream), 1, 0);
}

/* Peer copies (issue 37): with unified addressing both pointers name their devices, so a copy
 * between two devices of the lease is a device-to-device copy on the server, GPU to GPU where
 * they are peers. The contexts are checked as the driver checks them. */
static CUresult copy_peer(CUdeviceptr dst, CUcontext dctx, CUdeviceptr src, CUcontext sctx,
                          size_t n, CUstream s, int is_async, int ptds)
{
    CUresult r = gp_check_init();
    if (r != CUDA_SUCCESS)
        return r;
    if (!gp_ctx_check(dctx) || !gp_ctx_check(sctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    return copy_dtod(dst, src, n, s, is_async, ptds);
}

GP_EXPORT CUresult cuMemcpyPeer(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,
                                CUcontext srcContext, size_t ByteCount)
{
    return copy_peer(dstDevice, dstContext, srcDevice, srcContext, ByteCount, NULL, 0, 0);
}
GP_EXPORT CUresult cuMemcpyPeer_ptds(CUdeviceptr dstDevice, CUcontext dstContext,
                                     CUdeviceptr srcDevice, CUcontext srcContext, size_t ByteCount)
{
    return copy_peer(dstDevice, dstContext, srcDevice, srcContext, ByteCount, NULL, 0, 1);
}
GP_EXPORT CUresult cuMemcpyPeerAsync(CUdeviceptr dstDevice, CUcontext dstContext,
                                     CUdeviceptr srcDevice, CUcontext srcContext, size_t ByteCount,
                                     CUstream hStream)
{
    return copy_peer(dstDevice, dstContext, srcDevice, srcContext, ByteCount, hStream, 1, 0);
}
GP_EXPORT CUresult cuMemcpyPeerAsync_ptsz(CUdeviceptr dstDevice, CUcontext dstContext,
                                          CUdeviceptr srcDevice, CUcontext srcContext,
                                          size_t ByteCount, CUstream hStream)
{
    return copy_peer(dstDevice, dstContext, srcDevice, srcContext, ByteCount, gp_ptsz(hStream), 1,
                     0);
}

GP_EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount)
{
    return copy_dtod(dstDevice, srcDevice, ByteCount, NULL, 0, 0);
}
GP_EXPORT CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr dstDevice, CUdeviceptr srcDevice,
                                        size_t ByteCount)
{
    return copy_dtod(dstDevice, srcDevice, ByteCount, NULL, 0, 1);
}
GP_EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice,
                                        size_t ByteCount, CUstream hStream)
{
    return copy_dtod(dstDevice, srcDevice, ByteCount, hStream, 1, 0);
}
GP_EXPORT CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr dstDevice, CUdeviceptr srcDevice,
                                             size_t ByteCount, CUstream hStream)
{
    return copy_dtod(dstDevice, srcDevice, ByteCount, gp_ptsz(hStream), 1, 0);
}

/* cuMemcpy without a direction (unified addressing): anything in the window or in a module
 * global is device memory, everything else is host memory. */
static int is_device(uint64_t a)
{
    if (gp_vamap_in_window(a))
        return 1;
    gp_range rg;
    return gp_vamap_find(a, &rg) == 0 && (rg.kind == GP_RANGE_DEVICE || rg.kind == GP_RANGE_GLOBAL);
}

static CUresult copy_any(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s, int is_async,
                         int ptds)
{
    ENTER(s, is_async, ptds);
    if (n == 0)
        return CUDA_SUCCESS;
    int dd = is_device(dst), sd = is_device(src);
    if (dd && sd)
        return dtod(dst, src, n, wire, is_async);
    CUresult cr = is_async ? gp_capture_host_copy(wire, "cuMemcpyAsync") : CUDA_SUCCESS;
    if (cr != CUDA_SUCCESS)
        return cr;
    if (dd)
        return htod(dst, (const void *)(uintptr_t)src, n, wire, is_async);
    if (sd) {
        return is_async ? dtoh_async((void *)(uintptr_t)dst, src, n, wire)
                        : dtoh_sync((void *)(uintptr_t)dst, src, n, wire);
    }
    /* Host to host: earlier work of the stream may still be writing the source (an async
     * device-to-host copy), so wait for the stream first, then copy here. */
    return host_to_host(dst, src, n, wire);
}

GP_EXPORT CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount)
{
    return copy_any(dst, src, ByteCount, NULL, 0, 0);
}
GP_EXPORT CUresult cuMemcpy_ptds(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount)
{
    return copy_any(dst, src, ByteCount, NULL, 0, 1);
}
GP_EXPORT CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount,
                                 CUstream hStream)
{
    return copy_any(dst, src, ByteCount, hStream, 1, 0);
}
GP_EXPORT CUresult cuMemcpyAsync_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount,
                                      CUstream hStream)
{
    return copy_any(dst, src, ByteCount, gp_ptsz(hStream), 1, 0);
}

/* ================================================================ 2D copies == */

/* cuMemcpy2D: a rectangle of Height rows of WidthInBytes, each side with its own pitch. It travels
 * as the 1D copies above, so it has their chunking, compression and ordering:
 *   - a side whose rows are contiguous (pitch == width) is one span;
 *   - host to device: host rows are gathered into one buffer when the device rows are
 *     contiguous, else each row is its own copy (posted, no round trip);
 *   - device to host: one copy into a buffer scattered to the host rows when the device rows are
 *     contiguous and the copy is synchronous, else each row is its own copy (replies land in the
 *     host rows; a synchronous copy then waits for its stream once);
 *   - device to device: one copy when both sides are contiguous, else one per row.
 * So a rectangle whose device side is pitched costs a message per row. CUDA arrays (textures)
 * are not supported by gpupool at all. */
typedef struct {
    int device; /* 1: device memory, 0: host memory */
    int alias;  /* declared device memory, but it is mapped host memory (its device alias) */
    uint64_t addr;
    size_t pitch;
} side_2d;

static CUresult resolve_side(CUmemorytype type, const void *host, CUdeviceptr dev, size_t x,
                             size_t y, size_t pitch, size_t width, size_t height, side_2d *out)
{
    uint64_t base;
    switch (type) {
    case CU_MEMORYTYPE_HOST:
        base = (uint64_t)(uintptr_t)host;
        out->device = 0;
        break;
    case CU_MEMORYTYPE_DEVICE:
        base = dev;
        out->device = 1;
        break;
    case CU_MEMORYTYPE_UNIFIED:
        base = dev;
        out->device = is_device(dev);
        break;
    case CU_MEMORYTYPE_ARRAY: {
        static atomic_int said;
        if (atomic_exchange(&said, 1) == 0)
            gp_log_error("cuMemcpy2D: CUDA arrays are not supported by gpupool; copy to or from "
                         "linear device memory instead (CUDA_ERROR_NOT_SUPPORTED; said once "
                         "per process)");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (base == 0 || (height > 1 && pitch < width))
        return CUDA_ERROR_INVALID_VALUE;
    /* The first and the last byte touched must not wrap around the address space. */
    uint64_t first, last;
    if (__builtin_mul_overflow((uint64_t)y, (uint64_t)pitch, &first) ||
        __builtin_add_overflow(first, base, &first) || __builtin_add_overflow(first, x, &first) ||
        __builtin_mul_overflow((uint64_t)(height - 1), (uint64_t)pitch, &last) ||
        __builtin_add_overflow(last, first, &last) || __builtin_add_overflow(last, width, &last))
        return CUDA_ERROR_INVALID_VALUE;
    out->addr = first;
    out->pitch = height > 1 ? pitch : width;
    out->alias = out->device && gp_vamap_host_span(first, last - first);
    if (out->alias)
        out->device = 0; /* mapped host memory: done here (see "mapped host memory" above) */
    return CUDA_SUCCESS;
}

static CUresult copy_2d(const CUDA_MEMCPY2D *p, CUstream s, int is_async, int ptds)
{
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    ENTER(s, is_async, ptds);
    size_t w = p->WidthInBytes, h = p->Height;
    if (w == 0 || h == 0)
        return CUDA_SUCCESS;
    if (h > SIZE_MAX / w)
        return CUDA_ERROR_INVALID_VALUE;
    side_2d src, dst;
    CUresult r = resolve_side(p->srcMemoryType, p->srcHost, p->srcDevice, p->srcXInBytes, p->srcY,
                              p->srcPitch, w, h, &src);
    if (r == CUDA_SUCCESS)
        r = resolve_side(p->dstMemoryType, p->dstHost, p->dstDevice, p->dstXInBytes, p->dstY,
                         p->dstPitch, w, h, &dst);
    if (r != CUDA_SUCCESS)
        return r;
    if (!src.device && !dst.device) { /* host to host, after the stream's earlier work */
        r = gp_stream_wait_wire(wire);
        for (size_t i = 0; r == CUDA_SUCCESS && i < h; i++)
            memmove((void *)(uintptr_t)(dst.addr + i * dst.pitch),
                    (const void *)(uintptr_t)(src.addr + i * src.pitch), w);
        return r;
    }
    if (src.device != dst.device) {
        r = is_async ? gp_capture_host_copy(wire, "cuMemcpy2DAsync") : CUDA_SUCCESS;
        if (r != CUDA_SUCCESS)
            return r;
    }
    int src_packed = src.pitch == w, dst_packed = dst.pitch == w;
    if (src.device && dst.device) {
        if (src_packed && dst_packed)
            return dtod(dst.addr, src.addr, w * h, wire, is_async);
        for (size_t i = 0; r == CUDA_SUCCESS && i < h; i++)
            r = dtod(dst.addr + i * dst.pitch, src.addr + i * src.pitch, w, wire, is_async);
        return r;
    }
    if (dst.device) { /* host to device */
        /* Mapped host memory as the stream's earlier work left it, as dtod_mapped reads it. */
        if (src.alias)
            r = gp_stream_wait_wire(wire);
        if (r != CUDA_SUCCESS)
            return r;
        if (src_packed && dst_packed)
            return htod(dst.addr, (const void *)(uintptr_t)src.addr, w * h, wire, is_async);
        if (dst_packed) {
            unsigned char *staged = malloc(w * h);
            if (!staged)
                return CUDA_ERROR_OUT_OF_MEMORY;
            for (size_t i = 0; i < h; i++)
                memcpy(staged + i * w, (const void *)(uintptr_t)(src.addr + i * src.pitch), w);
            r = htod(dst.addr, staged, w * h, wire, is_async); /* sent before it returns */
            free(staged);
            return r;
        }
        for (size_t i = 0; r == CUDA_SUCCESS && i < h; i++)
            r = htod(dst.addr + i * dst.pitch, (const void *)(uintptr_t)(src.addr + i * src.pitch),
                     w, wire, is_async);
        return r;
    }
    /* device to host */
    if (src_packed && dst_packed) {
        void *to = (void *)(uintptr_t)dst.addr;
        return is_async ? dtoh_async(to, src.addr, w * h, wire)
                        : dtoh_sync(to, src.addr, w * h, wire);
    }
    if (src_packed && !is_async) {
        unsigned char *staged = malloc(w * h);
        if (!staged)
            return CUDA_ERROR_OUT_OF_MEMORY;
        r = dtoh_sync(staged, src.addr, w * h, wire);
        for (size_t i = 0; r == CUDA_SUCCESS && i < h; i++)
            memcpy((void *)(uintptr_t)(dst.addr + i * dst.pitch), staged + i * w, w);
        free(staged);
        return r;
    }
    for (size_t i = 0; r == CUDA_SUCCESS && i < h; i++)
        r = dtoh_async((void *)(uintptr_t)(dst.addr + i * dst.pitch), src.addr + i * src.pitch, w,
                       wire);
    if (r == CUDA_SUCCESS && !is_async)
        r = gp_stream_wait_wire(wire);
    return r;
}

GP_EXPORT CUresult cuMemcpy2D_v2(const CUDA_MEMCPY2D *pCopy)
{
    return copy_2d(pCopy, NULL, 0, 0);
}
GP_EXPORT CUresult cuMemcpy2D_v2_ptds(const CUDA_MEMCPY2D *pCopy)
{
    return copy_2d(pCopy, NULL, 0, 1);
}
/* "Unaligned" lifts the driver's pitch alignment rules for arrays; with linear memory only, it is
 * the same copy. */
GP_EXPORT CUresult cuMemcpy2DUnaligned_v2(const CUDA_MEMCPY2D *pCopy)
{
    return copy_2d(pCopy, NULL, 0, 0);
}
GP_EXPORT CUresult cuMemcpy2DUnaligned_v2_ptds(const CUDA_MEMCPY2D *pCopy)
{
    return copy_2d(pCopy, NULL, 0, 1);
}
GP_EXPORT CUresult cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D *pCopy, CUstream hStream)
{
    return copy_2d(pCopy, hStream, 1, 0);
}
GP_EXPORT CUresult cuMemcpy2DAsync_v2_ptsz(const CUDA_MEMCPY2D *pCopy, CUstream hStream)
{
    return copy_2d(pCopy, gp_ptsz(hStream), 1, 0);
}

/* =================================================================== memsets == */

/* A memset outside the device memory this process allocated through gpupool fails as with the
 * driver (invalid value), silently like the driver's, except where it starts in host memory but
 * runs past its end: mapped host memory (JAX/XLA memsets it) is set here (memset_mapped), so a
 * memset that fails there most likely has a wrong size: once per process a line says so. */
static CUresult memset_outside(uint64_t addr, uint64_t len)
{
    static atomic_int said;
    gp_range rg;
    if (gp_vamap_find(addr, &rg) == 0 &&
        (rg.kind == GP_RANGE_HOST_ALLOC || rg.kind == GP_RANGE_HOST_REG) &&
        atomic_exchange(&said, 1) == 0)
        gp_log_error("memset of %llu bytes at 0x%llx runs past the end of the host memory there "
                     "(%llu bytes at 0x%llx); it fails with CUDA_ERROR_INVALID_VALUE: check the "
                     "size (said once per process)",
                     (unsigned long long)len, (unsigned long long)addr, (unsigned long long)rg.size,
                     (unsigned long long)rg.base);
    return CUDA_ERROR_INVALID_VALUE;
}

static CUresult memset_1d(CUdeviceptr dst, uint32_t value, uint32_t elem, size_t count, CUstream s,
                          int is_async, int ptds)
{
    ENTER(s, is_async, ptds);
    if (count == 0)
        return CUDA_SUCCESS;
    if (dst % elem != 0 || count > UINT64_MAX / elem)
        return CUDA_ERROR_INVALID_VALUE;
    if (mapped(dst, (size_t)count * elem))
        return memset_mapped(dst, (size_t)count * elem, value, elem, count, 1, wire, is_async);
    if (!gp_vamap_device_span(dst, (uint64_t)count * elem))
        return memset_outside(dst, (uint64_t)count * elem);
    gp_memset m = {.dst = dst,
                   .value = value,
                   .elem_size = elem,
                   .count = count,
                   .stream = wire,
                   .is_async = (uint32_t)is_async};
    int p = other_part(dst);
    uint64_t own = 0;
    if (p >= 0) { /* another part: after the stream, synchronous there (elsewhere) */
        CUresult er = elsewhere(p, dst, wire, &own);
        if (er != CUDA_SUCCESS)
            return er;
        m.stream = 0;
        m.is_async = 0;
    }
    GP_FRAME(buf, len, gp_memset, &m);
    CUresult r = buf ? gp_post(buf, len, NULL, 0) : CUDA_ERROR_OUT_OF_MEMORY;
    if (p >= 0) {
        r = done_there(r);
        come_back(own);
    }
    if (buf)
        GP_FRAME_FREE(buf);
    return r;
}

static CUresult memset_2d(CUdeviceptr dst, size_t pitch, uint32_t value, uint32_t elem,
                          size_t width, size_t height, CUstream s, int is_async, int ptds)
{
    ENTER(s, is_async, ptds);
    if (width == 0 || height == 0)
        return CUDA_SUCCESS;
    if (dst % elem != 0 || width > UINT64_MAX / elem)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t row = (uint64_t)width * elem;
    if (height > 1 && (pitch < row || (height - 1) > (UINT64_MAX - row) / pitch))
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t span = (uint64_t)pitch * (height - 1) + row;
    if (mapped(dst, span))
        return memset_mapped(dst, pitch, value, elem, width, height, wire, is_async);
    if (!gp_vamap_device_span(dst, span))
        return memset_outside(dst, span);
    gp_memset_2d m = {.dst = dst,
                      .pitch = pitch,
                      .value = value,
                      .elem_size = elem,
                      .width = width,
                      .height = height,
                      .stream = wire,
                      .is_async = (uint32_t)is_async};
    int p = other_part(dst);
    uint64_t own = 0;
    if (p >= 0) { /* another part: after the stream, synchronous there (elsewhere) */
        CUresult er = elsewhere(p, dst, wire, &own);
        if (er != CUDA_SUCCESS)
            return er;
        m.stream = 0;
        m.is_async = 0;
    }
    GP_FRAME(buf, len, gp_memset_2d, &m);
    CUresult r = buf ? gp_post(buf, len, NULL, 0) : CUDA_ERROR_OUT_OF_MEMORY;
    if (p >= 0) {
        r = done_there(r);
        come_back(own);
    }
    if (buf)
        GP_FRAME_FREE(buf);
    return r;
}

#define GP_MEMSET_1D(suffix, T, elem)                                                              \
    GP_EXPORT CUresult cuMemsetD##suffix##_v2(CUdeviceptr d, T v, size_t n)                        \
    {                                                                                              \
        return memset_1d(d, v, elem, n, NULL, 0, 0);                                               \
    }                                                                                              \
    GP_EXPORT CUresult cuMemsetD##suffix##_v2_ptds(CUdeviceptr d, T v, size_t n)                   \
    {                                                                                              \
        return memset_1d(d, v, elem, n, NULL, 0, 1);                                               \
    }                                                                                              \
    GP_EXPORT CUresult cuMemsetD##suffix##Async(CUdeviceptr d, T v, size_t n, CUstream s)          \
    {                                                                                              \
        return memset_1d(d, v, elem, n, s, 1, 0);                                                  \
    }                                                                                              \
    GP_EXPORT CUresult cuMemsetD##suffix##Async_ptsz(CUdeviceptr d, T v, size_t n, CUstream s)     \
    {                                                                                              \
        return memset_1d(d, v, elem, n, gp_ptsz(s), 1, 0);                                         \
    }

#define GP_MEMSET_2D(suffix, T, elem)                                                              \
    GP_EXPORT CUresult cuMemsetD2D##suffix##_v2(CUdeviceptr d, size_t p, T v, size_t w, size_t h)  \
    {                                                                                              \
        return memset_2d(d, p, v, elem, w, h, NULL, 0, 0);                                         \
    }                                                                                              \
    GP_EXPORT CUresult cuMemsetD2D##suffix##_v2_ptds(CUdeviceptr d, size_t p, T v, size_t w,       \
                                                     size_t h)                                     \
    {                                                                                              \
        return memset_2d(d, p, v, elem, w, h, NULL, 0, 1);                                         \
    }                                                                                              \
    GP_EXPORT CUresult cuMemsetD2D##suffix##Async(CUdeviceptr d, size_t p, T v, size_t w,          \
                                                  size_t h, CUstream s)                            \
    {                                                                                              \
        return memset_2d(d, p, v, elem, w, h, s, 1, 0);                                            \
    }                                                                                              \
    GP_EXPORT CUresult cuMemsetD2D##suffix##Async_ptsz(CUdeviceptr d, size_t p, T v, size_t w,     \
                                                       size_t h, CUstream s)                       \
    {                                                                                              \
        return memset_2d(d, p, v, elem, w, h, gp_ptsz(s), 1, 0);                                   \
    }

GP_MEMSET_1D(8, unsigned char, 1)
GP_MEMSET_1D(16, unsigned short, 2)
GP_MEMSET_1D(32, unsigned int, 4)
GP_MEMSET_2D(8, unsigned char, 1)
GP_MEMSET_2D(16, unsigned short, 2)
GP_MEMSET_2D(32, unsigned int, 4)
