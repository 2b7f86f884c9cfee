/*
 * errors.cu: the driver's error codes come back through the remoting stack, and the program
 * goes on working after each (none of these errors is sticky).
 *
 *     errors [--no-bogus-handles]
 *
 *  - cudaMalloc of more than the device memory -> cudaErrorMemoryAllocation, then a normal
 *    allocation and copy work;
 *  - cudaFree of a pointer that was never allocated, and a double free -> cudaErrorInvalidValue;
 *  - bogus stream / event handles -> an error, not a crash (skipped with --no-bogus-handles, for a
 *    real driver that may dereference them);
 *  - too many threads per block -> cudaErrorInvalidConfiguration or cudaErrorInvalidValue;
 *  - a kernel that the simulated device does not know (errors_unknown_kernel_q7) -> an error at
 *    the launch or the next synchronisation; the shim names the kernel on stderr (the pytest
 *    checks that; this program never writes that name to stderr itself). On a real GPU the
 *    kernel simply runs and must compute its value.
 */
#include "gp_check.cuh"
#include "../sim/gp_test_kernels.cuh"

/* Not a gp_test_* kernel: the simulated device cannot run it. */
extern "C" __global__ void errors_unknown_kernel_q7(int *out)
{
    out[threadIdx.x] = 42 + (int)threadIdx.x;
}

/* After an error: a small allocation, copy and kernel still work. */
static void still_works(const char *after)
{
    const int n = 1000;
    float hx[n], hy[n];
    for (int i = 0; i < n; i++) {
        hx[i] = (float)i;
        hy[i] = 1.0f;
    }
    float *x = NULL, *y = NULL;
    cudaError_t e1 = cudaMalloc(&x, sizeof hx), e2 = cudaMalloc(&y, sizeof hy);
    EXPECT(e1 == cudaSuccess && e2 == cudaSuccess, "after %s: cudaMalloc -> %s / %s", after,
           cudaGetErrorName(e1), cudaGetErrorName(e2));
    if (e1 != cudaSuccess || e2 != cudaSuccess)
        return;
    CHECK(cudaMemcpy(x, hx, sizeof hx, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(y, hy, sizeof hy, cudaMemcpyHostToDevice));
    gp_test_axpy<<<4, 256>>>(2.0f, x, y, n);
    cudaError_t le = cudaGetLastError();
    EXPECT(le == cudaSuccess, "after %s: launch -> %s", after, cudaGetErrorName(le));
    cudaError_t se = cudaDeviceSynchronize();
    EXPECT(se == cudaSuccess, "after %s: cudaDeviceSynchronize -> %s", after, cudaGetErrorName(se));
    memset(hy, 0, sizeof hy);
    CHECK(cudaMemcpy(hy, y, sizeof hy, cudaMemcpyDeviceToHost));
    int bad = -1;
    for (int i = 0; i < n && bad < 0; i++)
        if (hy[i] != 2.0f * i + 1.0f)
            bad = i;
    EXPECT(bad < 0, "after %s: axpy y[%d] = %g", after, bad, bad >= 0 ? hy[bad] : 0.0);
    CHECK(cudaFree(x));
    CHECK(cudaFree(y));
}

int main(int argc, char **argv)
{
    gp_begin("errors");
    bool bogus_handles = !(argc > 1 && strcmp(argv[1], "--no-bogus-handles") == 0);
    REQUIRE(cudaSetDevice(0));
    cudaDeviceProp p;
    REQUIRE(cudaGetDeviceProperties(&p, 0));
    bool simulated = strstr(p.name, "imulated") != NULL;
    printf("device: %s (%s)\n", p.name, simulated ? "simulated" : "real");
    still_works("start");

    /* 1. out of memory, twice the device; then 1 TiB past any device */
    {
        void *big = NULL;
        size_t want = p.totalGlobalMem * 2;
        EXPECT_ERR(cudaMalloc(&big, want), cudaErrorMemoryAllocation);
        EXPECT(big == NULL, "failed cudaMalloc left a pointer %p", big);
        EXPECT_ERR(cudaGetLastError(), cudaErrorMemoryAllocation);
        EXPECT_ERR(cudaGetLastError(), cudaSuccess); /* not sticky */
        still_works("out of memory");
        /* exactly one byte more than the whole device */
        EXPECT_ERR(cudaMalloc(&big, p.totalGlobalMem + 1), cudaErrorMemoryAllocation);
        (void)cudaGetLastError();
        /* a pinned host allocation of an absurd size fails too, without a crash */
        void *hbig = NULL;
        cudaError_t he = cudaMallocHost(&hbig, (size_t)1 << 50);
        EXPECT(he == cudaErrorMemoryAllocation, "cudaMallocHost(1 PiB) -> %s", cudaGetErrorName(he));
        if (he == cudaSuccess)
            cudaFreeHost(hbig);
        (void)cudaGetLastError();
        still_works("huge pinned allocation");
    }

    /* 2. invalid frees */
    {
        int host_var = 0;
        EXPECT_ERR(cudaFree((void *)0x1234), cudaErrorInvalidValue);
        (void)cudaGetLastError();
        EXPECT_ERR(cudaFree(&host_var), cudaErrorInvalidValue);
        (void)cudaGetLastError();
        void *d = NULL;
        CHECK(cudaMalloc(&d, 4096));
        EXPECT_ERR(cudaFree((char *)d + 16), cudaErrorInvalidValue); /* inside, not the start */
        (void)cudaGetLastError();
        CHECK(cudaFree(d));
        EXPECT_ERR(cudaFree(d), cudaErrorInvalidValue); /* double free */
        (void)cudaGetLastError();
        CHECK(cudaFree(NULL)); /* freeing NULL is fine */
        still_works("invalid free");
    }

    /* 3. bogus handles: an error code, no crash */
    if (bogus_handles) {
        cudaStream_t bs = (cudaStream_t)(uintptr_t)0x6750abcdef001234ull;
        cudaEvent_t be = (cudaEvent_t)(uintptr_t)0x6750abcdef005678ull;
        cudaError_t e;
        e = cudaStreamSynchronize(bs);
        printf("cudaStreamSynchronize(bogus) -> %s\n", cudaGetErrorName(e));
        EXPECT(e != cudaSuccess, "cudaStreamSynchronize(bogus stream) succeeded");
        (void)cudaGetLastError();
        e = cudaStreamQuery(bs);
        printf("cudaStreamQuery(bogus) -> %s\n", cudaGetErrorName(e));
        EXPECT(e != cudaSuccess && e != cudaErrorNotReady, "cudaStreamQuery(bogus stream) -> %s",
               cudaGetErrorName(e));
        (void)cudaGetLastError();
        e = cudaEventQuery(be);
        printf("cudaEventQuery(bogus) -> %s\n", cudaGetErrorName(e));
        EXPECT(e != cudaSuccess && e != cudaErrorNotReady, "cudaEventQuery(bogus event) -> %s",
               cudaGetErrorName(e));
        (void)cudaGetLastError();
        e = cudaEventSynchronize(be);
        printf("cudaEventSynchronize(bogus) -> %s\n", cudaGetErrorName(e));
        EXPECT(e != cudaSuccess, "cudaEventSynchronize(bogus event) succeeded");
        (void)cudaGetLastError();
        e = cudaEventRecord(be, 0);
        printf("cudaEventRecord(bogus) -> %s\n", cudaGetErrorName(e));
        EXPECT(e != cudaSuccess, "cudaEventRecord(bogus event) succeeded");
        (void)cudaGetLastError();
        /* the deferred error of a fire-and-forget call on a bogus handle may surface here */
        e = cudaDeviceSynchronize();
        printf("cudaDeviceSynchronize after bogus handles -> %s\n", cudaGetErrorName(e));
        (void)cudaGetLastError();
        still_works("bogus handles");
    }

    /* 4. too many threads per block, and a zero-sized grid */
    {
        int *out = NULL;
        CHECK(cudaMalloc(&out, 4096));
        gp_test_index<<<1, p.maxThreadsPerBlock * 2>>>((unsigned *)out, 16);
        cudaError_t le = cudaGetLastError();
        cudaError_t se = cudaDeviceSynchronize();
        printf("launch with %d threads per block -> %s, then sync -> %s\n", p.maxThreadsPerBlock * 2,
               cudaGetErrorName(le), cudaGetErrorName(se));
        cudaError_t got = le != cudaSuccess ? le : se;
        EXPECT(got == cudaErrorInvalidConfiguration || got == cudaErrorInvalidValue,
               "too many threads per block: launch -> %s, sync -> %s (expected "
               "cudaErrorInvalidConfiguration or cudaErrorInvalidValue)",
               cudaGetErrorName(le), cudaGetErrorName(se));
        (void)cudaGetLastError();
        gp_test_index<<<dim3(1, 1, 1), dim3(1, 1, 128)>>>((unsigned *)out, 16); /* z <= 64 */
        le = cudaGetLastError();
        se = cudaDeviceSynchronize();
        got = le != cudaSuccess ? le : se;
        printf("launch with blockDim.z = 128 -> %s, then sync -> %s\n", cudaGetErrorName(le),
               cudaGetErrorName(se));
        EXPECT(got == cudaErrorInvalidConfiguration || got == cudaErrorInvalidValue,
               "blockDim.z 128: launch -> %s, sync -> %s", cudaGetErrorName(le), cudaGetErrorName(se));
        (void)cudaGetLastError();
        gp_test_noop<<<dim3(0, 1, 1), 1>>>();
        le = cudaGetLastError();
        se = cudaDeviceSynchronize();
        got = le != cudaSuccess ? le : se;
        printf("launch with gridDim.x = 0 -> %s, then sync -> %s\n", cudaGetErrorName(le),
               cudaGetErrorName(se));
        EXPECT(got == cudaErrorInvalidConfiguration || got == cudaErrorInvalidValue,
               "gridDim.x 0: launch -> %s, sync -> %s", cudaGetErrorName(le), cudaGetErrorName(se));
        (void)cudaGetLastError();
        CHECK(cudaFree(out));
        still_works("bad launch configuration");
    }

    /* 5. invalid device */
    EXPECT_ERR(cudaSetDevice(99), cudaErrorInvalidDevice);
    (void)cudaGetLastError();

    /* 5b. a memset of mapped host memory: through gpupool the memory stays on this machine and
     * the shim sets it here (tests/cuda/mapped.c has the rest); one running past its end is an
     * error, with one line from the shim saying why. */
    if (gp_through_gpupool()) {
        unsigned char *hm = NULL;
        REQUIRE(cudaHostAlloc((void **)&hm, 4096, cudaHostAllocMapped));
        memset(hm, 0xff, 4096);
        CHECK(cudaMemsetAsync(hm, 0, 4096, 0));
        CHECK(cudaStreamSynchronize(0));
        EXPECT(hm[0] == 0 && hm[4095] == 0, "the memset of mapped host memory did not land");
        EXPECT_ERR(cudaMemsetAsync(hm + 4000, 0, 200, 0), cudaErrorInvalidValue);
        (void)cudaGetLastError();
        CHECK(cudaFreeHost(hm));
    }

    /* 6. an unknown kernel: last, because it is the one most likely to upset the session */
    {
        int *out = NULL, h[32] = {0};
        CHECK(cudaMalloc(&out, sizeof h));
        CHECK(cudaMemset(out, 0, sizeof h));
        errors_unknown_kernel_q7<<<1, 32>>>(out);
        cudaError_t le = cudaGetLastError();
        cudaError_t se = cudaDeviceSynchronize();
        printf("unknown kernel: launch -> %s, then sync -> %s\n", cudaGetErrorName(le),
               cudaGetErrorName(se));
        if (simulated) {
            EXPECT(le != cudaSuccess || se != cudaSuccess,
                   "the simulated device ran a kernel it does not know: launch and sync succeeded");
        } else {
            EXPECT(le == cudaSuccess && se == cudaSuccess, "real GPU: launch -> %s, sync -> %s",
                   cudaGetErrorName(le), cudaGetErrorName(se));
            CHECK(cudaMemcpy(h, out, sizeof h, cudaMemcpyDeviceToHost));
            EXPECT(h[0] == 42 && h[31] == 73, "real GPU: unknown kernel computed %d, %d", h[0], h[31]);
        }
        (void)cudaGetLastError();
        cudaFree(out);
        (void)cudaGetLastError();
        still_works("unknown kernel");
    }

    CHECK(cudaDeviceSynchronize());
    return gp_finish();
}
