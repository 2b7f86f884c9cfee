/*
 * test_sim_launch.c: modules, libraries and launches: every gp_test_* kernel computes the right
 * values through cuLaunchKernel with kernelParams and with the packed `extra` buffer, unknown
 * kernels fail with their name, bad pointers fail with a sticky CUDA_ERROR_ILLEGAL_ADDRESS, and
 * images (PTX text here; the nvcc-built cubin and fatbins when the pytest provides them) are
 * parsed for names, parameters and globals, while garbage images are refused.
 */
#include <dlfcn.h>
#include <time.h>

#include "sim_test.h"

/* struct gp_big_arg of gp_test_kernels.cuh */
struct big_arg {
    int v[100];
};

/* A fatbin wrapper as nvcc emits it into host code: {magic, version, fatbin, unused}. */
struct fatbin_wrapper {
    int magic;
    int version;
    const void *data;
    void *unused;
};

static CUmodule load_ptx(void)
{
    CUmodule m = NULL;
    OK(cuModuleLoadData(&m, sim_test_ptx));
    return m;
}

static CUfunction get_fn(CUmodule m, const char *name)
{
    CUfunction f = NULL;
    OK(cuModuleGetFunction(&f, m, name));
    return f;
}

/* Launches f with its arguments either as kernelParams or packed into an `extra` buffer, the way
 * the worker packs them: at the offsets cuFuncGetParamInfo reports. */
static CUresult launch(CUfunction f, const unsigned grid[3], const unsigned block[3], void **args,
                       bool use_extra)
{
    if (!use_extra)
        return cuLaunchKernel(f, grid[0], grid[1], grid[2], block[0], block[1], block[2], 0, NULL,
                              args, NULL);
    unsigned char buf[1024];
    size_t total = 0, off = 0, size = 0;
    memset(buf, 0xee, sizeof(buf));
    for (size_t i = 0; cuFuncGetParamInfo(f, i, &off, &size) == CUDA_SUCCESS; i++) {
        CHECK(off + size <= sizeof(buf));
        memcpy(buf + off, args[i], size);
        if (off + size > total)
            total = off + size;
    }
    void *extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, buf, CU_LAUNCH_PARAM_BUFFER_SIZE, &total,
                     CU_LAUNCH_PARAM_END};
    return cuLaunchKernel(f, grid[0], grid[1], grid[2], block[0], block[1], block[2], 0, NULL, NULL,
                          extra);
}

static const unsigned one[3] = {1, 1, 1};

static void run_all_kernels(CUmodule m, bool use_extra)
{
    /* gp_test_noop */
    OK(launch(get_fn(m, "gp_test_noop"), one, one, NULL, use_extra));

    /* gp_test_axpy: 1024 threads, n = 1000 */
    enum {
        N = 1000
    };
    float x[N], y[N], out[N];
    for (int i = 0; i < N; i++) {
        x[i] = (float)i;
        y[i] = 2.0f * (float)i;
    }
    CUdeviceptr dx = 0, dy = 0;
    OK(cuMemAlloc_v2(&dx, sizeof(x)));
    OK(cuMemAlloc_v2(&dy, sizeof(y)));
    OK(cuMemcpyHtoD_v2(dx, x, sizeof(x)));
    OK(cuMemcpyHtoD_v2(dy, y, sizeof(y)));
    float a = 0.5f;
    int n = N;
    void *axpy_args[] = {&a, &dx, &dy, &n};
    const unsigned g4[3] = {4, 1, 1}, b256[3] = {256, 1, 1};
    OK(launch(get_fn(m, "gp_test_axpy"), g4, b256, axpy_args, use_extra));
    OK(cuMemcpyDtoH_v2(out, dy, sizeof(out)));
    for (int i = 0; i < N; i++)
        CHECK(out[i] == 2.5f * (float)i);

    /* gp_test_scalars */
    CUdeviceptr dout = 0;
    OK(cuMemAlloc_v2(&dout, 6 * sizeof(double)));
    char c = -5;
    short s = -300;
    int i32 = 123456;
    long long l = 1ll << 40;
    float f = 1.5f;
    double d = -2.25;
    void *sc_args[] = {&dout, &c, &s, &i32, &l, &f, &d};
    OK(launch(get_fn(m, "gp_test_scalars"), one, one, sc_args, use_extra));
    double r[6];
    OK(cuMemcpyDtoH_v2(r, dout, sizeof(r)));
    CHECK(r[0] == -5.0 && r[1] == -300.0 && r[2] == 123456.0);
    CHECK(r[3] == 1099511627776.0 && r[4] == 1.5 && r[5] == -2.25);

    /* gp_test_big_struct */
    struct big_arg big;
    long long want = 0;
    for (int k = 0; k < 100; k++) {
        big.v[k] = k * 3 - 7;
        want += (long long)big.v[k] * (k + 1);
    }
    CUdeviceptr dll = 0;
    OK(cuMemAlloc_v2(&dll, 3 * sizeof(long long)));
    void *big_args[] = {&big, &dll};
    OK(launch(get_fn(m, "gp_test_big_struct"), one, one, big_args, use_extra));
    long long rr[3];
    OK(cuMemcpyDtoH_v2(rr, dll, sizeof(rr)));
    CHECK_EQ(rr[0], want);
    CHECK_EQ(rr[1], -7);
    CHECK_EQ(rr[2], 99 * 3 - 7);

    /* gp_test_index: a 3D grid of 3D blocks, 288 threads, n = 250 */
    enum {
        M = 300
    };
    unsigned idx[M];
    CUdeviceptr didx = 0;
    OK(cuMemAlloc_v2(&didx, sizeof(idx)));
    OK(cuMemsetD32_v2(didx, 0xffffffffu, M));
    unsigned nn = 250;
    void *idx_args[] = {&didx, &nn};
    const unsigned g3[3] = {3, 2, 2}, b3[3] = {4, 3, 2};
    OK(launch(get_fn(m, "gp_test_index"), g3, b3, idx_args, use_extra));
    OK(cuMemcpyDtoH_v2(idx, didx, sizeof(idx)));
    for (unsigned t = 0; t < M; t++)
        CHECK_EQ(idx[t], t < nn ? t * 2654435761u : 0xffffffffu);
    /* n larger than the grid: only the 288 threads' entries are written */
    nn = M;
    OK(cuMemsetD32_v2(didx, 0xffffffffu, M));
    OK(launch(get_fn(m, "gp_test_index"), g3, b3, idx_args, use_extra));
    OK(cuMemcpyDtoH_v2(idx, didx, sizeof(idx)));
    for (unsigned t = 0; t < M; t++)
        CHECK_EQ(idx[t], t < 288 ? t * 2654435761u : 0xffffffffu);

    OK(cuMemFree_v2(dx));
    OK(cuMemFree_v2(dy));
    OK(cuMemFree_v2(dout));
    OK(cuMemFree_v2(dll));
    OK(cuMemFree_v2(didx));
}

static void test_kernels_params(void)
{
    sim_test_init();
    run_all_kernels(load_ptx(), false);
}

static void test_kernels_extra(void)
{
    sim_test_init();
    run_all_kernels(load_ptx(), true);
}

static void test_param_info(void)
{
    sim_test_init();
    CUmodule m = load_ptx();
    CUfunction f = get_fn(m, "gp_test_scalars");
    static const size_t offs[7] = {0, 8, 10, 12, 16, 24, 32}, sizes[7] = {8, 1, 2, 4, 8, 4, 8};
    size_t off = 0, size = 0;
    for (size_t i = 0; i < 7; i++) {
        OK(cuFuncGetParamInfo(f, i, &off, &size));
        CHECK_EQ(off, offs[i]);
        CHECK_EQ(size, sizes[i]);
    }
    OK(cuFuncGetParamInfo(f, 6, &off, NULL)); /* the size is optional */
    CHECK_RC(cuFuncGetParamInfo(f, 7, &off, &size), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuFuncGetParamInfo(f, 0, NULL, &size), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuFuncGetParamInfo((CUfunction)0x42, 0, &off, &size), CUDA_ERROR_INVALID_HANDLE);
    OK(cuFuncGetParamInfo(get_fn(m, "gp_test_big_struct"), 0, &off, &size));
    CHECK_EQ(size, 400);
    OK(cuFuncGetParamInfo(get_fn(m, "gp_test_big_struct"), 1, &off, &size));
    CHECK_EQ(off, 400);
    CHECK_RC(cuFuncGetParamInfo(get_fn(m, "gp_test_noop"), 0, &off, &size),
             CUDA_ERROR_INVALID_VALUE);
    /* A PTX module's other kernels: any name, layout unknown. */
    CHECK_RC(cuFuncGetParamInfo(get_fn(m, "some_kernel"), 0, &off, &size),
             CUDA_ERROR_NOT_SUPPORTED);
    /* Same name, same handle. */
    CHECK(get_fn(m, "gp_test_axpy") == get_fn(m, "gp_test_axpy"));
    CHECK_RC(cuModuleGetFunction(NULL, m, "x"), CUDA_ERROR_INVALID_VALUE);
    CUfunction g = NULL;
    CHECK_RC(cuModuleGetFunction(&g, (CUmodule)0x42, "x"), CUDA_ERROR_INVALID_HANDLE);
    OK(cuModuleUnload(m));
    CHECK_RC(cuModuleUnload(m), CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cuFuncGetParamInfo(f, 0, &off, &size), CUDA_ERROR_INVALID_HANDLE);
}

static void test_library(void)
{
    OK(cuInit(0));
    CUlibrary lib = NULL;
    CUlibraryOption opt = CU_LIBRARY_BINARY_IS_PRESERVED;
    void *optval = (void *)1;
    /* Libraries need no context (cudart loads them early). */
    OK(cuLibraryLoadData(&lib, sim_test_ptx, NULL, NULL, 0, &opt, &optval, 1));
    CHECK_RC(cuLibraryLoadData(&lib, sim_test_ptx, NULL, NULL, 1, NULL, NULL, 0),
             CUDA_ERROR_INVALID_VALUE);
    CUlibraryOption badopt = 77;
    CUlibrary lib2 = NULL;
    CHECK_RC(cuLibraryLoadData(&lib2, sim_test_ptx, NULL, NULL, 0, &badopt, NULL, 1),
             CUDA_ERROR_INVALID_VALUE);
    CUkernel k = NULL, k2 = NULL;
    OK(cuLibraryGetKernel(&k, lib, "gp_test_index"));
    OK(cuLibraryGetKernel(&k2, lib, "gp_test_index"));
    CHECK(k == k2);
    size_t off = 0, size = 0;
    OK(cuKernelGetParamInfo(k, 1, &off, &size));
    CHECK_EQ(off, 8);
    CHECK_EQ(size, 4);
    CHECK_RC(cuKernelGetParamInfo(k, 2, &off, &size), CUDA_ERROR_INVALID_VALUE);
    sim_test_init();
    CUfunction f = NULL;
    OK(cuKernelGetFunction(&f, k));
    CHECK(f != NULL && (void *)f != (void *)k);
    CHECK_RC(cuKernelGetParamInfo((CUkernel)f, 0, &off, &size), CUDA_ERROR_INVALID_HANDLE);
    /* cudart launches the CUkernel itself through cuLaunchKernel. */
    CUdeviceptr d = 0;
    OK(cuMemAlloc_v2(&d, 64));
    unsigned n = 16;
    void *args[] = {&d, &n};
    OK(cuLaunchKernel((CUfunction)k, 1, 1, 1, 16, 1, 1, 0, NULL, args, NULL));
    OK(cuLaunchKernel(f, 1, 1, 1, 16, 1, 1, 0, NULL, args, NULL));
    unsigned out[16];
    OK(cuMemcpyDtoH_v2(out, d, sizeof(out)));
    CHECK_EQ(out[15], 15u * 2654435761u);
    int v = 0;
    OK(cuKernelGetAttribute(&v, 0 /* MAX_THREADS_PER_BLOCK */, k, 0));
    CHECK_EQ(v, 1024);
    CHECK_RC(cuKernelGetAttribute(&v, 0, k, 3), CUDA_ERROR_INVALID_DEVICE);
    OK(cuKernelSetCacheConfig(k, 2 /* PREFER_L1 */, 0));
    CHECK_RC(cuKernelSetCacheConfig(k, 9, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuKernelSetCacheConfig(k, 0, 1), CUDA_ERROR_INVALID_DEVICE);
    OK(cuKernelSetAttribute(8 /* MAX_DYNAMIC_SHARED_SIZE_BYTES */, 65536, k, 0));
    OK(cuFuncGetAttribute(&v, 8, f));
    CHECK_EQ(v, 65536);
    CUdeviceptr gp = 0;
    size_t gs = 0;
    CHECK_RC(cuLibraryGetGlobal(&gp, &gs, lib, "anything"), CUDA_ERROR_NOT_FOUND);
    OK(cuLibraryUnload(lib));
    CHECK_RC(cuLibraryUnload(lib), CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cuKernelGetParamInfo(k, 0, &off, &size), CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, args, NULL), CUDA_ERROR_INVALID_HANDLE);
}

static void test_launch_errors(void)
{
    sim_test_init();
    CUmodule m = load_ptx();
    CUfunction f = get_fn(m, "gp_test_index");
    CUdeviceptr d = 0;
    OK(cuMemAlloc_v2(&d, 4096));
    unsigned n = 1;
    void *args[] = {&d, &n};
    CHECK_RC(cuLaunchKernel(f, 0, 1, 1, 1, 1, 1, 0, NULL, args, NULL), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuLaunchKernel(f, 1, 1, 1, 1025, 1, 1, 0, NULL, args, NULL), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuLaunchKernel(f, 1, 1, 1, 32, 32, 2, 0, NULL, args, NULL), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuLaunchKernel(f, 1, 1, 1, 1, 1, 65, 0, NULL, args, NULL), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuLaunchKernel(f, 1, 65536, 1, 1, 1, 1, 0, NULL, args, NULL),
             CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 49153, NULL, args, NULL),
             CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, (CUstream)0x9, args, NULL),
             CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cuLaunchKernel((CUfunction)0x9, 1, 1, 1, 1, 1, 1, 0, NULL, args, NULL),
             CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL), CUDA_ERROR_INVALID_VALUE);
    void *bad_args[] = {&d, NULL};
    CHECK_RC(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, bad_args, NULL),
             CUDA_ERROR_INVALID_VALUE);
    unsigned char buf[12];
    memcpy(buf, &d, 8);
    memcpy(buf + 8, &n, 4);
    size_t size = sizeof(buf);
    void *extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, buf, CU_LAUNCH_PARAM_BUFFER_SIZE, &size,
                     CU_LAUNCH_PARAM_END};
    CHECK_RC(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, args, extra), CUDA_ERROR_INVALID_VALUE);
    OK(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, extra));
    size = 11; /* too small for the parameters */
    CHECK_RC(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, extra), CUDA_ERROR_INVALID_VALUE);
    size = 16; /* padding after the parameters is fine */
    OK(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, extra));
    void *bad_extra[] = {(void *)0x7, buf, CU_LAUNCH_PARAM_END};
    CHECK_RC(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, bad_extra),
             CUDA_ERROR_INVALID_VALUE);
    void *no_size[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, buf, CU_LAUNCH_PARAM_END};
    CHECK_RC(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, no_size), CUDA_ERROR_INVALID_VALUE);
    /* Dynamic shared memory up to the function's limit, which can be raised. */
    OK(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 49152, NULL, args, NULL));
    OK(cuFuncSetAttribute(f, 8, 200000));
    OK(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 200000, NULL, args, NULL));
    OK(cuLaunchKernel(f, 2147483647u, 1, 1, 1, 1, 1, 0, NULL, args, NULL)); /* huge grid, n = 1 */
}

static void test_unknown_kernel(void)
{
    sim_test_init();
    CUmodule m = load_ptx();
    CUfunction f = get_fn(m, "my_real_kernel");
    sim_test_stderr_begin();
    CUresult rc = cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
    char *err = sim_test_stderr_end();
    CHECK_EQ(rc, CUDA_ERROR_NOT_SUPPORTED);
    CHECK(strcmp(err, "gpupool-sim: kernel 'my_real_kernel' cannot run on the simulated device "
                      "(only gp_test_* kernels are simulated)\n") == 0);
    CHECK(strstr(gpupoolSimLastErrorDetail(), "'my_real_kernel'") != NULL);
    free(err);
    /* The detail is per call: the next successful call clears it. */
    OK(cuCtxSynchronize());
    CHECK(gpupoolSimLastErrorDetail()[0] == '\0');
    /* gp_test_ names that are not in the table are not simulated either. */
    sim_test_stderr_begin();
    rc = cuLaunchKernel(get_fn(m, "gp_test_missing"), 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
    free(sim_test_stderr_end());
    CHECK_EQ(rc, CUDA_ERROR_NOT_SUPPORTED);
}

/* The benchmark-only count mode: any kernel is accepted and not run, with or without a known
 * parameter layout, directly and in a captured graph; the gp_test_* kernels still compute. */
static void test_count_mode(void)
{
    CHECK(setenv("GPUPOOL_SIM_COUNT_ONLY", "true", 1) == 0);
    CHECK(setenv("GPUPOOL_BENCH_COUNT_MODE", "1", 1) == 0);
    sim_test_init();
    CUmodule m = load_ptx();
    CUfunction f = get_fn(m, "my_real_kernel");
    size_t off = 0;
    CHECK_RC(cuFuncGetParamInfo(f, 0, &off, NULL), CUDA_ERROR_NOT_SUPPORTED); /* layout unknown */
    int arg = 7;
    void *args[] = {&arg};
    sim_test_stderr_begin();
    CUresult rc = cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
    CUresult rc2 = cuLaunchKernel(f, 8, 1, 1, 128, 1, 1, 0, NULL, args, NULL);
    char *err = sim_test_stderr_end();
    OK(rc);
    OK(rc2);
    CHECK(err[0] == '\0'); /* nothing on stderr: accepting is the point of the mode */
    free(err);
    /* The launch is still checked where the sim can check it. */
    CHECK_RC(cuLaunchKernel(f, 0, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL), CUDA_ERROR_INVALID_VALUE);
    /* gp_test_axpy still computes. */
    enum {
        N = 64
    };
    float x[N], y[N];
    for (int i = 0; i < N; i++) {
        x[i] = (float)i;
        y[i] = 1.0f;
    }
    CUdeviceptr dx = 0, dy = 0;
    OK(cuMemAlloc_v2(&dx, sizeof(x)));
    OK(cuMemAlloc_v2(&dy, sizeof(y)));
    OK(cuMemcpyHtoD_v2(dx, x, sizeof(x)));
    OK(cuMemcpyHtoD_v2(dy, y, sizeof(y)));
    float a = 2.0f;
    int n = N;
    void *axpy_args[] = {&a, &dx, &dy, &n};
    OK(cuLaunchKernel(get_fn(m, "gp_test_axpy"), 1, 1, 1, N, 1, 1, 0, NULL, axpy_args, NULL));
    OK(cuMemcpyDtoH_v2(y, dy, sizeof(y)));
    for (int i = 0; i < N; i++)
        CHECK(y[i] == 2.0f * (float)i + 1.0f);
    /* Captured into a graph and replayed: accepted, not run. */
    CUstream s;
    OK(cuStreamCreateWithPriority(&s, 0, 0));
    OK(cuStreamBeginCapture_v2(s, 0));
    OK(cuLaunchKernel(f, 2, 1, 1, 32, 1, 1, 0, s, args, NULL));
    CUgraph g = NULL;
    OK(cuStreamEndCapture(s, &g));
    size_t nodes = 0;
    OK(cuGraphGetNodes(g, NULL, &nodes));
    CHECK_EQ(nodes, 1);
    CUgraphExec ge = NULL;
    OK(cuGraphInstantiateWithFlags(&ge, g, 0));
    OK(cuGraphLaunch(ge, s));
    OK(cuGraphLaunch(ge, s));
    OK(cuStreamSynchronize(s));
    OK(cuGraphExecDestroy(ge));
    OK(cuGraphDestroy(g));
    OK(cuCtxSynchronize()); /* nothing sticky */
}

static void test_illegal_address(void)
{
    sim_test_init();
    CUmodule m = load_ptx();
    CUdeviceptr y = 0;
    OK(cuMemAlloc_v2(&y, 64 * sizeof(float)));
    CUdeviceptr x = 0x1000; /* not device memory */
    float a = 1;
    int n = 64;
    void *args[] = {&a, &x, &y, &n};
    CHECK_RC(cuLaunchKernel(get_fn(m, "gp_test_axpy"), 1, 1, 1, 64, 1, 1, 0, NULL, args, NULL),
             CUDA_ERROR_ILLEGAL_ADDRESS);
    CHECK(strstr(gpupoolSimLastErrorDetail(), "parameter x") != NULL);
    /* Sticky: the context is unusable until reset. */
    CUdeviceptr p = 0;
    CHECK_RC(cuMemAlloc_v2(&p, 16), CUDA_ERROR_ILLEGAL_ADDRESS);
    CHECK_RC(cuCtxSynchronize(), CUDA_ERROR_ILLEGAL_ADDRESS);
    CHECK_RC(cuStreamSynchronize(NULL), CUDA_ERROR_ILLEGAL_ADDRESS);
    OK(cuDevicePrimaryCtxReset_v2(0));
    sim_test_init();
    OK(cuMemAlloc_v2(&p, 16));
    /* A range that starts in device memory and runs past its end is caught too. */
    m = load_ptx();
    n = 5; /* out has room for 4 */
    unsigned nn = 5;
    void *idx_args[] = {&p, &nn};
    OK(cuLaunchKernel(get_fn(m, "gp_test_index"), 1, 1, 1, 4, 1, 1, 0, NULL, idx_args, NULL));
    CHECK_RC(cuLaunchKernel(get_fn(m, "gp_test_index"), 1, 1, 1, 5, 1, 1, 0, NULL, idx_args, NULL),
             CUDA_ERROR_ILLEGAL_ADDRESS);
}

static void test_launch_ex(void)
{
    sim_test_init();
    CUmodule m = load_ptx();
    CUfunction f = get_fn(m, "gp_test_index");
    CUdeviceptr d = 0;
    OK(cuMemAlloc_v2(&d, 64 * 4));
    unsigned n = 64;
    void *args[] = {&d, &n};
    CUlaunchAttribute attr;
    memset(&attr, 0, sizeof(attr));
    attr.id = 4; /* CLUSTER_DIMENSION */
    attr.value.clusterDim.x = 2;
    attr.value.clusterDim.y = 1;
    attr.value.clusterDim.z = 1;
    CUlaunchConfig cfg = {.gridDimX = 4,
                          .gridDimY = 1,
                          .gridDimZ = 1,
                          .blockDimX = 16,
                          .blockDimY = 1,
                          .blockDimZ = 1,
                          .attrs = &attr,
                          .numAttrs = 1};
    OK(cuLaunchKernelEx(&cfg, f, args, NULL));
    unsigned out[64];
    OK(cuMemcpyDtoH_v2(out, d, sizeof(out)));
    CHECK_EQ(out[63], 63u * 2654435761u);
    cfg.gridDimX = 3; /* not a multiple of the cluster */
    CHECK_RC(cuLaunchKernelEx(&cfg, f, args, NULL), 912);
    cfg.gridDimX = 32;
    attr.value.clusterDim.x = 16; /* beyond the portable 8 */
    CHECK_RC(cuLaunchKernelEx(&cfg, f, args, NULL), 912);
    OK(cuFuncSetAttribute(f, 14 /* NON_PORTABLE_CLUSTER_SIZE_ALLOWED */, 1));
    OK(cuLaunchKernelEx(&cfg, f, args, NULL));
    CHECK_RC(cuLaunchKernelEx(NULL, f, args, NULL), CUDA_ERROR_INVALID_VALUE);
    cfg.attrs = NULL;
    CHECK_RC(cuLaunchKernelEx(&cfg, f, args, NULL), CUDA_ERROR_INVALID_VALUE);
    cfg.numAttrs = 0;
    OK(cuLaunchKernelEx(&cfg, f, args, NULL));
}

static void test_spin_timing(void)
{
    sim_test_init();
    CUmodule m = load_ptx();
    CUevent a = NULL, b = NULL;
    OK(cuEventCreate(&a, 0));
    OK(cuEventCreate(&b, 0));
    unsigned long long ns = 30ull * 1000 * 1000;
    void *args[] = {&ns};
    OK(cuEventRecord(a, NULL));
    OK(cuLaunchKernel(get_fn(m, "gp_test_spin"), 2, 1, 1, 64, 1, 1, 0, NULL, args, NULL));
    OK(cuEventRecord(b, NULL));
    OK(cuEventSynchronize(b));
    float ms = 0;
    OK(cuEventElapsedTime_v2(&ms, a, b));
    CHECK(ms >= 29.5f && ms < 2000.0f); /* once per launch, not once per thread */
}

static void test_attributes_occupancy(void)
{
    sim_test_init();
    CUmodule m = load_ptx();
    CUfunction f = get_fn(m, "gp_test_axpy");
    int v = 0;
    OK(cuFuncGetAttribute(&v, 4 /* NUM_REGS */, f));
    CHECK_EQ(v, 32); /* PTX: unknown, a typical value */
    OK(cuFuncGetAttribute(&v, 0, f));
    CHECK_EQ(v, 1024);
    OK(cuFuncGetAttribute(&v, 6 /* BINARY_VERSION */, f));
    CHECK_EQ(v, 90);
    OK(cuFuncGetAttribute(&v, 9 /* CARVEOUT */, f));
    CHECK_EQ(v, -1);
    CHECK_RC(cuFuncGetAttribute(&v, 16, f), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuFuncGetAttribute(NULL, 0, f), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuFuncGetAttribute(&v, 0, (CUfunction)0x5), CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cuFuncSetAttribute(f, 4, 10), CUDA_ERROR_INVALID_VALUE); /* read-only */
    CHECK_RC(cuFuncSetAttribute(f, 8, 232449), CUDA_ERROR_INVALID_VALUE);
    OK(cuFuncSetAttribute(f, 9, 50));
    OK(cuFuncSetCacheConfig(f, 1));
    CHECK_RC(cuFuncSetCacheConfig(f, 4), CUDA_ERROR_INVALID_VALUE);

    int blocks = 0;
    OK(cuOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, f, 256, 0));
    CHECK_EQ(blocks, 8); /* 2048 threads per SM */
    OK(cuOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, f, 32, 0));
    CHECK_EQ(blocks, 32); /* blocks per SM */
    OK(cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(&blocks, f, 1024, 0, 1));
    CHECK_EQ(blocks, 2);
    OK(cuOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, f, 1025, 0));
    CHECK_EQ(blocks, 0);
    OK(cuFuncSetAttribute(f, 8, 100000));
    OK(cuOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, f, 64, 100000));
    CHECK_EQ(blocks, 2); /* 228 KiB of shared memory per SM */
    CHECK_RC(cuOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, f, 0, 0),
             CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(&blocks, f, 32, 0, 4),
             CUDA_ERROR_INVALID_VALUE);
    size_t smem = 0;
    OK(cuOccupancyAvailableDynamicSMemPerBlock(&smem, f, 2, 256));
    CHECK_EQ(smem, 100000); /* capped by the function's limit */
    OK(cuOccupancyAvailableDynamicSMemPerBlock(&smem, f, 4, 256));
    CHECK_EQ(smem, 233472 / 4 - 1024);
    OK(cuOccupancyAvailableDynamicSMemPerBlock(&smem, f, 9, 256));
    CHECK_EQ(smem, 0); /* 9 blocks of 256 threads do not fit */
    CUlaunchConfig cfg = {.gridDimX = 64,
                          .gridDimY = 1,
                          .gridDimZ = 1,
                          .blockDimX = 128,
                          .blockDimY = 1,
                          .blockDimZ = 1};
    int cs = 0, nc = 0;
    OK(cuOccupancyMaxPotentialClusterSize(&cs, f, &cfg));
    CHECK_EQ(cs, 8);
    OK(cuOccupancyMaxActiveClusters(&nc, f, &cfg));
    CHECK_EQ(nc, 16 * 16 * 8); /* 16 blocks per SM, 16 SMs per GPC, 8 GPCs, clusters of 1 */
    CUlaunchAttribute attr;
    memset(&attr, 0, sizeof(attr));
    attr.id = 4;
    attr.value.clusterDim.x = 4;
    attr.value.clusterDim.y = 1;
    attr.value.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    OK(cuOccupancyMaxActiveClusters(&nc, f, &cfg));
    CHECK_EQ(nc, 16 * 16 / 4 * 8);
    attr.value.clusterDim.x = 9;
    CHECK_RC(cuOccupancyMaxActiveClusters(&nc, f, &cfg), 912);
    CHECK_RC(cuOccupancyMaxActiveClusters(&nc, f, NULL), CUDA_ERROR_INVALID_VALUE);
}

/* ---- images built by nvcc (tests/test_sim_device.py provides them) ----------------------- */

static void test_cubin_module(void)
{
    size_t len = 0;
    unsigned char *cubin = sim_test_input("GP_SIM_TEST_CUBIN", &len);
    sim_test_init();
    CUmodule m = NULL;
    OK(cuModuleLoadData(&m, cubin));
    /* Only the image's kernels exist. */
    CUfunction f = NULL;
    CHECK_RC(cuModuleGetFunction(&f, m, "no_such_kernel"), CUDA_ERROR_NOT_FOUND);
    CHECK_RC(cuModuleGetFunction(&f, m, "gp_counter"), CUDA_ERROR_NOT_FOUND); /* a variable */
    run_all_kernels(m, false);
    run_all_kernels(m, true);
    /* An ordinary kernel: its layout comes from the cubin's parameter records. */
    CUfunction other = get_fn(m, "gp_other_kernel");
    static const size_t offs[4] = {0, 8, 16, 416}, sizes[4] = {4, 8, 400, 8};
    size_t off = 0, size = 0;
    for (size_t i = 0; i < 4; i++) {
        OK(cuFuncGetParamInfo(other, i, &off, &size));
        CHECK_EQ(off, offs[i]);
        CHECK_EQ(size, sizes[i]);
    }
    CHECK_RC(cuFuncGetParamInfo(other, 4, &off, &size), CUDA_ERROR_INVALID_VALUE);
    sim_test_stderr_begin();
    CUresult rc = cuLaunchKernel(other, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
    free(sim_test_stderr_end());
    CHECK_EQ(rc, CUDA_ERROR_NOT_SUPPORTED);
    int regs = 0;
    OK(cuFuncGetAttribute(&regs, 4, get_fn(m, "gp_test_axpy")));
    CHECK(regs > 0 && regs <= 255);

    /* Globals: device memory of the right size, with the image's initial values. */
    CUdeviceptr g = 0, g2 = 0;
    size_t gsize = 0;
    OK(cuModuleGetGlobal_v2(&g, &gsize, m, "gp_table"));
    CHECK_EQ(gsize, 64);
    float table[16];
    OK(cuMemcpyDtoH_v2(table, g, sizeof(table)));
    CHECK(table[0] == 1.0f && table[2] == 3.0f && table[3] == 0.0f && table[15] == 0.0f);
    OK(cuModuleGetGlobal_v2(&g2, NULL, m, "gp_table"));
    CHECK_EQ(g2, g); /* same memory every time */
    OK(cuModuleGetGlobal_v2(&g, &gsize, m, "gp_consts"));
    CHECK_EQ(gsize, 16);
    int consts[4];
    OK(cuMemcpyDtoH_v2(consts, g, sizeof(consts)));
    CHECK(consts[0] == 5 && consts[3] == 8);
    OK(cuModuleGetGlobal_v2(&g, &gsize, m, "gp_counter"));
    CHECK_EQ(gsize, 4);
    int counter = 7;
    OK(cuMemcpyDtoH_v2(&counter, g, 4));
    CHECK_EQ(counter, 0);
    CHECK_RC(cuModuleGetGlobal_v2(&g, &gsize, m, "gp_nothing"), CUDA_ERROR_NOT_FOUND);
    CHECK_RC(cuMemFree_v2(g), CUDA_ERROR_INVALID_VALUE); /* module memory is not cuMemFree's */
    OK(cuModuleUnload(m));
    CHECK_RC(cuMemcpyDtoH_v2(&counter, g, 4), CUDA_ERROR_INVALID_VALUE); /* freed with it */
    free(cubin);
}

static void test_cubin_wrong_arch(void)
{
    size_t len = 0;
    unsigned char *cubin = sim_test_input("GP_SIM_TEST_CUBIN", &len);
    CHECK(setenv("GPUPOOL_SIM_CC_MAJOR", "8", 1) == 0); /* an sm_90 cubin cannot run on 8.0 */
    sim_test_init();
    CUmodule m = NULL;
    CHECK_RC(cuModuleLoadData(&m, cubin), CUDA_ERROR_NO_BINARY_FOR_GPU);
    free(cubin);
}

static void test_fatbin(void)
{
    size_t len = 0;
    unsigned char *fatbin = sim_test_input("GP_SIM_TEST_FATBIN", &len);
    OK(cuInit(0));
    CUlibrary lib = NULL;
    OK(cuLibraryLoadData(&lib, fatbin, NULL, NULL, 0, NULL, NULL, 0));
    CUkernel k = NULL;
    CHECK_RC(cuLibraryGetKernel(&k, lib, "no_such_kernel"), CUDA_ERROR_NOT_FOUND);
    OK(cuLibraryGetKernel(&k, lib, "gp_test_axpy"));
    /* The way cudart passes it: a wrapper pointing at the fatbin. */
    struct fatbin_wrapper w = {0x466243b1, 1, fatbin, NULL};
    CUlibrary lib2 = NULL;
    OK(cuLibraryLoadData(&lib2, &w, NULL, NULL, 0, NULL, NULL, 0));
    OK(cuLibraryGetKernel(&k, lib2, "gp_other_kernel"));
    size_t off = 0, size = 0;
    OK(cuKernelGetParamInfo(k, 2, &off, &size));
    CHECK_EQ(size, 400);
    sim_test_init();
    CUdeviceptr g = 0;
    size_t gs = 0;
    OK(cuLibraryGetGlobal(&g, &gs, lib2, "gp_table"));
    CHECK_EQ(gs, 64);
    CUmodule m = NULL;
    OK(cuModuleLoadData(&m, fatbin));
    run_all_kernels(m, true);
    OK(cuLibraryUnload(lib));
    OK(cuLibraryUnload(lib2));
    free(fatbin);
}

static void test_fatbin_wrong_arch(void)
{
    size_t len = 0;
    unsigned char *fatbin = sim_test_input("GP_SIM_TEST_FATBIN", &len);
    /* sm_90 code and compute_90 PTX: nothing a compute capability 8.6 device can use. */
    CHECK(setenv("GPUPOOL_SIM_CC_MAJOR", "8", 1) == 0);
    CHECK(setenv("GPUPOOL_SIM_CC_MINOR", "6", 1) == 0);
    OK(cuInit(0));
    CUlibrary lib = NULL;
    CHECK_RC(cuLibraryLoadData(&lib, fatbin, NULL, NULL, 0, NULL, NULL, 0),
             CUDA_ERROR_NO_BINARY_FOR_GPU);
    free(fatbin);
}

static void test_fatbin_compressed(void)
{
    size_t len = 0;
    unsigned char *fatbin = sim_test_input("GP_SIM_TEST_FATBIN_COMPRESSED", &len);
    OK(cuInit(0));
    CUlibrary lib = NULL;
    OK(cuLibraryLoadData(&lib, fatbin, NULL, NULL, 0, NULL, NULL, 0));
    CUkernel k = NULL;
    /* nvcc compresses with ZSTD. With the system's libzstd.so.1 the sim reads the code like an
     * uncompressed cubin: only its names exist, and globals have their sizes. Without it the
     * code is opaque: names cannot be checked, so any is accepted. Either way the sim's own
     * kernels have their layout and run. */
    void *zstd = dlopen("libzstd.so.1", RTLD_NOW | RTLD_LOCAL);
    if (zstd) {
        CHECK(dlclose(zstd) == 0);
        CHECK_RC(cuLibraryGetKernel(&k, lib, "no_such_kernel"), CUDA_ERROR_NOT_FOUND);
        sim_test_init();
        CUdeviceptr g = 0;
        size_t gs = 0;
        OK(cuLibraryGetGlobal(&g, &gs, lib, "gp_table"));
        CHECK_EQ(gs, 64);
    } else {
        printf("note: libzstd.so.1 not found: compressed code stays opaque to the sim\n");
        OK(cuLibraryGetKernel(&k, lib, "no_such_kernel"));
    }
    OK(cuLibraryGetKernel(&k, lib, "gp_test_index"));
    sim_test_init();
    CUdeviceptr d = 0;
    OK(cuMemAlloc_v2(&d, 16));
    unsigned n = 4;
    void *args[] = {&d, &n};
    OK(cuLaunchKernel((CUfunction)k, 1, 1, 1, 4, 1, 1, 0, NULL, args, NULL));
    free(fatbin);
}

static void test_garbage_images(void)
{
    sim_test_init();
    CUmodule m = NULL;
    static unsigned char buf[65536];
    /* Random bytes. */
    unsigned seed = 12345;
    for (size_t i = 0; i < sizeof(buf); i++) {
        seed = seed * 1103515245u + 12345u;
        buf[i] = (unsigned char)(seed >> 16);
    }
    buf[0] = 0x01;
    CHECK_RC(cuModuleLoadData(&m, buf), CUDA_ERROR_INVALID_IMAGE);
    /* An ELF header that is not CUDA's, or whose tables point nowhere. */
    memset(buf, 0, sizeof(buf));
    memcpy(buf, "\177ELF\2\1\1", 7);
    buf[18] = 62; /* x86-64 */
    buf[58] = 64;
    buf[60] = 1;
    buf[40] = 128; /* section headers at 128 */
    CHECK_RC(cuModuleLoadData(&m, buf), CUDA_ERROR_INVALID_IMAGE);
    buf[18] = 190; /* CUDA, but the one section points far outside */
    buf[128 + 24 + 3] = 0x7f;
    buf[128 + 32] = 16;
    CHECK_RC(cuModuleLoadData(&m, buf), CUDA_ERROR_INVALID_IMAGE);
    buf[40] = 0xff; /* section headers beyond 1 GiB */
    buf[45] = 0x7f;
    CHECK_RC(cuModuleLoadData(&m, buf), CUDA_ERROR_INVALID_IMAGE);
    /* A fatbin header claiming more than any image holds, or an entry running past its end. */
    memset(buf, 0, sizeof(buf));
    uint32_t magic = 0xBA55ED50u;
    memcpy(buf, &magic, 4);
    buf[4] = 1;
    buf[6] = 16;
    uint64_t fsize = 1ull << 40;
    memcpy(buf + 8, &fsize, 8);
    CHECK_RC(cuModuleLoadData(&m, buf), CUDA_ERROR_INVALID_IMAGE);
    fsize = 64;
    memcpy(buf + 8, &fsize, 8);
    buf[16] = 2;    /* ELF entry */
    buf[20] = 64;   /* header size */
    buf[24] = 0xff; /* payload far beyond the fatbin */
    CHECK_RC(cuModuleLoadData(&m, buf), CUDA_ERROR_INVALID_IMAGE);
    fsize = 0; /* no entries at all */
    memcpy(buf + 8, &fsize, 8);
    CHECK_RC(cuModuleLoadData(&m, buf), CUDA_ERROR_INVALID_IMAGE);
    /* A wrapper without a fatbin; text that is not PTX. */
    struct fatbin_wrapper w = {0x466243b1, 1, NULL, NULL};
    CHECK_RC(cuModuleLoadData(&m, &w), CUDA_ERROR_INVALID_IMAGE);
    CHECK_RC(cuModuleLoadData(&m, "hello, world"), CUDA_ERROR_INVALID_IMAGE);
    CHECK_RC(cuModuleLoadData(&m, NULL), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuModuleLoadData(NULL, sim_test_ptx), CUDA_ERROR_INVALID_VALUE);
    CUlibrary lib = NULL;
    CHECK_RC(cuLibraryLoadData(&lib, buf, NULL, NULL, 0, NULL, NULL, 0), CUDA_ERROR_INVALID_IMAGE);
    OK(cuCtxSynchronize()); /* nothing sticky came of it */
}

SIM_TEST_MAIN(SIM_T(kernels_params), SIM_T(kernels_extra), SIM_T(param_info), SIM_T(library),
              SIM_T(launch_errors), SIM_T(unknown_kernel), SIM_T(count_mode),
              SIM_T(illegal_address), SIM_T(launch_ex), SIM_T(spin_timing),
              SIM_T(attributes_occupancy), SIM_T(cubin_module), SIM_T(cubin_wrong_arch),
              SIM_T(fatbin), SIM_T(fatbin_wrong_arch), SIM_T(fatbin_compressed),
              SIM_T(garbage_images))
