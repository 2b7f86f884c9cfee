/*
 * graphs.cu: stream capture and CUDA graphs as PyTorch uses them: capture on a side stream,
 * instantiate, replay many times with new inputs between replays.
 *
 *     graphs [replays]      (default 20)
 *
 * 1. capture status before, during and after a capture (cudaStreamIsCapturing,
 *    cudaStreamGetCaptureInfo), the thread's capture mode;
 * 2. capture memset + device-to-device copy + two gp_test_axpy launches + an event record on a
 *    non-blocking stream: nothing runs during the capture; 4 nodes (the event record is none:
 *    the event becomes a captured event);
 * 3. instantiate and replay, changing the input between replays: each replay computes from the
 *    input as it is then (y = 3 * in);
 * 4. illegal calls: synchronizing a capturing stream gives cudaErrorStreamCaptureUnsupported and
 *    invalidates the capture (end: cudaErrorStreamCaptureInvalidated); a host-to-device copy in a
 *    capture is refused the same way (gpupool cannot replay host memory on the server: the shim
 *    says so on stderr); capturing the legacy stream, beginning twice, ending without a capture;
 * 5. destroy, and the device is still fine.
 */
#include "gp_check.cuh"
#include "../sim/gp_test_kernels.cuh"

static const int N = 1 << 14;

static cudaStreamCaptureStatus status_of(cudaStream_t s)
{
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    CHECK(cudaStreamIsCapturing(s, &st));
    return st;
}

int main(int argc, char **argv)
{
    gp_begin("graphs");
    int replays = argc > 1 ? atoi(argv[1]) : 20;
    REQUIRE(cudaSetDevice(0));

    cudaStream_t s;
    REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    float *in = NULL, *x = NULL, *y = NULL, *hin = NULL, *hy = NULL;
    REQUIRE(cudaMalloc(&in, N * sizeof(float)));
    REQUIRE(cudaMalloc(&x, N * sizeof(float)));
    REQUIRE(cudaMalloc(&y, N * sizeof(float)));
    REQUIRE(cudaMallocHost(&hin, N * sizeof(float)));
    REQUIRE(cudaMallocHost(&hy, N * sizeof(float)));
    cudaEvent_t ev;
    REQUIRE(cudaEventCreate(&ev));

    /* y holds a sentinel: the capture must not run anything. */
    CHECK(cudaMemsetAsync(y, 0x7f, N * sizeof(float), s));
    CHECK(cudaStreamSynchronize(s));

    /* 1. status and mode */
    EXPECT(status_of(s) == cudaStreamCaptureStatusNone, "not capturing before the capture");
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    EXPECT(mode == cudaStreamCaptureModeGlobal, "the default thread mode is global, got %d",
           (int)mode);
    CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    EXPECT(mode == cudaStreamCaptureModeRelaxed, "exchange gives back relaxed, got %d", (int)mode);

    /* 2. capture */
    REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    EXPECT(status_of(s) == cudaStreamCaptureStatusActive, "capturing during the capture");
    cudaStreamCaptureStatus cst = cudaStreamCaptureStatusNone;
    unsigned long long id1 = 0;
    CHECK(cudaStreamGetCaptureInfo(s, &cst, &id1));
    EXPECT(cst == cudaStreamCaptureStatusActive && id1 != 0, "capture info: status %d id %llu",
           (int)cst, id1);
    EXPECT_ERR(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaErrorIllegalState);
    (void)cudaGetLastError(); /* the runtime keeps it as the last error */
    CHECK(cudaMemsetAsync(y, 0, N * sizeof(float), s));
    CHECK(cudaMemcpyAsync(x, in, N * sizeof(float), cudaMemcpyDeviceToDevice, s));
    gp_test_axpy<<<(N + 255) / 256, 256, 0, s>>>(2.0f, x, y, N); /* y = 2 in */
    CHECK(cudaGetLastError());
    gp_test_axpy<<<(N + 255) / 256, 256, 0, s>>>(1.0f, x, y, N); /* y = 3 in */
    CHECK(cudaGetLastError());
    CHECK(cudaEventRecord(ev, s));
    cudaGraph_t graph = NULL;
    REQUIRE(cudaStreamEndCapture(s, &graph));
    EXPECT(graph != NULL, "end capture gives a graph");
    EXPECT(status_of(s) == cudaStreamCaptureStatusNone, "not capturing after the capture");
    CHECK(cudaMemcpyAsync(hy, y, N * sizeof(float), cudaMemcpyDeviceToHost, s));
    CHECK(cudaStreamSynchronize(s));
    uint32_t sentinel = 0x7f7f7f7fu, word = 0;
    memcpy(&word, &hy[N - 1], 4);
    EXPECT(word == sentinel, "the capture ran work: y[N-1] = 0x%08x", word);

    /* 3. instantiate and replay with new inputs */
    size_t nodes = 0;
    CHECK(cudaGraphGetNodes(graph, NULL, &nodes));
    EXPECT(nodes == 4, "the graph has %zu nodes, expected 4 (memset, copy, 2 kernels)", nodes);
    cudaGraphExec_t exec = NULL;
    REQUIRE(cudaGraphInstantiate(&exec, graph, 0));
    for (int r = 0; r < replays; r++) {
        for (int i = 0; i < N; i++)
            hin[i] = (float)((i * 7 + r * 13) % 1000);
        CHECK(cudaMemcpyAsync(in, hin, N * sizeof(float), cudaMemcpyHostToDevice, s));
        CHECK(cudaGraphLaunch(exec, s));
        CHECK(cudaMemcpyAsync(hy, y, N * sizeof(float), cudaMemcpyDeviceToHost, s));
        CHECK(cudaStreamSynchronize(s));
        int bad = 0;
        for (int i = 0; i < N; i++)
            if (hy[i] != 3.0f * hin[i] && bad++ < 3)
                printf("  replay %d: y[%d] = %g, expected %g\n", r, i, hy[i], 3.0f * hin[i]);
        EXPECT(bad == 0, "replay %d: %d wrong values", r, bad);
    }
    /* An event recorded in a capture is no node: it stays a captured event until recorded
     * again outside a capture, and querying it is refused (the real driver, 580.x, answers
     * invalid value, not cudaErrorCapturedEvent). */
    EXPECT_ERR(cudaEventQuery(ev), cudaErrorInvalidValue);
    (void)cudaGetLastError();
    CHECK(cudaEventRecord(ev, s));
    CHECK(cudaEventSynchronize(ev));
    EXPECT_ERR(cudaEventQuery(ev), cudaSuccess);
    printf("replayed %d times\n", replays);

    /* 4a. synchronizing a capturing stream invalidates the capture */
    REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    unsigned long long id2 = 0;
    CHECK(cudaStreamGetCaptureInfo(s, &cst, &id2));
    EXPECT(id2 != id1 && id2 != 0, "a new capture has a new id (%llu, %llu)", id1, id2);
    CHECK(cudaMemsetAsync(y, 0, N * sizeof(float), s));
    EXPECT_ERR(cudaStreamSynchronize(s), cudaErrorStreamCaptureUnsupported);
    EXPECT(status_of(s) == cudaStreamCaptureStatusInvalidated, "invalidated after the sync");
    EXPECT_ERR(cudaEventRecord(ev, s), cudaErrorStreamCaptureInvalidated);
    (void)cudaGetLastError();
    cudaGraph_t bad_graph = (cudaGraph_t)&bad_graph;
    EXPECT_ERR(cudaStreamEndCapture(s, &bad_graph), cudaErrorStreamCaptureInvalidated);
    EXPECT(bad_graph == NULL, "no graph from an invalidated capture");
    EXPECT(status_of(s) == cudaStreamCaptureStatusNone, "not capturing after the end");
    (void)cudaGetLastError();

    /* 4b. a host-to-device copy in a capture: gpupool refuses it (the graph replays on the
     * server, where this process's memory is not); a real driver captures it. */
    REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    bad_graph = NULL;
    if (gp_through_gpupool()) {
        EXPECT_ERR(cudaMemcpyAsync(in, hin, N * sizeof(float), cudaMemcpyHostToDevice, s),
                   cudaErrorStreamCaptureUnsupported);
        EXPECT_ERR(cudaStreamEndCapture(s, &bad_graph), cudaErrorStreamCaptureInvalidated);
        (void)cudaGetLastError();
    } else {
        CHECK(cudaMemcpyAsync(in, hin, N * sizeof(float), cudaMemcpyHostToDevice, s));
        CHECK(cudaStreamEndCapture(s, &bad_graph));
        CHECK(cudaGraphDestroy(bad_graph));
    }

    /* 4c. what cannot be captured or ended */
    EXPECT_ERR(cudaStreamEndCapture(s, &bad_graph), cudaErrorIllegalState);
    (void)cudaGetLastError();
    EXPECT_ERR(cudaStreamBeginCapture(cudaStreamLegacy, cudaStreamCaptureModeGlobal),
               cudaErrorStreamCaptureUnsupported);
    (void)cudaGetLastError();

    /* the graph still replays after all that */
    for (int i = 0; i < N; i++)
        hin[i] = (float)(i % 100);
    CHECK(cudaMemcpyAsync(in, hin, N * sizeof(float), cudaMemcpyHostToDevice, s));
    CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaMemcpyAsync(hy, y, N * sizeof(float), cudaMemcpyDeviceToHost, s));
    CHECK(cudaStreamSynchronize(s));
    EXPECT(hy[N - 1] == 3.0f * hin[N - 1], "last replay: y[N-1] = %g", hy[N - 1]);

    /* 5. destroy */
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
    CHECK(cudaEventDestroy(ev));
    CHECK(cudaStreamDestroy(s));
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaFree(in));
    CHECK(cudaFree(x));
    CHECK(cudaFree(y));
    CHECK(cudaFreeHost(hin));
    CHECK(cudaFreeHost(hy));
    return gp_finish();
}
