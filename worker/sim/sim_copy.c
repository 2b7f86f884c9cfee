/*
 * sim_copy.c: copies and memsets. Streams are synchronous in the sim, so the Async variants do
 * the work before returning, after checking the stream handle.
 *
 * On a capturing stream (sim_stream.c) the Async device-side calls record into the graph instead;
 * host copies and 2D memsets are refused with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED.
 *
 * Every device range must lie entirely in device memory (sim_dev_range), else the call fails with
 * CUDA_ERROR_INVALID_VALUE, as the driver fails on a pointer it does not know; a zero-byte request
 * does nothing and succeeds. Host pointers cannot be checked: they are the caller's (the worker's
 * own buffers).
 */
#include <string.h>

#include "sim_api.h"
#include "sim_internal.h"

static void *dev_range(const char *op, uint64_t addr, uint64_t len)
{
    void *p = sim_dev_range(addr, len);
    if (!p)
        sim_detail("%s: [0x%llx, +%llu bytes) is not device memory", op, (unsigned long long)addr,
                   (unsigned long long)len);
    return p;
}

/* Context, then stream: the order in which the driver reports them. */
static CUresult enter_stream(CUstream s, bool check_stream)
{
    struct sim_ctx *c = NULL;
    CUresult rc = sim_enter_ctx(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (check_stream && (rc = sim_stream_check(s)) != CUDA_SUCCESS)
        return sim_leave(rc);
    return CUDA_SUCCESS;
}

/* Stream capture (sim_graph.c): *g is the graph an async call on s records into, or NULL (run
 * it now). A synchronous call runs at once (the sim does not model the legacy stream's implicit
 * synchronisation with capturing streams). */
static CUresult capture_target(CUstream s, bool async, struct sim_graph **g)
{
    *g = NULL;
    return async ? sim_capture_target(s, g) : CUDA_SUCCESS;
}

/* Host memory cannot be part of a graph in the sim: the capture is invalidated. */
static CUresult refuse_host_copy(const char *op, CUstream s, bool async)
{
    struct sim_graph *g = NULL;
    CUresult rc = capture_target(s, async, &g);
    if (rc != CUDA_SUCCESS || !g)
        return rc;
    sim_capture_invalidate(s);
    sim_detail("%s: copies of host memory cannot be captured on the simulated device", op);
    return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
}

static CUresult htod(CUdeviceptr dst, const void *src, size_t n, CUstream s, bool async)
{
    CUresult rc = enter_stream(s, async);
    if (rc != CUDA_SUCCESS)
        return rc;
    if ((rc = refuse_host_copy("cuMemcpyHtoDAsync", s, async)) != CUDA_SUCCESS)
        return sim_leave(rc);
    if (n == 0)
        return sim_leave(CUDA_SUCCESS);
    void *d = dev_range("cuMemcpyHtoD", dst, n);
    if (!src || !d)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    memcpy(d, src, n);
    return sim_leave(CUDA_SUCCESS);
}

static CUresult dtoh(void *dst, CUdeviceptr src, size_t n, CUstream s, bool async)
{
    CUresult rc = enter_stream(s, async);
    if (rc != CUDA_SUCCESS)
        return rc;
    if ((rc = refuse_host_copy("cuMemcpyDtoHAsync", s, async)) != CUDA_SUCCESS)
        return sim_leave(rc);
    if (n == 0)
        return sim_leave(CUDA_SUCCESS);
    const void *p = dev_range("cuMemcpyDtoH", src, n);
    if (!dst || !p)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    memcpy(dst, p, n);
    return sim_leave(CUDA_SUCCESS);
}

static CUresult dtod(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s, bool async)
{
    CUresult rc = enter_stream(s, async);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (n == 0)
        return sim_leave(CUDA_SUCCESS);
    void *d = dev_range("cuMemcpyDtoD destination", dst, n);
    const void *p = d ? dev_range("cuMemcpyDtoD source", src, n) : NULL;
    if (!d || !p)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    struct sim_graph *g = NULL;
    if ((rc = capture_target(s, async, &g)) != CUDA_SUCCESS)
        return sim_leave(rc);
    if (g) {
        struct sim_op op = {.kind = SIM_OP_DTOD, .dst = dst, .src = src, .n = n};
        return sim_leave(sim_graph_add(g, &op));
    }
    memmove(d, p, n); /* overlapping ranges are the caller's business, but must not be UB here */
    return sim_leave(CUDA_SUCCESS);
}

/* elem is 1, 2 or 4; the driver requires the destination aligned to it. */
CUresult sim_memset_run(uint64_t dst, unsigned value, size_t n, unsigned elem)
{
    if (n == 0)
        return CUDA_SUCCESS;
    if (dst % elem != 0 || n > SIZE_MAX / elem)
        return CUDA_ERROR_INVALID_VALUE;
    unsigned char *d = dev_range("cuMemset", dst, (uint64_t)n * elem);
    if (!d)
        return CUDA_ERROR_INVALID_VALUE;
    unsigned pattern = elem == 1 ? (value & 0xffu) : elem == 2 ? (value & 0xffffu) : value;
    if (pattern == 0) {
        /* Zeroing, what a scrub does to a whole GPU: whole pages are given back rather than
         * written (sim_zero_range). */
        sim_zero_range(dst, (uint64_t)n * elem);
    } else if (elem == 1) {
        memset(d, (int)(value & 0xff), n);
    } else if (elem == 2) {
        uint16_t v = (uint16_t)value;
        for (size_t i = 0; i < n; i++)
            memcpy(d + i * 2, &v, 2);
    } else {
        uint32_t v = value;
        for (size_t i = 0; i < n; i++)
            memcpy(d + i * 4, &v, 4);
    }
    return CUDA_SUCCESS;
}

static CUresult memset_n(CUdeviceptr dst, unsigned value, size_t n, unsigned elem, CUstream s,
                         bool async)
{
    CUresult rc = enter_stream(s, async);
    if (rc != CUDA_SUCCESS)
        return rc;
    struct sim_graph *g = NULL;
    if ((rc = capture_target(s, async, &g)) != CUDA_SUCCESS)
        return sim_leave(rc);
    if (g && n > 0) {
        /* Checked now, as the driver checks a memset node's parameters at capture. */
        if (dst % elem != 0 || n > SIZE_MAX / elem ||
            !dev_range("cuMemset", dst, (uint64_t)n * elem))
            return sim_leave(CUDA_ERROR_INVALID_VALUE);
        struct sim_op op = {
            .kind = SIM_OP_MEMSET, .dst = dst, .n = n, .value = value, .elem = elem};
        return sim_leave(sim_graph_add(g, &op));
    }
    return sim_leave(sim_memset_run(dst, value, n, elem));
}

/* A 2D memset: height rows of width elements, rows pitch bytes apart. The whole pitched span
 * must be device memory (it is one pitched allocation on the device). */
static CUresult memset_2d(CUdeviceptr dst, size_t pitch, unsigned value, size_t width,
                          size_t height, unsigned elem, CUstream s)
{
    CUresult rc = enter_stream(s, true);
    if (rc != CUDA_SUCCESS)
        return rc;
    struct sim_graph *g = NULL;
    if ((rc = capture_target(s, true, &g)) != CUDA_SUCCESS)
        return sim_leave(rc);
    if (g) {
        sim_capture_invalidate(s);
        sim_detail("cuMemsetD2D*Async cannot be captured on the simulated device");
        return sim_leave(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    if (width == 0 || height == 0)
        return sim_leave(CUDA_SUCCESS);
    if (dst % elem != 0 || pitch % elem != 0 || width > SIZE_MAX / elem || width * elem > pitch ||
        (height - 1) > (SIZE_MAX - width * elem) / pitch)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    uint64_t span = (uint64_t)(height - 1) * pitch + (uint64_t)width * elem;
    unsigned char *d = dev_range("cuMemsetD2D", dst, span);
    if (!d)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    uint16_t v16 = (uint16_t)value;
    uint32_t v32 = value;
    for (size_t r = 0; r < height; r++) {
        unsigned char *row = d + r * pitch;
        if (elem == 1)
            memset(row, (int)(value & 0xff), width);
        for (size_t i = 0; elem != 1 && i < width; i++)
            memcpy(row + i * elem, elem == 2 ? (const void *)&v16 : (const void *)&v32, elem);
    }
    return sim_leave(CUDA_SUCCESS);
}

CUresult gpupoolSimHostPointer(CUdeviceptr dptr, size_t size, void **host)
{
    CUresult rc = enter_stream(NULL, false);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!host || size == 0) {
        sim_detail("gpupoolSimHostPointer: %s", !host ? "no result pointer" : "empty range");
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    }
    void *p = dev_range("gpupoolSimHostPointer", dptr, size);
    if (!p)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    *host = p;
    return sim_leave(CUDA_SUCCESS);
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount)
{
    return htod(dstDevice, srcHost, ByteCount, NULL, false);
}

CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount)
{
    return dtoh(dstHost, srcDevice, ByteCount, NULL, false);
}

CUresult cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount)
{
    return dtod(dstDevice, srcDevice, ByteCount, NULL, false);
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                              CUstream hStream)
{
    return htod(dstDevice, srcHost, ByteCount, hStream, true);
}

CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                              CUstream hStream)
{
    return dtoh(dstHost, srcDevice, ByteCount, hStream, true);
}

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
                              CUstream hStream)
{
    return dtod(dstDevice, srcDevice, ByteCount, hStream, true);
}

CUresult cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N)
{
    return memset_n(dstDevice, uc, N, 1, NULL, false);
}

CUresult cuMemsetD16_v2(CUdeviceptr dstDevice, unsigned short us, size_t N)
{
    return memset_n(dstDevice, us, N, 2, NULL, false);
}

CUresult cuMemsetD32_v2(CUdeviceptr dstDevice, unsigned int ui, size_t N)
{
    return memset_n(dstDevice, ui, N, 4, NULL, false);
}

CUresult cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream)
{
    return memset_n(dstDevice, uc, N, 1, hStream, true);
}

CUresult cuMemsetD16Async(CUdeviceptr dstDevice, unsigned short us, size_t N, CUstream hStream)
{
    return memset_n(dstDevice, us, N, 2, hStream, true);
}

CUresult cuMemsetD32Async(CUdeviceptr dstDevice, unsigned int ui, size_t N, CUstream hStream)
{
    return memset_n(dstDevice, ui, N, 4, hStream, true);
}

CUresult cuMemsetD2D8Async(CUdeviceptr dstDevice, size_t dstPitch, unsigned char uc, size_t Width,
                           size_t Height, CUstream hStream)
{
    return memset_2d(dstDevice, dstPitch, uc, Width, Height, 1, hStream);
}

CUresult cuMemsetD2D16Async(CUdeviceptr dstDevice, size_t dstPitch, unsigned short us, size_t Width,
                            size_t Height, CUstream hStream)
{
    return memset_2d(dstDevice, dstPitch, us, Width, Height, 2, hStream);
}

CUresult cuMemsetD2D32Async(CUdeviceptr dstDevice, size_t dstPitch, unsigned int ui, size_t Width,
                            size_t Height, CUstream hStream)
{
    return memset_2d(dstDevice, dstPitch, ui, Width, Height, 4, hStream);
}
