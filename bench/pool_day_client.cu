/*
 * pool_day_client.cu: one session of bench/pool_day.py's replayed day (a notebook, a training
 * job, a CI job or an inference service), an ordinary CUDA program run through gpupool's shim.
 *
 *     pool_day_client BUSY_MS,IDLE_MS,BUSY_MS,IDLE_MS,...
 *
 * Phases alternate, busy first. A busy phase first makes one round trip (cudaDeviceSynchronize:
 * the first one also creates the context, so it waits for the lease; after an idle detach it
 * waits for a GPU to come back), then keeps the device busy for BUSY_MS with gp_test_spin kernels
 * (at most 100 ms each, back to back; on the simulated device they spin for real time) and
 * synchronises. An idle phase sends nothing for IDLE_MS. Per busy phase, one line on stdout:
 *
 *     phase=N at=<unix seconds when it wanted the GPU> wait_ms=X busy_ms=Y
 *
 * so that the benchmark measures waits and busy time from the client's side, independently of
 * gpupoold. Exits 1 with a message on stderr on any CUDA error, 2 on bad arguments.
 */
#include "../tests/sim/gp_test_kernels.cuh"

#include <cuda_runtime.h>

#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define MAX_SPIN_MS 100.0

static void check(cudaError_t rc, const char *what)
{
    if (rc != cudaSuccess) {
        fprintf(stderr, "pool_day_client: %s failed: %s\n", what, cudaGetErrorName(rc));
        exit(1);
    }
}

static double clock_s(clockid_t id)
{
    struct timespec ts;
    if (clock_gettime(id, &ts) != 0) {
        perror("pool_day_client: clock_gettime");
        exit(1);
    }
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void sleep_ms(double ms)
{
    struct timespec ts;
    ts.tv_sec = (time_t)(ms / 1000);
    ts.tv_nsec = (long)((ms - (double)ts.tv_sec * 1000) * 1e6);
    while (nanosleep(&ts, &ts) != 0) {
        /* interrupted: sleep the rest */
    }
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: pool_day_client BUSY_MS,IDLE_MS,BUSY_MS,...\n");
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *p = argv[1];
    for (int phase = 0; *p; phase++) {
        char *end;
        double ms = strtod(p, &end);
        if (end == p || ms < 0 || (*end != ',' && *end != '\0')) {
            fprintf(stderr, "pool_day_client: bad phase list at '%s' (milliseconds, commas)\n", p);
            return 2;
        }
        p = *end ? end + 1 : end;
        if (phase % 2) {
            sleep_ms(ms);
            continue;
        }
        double at = clock_s(CLOCK_REALTIME), t0 = clock_s(CLOCK_MONOTONIC);
        check(cudaDeviceSynchronize(), "cudaDeviceSynchronize (waiting for the GPU)");
        double t1 = clock_s(CLOCK_MONOTONIC);
        for (double left = ms; left > 0; left -= MAX_SPIN_MS) {
            double chunk = left < MAX_SPIN_MS ? left : MAX_SPIN_MS;
            gp_test_spin<<<1, 1>>>((unsigned long long)(chunk * 1e6));
            check(cudaGetLastError(), "gp_test_spin launch");
        }
        check(cudaDeviceSynchronize(), "cudaDeviceSynchronize (end of a busy phase)");
        double t2 = clock_s(CLOCK_MONOTONIC);
        printf("phase=%d at=%.6f wait_ms=%.3f busy_ms=%.3f\n", phase, at, (t1 - t0) * 1000,
               (t2 - t1) * 1000);
    }
    return 0;
}
