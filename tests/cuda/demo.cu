/*
 * demo.cu: a friendly tour of a remote GPU, used by `make demo`.
 *
 * Shows the device, runs a vector axpy (y = a*x + y) on it, checks the result on the host, and
 * times a few things. On gpupool's simulated device the kernel runs on the server's host CPU,
 * so the timings show the cost of the remoting path, not of a GPU.
 */
#include "gp_check.cuh"
#include "../sim/gp_test_kernels.cuh"

int main(void)
{
    gp_begin("demo");
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        printf("No CUDA device: %s (%s).\n", cudaGetErrorName(e), cudaGetErrorString(e));
        printf("Is GPUPOOL_SERVER set and gpupoold running?\n");
        return 1;
    }
    int drv = 0, rt = 0;
    cudaDriverGetVersion(&drv);
    cudaRuntimeGetVersion(&rt);
    printf("CUDA driver %d.%d, runtime %d.%d, %d device(s)\n", drv / 1000, drv % 1000 / 10, rt / 1000,
           rt % 1000 / 10, count);
    for (int d = 0; d < count; d++) {
        cudaDeviceProp p;
        REQUIRE(cudaGetDeviceProperties(&p, d));
        printf("  device %d: %s, %.1f GiB, compute capability %d.%d, %d SMs, PCI %04x:%02x:%02x\n", d,
               p.name, p.totalGlobalMem / 1073741824.0, p.major, p.minor, p.multiProcessorCount,
               p.pciDomainID, p.pciBusID, p.pciDeviceID);
    }

    const int n = 1 << 22; /* 4 Mi floats, 16 MiB per vector */
    const size_t bytes = (size_t)n * sizeof(float);
    float *hx = NULL, *hy = NULL, *x = NULL, *y = NULL;
    REQUIRE(cudaMallocHost(&hx, bytes));
    REQUIRE(cudaMallocHost(&hy, bytes));
    for (int i = 0; i < n; i++) {
        hx[i] = (float)(i % 1000);
        hy[i] = 1.0f;
    }
    REQUIRE(cudaMalloc(&x, bytes));
    REQUIRE(cudaMalloc(&y, bytes));
    cudaEvent_t start, stop;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));

    double t0 = gp_now();
    CHECK(cudaMemcpy(x, hx, bytes, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(y, hy, bytes, cudaMemcpyHostToDevice));
    CHECK(cudaDeviceSynchronize());
    double t_up = gp_now() - t0;

    CHECK(cudaEventRecord(start));
    gp_test_axpy<<<(n + 255) / 256, 256>>>(3.0f, x, y, n);
    CHECK(cudaGetLastError());
    CHECK(cudaEventRecord(stop));
    CHECK(cudaEventSynchronize(stop));
    float kernel_ms = 0;
    CHECK(cudaEventElapsedTime(&kernel_ms, start, stop));

    t0 = gp_now();
    CHECK(cudaMemcpy(hy, y, bytes, cudaMemcpyDeviceToHost));
    double t_down = gp_now() - t0;

    int bad = 0;
    for (int i = 0; i < n; i++)
        if (hy[i] != 3.0f * (float)(i % 1000) + 1.0f)
            bad++;
    EXPECT(bad == 0, "%d of %d results wrong", bad, n);
    printf("axpy on %d floats: %s (kernel %.3f ms by CUDA events)\n", n, bad ? "WRONG" : "correct",
           kernel_ms);
    printf("  upload   2 x %zu MiB in %.1f ms (%.2f GB/s)\n", bytes >> 20, t_up * 1e3, 2 * bytes / t_up / 1e9);
    printf("  download 1 x %zu MiB in %.1f ms (%.2f GB/s)\n", bytes >> 20, t_down * 1e3, bytes / t_down / 1e9);

    const int launches = 20000;
    t0 = gp_now();
    for (int i = 0; i < launches; i++)
        gp_test_noop<<<1, 1>>>();
    CHECK(cudaDeviceSynchronize());
    double t_l = gp_now() - t0;
    printf("  %d empty kernel launches in %.1f ms (%.0f per second)\n", launches, t_l * 1e3,
           launches / t_l);

    const int syncs = 2000;
    t0 = gp_now();
    for (int i = 0; i < syncs; i++)
        CHECK(cudaStreamSynchronize(0));
    double t_s = gp_now() - t0;
    printf("  synchronous round trip (cudaStreamSynchronize): %.1f us\n", t_s / syncs * 1e6);

    CHECK(cudaFree(x));
    CHECK(cudaFree(y));
    CHECK(cudaFreeHost(hx));
    CHECK(cudaFreeHost(hy));
    CHECK(cudaEventDestroy(start));
    CHECK(cudaEventDestroy(stop));
    return gp_finish();
}
