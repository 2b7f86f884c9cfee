/*
 * threads.cu: many host threads share one connection and one context.
 *
 *     threads [nthreads] [iterations]     (default 8 threads, 40 iterations)
 *
 * Each thread has its own stream and buffers and repeatedly does: H2D copies (pinned and
 * pageable alternately), a memset, axpy kernels, a D2D copy, a D2H copy, a stream sync, and
 * verifies everything bit-exact; every few iterations it also uses the legacy default stream,
 * events and cudaDeviceSynchronize, so frames of all threads interleave on the wire.
 */
#include "gp_check.cuh"
#include "../sim/gp_test_kernels.cuh"

#include <thread>
#include <vector>

static void worker(int id, int iterations)
{
    const int n = 4096 + 97 * id; /* different sizes per thread */
    const size_t bytes = n * sizeof(float);
    cudaStream_t s;
    CHECK(cudaSetDevice(0));
    CHECK(cudaStreamCreateWithFlags(&s, id % 2 ? cudaStreamNonBlocking : cudaStreamDefault));
    cudaEvent_t ev;
    CHECK(cudaEventCreate(&ev));
    float *x = NULL, *y = NULL, *z = NULL, *px = NULL, *py = NULL;
    CHECK(cudaMalloc(&x, bytes));
    CHECK(cudaMalloc(&y, bytes));
    CHECK(cudaMalloc(&z, bytes));
    CHECK(cudaMallocHost(&px, bytes));
    CHECK(cudaMallocHost(&py, bytes));
    float *gx = (float *)malloc(bytes), *gy = (float *)malloc(bytes), *out = (float *)malloc(bytes);
    if (!x || !y || !z || !px || !py) {
        EXPECT(false, "thread %d: allocation failed", id);
        return;
    }
    for (int it = 0; it < iterations; it++) {
        float a = (float)((id + it) % 5) - 2.0f; /* -2 .. 2: exact products */
        bool pinned = it % 2 == 0;
        float *hx = pinned ? px : gx, *hy = pinned ? py : gy;
        for (int i = 0; i < n; i++) {
            hx[i] = (float)((i * (id + 3) + it) % 1024 - 512);
            hy[i] = (float)((i + id * 7 + it * 3) % 333);
        }
        CHECK(cudaMemsetAsync(z, 0xff, bytes, s));
        CHECK(cudaMemcpyAsync(x, hx, bytes, cudaMemcpyHostToDevice, s));
        CHECK(cudaMemcpyAsync(y, hy, bytes, cudaMemcpyHostToDevice, s));
        gp_test_axpy<<<(n + 127) / 128, 128, 0, s>>>(a, x, y, n);     /* y = a x + y */
        gp_test_axpy<<<(n + 255) / 256, 256, 0, s>>>(1.0f, x, y, n); /* y = (a+1) x + y */
        CHECK(cudaMemcpyAsync(z, y, bytes, cudaMemcpyDeviceToDevice, s));
        CHECK(cudaEventRecord(ev, s));
        memset(out, 0, bytes);
        if (it % 5 == 4) {
            /* through the legacy default stream after waiting for our event */
            CHECK(cudaStreamWaitEvent(0, ev, 0));
            CHECK(cudaMemcpy(out, z, bytes, cudaMemcpyDeviceToHost));
        } else {
            CHECK(cudaMemcpyAsync(out, z, bytes, cudaMemcpyDeviceToHost, s));
            if (it % 3 == 0)
                CHECK(cudaEventSynchronize(ev));
            CHECK(cudaStreamSynchronize(s));
        }
        int bad = -1;
        for (int i = 0; i < n && bad < 0; i++) {
            float want = a * hx[i] + hy[i];
            want = 1.0f * hx[i] + want;
            if (out[i] != want)
                bad = i;
        }
        EXPECT(bad < 0, "thread %d iteration %d: y[%d] = %g, expected %g", id, it, bad,
               bad >= 0 ? out[bad] : 0.0, bad >= 0 ? (double)((a + 1.0f) * hx[bad] + hy[bad]) : 0.0);
        if (it % 10 == 9)
            CHECK(cudaDeviceSynchronize());
    }
    CHECK(cudaEventDestroy(ev));
    CHECK(cudaStreamDestroy(s));
    CHECK(cudaFree(x));
    CHECK(cudaFree(y));
    CHECK(cudaFree(z));
    CHECK(cudaFreeHost(px));
    CHECK(cudaFreeHost(py));
    free(gx);
    free(gy);
    free(out);
}

int main(int argc, char **argv)
{
    gp_begin("threads");
    int nthreads = argc > 1 ? atoi(argv[1]) : 8;
    int iterations = argc > 2 ? atoi(argv[2]) : 40;
    REQUIRE(cudaSetDevice(0));
    REQUIRE(cudaFree(0)); /* create the context before the threads start */
    double t0 = gp_now();
    std::vector<std::thread> ts;
    for (int i = 0; i < nthreads; i++)
        ts.emplace_back(worker, i, iterations);
    for (auto &t : ts)
        t.join();
    CHECK(cudaDeviceSynchronize());
    printf("%d threads x %d iterations in %.2f s\n", nthreads, iterations, gp_now() - t0);
    return gp_finish();
}
