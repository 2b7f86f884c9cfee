/*
 * test_sim_graph.c: stream capture and graphs on the simulated device (worker/sim/sim_graph.c):
 * a capturing stream records instead of running, a graph replays what it recorded with the data
 * as it is at replay time, illegal calls invalidate the capture with the driver's codes.
 */
#include <stdint.h>

#include "sim_test.h"

enum {
    ILLEGAL_STATE = 401,
    CAPTURE_INVALIDATED = 901
};
enum {
    NONE = 0,
    ACTIVE = 1,
    INVALIDATED = 2
};
#define WORDS 1024

static int status(CUstream s)
{
    int st = -1;
    OK(cuStreamIsCapturing(s, &st));
    return st;
}

static uint32_t *host(CUdeviceptr d)
{
    return (uint32_t *)(uintptr_t)d; /* device memory is host memory at the same address */
}

static void test_capture_and_replay(void)
{
    sim_test_init();
    CUstream s;
    OK(cuStreamCreateWithPriority(&s, 0, 0));
    CUdeviceptr src, dst;
    OK(cuMemAlloc_v2(&src, WORDS * 4));
    OK(cuMemAlloc_v2(&dst, WORDS * 4));
    OK(cuMemsetD32_v2(dst, 0xdead, WORDS));
    CHECK_RC(cuStreamBeginCapture_v2(NULL, 0), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    CHECK_RC(cuStreamBeginCapture_v2(s, 3), CUDA_ERROR_INVALID_VALUE);
    CHECK_EQ(status(s), NONE);
    OK(cuStreamBeginCapture_v2(s, 0));
    CHECK_RC(cuStreamBeginCapture_v2(s, 0), ILLEGAL_STATE);
    CHECK_EQ(status(s), ACTIVE);
    OK(cuMemsetD32Async(dst, 5, WORDS, s));
    OK(cuMemcpyDtoDAsync_v2(dst, src, WORDS * 2, s)); /* first half of dst = src */
    CUevent e;
    OK(cuEventCreate(&e, 0));
    OK(cuEventRecord(e, s));        /* a captured event, no node */
    CHECK_EQ(host(dst)[0], 0xdead); /* nothing ran */
    CUgraph g = NULL;
    OK(cuStreamEndCapture(s, &g));
    CHECK(g != NULL);
    CHECK_EQ(status(s), NONE);
    CHECK_RC(cuEventQuery(e), CUDA_ERROR_INVALID_VALUE); /* as the real driver answers */
    size_t n = 0;
    OK(cuGraphGetNodes(g, NULL, &n));
    CHECK_EQ(n, 2);
    CUgraphExec x = NULL;
    OK(cuGraphInstantiateWithFlags(&x, g, 0));
    for (uint32_t r = 0; r < 3; r++) {
        OK(cuMemsetD32_v2(src, 100 + r, WORDS));
        OK(cuGraphLaunch(x, s));
        CHECK_EQ(host(dst)[0], 100 + r);
        CHECK_EQ(host(dst)[WORDS / 2 - 1], 100 + r);
        CHECK_EQ(host(dst)[WORDS / 2], 5);
        CHECK_EQ(host(dst)[WORDS - 1], 5);
    }
    OK(cuGraphUpload(x, s));
    OK(cuEventRecord(e, s));
    OK(cuEventQuery(e));
    OK(cuGraphExecDestroy(x));
    CHECK_RC(cuGraphExecDestroy(x), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuGraphLaunch(x, s), CUDA_ERROR_INVALID_VALUE);
    OK(cuGraphDestroy(g));
    CHECK_RC(cuGraphInstantiateWithFlags(&x, g, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuStreamEndCapture(s, &g), ILLEGAL_STATE);
}

static void test_illegal_calls_invalidate(void)
{
    sim_test_init();
    CUstream s;
    OK(cuStreamCreateWithPriority(&s, 0, 0));
    CUdeviceptr d;
    OK(cuMemAlloc_v2(&d, WORDS * 4));
    uint32_t buf[WORDS] = {0};

    /* synchronize: unsupported, then everything on the stream fails until the end */
    OK(cuStreamBeginCapture_v2(s, 0));
    OK(cuMemsetD32Async(d, 1, WORDS, s));
    CHECK_RC(cuStreamSynchronize(s), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    CHECK_EQ(status(s), INVALIDATED);
    CHECK_RC(cuMemsetD32Async(d, 1, WORDS, s), CAPTURE_INVALIDATED);
    CUgraph g = (CUgraph)(uintptr_t)1;
    CHECK_RC(cuStreamEndCapture(s, &g), CAPTURE_INVALIDATED);
    CHECK(g == NULL);
    CHECK_EQ(status(s), NONE);

    /* query, then a host copy */
    OK(cuStreamBeginCapture_v2(s, 2));
    CHECK_RC(cuStreamQuery(s), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    CHECK_RC(cuStreamEndCapture(s, &g), CAPTURE_INVALIDATED);
    OK(cuStreamBeginCapture_v2(s, 1));
    CHECK_RC(cuMemcpyHtoDAsync_v2(d, buf, sizeof buf, s), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    CHECK_RC(cuStreamEndCapture(s, &g), CAPTURE_INVALIDATED);

    /* the stream works normally afterwards; a stream destroyed while capturing frees its graph */
    OK(cuMemsetD32Async(d, 9, WORDS, s));
    OK(cuStreamSynchronize(s));
    CHECK_EQ(host(d)[WORDS - 1], 9);
    OK(cuStreamBeginCapture_v2(s, 0));
    OK(cuMemsetD32Async(d, 1, WORDS, s));
    OK(cuStreamDestroy_v2(s));
    CHECK_EQ(host(d)[0], 9);
}

SIM_TEST_MAIN(SIM_T(capture_and_replay), SIM_T(illegal_calls_invalidate))
