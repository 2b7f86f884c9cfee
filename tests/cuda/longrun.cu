/*
 * longrun.cu: runs until the server goes away (the kill test).
 *
 *     longrun [max_seconds]     (default 300: never runs forever if nobody kills the server)
 *
 * Loops: a small H2D copy, a kernel, a D2H copy, cudaDeviceSynchronize, verify, and prints
 * "tick N" (flushed) each iteration. When a CUDA call fails it prints
 * "longrun: CUDA error after N ticks: <call> -> <name>: <string>" to stderr and exits 1 at once;
 * the pytest kills the daemon and its workers and expects that exit within seconds, never a hang.
 * Exits 0 only when max_seconds pass without an error; exits 2 on wrong data.
 */
#include "gp_check.cuh"
#include "../sim/gp_test_kernels.cuh"

static long ticks = 0;

#define LR(call)                                                                               \
    do {                                                                                       \
        cudaError_t lr_e_ = (call);                                                            \
        if (lr_e_ != cudaSuccess) {                                                            \
            fprintf(stderr, "longrun: CUDA error after %ld ticks: %s -> %s: %s\n", ticks,      \
                    #call, cudaGetErrorName(lr_e_), cudaGetErrorString(lr_e_));                \
            printf("FAIL longrun: CUDA error after %ld ticks (%s)\n", ticks,                   \
                   cudaGetErrorName(lr_e_));                                                   \
            fflush(stdout);                                                                    \
            return 1;                                                                          \
        }                                                                                      \
    } while (0)

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    double max_s = argc > 1 ? atof(argv[1]) : 300.0;
    const int n = 1024;
    float hx[n], hy[n], back[n];
    float *x = NULL, *y = NULL;
    LR(cudaSetDevice(0));
    LR(cudaMalloc(&x, sizeof hx));
    LR(cudaMalloc(&y, sizeof hy));
    double t0 = gp_now();
    while (gp_now() - t0 < max_s) {
        for (int i = 0; i < n; i++) {
            hx[i] = (float)((i + ticks) % 100);
            hy[i] = (float)(i % 13);
        }
        LR(cudaMemcpy(x, hx, sizeof hx, cudaMemcpyHostToDevice));
        LR(cudaMemcpy(y, hy, sizeof hy, cudaMemcpyHostToDevice));
        gp_test_axpy<<<n / 256, 256>>>(2.0f, x, y, n);
        LR(cudaGetLastError());
        LR(cudaMemcpy(back, y, sizeof back, cudaMemcpyDeviceToHost));
        LR(cudaDeviceSynchronize());
        for (int i = 0; i < n; i++) {
            if (back[i] != 2.0f * hx[i] + hy[i]) {
                printf("FAIL longrun: wrong data at tick %ld, y[%d] = %g\n", ticks, i, back[i]);
                return 2;
            }
        }
        ticks++;
        printf("tick %ld\n", ticks);
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    printf("PASS longrun: %ld ticks in %.0f s, no error\n", ticks, max_s);
    return 0;
}
