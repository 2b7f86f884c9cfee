/*
 * kernels.cu: the gp_test_* kernels compute the right values with every kind of argument.
 *
 *     kernels [launch_loop_count]     (default 10000)
 *
 * Pointer, int, float, double, char/short, long long, a 400-byte struct (more than 256 bytes of
 * parameters), 3D grids of 3D blocks, cudaLaunchKernel, cudaLaunchKernelEx with and without
 * attributes, launches on several streams, and a long loop of launches with one final check.
 * Values are chosen so that a*x+y is exact in float whether or not the compiler fuses it (the
 * simulated device computes on the host), so every comparison is bit-exact.
 */
#include "gp_check.cuh"
#include "../sim/gp_test_kernels.cuh"

#include <math.h>

static void check_axpy(const char *what, const float *hy, const float *hx, const float *y0, float a,
                       int n, int applied)
{
    int bad = -1;
    float bad_want = 0.0f;
    for (int i = 0; i < n && bad < 0; i++) {
        float want = y0[i];
        for (int k = 0; k < applied; k++)
            want = a * hx[i] + want;
        /* A real GPU fuses a * x + y into one rounding (FMA), the host rounds twice. */
        if (fabsf(hy[i] - want) > 1e-6f * fabsf(want)) {
            bad = i;
            bad_want = want;
        }
    }
    EXPECT(bad < 0, "%s: y[%d] = %.9g, expected %.9g", what, bad, bad >= 0 ? hy[bad] : 0.0,
           (double)bad_want);
}

int main(int argc, char **argv)
{
    gp_begin("kernels");
    int loops = argc > 1 ? atoi(argv[1]) : 10000;
    REQUIRE(cudaSetDevice(0));
    cudaStream_t s;
    REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

    /* no-op, default stream and a stream */
    gp_test_noop<<<1, 1>>>();
    CHECK(cudaGetLastError());
    gp_test_noop<<<dim3(7, 3, 2), dim3(32, 4, 2), 0, s>>>();
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());

    /* axpy: pointers, float, int; n not a multiple of the block */
    const int n = (1 << 20) + 3;
    float *hx = (float *)malloc(n * sizeof(float)), *hy0 = (float *)malloc(n * sizeof(float));
    float *hy = (float *)malloc(n * sizeof(float));
    for (int i = 0; i < n; i++) {
        hx[i] = (float)((i * 37) % 2001 - 1000);
        hy0[i] = (float)((i * 11) % 517 - 250);
    }
    float *x = NULL, *y = NULL;
    REQUIRE(cudaMalloc(&x, (n + 64) * sizeof(float)));
    REQUIRE(cudaMalloc(&y, (n + 64) * sizeof(float)));
    CHECK(cudaMemcpy(x, hx, n * sizeof(float), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(y, hy0, n * sizeof(float), cudaMemcpyHostToDevice));
    CHECK(cudaMemset(y + n, 0x7f, 64 * sizeof(float)));
    gp_test_axpy<<<(n + 255) / 256, 256>>>(2.0f, x, y, n);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(hy, y, n * sizeof(float), cudaMemcpyDeviceToHost));
    check_axpy("axpy <<<>>>", hy, hx, hy0, 2.0f, n, 1);
    {
        uint32_t tail[64];
        CHECK(cudaMemcpy(tail, y + n, sizeof tail, cudaMemcpyDeviceToHost));
        int bad = -1;
        for (int i = 0; i < 64 && bad < 0; i++)
            if (tail[i] != 0x7f7f7f7fu)
                bad = i;
        EXPECT(bad < 0, "axpy wrote past n: y[n+%d] = 0x%08x", bad, bad >= 0 ? tail[bad] : 0);
    }

    /* the same through cudaLaunchKernel with an explicit argument array, on a stream, with a
     * negative scalar; y is now y0 + 2x, after this y0 + 2x - 0.5x */
    {
        float a = -0.5f;
        int nn = n;
        void *args[] = {&a, &x, &y, &nn};
        CHECK(cudaLaunchKernel((const void *)gp_test_axpy, dim3((n + 127) / 128), dim3(128), args, 0, s));
        CHECK(cudaMemcpyAsync(hy, y, n * sizeof(float), cudaMemcpyDeviceToHost, s));
        CHECK(cudaStreamSynchronize(s));
        int bad = -1;
        for (int i = 0; i < n && bad < 0; i++)
            if (hy[i] != -0.5f * hx[i] + (2.0f * hx[i] + hy0[i]))
                bad = i;
        EXPECT(bad < 0, "axpy cudaLaunchKernel: y[%d] = %.9g", bad, bad >= 0 ? hy[bad] : 0.0);
    }

    /* cudaLaunchKernelEx, without attributes and with cluster / priority attributes */
    {
        CHECK(cudaMemcpy(y, hy0, n * sizeof(float), cudaMemcpyHostToDevice));
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3((n + 255) / 256);
        cfg.blockDim = dim3(256);
        cfg.stream = s;
        CHECK(cudaLaunchKernelEx(&cfg, gp_test_axpy, 4.0f, (const float *)x, y, n));
        cudaLaunchAttribute attrs[2] = {};
        attrs[0].id = cudaLaunchAttributeClusterDimension;
        attrs[0].val.clusterDim.x = 1;
        attrs[0].val.clusterDim.y = 1;
        attrs[0].val.clusterDim.z = 1;
        attrs[1].id = cudaLaunchAttributePriority;
        attrs[1].val.priority = 0;
        cfg.attrs = attrs;
        cfg.numAttrs = 2;
        CHECK(cudaLaunchKernelEx(&cfg, gp_test_axpy, 4.0f, (const float *)x, y, n));
        CHECK(cudaMemcpyAsync(hy, y, n * sizeof(float), cudaMemcpyDeviceToHost, s));
        CHECK(cudaStreamSynchronize(s));
        check_axpy("axpy cudaLaunchKernelEx", hy, hx, hy0, 4.0f, n, 2);
    }

    /* scalars of every size: alignment and padding of the parameter buffer */
    {
        double *out = NULL, h[6] = {0};
        REQUIRE(cudaMalloc(&out, 6 * sizeof(double)));
        CHECK(cudaMemset(out, 0, 6 * sizeof(double)));
        const char c = -7;
        const short sh = -12345;
        const int i = 123456789;
        const long long l = -1234567890123LL;
        const float f = 3.25f;
        const double d = -2.5e300;
        gp_test_scalars<<<dim3(2, 2, 1), dim3(8, 1, 1)>>>(out, c, sh, i, l, f, d);
        CHECK(cudaGetLastError());
        CHECK(cudaMemcpy(h, out, sizeof h, cudaMemcpyDeviceToHost));
        const double want[6] = {(double)c, (double)sh, (double)i, (double)l, (double)f, d};
        const char *names[6] = {"char", "short", "int", "long long", "float", "double"};
        for (int k = 0; k < 6; k++)
            EXPECT(h[k] == want[k], "gp_test_scalars %s: got %.17g, expected %.17g", names[k], h[k],
                   want[k]);
        /* again with other values through cudaLaunchKernel */
        char c2 = 127;
        short s2 = 32767;
        int i2 = -2147483647 - 1;
        long long l2 = 9007199254740993LL; /* 2^53+1: not exact as a double, (double)l rounds */
        float f2 = -1.0e-30f;
        double d2 = 1.0 / 3.0;
        void *args[] = {&out, &c2, &s2, &i2, &l2, &f2, &d2};
        CHECK(cudaLaunchKernel((const void *)gp_test_scalars, dim3(1), dim3(1), args, 0, s));
        CHECK(cudaMemcpyAsync(h, out, sizeof h, cudaMemcpyDeviceToHost, s));
        CHECK(cudaStreamSynchronize(s));
        const double want2[6] = {(double)c2, (double)s2, (double)i2, (double)l2, (double)f2, d2};
        for (int k = 0; k < 6; k++)
            EXPECT(h[k] == want2[k], "gp_test_scalars (2) %s: got %.17g, expected %.17g", names[k],
                   h[k], want2[k]);
        CHECK(cudaFree(out));
    }

    /* a 400-byte struct argument (more than 256 bytes of parameters) */
    {
        long long *out = NULL, h[3] = {0};
        REQUIRE(cudaMalloc(&out, 3 * sizeof(long long)));
        gp_big_arg arg;
        long long sum = 0;
        for (int k = 0; k < 100; k++) {
            arg.v[k] = k * 7919 - 300000 + (k % 3 == 0 ? 2000000000 : 0);
            sum += (long long)arg.v[k] * (k + 1);
        }
        gp_test_big_struct<<<1, 32, 0, s>>>(arg, out);
        CHECK(cudaGetLastError());
        CHECK(cudaMemcpyAsync(h, out, sizeof h, cudaMemcpyDeviceToHost, s));
        CHECK(cudaStreamSynchronize(s));
        EXPECT(h[0] == sum, "gp_test_big_struct sum: got %lld, expected %lld", h[0], sum);
        EXPECT(h[1] == arg.v[0], "gp_test_big_struct v[0]: got %lld, expected %d", h[1], arg.v[0]);
        EXPECT(h[2] == arg.v[99], "gp_test_big_struct v[99]: got %lld, expected %d", h[2], arg.v[99]);
        CHECK(cudaFree(out));
    }

    /* 3D grid of 3D blocks: every thread writes its own slot */
    {
        const dim3 grid(5, 3, 4), block(8, 4, 3);
        const unsigned total = 5 * 3 * 4 * 8 * 4 * 3, nidx = total - 13;
        unsigned *out = NULL, *h = (unsigned *)malloc(total * sizeof(unsigned));
        REQUIRE(cudaMalloc(&out, total * sizeof(unsigned)));
        CHECK(cudaMemset(out, 0xff, total * sizeof(unsigned)));
        gp_test_index<<<grid, block>>>(out, nidx);
        CHECK(cudaGetLastError());
        CHECK(cudaMemcpy(h, out, total * sizeof(unsigned), cudaMemcpyDeviceToHost));
        int bad = -1;
        for (unsigned t = 0; t < total && bad < 0; t++) {
            unsigned want = t < nidx ? t * 2654435761u : 0xffffffffu;
            if (h[t] != want)
                bad = (int)t;
        }
        EXPECT(bad < 0, "gp_test_index 3D: out[%d] = 0x%08x, expected 0x%08x", bad,
               bad >= 0 ? h[bad] : 0, bad >= 0 ? (bad < (int)nidx ? bad * 2654435761u : 0xffffffffu) : 0);
        /* a 1D grid big in x, and a grid big in y */
        const unsigned n1 = 70000;
        CHECK(cudaMemset(out, 0, total * sizeof(unsigned)));
        unsigned *o1 = NULL, *h1 = (unsigned *)malloc(n1 * sizeof(unsigned));
        REQUIRE(cudaMalloc(&o1, n1 * sizeof(unsigned)));
        gp_test_index<<<dim3((n1 + 31) / 32), dim3(32)>>>(o1, n1);
        CHECK(cudaMemcpy(h1, o1, n1 * sizeof(unsigned), cudaMemcpyDeviceToHost));
        bad = -1;
        for (unsigned t = 0; t < n1 && bad < 0; t++)
            if (h1[t] != t * 2654435761u)
                bad = (int)t;
        EXPECT(bad < 0, "gp_test_index 1D: out[%d] wrong", bad);
        gp_test_index<<<dim3(2, 300, 1), dim3(1, 1, 64)>>>(o1, n1);
        CHECK(cudaMemcpy(h1, o1, n1 * sizeof(unsigned), cudaMemcpyDeviceToHost));
        bad = -1;
        for (unsigned t = 0; t < 2 * 300 * 64 && bad < 0; t++)
            if (h1[t] != t * 2654435761u)
                bad = (int)t;
        EXPECT(bad < 0, "gp_test_index grid(2,300,1) block(1,1,64): out[%d] wrong", bad);
        CHECK(cudaFree(o1));
        CHECK(cudaFree(out));
        free(h);
        free(h1);
    }

    /* many launches, one check at the end: y = y0 + loops * 0.25 * x, exact in float */
    {
        const int m = 4096;
        float *lx = NULL, *ly = NULL, hlx[m], hly[m], hly0[m];
        for (int i = 0; i < m; i++) {
            hlx[i] = (float)(i % 16);
            hly0[i] = (float)(i % 7);
        }
        REQUIRE(cudaMalloc(&lx, m * sizeof(float)));
        REQUIRE(cudaMalloc(&ly, m * sizeof(float)));
        CHECK(cudaMemcpy(lx, hlx, sizeof hlx, cudaMemcpyHostToDevice));
        CHECK(cudaMemcpy(ly, hly0, sizeof hly0, cudaMemcpyHostToDevice));
        double t0 = gp_now();
        for (int k = 0; k < loops; k++)
            gp_test_axpy<<<m / 256, 256, 0, s>>>(0.25f, lx, ly, m);
        CHECK(cudaGetLastError());
        CHECK(cudaStreamSynchronize(s));
        double dt = gp_now() - t0;
        printf("%d launches in %.3f s (%.0f launches/s)\n", loops, dt, loops / dt);
        CHECK(cudaMemcpy(hly, ly, sizeof hly, cudaMemcpyDeviceToHost));
        int bad = -1;
        for (int i = 0; i < m && bad < 0; i++)
            if (hly[i] != hly0[i] + (float)loops * 0.25f * hlx[i])
                bad = i;
        EXPECT(bad < 0, "%d axpy launches: y[%d] = %.9g, expected %.9g", loops, bad,
               bad >= 0 ? hly[bad] : 0.0, bad >= 0 ? hly0[bad] + loops * 0.25 * hlx[bad] : 0.0);
        CHECK(cudaFree(lx));
        CHECK(cudaFree(ly));
    }

    /* kernel attributes answered for a test kernel */
    {
        cudaFuncAttributes fa;
        memset(&fa, 0, sizeof fa);
        CHECK(cudaFuncGetAttributes(&fa, gp_test_axpy));
        printf("gp_test_axpy: maxThreadsPerBlock=%d numRegs=%d\n", fa.maxThreadsPerBlock, fa.numRegs);
        EXPECT(fa.maxThreadsPerBlock > 0, "cudaFuncGetAttributes maxThreadsPerBlock %d",
               fa.maxThreadsPerBlock);
        int blocks = 0;
        CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, gp_test_axpy, 256, 0));
        printf("gp_test_axpy: occupancy %d blocks of 256 per SM\n", blocks);
        EXPECT(blocks > 0, "occupancy of gp_test_axpy: %d blocks", blocks);
    }

    CHECK(cudaStreamDestroy(s));
    CHECK(cudaFree(x));
    CHECK(cudaFree(y));
    free(hx);
    free(hy);
    free(hy0);
    CHECK(cudaDeviceSynchronize());
    return gp_finish();
}
