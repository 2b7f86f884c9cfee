/*
 * detach.cu: a tenant whose state must survive an idle detach (tests/test_e2e_detach.py).
 *
 *     detach [MIB [SPIN_MS [AGAIN]]]
 *
 * Sets up MIB MiB (default 2048) of device memory in 32 MiB allocations, each a memset byte with
 * a splitmix pattern in its first MiB, plus a stream-ordered allocation (cudaMallocAsync), a VMM
 * mapping (cuMemCreate/Map), a module global, two streams, two events timed around a spin
 * kernel, an axpy result and an instantiated graph (captured: a memset and an axpy); prints "ready" and waits for a line on stdin (meanwhile gpupoold
 * detaches it and another client uses the GPU). Then it checks that everything is as it left it:
 * every byte, the global, kernels launching on the old streams with the old pointers, the old
 * graph replaying, the old events timing a new spin; prints "first_call_ms=..." (the first call after the idle, which
 * brings the lease back) and the summary line.
 *
 * SPIN_MS > 0: before "ready", print "spinning" and run one kernel of SPIN_MS ms, then a
 * synchronise, then "spun at=<epoch s>": a lease busy in one long call, which must not be
 * detached meanwhile, whoever waits.
 *
 * AGAIN > 0: after the first call (the lease is back on a GPU), print "back" and wait for a
 * second line before the checks: a lease attached again, idle, across a gpupoold restart.
 */
#include "gp_check.cuh"
#include "../sim/gp_test_kernels.cuh"

#include <vector>

#define MIB (1ull << 20)
#define PIECE (32 * MIB)

__device__ unsigned long long g_marks[64];

typedef CUresult (*gran_fn)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags);
typedef CUresult (*reserve_fn)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
typedef CUresult (*create_fn)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                              unsigned long long);
typedef CUresult (*map_fn)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                           unsigned long long);
typedef CUresult (*access_fn)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);

static uint8_t fill_byte(size_t i) { return (uint8_t)((i * 37 + 11) | 1); }

/* n bytes at d equal the pattern `seed` (pattern) or the byte `value` (value >= 0). */
static void expect_bytes(const void *d, size_t n, uint64_t seed, int value, const char *what,
                         std::vector<uint8_t> &buf)
{
    buf.resize(n);
    CHECK(cudaMemcpy(buf.data(), d, n, cudaMemcpyDeviceToHost));
    long long bad = value >= 0 ? gp_verify_byte(buf.data(), n, (uint8_t)value)
                               : gp_verify(buf.data(), n, seed);
    EXPECT(bad < 0, "%s: byte %lld of %zu differs", what, bad, n);
}

int main(int argc, char **argv)
{
    gp_begin("detach");
    size_t mib = argc > 1 ? strtoull(argv[1], NULL, 0) : 2048;
    size_t pieces = mib * MIB / PIECE;
    unsigned long long spin_ms = argc > 2 ? strtoull(argv[2], NULL, 0) : 0;
    int again = argc > 3 && strtoul(argv[3], NULL, 0) > 0;
    std::vector<uint8_t> host(MIB);

    /* Plain allocations: memset bulk, a pattern in the first MiB of each. */
    std::vector<void *> ptrs(pieces, nullptr);
    for (size_t i = 0; i < pieces; i++) {
        REQUIRE(cudaMalloc(&ptrs[i], PIECE));
        CHECK(cudaMemset(ptrs[i], fill_byte(i), PIECE));
        gp_fill(host.data(), MIB, 100 + i);
        CHECK(cudaMemcpy(ptrs[i], host.data(), MIB, cudaMemcpyHostToDevice));
    }

    cudaStream_t s1, s2;
    REQUIRE(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    REQUIRE(cudaStreamCreate(&s2));

    /* Stream-ordered allocation. */
    void *pooled = nullptr;
    std::vector<uint8_t> pool_host(16 * MIB);
    gp_fill(pool_host.data(), pool_host.size(), 7);
    REQUIRE(cudaMallocAsync(&pooled, pool_host.size(), s1));
    CHECK(cudaMemcpyAsync(pooled, pool_host.data(), pool_host.size(), cudaMemcpyHostToDevice, s1));
    CHECK(cudaStreamSynchronize(s1));

    /* A VMM mapping. */
    gran_fn pGran = (gran_fn)gp_driver_fn("cuMemGetAllocationGranularity");
    reserve_fn pReserve = (reserve_fn)gp_driver_fn("cuMemAddressReserve");
    create_fn pCreate = (create_fn)gp_driver_fn("cuMemCreate");
    map_fn pMap = (map_fn)gp_driver_fn("cuMemMap");
    access_fn pAccess = (access_fn)gp_driver_fn("cuMemSetAccess");
    EXPECT(pGran && pReserve && pCreate && pMap && pAccess, "VMM entry points missing");
    if (!(pGran && pReserve && pCreate && pMap && pAccess))
        return gp_finish();
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    size_t g = 0;
    CHECK_CU(pGran(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    size_t vmm_size = 4 * g;
    CUdeviceptr vmm = 0;
    CUmemGenericAllocationHandle h = 0;
    CHECK_CU(pReserve(&vmm, vmm_size, 0, 0, 0));
    CHECK_CU(pCreate(&h, vmm_size, &prop, 0));
    CHECK_CU(pMap(vmm, vmm_size, 0, h, 0));
    CUmemAccessDesc acc;
    acc.location = prop.location;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CHECK_CU(pAccess(vmm, vmm_size, &acc, 1));
    std::vector<uint8_t> vmm_host(vmm_size);
    gp_fill(vmm_host.data(), vmm_size, 9);
    CHECK(cudaMemcpy((void *)vmm, vmm_host.data(), vmm_size, cudaMemcpyHostToDevice));

    /* A module global. */
    unsigned long long marks[64];
    for (int i = 0; i < 64; i++)
        marks[i] = 0x9E3779B97F4A7C15ull * (unsigned long long)(i + 1);
    CHECK(cudaMemcpyToSymbol(g_marks, marks, sizeof marks));

    /* axpy on s2 (y = 2x + y), events around a spin on s2. */
    const int n = 1 << 16;
    float *x = nullptr, *y = nullptr;
    REQUIRE(cudaMalloc(&x, n * sizeof(float)));
    REQUIRE(cudaMalloc(&y, n * sizeof(float)));
    std::vector<float> hx(n), hy(n);
    for (int i = 0; i < n; i++) {
        hx[i] = (float)i;
        hy[i] = 1.0f;
    }
    CHECK(cudaMemcpy(x, hx.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(y, hy.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    gp_test_axpy<<<(n + 255) / 256, 256, 0, s2>>>(2.0f, x, y, n);
    CHECK(cudaGetLastError());
    cudaEvent_t e0, e1;
    REQUIRE(cudaEventCreate(&e0));
    REQUIRE(cudaEventCreate(&e1));
    CHECK(cudaEventRecord(e0, s2));
    gp_test_spin<<<1, 1, 0, s2>>>(20ull * 1000 * 1000);
    CHECK(cudaEventRecord(e1, s2));
    CHECK(cudaStreamSynchronize(s2));
    float before_ms = 0;
    CHECK(cudaEventElapsedTime(&before_ms, e0, e1));

    /* A graph captured on s1: gr = 0; gr = 3 * x + gr. Replayed once now, once after the idle. */
    float *gr = nullptr;
    REQUIRE(cudaMalloc(&gr, n * sizeof(float)));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    REQUIRE(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal));
    CHECK(cudaMemsetAsync(gr, 0, n * sizeof(float), s1));
    gp_test_axpy<<<(n + 255) / 256, 256, 0, s1>>>(3.0f, x, gr, n);
    REQUIRE(cudaStreamEndCapture(s1, &graph));
    REQUIRE(cudaGraphInstantiate(&exec, graph, 0));
    CHECK(cudaGraphLaunch(exec, s1));
    CHECK(cudaStreamSynchronize(s1));

    if (spin_ms > 0) {
        printf("spinning\n");
        fflush(stdout);
        gp_test_spin<<<1, 1, 0, s2>>>(spin_ms * 1000 * 1000);
        CHECK(cudaGetLastError());
        CHECK(cudaStreamSynchronize(s2));
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        printf("spun at=%.6f\n", (double)ts.tv_sec + ts.tv_nsec / 1e9);
    }
    printf("ready pieces=%zu vmm=%zu\n", pieces, vmm_size);
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof line, stdin))
        fprintf(stderr, "detach: stdin closed; carrying on\n");

    /* The first call after the idle brings the lease back: a query. */
    double t0 = gp_now();
    CHECK(cudaStreamQuery(s1));
    double first_ms = (gp_now() - t0) * 1000;
    if (again) {
        printf("back\n");
        fflush(stdout);
        if (!fgets(line, sizeof line, stdin))
            fprintf(stderr, "detach: stdin closed; carrying on\n");
    }

    std::vector<uint8_t> buf;
    for (size_t i = 0; i < pieces; i++) {
        char what[64];
        snprintf(what, sizeof what, "allocation %zu (pattern)", i);
        expect_bytes(ptrs[i], MIB, 100 + i, -1, what, buf);
        snprintf(what, sizeof what, "allocation %zu (memset)", i);
        expect_bytes((uint8_t *)ptrs[i] + MIB, PIECE - MIB, 0, fill_byte(i), what, buf);
    }
    expect_bytes(pooled, pool_host.size(), 7, -1, "stream-ordered allocation", buf);
    expect_bytes((void *)vmm, vmm_size, 9, -1, "VMM mapping", buf);
    unsigned long long back[64];
    CHECK(cudaMemcpyFromSymbol(back, g_marks, sizeof back));
    EXPECT(memcmp(back, marks, sizeof marks) == 0, "the module global changed");

    /* Old streams, old pointers, old events. */
    gp_test_axpy<<<(n + 255) / 256, 256, 0, s1>>>(1.0f, x, y, n);
    CHECK(cudaGetLastError());
    CHECK(cudaStreamSynchronize(s1));
    CHECK(cudaMemcpy(hy.data(), y, n * sizeof(float), cudaMemcpyDeviceToHost));
    int wrong = 0;
    for (int i = 0; i < n; i++)
        wrong += hy[i] != 3.0f * (float)i + 1.0f;
    EXPECT(wrong == 0, "axpy after the detach: %d of %d wrong", wrong, n);
    /* The old graph replays: gr was left as 3x; the memset in it clears it first. */
    CHECK(cudaMemset(gr, 0x7f, n * sizeof(float)));
    CHECK(cudaGraphLaunch(exec, s1));
    CHECK(cudaStreamSynchronize(s1));
    CHECK(cudaMemcpy(hy.data(), gr, n * sizeof(float), cudaMemcpyDeviceToHost));
    wrong = 0;
    for (int i = 0; i < n; i++)
        wrong += hy[i] != 3.0f * (float)i;
    EXPECT(wrong == 0, "graph replay after the detach: %d of %d wrong", wrong, n);
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
    CHECK(cudaEventRecord(e0, s2));
    gp_test_spin<<<1, 1, 0, s2>>>(20ull * 1000 * 1000);
    CHECK(cudaEventRecord(e1, s2));
    CHECK(cudaEventSynchronize(e1));
    float after_ms = 0;
    CHECK(cudaEventElapsedTime(&after_ms, e0, e1));
    EXPECT(before_ms >= 15 && after_ms >= 15, "event timing: %.2f ms before, %.2f ms after",
           before_ms, after_ms);
    CHECK(cudaFreeAsync(pooled, s1));
    CHECK(cudaStreamSynchronize(s1));
    printf("first_call_ms=%.3f before_ms=%.2f after_ms=%.2f\n", first_ms, before_ms, after_ms);
    return gp_finish();
}
