/*
 * bench_client.cu: the CUDA side of the remoting benchmark (bench/remoting_bench.py runs it).
 *
 *     bench_client [--quick] [--reps N] [--launches N]
 *
 * An ordinary CUDA program (nvcc, static cudart) that times, through whatever libcuda.so.1 it
 * finds (gpupool's shim in the benchmark):
 *   sync_rtt      cudaStreamSynchronize on an idle stream, one round trip each (us);
 *   ctx_sync_rtt  cuCtxSynchronize (driver API through cudaGetDriverEntryPointByVersion) (us);
 *   launches      gp_test_noop<<<1,1,0,s>>> N times, then one cudaStreamSynchronize (per second);
 *   h2d / d2h     copies of 4 KiB, 1 MiB and 256 MiB: pinned memory with cudaMemcpyAsync on a
 *                 stream, pageable memory with cudaMemcpy; timed from the first call to the end of
 *                 a final synchronisation (bytes per second).
 * Round trips are the best of at least 5 runs (mean and median of that run); every other figure
 * is the median of --reps runs. Every result is one line `RESULT {json}` on stdout.
 * The 256 MiB copies also report the CPU time this process (shim threads included) spent on all
 * their runs ("cpu_s", with "bytes" moved), and print `PHASE <metric>` (flushed) just before
 * their timed runs, so that remoting_bench.py can read the worker's CPU time around them.
 * Data is checked once per size so that a fast but wrong path cannot post a number.
 */
#include "../tests/cuda/gp_check.cuh"
#include "../tests/sim/gp_test_kernels.cuh"

#include <algorithm>
#include <time.h>
#include <vector>

typedef CUresult (*pfn_cuCtxSynchronize)(void);

static double median(std::vector<double> v)
{
    std::sort(v.begin(), v.end());
    size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static void result(const char *metric, double value, const char *unit, const char *extra = "")
{
    printf("RESULT {\"metric\": \"%s\", \"value\": %.6g, \"unit\": \"%s\"%s}\n", metric, value, unit,
           extra);
    fflush(stdout);
}

/* CPU seconds of this process, all threads (the shim's reader and sender included). */
static double cpu_now(void)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts) != 0) {
        perror("bench_client: clock_gettime(CLOCK_PROCESS_CPUTIME_ID)");
        exit(1);
    }
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void die_on(cudaError_t e, const char *what)
{
    if (e != cudaSuccess) {
        fprintf(stderr, "bench_client: %s: %s (%s)\n", what, cudaGetErrorName(e), cudaGetErrorString(e));
        exit(1);
    }
}
#define D(call) die_on((call), #call)

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    bool quick = false;
    int reps = 3;
    long launches = 1000000;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick"))
            quick = true;
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--launches") && i + 1 < argc)
            launches = atol(argv[++i]);
    }
    if (quick)
        launches = std::min(launches, 100000L);
    if (reps < 1)
        reps = 1;

    D(cudaSetDevice(0));
    cudaDeviceProp p;
    D(cudaGetDeviceProperties(&p, 0));
    printf("device: %s\n", p.name);
    cudaStream_t s;
    D(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    D(cudaFree(0));

    /* ------------------------------------------------------------ synchronous round trips */
    /* Round trips: the best of at least 5 runs (lowest median), as tcp_baseline does: on a
     * virtual machine a round trip is bimodal (threads on one vCPU, or idle-vCPU wake-ups). */
    {
        const int n = quick ? 2000 : 10000;
        const int rtt_reps = std::max(reps, 5);
        std::vector<double> mean, p50, lat(n);
        for (int i = 0; i < n / 10; i++)
            D(cudaStreamSynchronize(s));
        for (int r = 0; r < rtt_reps; r++) {
            double t0 = gp_now();
            for (int i = 0; i < n; i++) {
                double a = gp_now();
                D(cudaStreamSynchronize(s));
                lat[i] = gp_now() - a;
            }
            mean.push_back((gp_now() - t0) / n * 1e6);
            p50.push_back(median(lat) * 1e6);
        }
        char extra[64];
        snprintf(extra, sizeof extra, ", \"p50\": %.3f", *std::min_element(p50.begin(), p50.end()));
        result("sync_rtt", *std::min_element(mean.begin(), mean.end()), "us", extra);

        pfn_cuCtxSynchronize ctxSync = (pfn_cuCtxSynchronize)gp_driver_fn("cuCtxSynchronize");
        if (ctxSync) {
            mean.clear();
            p50.clear();
            for (int r = 0; r < rtt_reps; r++) {
                double t0 = gp_now();
                for (int i = 0; i < n; i++) {
                    double a = gp_now();
                    if (ctxSync() != CUDA_SUCCESS) {
                        fprintf(stderr, "bench_client: cuCtxSynchronize failed\n");
                        return 1;
                    }
                    lat[i] = gp_now() - a;
                }
                mean.push_back((gp_now() - t0) / n * 1e6);
                p50.push_back(median(lat) * 1e6);
            }
            snprintf(extra, sizeof extra, ", \"p50\": %.3f", *std::min_element(p50.begin(), p50.end()));
            result("ctx_sync_rtt", *std::min_element(mean.begin(), mean.end()), "us", extra);
        }
    }

    /* ------------------------------------------------------------ pipelined launches */
    {
        for (int i = 0; i < 10000; i++)
            gp_test_noop<<<1, 1, 0, s>>>();
        D(cudaStreamSynchronize(s));
        std::vector<double> rate;
        for (int r = 0; r < reps; r++) {
            double t0 = gp_now();
            for (long i = 0; i < launches; i++)
                gp_test_noop<<<1, 1, 0, s>>>();
            D(cudaGetLastError());
            D(cudaStreamSynchronize(s));
            rate.push_back(launches / (gp_now() - t0));
        }
        char extra[64];
        snprintf(extra, sizeof extra, ", \"count\": %ld", launches);
        result("launches", median(rate), "1/s", extra);
    }

    /* ------------------------------------------------------------ copies */
    const size_t sizes[] = {4096, 1u << 20, 256u << 20};
    const size_t maxs = 256u << 20;
    uint8_t *dev = NULL, *pinned = NULL, *pageable = (uint8_t *)malloc(maxs);
    D(cudaMalloc(&dev, maxs));
    D(cudaMallocHost(&pinned, maxs));
    memset(pageable, 0, maxs); /* touch every page before timing */
    for (int k = 0; k < 3; k++) {
        size_t sz = sizes[k];
        size_t total = sz == 4096 ? (64u << 20) : (sz == (1u << 20) ? (512u << 20) : (1024u << 20));
        if (quick)
            total /= 4;
        if (total < sz)
            total = sz;
        size_t count = total / sz;

        /* correctness once: pattern up, back down through the other kind of memory */
        gp_fill(pinned, sz, 77 + k);
        D(cudaMemcpy(dev, pinned, sz, cudaMemcpyHostToDevice));
        D(cudaMemcpy(pageable, dev, sz, cudaMemcpyDeviceToHost));
        if (gp_verify(pageable, sz, 77 + k) >= 0) {
            fprintf(stderr, "bench_client: data check failed at %zu bytes\n", sz);
            return 1;
        }

        for (int pin = 1; pin >= 0; pin--) {
            uint8_t *host = pin ? pinned : pageable;
            for (int dir = 0; dir < 2; dir++) {
                std::vector<double> bw;
                char metric[64], extra[160];
                snprintf(metric, sizeof metric, "%s_%s_%zu", dir == 0 ? "h2d" : "d2h",
                         pin ? "pinned" : "pageable", sz);
                const bool cpu = sz == maxs;
                if (cpu) {
                    printf("PHASE %s\n", metric);
                    fflush(stdout);
                }
                double cpu0 = cpu_now();
                for (int r = 0; r < reps; r++) {
                    D(cudaDeviceSynchronize());
                    double t0 = gp_now();
                    for (size_t i = 0; i < count; i++) {
                        if (pin)
                            D(dir == 0 ? cudaMemcpyAsync(dev, host, sz, cudaMemcpyHostToDevice, s)
                                       : cudaMemcpyAsync(host, dev, sz, cudaMemcpyDeviceToHost, s));
                        else
                            D(dir == 0 ? cudaMemcpy(dev, host, sz, cudaMemcpyHostToDevice)
                                       : cudaMemcpy(host, dev, sz, cudaMemcpyDeviceToHost));
                    }
                    D(pin ? cudaStreamSynchronize(s) : cudaDeviceSynchronize());
                    bw.push_back((double)(count * sz) / (gp_now() - t0));
                }
                double cpu_s = cpu_now() - cpu0;
                int len = snprintf(extra, sizeof extra, ", \"size\": %zu, \"count\": %zu", sz, count);
                if (cpu)
                    snprintf(extra + len, sizeof extra - len, ", \"cpu_s\": %.6f, \"bytes\": %zu",
                             cpu_s, (size_t)reps * count * sz);
                result(metric, median(bw), "B/s", extra);
            }
        }
    }
    D(cudaFree(dev));
    D(cudaFreeHost(pinned));
    free(pageable);
    D(cudaStreamDestroy(s));
    printf("bench_client: done\n");
    return 0;
}
