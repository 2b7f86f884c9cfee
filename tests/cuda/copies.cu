/*
 * copies.cu: memory copies in every direction and memsets, verified bit for bit.
 *
 *     copies              the standard sizes: 1 B .. 256 MiB
 *     copies SIZE...      only these sizes (bytes; suffix K, M or G allowed), e.g. `copies 1G`
 *
 * For every size, with odd offsets on the host and on the device side:
 *   1. synchronous H2D, D2D, D2H (pageable host memory), guard bytes around the device ranges;
 *   2. the same with cudaMemcpyDefault (no direction: the addresses tell);
 *   3. asynchronous on three streams chained by events, pinned host memory;
 *   4. asynchronous with pageable host memory, on a stream and on the legacy default stream;
 *   5. cudaMemcpyAsync with cudaMemcpyDefault, pinned memory.
 * Then memsets: cudaMemset, cudaMemsetAsync, cuMemsetD8/D16/D32 and their Async forms (through
 * cudaGetDriverEntryPointByVersion), and cudaMemset2D; and 2D copies (test_copies_2d) between
 * pitched and packed host and device memory, sync and async.
 */
#include "gp_check.cuh"

#define GUARD 64
#define GUARD_BYTE 0xA5

static const size_t MiB = 1024 * 1024;

static size_t parse_size(const char *s)
{
    char *end = NULL;
    unsigned long long v = strtoull(s, &end, 0);
    switch (end && *end ? *end : 0) {
    case 'k': case 'K': v <<= 10; break;
    case 'm': case 'M': v <<= 20; break;
    case 'g': case 'G': v <<= 30; break;
    default: break;
    }
    return (size_t)v;
}

/* Reads back the guard bytes on both sides of dev[off, off+n) and checks they are untouched. */
static void check_guards(const char *what, const uint8_t *dev, size_t off, size_t n)
{
    uint8_t before[GUARD + 8], after[GUARD];
    CHECK(cudaMemcpy(before, dev, off, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(after, dev + off + n, GUARD, cudaMemcpyDeviceToHost));
    long long b = gp_verify_byte(before, off, GUARD_BYTE);
    long long a = gp_verify_byte(after, GUARD, GUARD_BYTE);
    EXPECT(b < 0, "%s n=%zu: guard byte before the range overwritten at -%lld", what, n,
           (long long)off - b);
    EXPECT(a < 0, "%s n=%zu: guard byte after the range overwritten at +%lld", what, n, a);
}

static void expect_pattern(const char *what, size_t n, const void *buf, uint64_t seed)
{
    long long bad = gp_verify(buf, n, seed);
    EXPECT(bad < 0, "%s n=%zu: first wrong byte at %lld: got 0x%02x, expected 0x%02x", what, n, bad,
           bad >= 0 ? ((const uint8_t *)buf)[bad] : 0, bad >= 0 ? gp_pattern_byte(seed, bad) : 0);
}

static void test_size(size_t n, cudaStream_t s[3], uint64_t seed0)
{
    const size_t dA = 7, dB = 1, h1 = 3, h2 = 5; /* odd offsets everywhere */
    const size_t span = n + GUARD + 8;
    double t0 = gp_now();
    uint8_t *A = NULL, *B = NULL;
    REQUIRE(cudaMalloc(&A, span));
    REQUIRE(cudaMalloc(&B, span));
    uint8_t *src = (uint8_t *)malloc(n + 16), *dst = (uint8_t *)malloc(n + 16);
    if (!src || !dst) {
        EXPECT(false, "host malloc of %zu bytes failed", n);
        exit(gp_finish());
    }

    /* 1. synchronous, pageable, explicit directions */
    uint64_t seed = seed0 + 1;
    CHECK(cudaMemset(A, GUARD_BYTE, span));
    CHECK(cudaMemset(B, GUARD_BYTE, span));
    gp_fill(src + h1, n, seed);
    memset(dst, 0, n + 16);
    CHECK(cudaMemcpy(A + dA, src + h1, n, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(B + dB, A + dA, n, cudaMemcpyDeviceToDevice));
    CHECK(cudaMemcpy(dst + h2, B + dB, n, cudaMemcpyDeviceToHost));
    expect_pattern("sync H2D->D2D->D2H", n, dst + h2, seed);
    EXPECT(dst[h2 - 1] == 0 && dst[h2 + n] == 0, "sync D2H n=%zu wrote outside the host range", n);
    check_guards("sync H2D", A, dA, n);
    check_guards("sync D2D", B, dB, n);
    /* the H2D result on its own, from A */
    memset(dst, 0, n + 16);
    CHECK(cudaMemcpy(dst + h1, A + dA, n, cudaMemcpyDeviceToHost));
    expect_pattern("sync H2D->D2H", n, dst + h1, seed);

    /* 2. cudaMemcpyDefault: the runtime/driver classify the addresses */
    seed = seed0 + 2;
    gp_fill(src + h2, n, seed);
    memset(dst, 0, n + 16);
    CHECK(cudaMemcpy(A + dB, src + h2, n, cudaMemcpyDefault));
    CHECK(cudaMemcpy(B + dA, A + dB, n, cudaMemcpyDefault));
    CHECK(cudaMemcpy(dst + h1, B + dA, n, cudaMemcpyDefault));
    expect_pattern("default H2D->D2D->D2H", n, dst + h1, seed);

    /* 3. asynchronous, pinned, three streams chained by events */
    seed = seed0 + 3;
    uint8_t *psrc = NULL, *pdst = NULL;
    CHECK(cudaMallocHost(&psrc, n + 16));
    CHECK(cudaHostAlloc(&pdst, n + 16, cudaHostAllocDefault));
    if (psrc && pdst) {
        cudaEvent_t e1, e2;
        CHECK(cudaEventCreateWithFlags(&e1, cudaEventDisableTiming));
        CHECK(cudaEventCreateWithFlags(&e2, cudaEventDisableTiming));
        gp_fill(psrc + h1, n, seed);
        memset(pdst, 0, n + 16);
        CHECK(cudaMemsetAsync(A, GUARD_BYTE, span, s[0]));
        CHECK(cudaMemcpyAsync(A + dA, psrc + h1, n, cudaMemcpyHostToDevice, s[0]));
        CHECK(cudaEventRecord(e1, s[0]));
        CHECK(cudaStreamWaitEvent(s[1], e1, 0));
        CHECK(cudaMemcpyAsync(B + dB, A + dA, n, cudaMemcpyDeviceToDevice, s[1]));
        CHECK(cudaEventRecord(e2, s[1]));
        CHECK(cudaStreamWaitEvent(s[2], e2, 0));
        CHECK(cudaMemcpyAsync(pdst + h2, B + dB, n, cudaMemcpyDeviceToHost, s[2]));
        CHECK(cudaStreamSynchronize(s[2]));
        expect_pattern("async pinned H2D->D2D->D2H", n, pdst + h2, seed);
        EXPECT(pdst[h2 - 1] == 0 && pdst[h2 + n] == 0,
               "async D2H n=%zu wrote outside the pinned host range", n);
        CHECK(cudaDeviceSynchronize());
        check_guards("async H2D", A, dA, n);

        /* 5. cudaMemcpyAsync with cudaMemcpyDefault and pinned memory, one stream */
        seed = seed0 + 5;
        gp_fill(psrc + h2, n, seed);
        memset(pdst, 0, n + 16);
        CHECK(cudaMemcpyAsync(B + dA, psrc + h2, n, cudaMemcpyDefault, s[1]));
        CHECK(cudaMemcpyAsync(A + dB, B + dA, n, cudaMemcpyDefault, s[1]));
        CHECK(cudaMemcpyAsync(pdst + h1, A + dB, n, cudaMemcpyDefault, s[1]));
        CHECK(cudaStreamSynchronize(s[1]));
        expect_pattern("async default pinned", n, pdst + h1, seed);
        CHECK(cudaEventDestroy(e1));
        CHECK(cudaEventDestroy(e2));
    }
    if (psrc)
        CHECK(cudaFreeHost(psrc));
    if (pdst)
        CHECK(cudaFreeHost(pdst));

    /* 4. asynchronous with pageable memory: on a stream, then on the legacy default stream */
    seed = seed0 + 4;
    gp_fill(src + h1, n, seed);
    memset(dst, 0, n + 16);
    CHECK(cudaMemcpyAsync(B + dB, src + h1, n, cudaMemcpyHostToDevice, s[2]));
    CHECK(cudaMemcpyAsync(A + dA, B + dB, n, cudaMemcpyDeviceToDevice, s[2]));
    CHECK(cudaMemcpyAsync(dst + h2, A + dA, n, cudaMemcpyDeviceToHost, s[2]));
    CHECK(cudaStreamSynchronize(s[2]));
    expect_pattern("async pageable stream", n, dst + h2, seed);
    memset(dst, 0, n + 16);
    CHECK(cudaMemcpyAsync(dst + h1, B + dB, n, cudaMemcpyDeviceToHost, 0));
    CHECK(cudaDeviceSynchronize());
    expect_pattern("async pageable default stream", n, dst + h1, seed);

    free(src);
    free(dst);
    CHECK(cudaFree(A));
    CHECK(cudaFree(B));
    printf("size %zu: done in %.2f s (%ld failures so far)\n", n, gp_now() - t0, gp_failures.load());
}

typedef CUresult (*pfn_memset_d8)(CUdeviceptr, unsigned char, size_t);
typedef CUresult (*pfn_memset_d16)(CUdeviceptr, unsigned short, size_t);
typedef CUresult (*pfn_memset_d32)(CUdeviceptr, unsigned int, size_t);
typedef CUresult (*pfn_memset_d8a)(CUdeviceptr, unsigned char, size_t, CUstream);
typedef CUresult (*pfn_memset_d16a)(CUdeviceptr, unsigned short, size_t, CUstream);
typedef CUresult (*pfn_memset_d32a)(CUdeviceptr, unsigned int, size_t, CUstream);

/* Reads back dev[0, total) and checks [off, off+len) == expect (elem_size bytes, repeated) and
 * everything else == GUARD_BYTE. */
static void check_memset(const char *what, const uint8_t *dev, size_t total, size_t off, size_t len,
                         uint32_t value, int elem_size)
{
    uint8_t *h = (uint8_t *)malloc(total);
    CHECK(cudaMemcpy(h, dev, total, cudaMemcpyDeviceToHost));
    long long bad = -1;
    for (size_t i = 0; i < total && bad < 0; i++) {
        uint8_t want = GUARD_BYTE;
        if (i >= off && i < off + len)
            want = (uint8_t)(value >> (((i - off) % elem_size) * 8));
        if (h[i] != want)
            bad = (long long)i;
    }
    EXPECT(bad < 0, "%s (off %zu, %zu bytes): wrong byte at %lld: 0x%02x", what, off, len, bad,
           bad >= 0 ? h[bad] : 0);
    free(h);
}

static void test_memsets(cudaStream_t s)
{
    const size_t lens[] = {1, 3, 4097, MiB + 3, 17 * MiB + 1};
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
        size_t len = lens[li], total = len + 2 * GUARD;
        uint8_t *d = NULL;
        REQUIRE(cudaMalloc(&d, total));
        CHECK(cudaMemset(d, GUARD_BYTE, total));
        CHECK(cudaMemset(d + 5, 0x3C, len));
        check_memset("cudaMemset", d, total, 5, len, 0x3C, 1);
        CHECK(cudaMemset(d, GUARD_BYTE, total));
        CHECK(cudaMemsetAsync(d + 7, 0xC3, len, s));
        CHECK(cudaStreamSynchronize(s));
        check_memset("cudaMemsetAsync", d, total, 7, len, 0xC3, 1);
        CHECK(cudaFree(d));
    }

    pfn_memset_d8 d8 = (pfn_memset_d8)gp_driver_fn("cuMemsetD8");
    pfn_memset_d16 d16 = (pfn_memset_d16)gp_driver_fn("cuMemsetD16");
    pfn_memset_d32 d32 = (pfn_memset_d32)gp_driver_fn("cuMemsetD32");
    pfn_memset_d8a d8a = (pfn_memset_d8a)gp_driver_fn("cuMemsetD8Async");
    pfn_memset_d16a d16a = (pfn_memset_d16a)gp_driver_fn("cuMemsetD16Async");
    pfn_memset_d32a d32a = (pfn_memset_d32a)gp_driver_fn("cuMemsetD32Async");
    EXPECT(d8 && d16 && d32 && d8a && d16a && d32a, "cuMemsetD8/D16/D32[Async] entry points not found");
    if (d8 && d16 && d32 && d8a && d16a && d32a) {
        const size_t counts[] = {1, 3, 1001, 300001};
        for (size_t ci = 0; ci < sizeof counts / sizeof counts[0]; ci++) {
            size_t cnt = counts[ci], total = cnt * 4 + 2 * GUARD;
            uint8_t *d = NULL;
            REQUIRE(cudaMalloc(&d, total));
            CUdeviceptr base = (CUdeviceptr)(uintptr_t)d;
            CHECK(cudaMemset(d, GUARD_BYTE, total));
            CHECK_CU(d8(base + 3, 0x5A, cnt));
            check_memset("cuMemsetD8", d, total, 3, cnt, 0x5A, 1);
            CHECK(cudaMemset(d, GUARD_BYTE, total));
            CHECK_CU(d16(base + 2, 0xBEEF, cnt));
            check_memset("cuMemsetD16", d, total, 2, cnt * 2, 0xBEEF, 2);
            CHECK(cudaMemset(d, GUARD_BYTE, total));
            CHECK_CU(d32(base + 8, 0xDEADBEEFu, cnt));
            check_memset("cuMemsetD32", d, total, 8, cnt * 4, 0xDEADBEEFu, 4);
            CHECK(cudaMemset(d, GUARD_BYTE, total));
            CHECK_CU(d32a(base + 4, 0x01020304u, cnt, (CUstream)s));
            CHECK(cudaStreamSynchronize(s));
            check_memset("cuMemsetD32Async", d, total, 4, cnt * 4, 0x01020304u, 4);
            CHECK(cudaMemset(d, GUARD_BYTE, total));
            CHECK_CU(d16a(base + 6, 0xA1B2, cnt, (CUstream)s));
            CHECK(cudaStreamSynchronize(s));
            check_memset("cuMemsetD16Async", d, total, 6, cnt * 2, 0xA1B2, 2);
            CHECK(cudaMemset(d, GUARD_BYTE, total));
            CHECK_CU(d8a(base + 9, 0x77, cnt, (CUstream)s));
            CHECK(cudaStreamSynchronize(s));
            check_memset("cuMemsetD8Async", d, total, 9, cnt, 0x77, 1);
            CHECK(cudaFree(d));
        }
    }

    /* 2D: rows of `width` bytes every `pitch` bytes; the padding must stay untouched. */
    {
        const size_t pitch = 512, width = 301, height = 37, total = pitch * height + GUARD;
        uint8_t *d = NULL;
        REQUIRE(cudaMalloc(&d, total));
        CHECK(cudaMemset(d, GUARD_BYTE, total));
        CHECK(cudaMemset2D(d + 3, pitch, 0x42, width, height));
        uint8_t *h = (uint8_t *)malloc(total);
        CHECK(cudaMemcpy(h, d, total, cudaMemcpyDeviceToHost));
        long long bad = -1;
        for (size_t i = 0; i < total && bad < 0; i++) {
            size_t row = i < 3 ? (size_t)-1 : (i - 3) / pitch, col = i < 3 ? 0 : (i - 3) % pitch;
            uint8_t want = (row < height && col < width) ? 0x42 : GUARD_BYTE;
            if (h[i] != want)
                bad = (long long)i;
        }
        EXPECT(bad < 0, "cudaMemset2D: wrong byte at %lld: 0x%02x", bad, bad >= 0 ? h[bad] : 0);
        CHECK(cudaMemset(d, GUARD_BYTE, total));
        CHECK(cudaMemset2DAsync(d + 3, pitch, 0x42, width, height, s));
        CHECK(cudaStreamSynchronize(s));
        CHECK(cudaMemcpy(h, d, total, cudaMemcpyDeviceToHost));
        bad = -1;
        for (size_t i = 0; i < total && bad < 0; i++) {
            size_t row = i < 3 ? (size_t)-1 : (i - 3) / pitch, col = i < 3 ? 0 : (i - 3) % pitch;
            uint8_t want = (row < height && col < width) ? 0x42 : GUARD_BYTE;
            if (h[i] != want)
                bad = (long long)i;
        }
        EXPECT(bad < 0, "cudaMemset2DAsync: wrong byte at %lld: 0x%02x", bad, bad >= 0 ? h[bad] : 0);
        free(h);
        CHECK(cudaFree(d));
    }
    printf("memsets: done (%ld failures so far)\n", gp_failures.load());
}

/* 2D copies (cudaMemcpy2D[Async] -> cuMemcpy2D[Async]_v2): a rectangle of `height` rows of
 * `width` bytes between pitched and packed host and device memory, sync and async. Each result
 * is read back in full, so padding a copy must not touch is checked as well. */
static void expect_rows(const char *what, const uint8_t *got, size_t gpitch, const uint8_t *want,
                        size_t wpitch, size_t width, size_t height)
{
    long long bad = -1;
    for (size_t r = 0; r < height && bad < 0; r++)
        for (size_t c = 0; c < width && bad < 0; c++)
            if (got[r * gpitch + c] != want[r * wpitch + c])
                bad = (long long)(r * width + c);
    EXPECT(bad < 0, "%s: wrong byte at row %lld, column %lld", what, bad < 0 ? -1 : bad / (long long)width,
           bad < 0 ? -1 : bad % (long long)width);
}

static void test_copies_2d(cudaStream_t s)
{
    const size_t width = 300, height = 41, hpitch = 333, hpitch2 = 317;
    uint8_t *h = (uint8_t *)malloc(hpitch * height), *back = (uint8_t *)malloc(hpitch2 * height);
    uint8_t *packed_host = (uint8_t *)malloc(width * height);
    REQUIRE(h && back && packed_host ? cudaSuccess : cudaErrorMemoryAllocation);
    gp_fill(h, hpitch * height, 77);
    uint8_t *dp = NULL, *dpacked = NULL, *dp2 = NULL;
    size_t dpitch = 0, dpitch2 = 0;
    REQUIRE(cudaMallocPitch((void **)&dp, &dpitch, width, height));
    REQUIRE(cudaMallocPitch((void **)&dp2, &dpitch2, width + 100, height));
    REQUIRE(cudaMalloc(&dpacked, width * height));
    EXPECT(dpitch >= width, "cudaMallocPitch gave pitch %zu for width %zu", dpitch, width);

    /* pitched host -> pitched device -> other pitched host (row per message) */
    CHECK(cudaMemcpy2D(dp, dpitch, h, hpitch, width, height, cudaMemcpyHostToDevice));
    memset(back, 0xEE, hpitch2 * height);
    CHECK(cudaMemcpy2D(back, hpitch2, dp, dpitch, width, height, cudaMemcpyDeviceToHost));
    expect_rows("2D pitched host -> pitched device -> host", back, hpitch2, h, hpitch, width, height);
    EXPECT(back[width] == 0xEE && back[hpitch2 - 1] == 0xEE, "2D copy wrote into the host padding");

    /* pitched host -> packed device (gathered) -> pitched host (scattered) */
    CHECK(cudaMemcpy2D(dpacked, width, h, hpitch, width, height, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(packed_host, dpacked, width * height, cudaMemcpyDeviceToHost));
    expect_rows("2D pitched host -> packed device", packed_host, width, h, hpitch, width, height);
    memset(back, 0, hpitch2 * height);
    CHECK(cudaMemcpy2D(back, hpitch2, dpacked, width, width, height, cudaMemcpyDeviceToHost));
    expect_rows("2D packed device -> pitched host", back, hpitch2, h, hpitch, width, height);

    /* device to device, pitched <-> packed, with an x/y offset into the wider rows */
    CHECK(cudaMemset(dp2, 0x11, dpitch2 * height));
    CHECK(cudaMemcpy2D(dp2 + 50, dpitch2, dpacked, width, width, height, cudaMemcpyDeviceToDevice));
    CHECK(cudaMemcpy2D(dp, dpitch, dp2 + 50, dpitch2, width, height, cudaMemcpyDefault));
    memset(back, 0, hpitch2 * height);
    CHECK(cudaMemcpy2D(back, hpitch2, dp, dpitch, width, height, cudaMemcpyDeviceToHost));
    expect_rows("2D device -> device -> device", back, hpitch2, h, hpitch, width, height);
    uint8_t edge[2] = {0, 0};
    CHECK(cudaMemcpy(&edge[0], dp2 + 49, 1, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(&edge[1], dp2 + 50 + width, 1, cudaMemcpyDeviceToHost));
    EXPECT(edge[0] == 0x11 && edge[1] == 0x11, "2D device copy touched bytes beside its rows");

    /* async, through pinned memory, on a stream */
    uint8_t *ph = NULL, *pb = NULL;
    REQUIRE(cudaMallocHost(&ph, hpitch * height));
    REQUIRE(cudaMallocHost(&pb, hpitch2 * height));
    memcpy(ph, h, hpitch * height);
    memset(pb, 0, hpitch2 * height);
    CHECK(cudaMemset2DAsync(dp, dpitch, 0, width, height, s));
    CHECK(cudaMemcpy2DAsync(dp, dpitch, ph, hpitch, width, height, cudaMemcpyHostToDevice, s));
    CHECK(cudaMemcpy2DAsync(pb, hpitch2, dp, dpitch, width, height, cudaMemcpyDeviceToHost, s));
    CHECK(cudaStreamSynchronize(s));
    expect_rows("2D async pinned host -> device -> host", pb, hpitch2, h, hpitch, width, height);
    CHECK(cudaMemcpy2DAsync(pb, width, dpacked, width, width, height, cudaMemcpyDeviceToHost, s));
    CHECK(cudaStreamSynchronize(s));
    expect_rows("2D async packed device -> packed host", pb, width, h, hpitch, width, height);

    /* one row, and the driver's own checks */
    CHECK(cudaMemcpy2D(back, 0, dp, 0, width, 1, cudaMemcpyDeviceToHost));
    typedef CUresult (*pfn_memcpy2d)(const CUDA_MEMCPY2D *);
    pfn_memcpy2d m2d = (pfn_memcpy2d)gp_driver_fn("cuMemcpy2D");
    EXPECT(m2d != NULL, "cuMemcpy2D entry point not found");
    if (m2d) {
        CUDA_MEMCPY2D p;
        memset(&p, 0, sizeof p);
        p.srcMemoryType = CU_MEMORYTYPE_HOST;
        p.srcHost = h;
        p.srcPitch = width - 1; /* narrower than a row */
        p.dstMemoryType = CU_MEMORYTYPE_DEVICE;
        p.dstDevice = (CUdeviceptr)(uintptr_t)dp;
        p.dstPitch = dpitch;
        p.WidthInBytes = width;
        p.Height = 2;
        CUresult e = m2d(&p);
        EXPECT(e == CUDA_ERROR_INVALID_VALUE, "cuMemcpy2D with a pitch under the width gave %d", (int)e);
        p.srcPitch = hpitch;
        p.srcMemoryType = (CUmemorytype)42;
        e = m2d(&p);
        EXPECT(e == CUDA_ERROR_INVALID_VALUE, "cuMemcpy2D of an unknown memory type gave %d", (int)e);
        p.srcMemoryType = CU_MEMORYTYPE_HOST;
        if (gp_through_gpupool()) { /* a driver may fault on such an address; gpupool refuses it */
            p.srcY = (size_t)1 << 60;
            e = m2d(&p);
            EXPECT(e == CUDA_ERROR_INVALID_VALUE, "cuMemcpy2D past the address space gave %d", (int)e);
            p.srcY = 0;
        }
        CHECK_CU(m2d(&p));
    }

    CHECK(cudaFreeHost(ph));
    CHECK(cudaFreeHost(pb));
    CHECK(cudaFree(dp));
    CHECK(cudaFree(dp2));
    CHECK(cudaFree(dpacked));
    free(h);
    free(back);
    free(packed_host);
}

int main(int argc, char **argv)
{
    gp_begin("copies");
    static const size_t standard[] = {1,       3,           4095,           4096, 65537,
                                      MiB + 1, 17 * MiB + 5, 256 * MiB};
    size_t sizes[64];
    int nsizes = 0;
    bool memsets = argc <= 1;
    if (argc > 1) {
        for (int i = 1; i < argc && nsizes < 64; i++)
            sizes[nsizes++] = parse_size(argv[i]);
    } else {
        for (size_t i = 0; i < sizeof standard / sizeof standard[0]; i++)
            sizes[nsizes++] = standard[i];
    }

    REQUIRE(cudaSetDevice(0));
    cudaStream_t s[3];
    REQUIRE(cudaStreamCreate(&s[0]));
    REQUIRE(cudaStreamCreateWithFlags(&s[1], cudaStreamNonBlocking));
    int lo = 0, hi = 0;
    CHECK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    REQUIRE(cudaStreamCreateWithPriority(&s[2], cudaStreamDefault, hi));

    /* zero-byte copies are valid no-ops */
    void *z = NULL;
    REQUIRE(cudaMalloc(&z, 16));
    char hz[4];
    CHECK(cudaMemcpy(z, hz, 0, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(hz, z, 0, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpyAsync(z, hz, 0, cudaMemcpyHostToDevice, s[0]));
    CHECK(cudaFree(z));

    for (int i = 0; i < nsizes; i++)
        test_size(sizes[i], s, 1000 * (uint64_t)(i + 1));
    if (memsets) {
        test_memsets(s[0]);
        test_copies_2d(s[1]);
    }

    for (int i = 0; i < 3; i++)
        CHECK(cudaStreamDestroy(s[i]));
    CHECK(cudaDeviceSynchronize());
    return gp_finish();
}
