/*
 * events.cu: events on two streams: record, query, synchronize, wait, elapsed time.
 *
 *     events [spin_ms]      (default 50)
 *
 * gp_test_spin(ns) busy-waits on the device (on the simulated device: on the worker's host), so
 * the time between events recorded around it must be at least about that long. The bounds are
 * generous: the machines that run the tests are noisy.
 */
#include "gp_check.cuh"
#include "../sim/gp_test_kernels.cuh"

int main(int argc, char **argv)
{
    gp_begin("events");
    double spin_ms = argc > 1 ? atof(argv[1]) : 50.0;
    unsigned long long spin_ns = (unsigned long long)(spin_ms * 1e6);
    REQUIRE(cudaSetDevice(0));

    cudaStream_t s1, s2;
    REQUIRE(cudaStreamCreate(&s1));
    REQUIRE(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    cudaEvent_t e0, e1, e2, e3, nt;
    REQUIRE(cudaEventCreate(&e0));
    REQUIRE(cudaEventCreate(&e1));
    REQUIRE(cudaEventCreateWithFlags(&e2, cudaEventDefault));
    REQUIRE(cudaEventCreateWithFlags(&e3, cudaEventBlockingSync));
    REQUIRE(cudaEventCreateWithFlags(&nt, cudaEventDisableTiming));

    /* an event never recorded is complete */
    EXPECT_ERR(cudaEventQuery(e0), cudaSuccess);
    CHECK(cudaEventSynchronize(e0));
    CHECK(cudaStreamQuery(s1));

    /* 1. elapsed time around a spin on one stream */
    CHECK(cudaEventRecord(e0, s1));
    gp_test_spin<<<1, 1, 0, s1>>>(spin_ns);
    CHECK(cudaGetLastError());
    CHECK(cudaEventRecord(e1, s1));
    cudaError_t q = cudaEventQuery(e1);
    EXPECT(q == cudaSuccess || q == cudaErrorNotReady, "cudaEventQuery right after record: %s",
           cudaGetErrorName(q));
    printf("query right after recording behind a %.0f ms spin: %s\n", spin_ms, cudaGetErrorName(q));
    CHECK(cudaEventSynchronize(e1));
    EXPECT_ERR(cudaEventQuery(e1), cudaSuccess);
    EXPECT_ERR(cudaEventQuery(e0), cudaSuccess);
    CHECK(cudaStreamQuery(s1));
    float ms = -1;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    printf("elapsed e0->e1 = %.3f ms (spin %.1f ms)\n", ms, spin_ms);
    EXPECT(ms >= 0.8 * spin_ms, "elapsed %.3f ms < 0.8 x spin %.1f ms", ms, spin_ms);
    EXPECT(ms < 100.0 * spin_ms + 5000.0, "elapsed %.3f ms is absurdly long", ms);
    float back = 1;
    CHECK(cudaEventElapsedTime(&back, e1, e0));
    EXPECT(back <= 0.0f, "elapsed e1->e0 = %.3f ms, expected <= 0", back);

    /* 2. cross-stream ordering: s2 waits for s1's event, then reads what s1 wrote */
    const int n = 1 << 16;
    float *x = NULL, *y = NULL, *hy = NULL, *hx = NULL;
    REQUIRE(cudaMalloc(&x, n * sizeof(float)));
    REQUIRE(cudaMalloc(&y, n * sizeof(float)));
    REQUIRE(cudaMallocHost(&hy, n * sizeof(float)));
    REQUIRE(cudaMallocHost(&hx, n * sizeof(float)));
    for (int i = 0; i < n; i++) {
        hx[i] = (float)(i % 1000);
        hy[i] = -1.0f;
    }
    CHECK(cudaMemcpyAsync(x, hx, n * sizeof(float), cudaMemcpyHostToDevice, s1));
    CHECK(cudaMemsetAsync(y, 0, n * sizeof(float), s1));
    CHECK(cudaEventRecord(e2, s1));
    gp_test_spin<<<1, 1, 0, s1>>>(spin_ns / 2);
    gp_test_axpy<<<(n + 255) / 256, 256, 0, s1>>>(2.0f, x, y, n); /* y = 2x */
    CHECK(cudaGetLastError());
    CHECK(cudaEventRecord(e3, s1));
    CHECK(cudaStreamWaitEvent(s2, e3, 0));
    gp_test_axpy<<<(n + 255) / 256, 256, 0, s2>>>(1.0f, x, y, n); /* y = 3x, only after s1 */
    CHECK(cudaMemcpyAsync(hy, y, n * sizeof(float), cudaMemcpyDeviceToHost, s2));
    CHECK(cudaEventRecord(nt, s2));
    CHECK(cudaEventSynchronize(nt));
    EXPECT_ERR(cudaEventQuery(e3), cudaSuccess); /* s2 waited for it, so it is complete */
    int bad = -1;
    for (int i = 0; i < n && bad < 0; i++)
        if (hy[i] != 3.0f * hx[i])
            bad = i;
    EXPECT(bad < 0, "cross-stream wait: y[%d] = %g, expected %g", bad, bad >= 0 ? hy[bad] : 0.0,
           bad >= 0 ? 3.0 * hx[bad] : 0.0);
    CHECK(cudaEventElapsedTime(&ms, e2, e3));
    printf("elapsed e2->e3 = %.3f ms (spin %.1f ms)\n", ms, spin_ms / 2);
    EXPECT(ms >= 0.8 * spin_ms / 2, "elapsed %.3f ms < 0.8 x spin %.1f ms", ms, spin_ms / 2);

    /* 3. elapsed time between events on different streams: e0 (s1, long ago) -> e3 (s1) works,
     * and a disable-timing event refuses timing */
    float total = -1;
    CHECK(cudaEventElapsedTime(&total, e0, e3));
    EXPECT(total >= 1.5 * 0.8 * spin_ms, "elapsed e0->e3 = %.3f ms, expected >= %.1f", total,
           1.2 * spin_ms);
    EXPECT_ERR(cudaEventElapsedTime(&ms, e0, nt), cudaErrorInvalidResourceHandle);

    /* 4. re-recording an event moves it; a stream waiting on a completed event does not block */
    CHECK(cudaEventRecord(e0, s2));
    CHECK(cudaStreamWaitEvent(s1, e0, 0));
    CHECK(cudaStreamSynchronize(s1));
    CHECK(cudaEventElapsedTime(&ms, e1, e0));
    EXPECT(ms >= 0.8 * spin_ms / 2, "re-recorded e1->e0 = %.3f ms, expected >= %.1f", ms,
           0.4 * spin_ms);

    /* 5. many records in a row: the last one's completion implies all */
    cudaEvent_t many[64];
    for (int i = 0; i < 64; i++) {
        CHECK(cudaEventCreate(&many[i]));
        gp_test_noop<<<1, 1, 0, i % 2 ? s1 : s2>>>();
        CHECK(cudaEventRecord(many[i], i % 2 ? s1 : s2));
    }
    CHECK(cudaStreamWaitEvent(s1, many[62], 0));
    CHECK(cudaEventRecord(many[0], s1));
    CHECK(cudaEventSynchronize(many[0]));
    for (int i = 1; i < 64; i += 2)
        EXPECT_ERR(cudaEventQuery(many[i]), cudaSuccess);
    CHECK(cudaDeviceSynchronize());
    for (int i = 0; i < 64; i++) {
        EXPECT_ERR(cudaEventQuery(many[i]), cudaSuccess);
        CHECK(cudaEventDestroy(many[i]));
    }

    /* 4. a host function runs after the work queued before it (a copy into pinned memory) and
     * before the work queued after it (a copy out of the buffer it wrote). */
    struct host_fn_state {
        const float *seen;
        float *out;
        float first;
        int calls;
    } hs = {hy, hx, -1.0f, 0};
    hx[0] = 0.0f;
    CHECK(cudaMemsetAsync(y, 0, sizeof(float), s1));
    CHECK(cudaMemcpyAsync(hy, x + 7, sizeof(float), cudaMemcpyDeviceToHost, s1));
    CHECK(cudaLaunchHostFunc(
        s1,
        [](void *arg) {
            host_fn_state *st = (host_fn_state *)arg;
            st->first = st->seen[0];
            st->out[0] = 42.0f;
            st->calls++;
        },
        &hs));
    CHECK(cudaMemcpyAsync(y, hx, sizeof(float), cudaMemcpyHostToDevice, s1));
    float after = 0.0f;
    CHECK(cudaMemcpyAsync(&after, y, sizeof(float), cudaMemcpyDeviceToHost, s1));
    CHECK(cudaStreamSynchronize(s1));
    EXPECT(hs.calls == 1, "the host function ran %d times", hs.calls);
    EXPECT(hs.first == 7.0f, "the host function saw %g, not the 7 copied before it", hs.first);
    EXPECT(after == 42.0f, "the copy after the host function read %g, not the 42 it wrote", after);
    hx[0] = 0.0f;

    CHECK(cudaEventDestroy(e0));
    CHECK(cudaEventDestroy(e1));
    CHECK(cudaEventDestroy(e2));
    CHECK(cudaEventDestroy(e3));
    CHECK(cudaEventDestroy(nt));
    CHECK(cudaStreamDestroy(s1));
    CHECK(cudaStreamDestroy(s2));
    CHECK(cudaFree(x));
    CHECK(cudaFree(y));
    CHECK(cudaFreeHost(hx));
    CHECK(cudaFreeHost(hy));
    return gp_finish();
}
