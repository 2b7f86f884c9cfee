/*
 * modules.cu: modules, libraries, globals, function attributes, occupancy and the launch
 * variants, through the runtime and straight through the driver API.
 *
 *     modules K.cubin K.fatbin K.ptx
 *
 * The three images are this file compiled with nvcc -cubin / -fatbin / -ptx (the device code:
 * the gp_test_* kernels and the globals below). The program links against libcuda (ours, found
 * through LD_LIBRARY_PATH) for the driver API calls.
 */
#include "gp_check.cuh"
#include "../sim/gp_test_kernels.cuh"

#include <vector>

__device__ int g_counter;
__constant__ float c_coef[16];
__device__ int g_init[4] = {1, 2, 3, 4};

/* EXPECT_CU(call, want): the driver call must return exactly `want`. */
#define EXPECT_CU(call, want)                                                                  \
    do {                                                                                       \
        CUresult gp_r_ = (call);                                                               \
        ++gp_checks;                                                                           \
        if (gp_r_ != (want))                                                                   \
            gp_fail(__FILE__, __LINE__, "%s -> %d, expected %d", #call, (int)gp_r_,             \
                    (int)(want));                                                              \
    } while (0)

static std::vector<char> read_file(const char *path, bool nul)
{
    std::vector<char> v;
    FILE *f = fopen(path, "rb");
    if (!f) {
        gp_fail(__FILE__, __LINE__, "cannot open %s", path);
        exit(gp_finish());
    }
    char buf[65536];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0)
        v.insert(v.end(), buf, buf + n);
    fclose(f);
    if (nul)
        v.push_back('\0');
    return v;
}

static size_t smem_for_block(int block) { return (size_t)block * 64; }

static void runtime_part(void)
{
    /* Globals through the runtime (cuLibraryGetGlobal underneath). */
    int v = 42, back = 0;
    CHECK(cudaMemcpyToSymbol(g_counter, &v, sizeof v));
    CHECK(cudaMemcpyFromSymbol(&back, g_counter, sizeof back));
    EXPECT(back == 42, "g_counter round trip: %d", back);
    int init[4] = {0};
    CHECK(cudaMemcpyFromSymbol(init, g_init, sizeof init));
    EXPECT(init[0] == 1 && init[1] == 2 && init[2] == 3 && init[3] == 4,
           "g_init from the image: %d %d %d %d", init[0], init[1], init[2], init[3]);
    float coef[16], coef_back[16];
    for (int i = 0; i < 16; i++)
        coef[i] = 0.5f * (float)i;
    CHECK(cudaMemcpyToSymbol(c_coef, coef, sizeof coef));
    CHECK(cudaMemcpyFromSymbol(coef_back, c_coef, sizeof coef_back));
    EXPECT(!memcmp(coef, coef_back, sizeof coef), "c_coef round trip");
    void *p1 = NULL, *p2 = NULL;
    size_t sz = 0;
    CHECK(cudaGetSymbolAddress(&p1, g_counter));
    CHECK(cudaGetSymbolAddress(&p2, g_counter));
    CHECK(cudaGetSymbolSize(&sz, g_counter));
    EXPECT(p1 && p1 == p2 && sz == sizeof(int), "symbol address %p/%p size %zu", p1, p2, sz);
    int direct = 0;
    CHECK(cudaMemcpy(&direct, p1, sizeof direct, cudaMemcpyDefault));
    EXPECT(direct == 42, "cudaMemcpyDefault from a global: %d", direct);
    cudaPointerAttributes pa;
    CHECK(cudaPointerGetAttributes(&pa, p1));
    EXPECT(pa.type == cudaMemoryTypeDevice, "a global is device memory (type %d)", (int)pa.type);

    /* Attributes and occupancy. */
    cudaFuncAttributes fa;
    CHECK(cudaFuncGetAttributes(&fa, gp_test_axpy));
    EXPECT(fa.maxThreadsPerBlock > 0 && fa.numRegs > 0, "axpy: %d threads, %d regs",
           fa.maxThreadsPerBlock, fa.numRegs);
    EXPECT(fa.maxDynamicSharedSizeBytes >= 0, "axpy max dynamic smem %d",
           fa.maxDynamicSharedSizeBytes);
    CHECK(cudaFuncSetAttribute(gp_test_noop, cudaFuncAttributeMaxDynamicSharedMemorySize, 100000));
    CHECK(cudaFuncGetAttributes(&fa, gp_test_noop));
    EXPECT(fa.maxDynamicSharedSizeBytes == 100000, "set max dynamic smem: %d",
           fa.maxDynamicSharedSizeBytes);
    gp_test_noop<<<1, 32, 100000>>>();
    CHECK(cudaGetLastError());
    int grid = 0, block = 0;
    CHECK(cudaOccupancyMaxPotentialBlockSize(&grid, &block, gp_test_axpy));
    EXPECT(grid > 0 && block > 0 && block <= fa.maxThreadsPerBlock, "potential grid %d block %d",
           grid, block);
    CHECK(cudaOccupancyMaxPotentialBlockSizeVariableSMem(&grid, &block, gp_test_axpy,
                                                         smem_for_block));
    EXPECT(grid > 0 && block > 0, "potential (variable smem) grid %d block %d", grid, block);
    int blocks = 0;
    for (int i = 0; i < 3; i++)
        CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, gp_test_axpy, 256, 0));
    EXPECT(blocks > 0, "active blocks %d", blocks);
    size_t avail = 0;
    CHECK(cudaOccupancyAvailableDynamicSMemPerBlock(&avail, gp_test_axpy, 1, 128));
    EXPECT(avail > 0, "available dynamic smem %zu", avail);

    /* Launch variants. */
    unsigned *out = NULL;
    const unsigned n = 4 * 2 * 64;
    CHECK(cudaMalloc(&out, n * sizeof(unsigned)));
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = 2;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.gridDim = dim3(4, 2, 1);
    cfg.blockDim = dim3(64, 1, 1);
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    int clusters = -1;
    CHECK(cudaOccupancyMaxActiveClusters(&clusters, gp_test_index, &cfg));
    EXPECT(clusters > 0, "active clusters of 2: %d", clusters);
    CHECK(cudaLaunchKernelEx(&cfg, gp_test_index, out, n));
    CHECK(cudaDeviceSynchronize());
    std::vector<unsigned> h(n);
    CHECK(cudaMemcpy(h.data(), out, n * sizeof(unsigned), cudaMemcpyDeviceToHost));
    EXPECT(h[0] != 0xffffffffu || h[n - 1] != 0xffffffffu, "clustered gp_test_index wrote");
    CHECK(cudaLaunchCooperativeKernel((const void *)gp_test_noop, dim3(2), dim3(32), NULL, 0, 0));
    CHECK(cudaDeviceSynchronize());
    gp_test_noop<<<1, 1025>>>();
    EXPECT(cudaGetLastError() != cudaSuccess, "a block of 1025 threads is refused");
    CHECK(cudaFree(out));
}

static void axpy_check(const char *what, CUdeviceptr y, int n, float want0)
{
    std::vector<float> h(n);
    CHECK_CU(cuMemcpyDtoH(h.data(), y, n * sizeof(float)));
    EXPECT(h[0] == want0 && h[n - 1] == want0, "%s: y = %g .. %g, expected %g", what, h[0],
           h[n - 1], want0);
}

static void driver_part(const char *cubin_path, const char *fatbin_path, const char *ptx_path)
{
    std::vector<char> cubin = read_file(cubin_path, false);
    std::vector<char> fatbin = read_file(fatbin_path, false);
    std::vector<char> ptx = read_file(ptx_path, true);

    /* A module from a file: functions, parameter info, launches three ways, globals. */
    CUmodule mod;
    CHECK_CU(cuModuleLoad(&mod, cubin_path));
    CUfunction axpy, again;
    CHECK_CU(cuModuleGetFunction(&axpy, mod, "gp_test_axpy"));
    CHECK_CU(cuModuleGetFunction(&again, mod, "gp_test_axpy"));
    EXPECT(axpy == again, "the same function twice");
    EXPECT_CU(cuModuleGetFunction(&again, mod, "no_such_kernel"), CUDA_ERROR_NOT_FOUND);
    const char *name = NULL;
    CHECK_CU(cuFuncGetName(&name, axpy));
    EXPECT(name && !strcmp(name, "gp_test_axpy"), "name %s", name ? name : "(null)");
    const size_t want_off[] = {0, 8, 16, 24}, want_size[] = {4, 8, 8, 4};
    for (int i = 0; i < 4; i++) {
        size_t off = 99, size = 99;
        CHECK_CU(cuFuncGetParamInfo(axpy, i, &off, &size));
        EXPECT(off == want_off[i] && size == want_size[i], "param %d at %zu size %zu", i, off,
               size);
    }
    size_t off, size;
    EXPECT_CU(cuFuncGetParamInfo(axpy, 4, &off, &size), CUDA_ERROR_INVALID_VALUE);

    const int n = 1000;
    CUdeviceptr x, y;
    CHECK_CU(cuMemAlloc(&x, n * sizeof(float)));
    CHECK_CU(cuMemAlloc(&y, n * sizeof(float)));
    std::vector<float> ones(n, 1.0f), zeros(n, 0.0f);
    CHECK_CU(cuMemcpyHtoD(x, ones.data(), n * sizeof(float)));
    CHECK_CU(cuMemcpyHtoD(y, zeros.data(), n * sizeof(float)));
    float a = 2.0f;
    int nn = n;
    void *params[] = {&a, &x, &y, &nn};
    CHECK_CU(cuLaunchKernel(axpy, (n + 127) / 128, 1, 1, 128, 1, 1, 0, NULL, params, NULL));
    CHECK_CU(cuCtxSynchronize());
    axpy_check("kernelParams", y, n, 2.0f);

    struct {
        float a;
        int pad;
        CUdeviceptr x, y;
        int n;
    } packed = {3.0f, 0, x, y, n};
    size_t psize = 28;
    void *extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, &packed, CU_LAUNCH_PARAM_BUFFER_SIZE, &psize,
                     CU_LAUNCH_PARAM_END};
    CHECK_CU(cuLaunchKernel(axpy, (n + 127) / 128, 1, 1, 128, 1, 1, 0, NULL, NULL, extra));
    CHECK_CU(cuCtxSynchronize());
    axpy_check("extra", y, n, 5.0f);

    CUlaunchAttribute la[1];
    memset(la, 0, sizeof la);
    la[0].id = CU_LAUNCH_ATTRIBUTE_PRIORITY;
    la[0].value.priority = 0;
    CUlaunchConfig lc = {};
    lc.gridDimX = (n + 127) / 128;
    lc.gridDimY = lc.gridDimZ = 1;
    lc.blockDimX = 128;
    lc.blockDimY = lc.blockDimZ = 1;
    lc.attrs = la;
    lc.numAttrs = 1;
    CHECK_CU(cuLaunchKernelEx(&lc, axpy, params, NULL));
    CHECK_CU(cuCtxSynchronize());
    axpy_check("cuLaunchKernelEx", y, n, 7.0f);
    EXPECT_CU(cuLaunchKernel(axpy, 1, 1, 1, 1025, 1, 1, 0, NULL, params, NULL),
              CUDA_ERROR_INVALID_VALUE);
    EXPECT_CU(cuLaunchKernel(axpy, 0, 1, 1, 1, 1, 1, 0, NULL, params, NULL),
              CUDA_ERROR_INVALID_VALUE);

    CUdeviceptr g;
    size_t gsize = 0;
    CHECK_CU(cuModuleGetGlobal(&g, &gsize, mod, "g_init"));
    int init[4] = {0};
    EXPECT(gsize == sizeof init, "g_init size %zu", gsize);
    CHECK_CU(cuMemcpyDtoH(init, g, sizeof init));
    EXPECT(init[0] == 1 && init[3] == 4, "g_init %d .. %d", init[0], init[3]);
    EXPECT_CU(cuModuleGetGlobal(&g, &gsize, mod, "no_such_global"), CUDA_ERROR_NOT_FOUND);

    /* Attributes and occupancy through the driver. */
    int regs = 0, maxt = 0;
    CHECK_CU(cuFuncGetAttribute(&regs, CU_FUNC_ATTRIBUTE_NUM_REGS, axpy));
    CHECK_CU(cuFuncGetAttribute(&maxt, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, axpy));
    EXPECT(regs > 0 && maxt > 0, "regs %d, max threads %d", regs, maxt);
    CHECK_CU(cuFuncSetAttribute(axpy, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 65536));
    int dyn = 0;
    CHECK_CU(cuFuncGetAttribute(&dyn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, axpy));
    EXPECT(dyn == 65536, "max dynamic smem after set: %d", dyn);
    CHECK_CU(cuFuncSetCacheConfig(axpy, CU_FUNC_CACHE_PREFER_SHARED));
    int grid = 0, block = 0;
    CHECK_CU(cuOccupancyMaxPotentialBlockSize(&grid, &block, axpy, smem_for_block, 0, 0));
    EXPECT(grid > 0 && block > 0 && block <= maxt, "driver potential grid %d block %d", grid,
           block);
    int blocks = 0;
    CHECK_CU(cuOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, axpy, 128, 0));
    EXPECT(blocks > 0, "driver active blocks %d", blocks);

    /* A fatbin in memory: the scalar packing. */
    CUmodule fmod;
    CHECK_CU(cuModuleLoadData(&fmod, fatbin.data()));
    CUfunction scalars;
    CHECK_CU(cuModuleGetFunction(&scalars, fmod, "gp_test_scalars"));
    CUdeviceptr dout;
    CHECK_CU(cuMemAlloc(&dout, 6 * sizeof(double)));
    char c = -7;
    short s = -12345;
    int i = 123456789;
    long long l = -1234567890123LL;
    float f = 3.25f;
    double d = -2.5e300;
    void *sp[] = {&dout, &c, &s, &i, &l, &f, &d};
    CHECK_CU(cuLaunchKernel(scalars, 1, 1, 1, 1, 1, 1, 0, NULL, sp, NULL));
    double hd[6] = {0};
    CHECK_CU(cuMemcpyDtoH(hd, dout, sizeof hd));
    EXPECT(hd[0] == -7 && hd[1] == -12345 && hd[2] == 123456789 && hd[3] == -1234567890123.0 &&
               hd[4] == 3.25 && hd[5] == -2.5e300,
           "scalars: %g %g %g %g %g %g", hd[0], hd[1], hd[2], hd[3], hd[4], hd[5]);

    /* A library from the cubin in memory: kernels, their functions, a 400-byte argument. */
    CUlibrary lib;
    CHECK_CU(cuLibraryLoadData(&lib, cubin.data(), NULL, NULL, 0, NULL, NULL, 0));
    CUkernel kbig;
    CHECK_CU(cuLibraryGetKernel(&kbig, lib, "gp_test_big_struct"));
    CUfunction fbig;
    CHECK_CU(cuKernelGetFunction(&fbig, kbig));
    CHECK_CU(cuKernelGetParamInfo(kbig, 0, &off, &size));
    EXPECT(off == 0 && size == 400, "big struct param 0 at %zu size %zu", off, size);
    CHECK_CU(cuKernelGetParamInfo(kbig, 1, &off, &size));
    EXPECT(off == 400 && size == 8, "big struct param 1 at %zu size %zu", off, size);
    gp_big_arg big;
    long long want = 0;
    for (int k = 0; k < 100; k++) {
        big.v[k] = 1000 * k - 7;
        want += (long long)big.v[k] * (k + 1);
    }
    CUdeviceptr lout;
    CHECK_CU(cuMemAlloc(&lout, 3 * sizeof(long long)));
    void *bp[] = {&big, &lout};
    long long hl[3] = {0};
    CHECK_CU(cuLaunchKernel((CUfunction)kbig, 1, 1, 1, 1, 1, 1, 0, NULL, bp, NULL));
    CHECK_CU(cuMemcpyDtoH(hl, lout, sizeof hl));
    EXPECT(hl[0] == want && hl[1] == big.v[0] && hl[2] == big.v[99], "big via CUkernel: %lld",
           hl[0]);
    CHECK_CU(cuMemsetD8(lout, 0, 3 * sizeof(long long)));
    CHECK_CU(cuLaunchKernel(fbig, 1, 1, 1, 1, 1, 1, 0, NULL, bp, NULL));
    CHECK_CU(cuMemcpyDtoH(hl, lout, sizeof hl));
    EXPECT(hl[0] == want, "big via cuKernelGetFunction: %lld", hl[0]);
    int kregs = 0;
    CHECK_CU(cuKernelGetAttribute(&kregs, CU_FUNC_ATTRIBUTE_NUM_REGS, kbig, 0));
    EXPECT(kregs > 0, "kernel regs %d", kregs);
    CHECK_CU(cuKernelSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 1024, kbig, 0));
    CUdeviceptr lg;
    CHECK_CU(cuLibraryGetGlobal(&lg, &gsize, lib, "g_counter"));
    EXPECT(gsize == sizeof(int), "library global size %zu", gsize);
    CUmodule lmod;
    CHECK_CU(cuLibraryGetModule(&lmod, lib));
    CUfunction via_mod;
    CHECK_CU(cuModuleGetFunction(&via_mod, lmod, "gp_test_big_struct"));
    EXPECT(via_mod == fbig, "the library's module gives the kernel's function");

    /* PTX text. */
    CUmodule pmod;
    CHECK_CU(cuModuleLoadData(&pmod, ptx.data()));
    CUfunction pnoop;
    CHECK_CU(cuModuleGetFunction(&pnoop, pmod, "gp_test_noop"));
    CHECK_CU(cuLaunchKernel(pnoop, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL));
    CHECK_CU(cuCtxSynchronize());

    /* JIT linking: gpupool refuses it clearly; a real driver (the native run of the GPU
     * validation) links. */
    CUlinkState link;
    if (gp_through_gpupool()) {
        EXPECT_CU(cuLinkCreate(0, NULL, NULL, &link), CUDA_ERROR_NOT_SUPPORTED);
    } else {
        CHECK_CU(cuLinkCreate(0, NULL, NULL, &link));
        CHECK_CU(cuLinkDestroy(link));
    }

    /* Unloading kills the handles: gpupool answers a stale handle with an error; a real driver
     * may crash on one (the native run of the GPU validation did), so only through gpupool. */
    printf("modules: unloading\n");
    CHECK_CU(cuModuleUnload(mod));
    if (gp_through_gpupool()) {
        EXPECT_CU(cuFuncGetName(&name, axpy), CUDA_ERROR_INVALID_HANDLE);
        EXPECT_CU(cuLaunchKernel(axpy, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL),
                  CUDA_ERROR_INVALID_HANDLE);
        EXPECT_CU(cuModuleUnload(mod), CUDA_ERROR_INVALID_HANDLE);
    }
    CHECK_CU(cuModuleUnload(fmod));
    CHECK_CU(cuModuleUnload(pmod));
    CHECK_CU(cuLibraryUnload(lib));
    if (gp_through_gpupool())
        EXPECT_CU(cuKernelGetFunction(&fbig, kbig), CUDA_ERROR_INVALID_HANDLE);
    CHECK_CU(cuMemFree(x));
    CHECK_CU(cuMemFree(y));
    CHECK_CU(cuMemFree(dout));
    CHECK_CU(cuMemFree(lout));
    CHECK_CU(cuCtxSynchronize());
}

int main(int argc, char **argv)
{
    gp_begin("modules");
    if (argc != 4) {
        fprintf(stderr, "usage: %s K.cubin K.fatbin K.ptx\n", argv[0]);
        return 2;
    }
    REQUIRE(cudaSetDevice(0));
    REQUIRE(cudaFree(0)); /* the primary context is current from here on */
    runtime_part();
    driver_part(argv[1], argv[2], argv[3]);
    CHECK(cudaDeviceSynchronize());
    return gp_finish();
}
